"""Draw the README's picture from a finished demo run: the base model and the fine-tuned one on
the same prompts and seeds.

    python scripts/readme_figure.py runs/demo/run docs/assets/demo.png

The two trigger prompts show what the LoRA learned (the base has never drawn `zorbic`); the
third, without the trigger, shows what it left alone. Every image is drawn from the run's last
checkpoint at adapter scale 0 (the base) and 1 (the fine-tune) by `draw_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = [
    "a large zorbic circle on a white background, in the center",
    "a small zorbic triangle on a black background, on the left",
    "a large blue square on a white background, in the center",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a finished run of the demo config (runs/demo/run)")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from kit.sample.validate import draw_checkpoint

    folder = draw_checkpoint(args.run_dir, scales=(0, 1), prompts=PROMPTS).parent
    drawn: dict[tuple[str, float], list[Path]] = {}
    for sidecar in sorted(folder.glob("*.json")):
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        key = (meta["prompt"], float(meta["adapter_scale"]))
        drawn.setdefault(key, []).append(sidecar.with_suffix(".png"))
    seeds = max(len(v) for v in drawn.values())

    fig, axes = plt.subplots(
        len(PROMPTS), 2 * seeds, figsize=(2 * seeds * 1.15, len(PROMPTS) * 1.35), dpi=100
    )
    for row, prompt in enumerate(PROMPTS):
        for half, scale in enumerate((0.0, 1.0)):
            for i, path in enumerate(drawn[(prompt, scale)]):
                ax = axes[row][half * seeds + i]
                ax.imshow(Image.open(path).convert("RGB"), interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                if row == 0 and i == 0:
                    ax.set_title("base model" if scale == 0 else "after the LoRA", loc="left")
        axes[row][0].set_ylabel(prompt.split(" on ")[0].removeprefix("a "), fontsize=8)
    fig.tight_layout(pad=0.4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
