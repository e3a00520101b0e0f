"""A size slider on the toy world, judged across five scales.

    python scripts/slider_toy.py runs/slider

Trains the demo config (`datasets_example/config.json`: its LoRA, seed and images, whose
noisy latents the slider trains at) as a slider from a prompt pair that differs only in size,
then draws prompts without a size word at adapter scales -2 … +2 (prompt i with seed i) and
reports, per scale, the judge's mean `extent` (the shape's side over the image's) and how many
shapes it calls large. Writes `slider.json` and the validation grid across the scales.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "datasets_example" / "config.json"
SLIDER = {
    "target": "a red circle on a white background, in the center",
    "positive": "a large red circle on a white background, in the center",
    "negative": "a small red circle on a white background, in the center",
    "strength": 1.0,
    "scales": [-2.0, -1.0, 0.0, 1.0, 2.0],
}


def prompts(n: int) -> list[str]:
    """Toy-world captions with their size word left out."""
    from kit.toy import world as toyworld

    return [
        toyworld.caption(s).replace(f"a {s.size} ", "a ", 1)
        for s in toyworld.sample_scenes(n, 3000)
    ]


def measure(run: Path, scales: list[float], n: int) -> list[dict]:
    """Per scale: mean extent and share judged large, over `n` prompts (prompt i, seed i)."""
    from kit.families.samplers import ImageSpec
    from kit.sample.validate import load_trained
    from kit.toy.judge import judge

    _, cfg, family, comps, _ = load_trained(run)
    pipe = family.pipeline(comps)
    pipe.set_progress_bar_config(disable=True)
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    rows = []
    for scale in scales:
        verdicts = [
            judge(
                family.sample(
                    pipe,
                    ImageSpec(p, "", i, v.validation_num_inference_steps,
                              family.guidance_scale(), side, side, adapter_scale=scale),
                )[0]
            )
            for i, p in enumerate(prompts(n))
        ]  # fmt: skip
        rows.append(
            {
                "scale": scale,
                "mean_extent": round(sum(x["extent"] for x in verdicts) / n, 4),
                "large": round(sum(x["size"] == "large" for x in verdicts) / n, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--set", nargs=2, action="append", metavar=("KEY", "JSON"), default=[])
    args = parser.parse_args(argv)
    import torch

    from kit.config import load_config
    from kit.sample.validate import draw_checkpoint
    from kit.train.loop import train

    torch.set_num_threads(1)
    out = Path(args.out_dir).resolve()  # the run config is read from datasets_example/
    run = out / "run"
    extra = {k: json.loads(v) for k, v in args.set}
    # A slider trains from its prompt pair alone, on the denoiser: the demo's preservation and
    # text-encoder adapter are not part of it, and its rate and steps are the ones it was
    # measured at.
    fields = {
        "preservation": None,
        "train_text_encoder": False,
        "learning_rate": 0.001,
        "max_train_steps": 120,
        "output_dir": str(run),
    }
    cfg = load_config(DEMO, {**fields, "validation_steps": 0, "slider": SLIDER, **extra})
    train(cfg, overwrite=True)
    scales = cfg.objective.slider.scales
    grid = draw_checkpoint(run, scales=scales, prompts=[cfg.objective.slider.target])
    rows = measure(run, scales, args.prompts)
    extents = [r["mean_extent"] for r in rows]
    monotone = all(a < b for a, b in zip(extents, extents[1:], strict=False))
    result = {"slider": SLIDER, "rows": rows, "monotone": monotone, "grid": str(grid)}
    (out / "slider.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"extent by scale {extents}: {'monotone' if monotone else 'NOT monotone'}; grid {grid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
