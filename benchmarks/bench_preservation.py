"""What output preservation, blank-prompt preservation and sliders cost per training step.

Each setting trains the demo config (`datasets_example/config.json`: the toy SD1.5 base, its 24 +
8 images, LoRA on the cross-attention's keys and values, without its preservation and
text-encoder adapter unless the setting names them) as a user runs it, `python -m kit train
CONFIG`, in a fresh process, for the same steps; settings alternate round by round (A B C A B C)
so a busy machine weighs on each alike. The table gives steady steps/s (the first `--warmup`
steps left out), the time ratio per step against plain training in the same run, and the
denoiser forward passes per step the estimator counts for that setting (`kit.preflight`), so the
measured cost can be read beside what the estimate plans for.

Usage: python benchmarks/bench_preservation.py [--steps 40] [--rounds 2] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import kit_times, run_process, steady  # noqa: E402

DEMO = ROOT / "datasets_example" / "config.json"

SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "output preservation": {
        "preservation": {"kind": "output", "class_words": {"zorbic": "pink"}, "weight": 1.0}
    },
    "blank preservation": {"preservation": {"kind": "blank", "weight": 1.0}},
    "text encoder trained": {"train_text_encoder": True},
    "output preservation, text encoder trained": {
        "preservation": {"kind": "output", "class_words": {"zorbic": "pink"}, "weight": 1.0},
        "train_text_encoder": True,
    },
    "slider": {
        "slider": {
            "target": "a red circle on a white background, in the center",
            "positive": "a large red circle on a white background, in the center",
            "negative": "a small red circle on a white background, in the center",
        }
    },
}
"""Setting name → overrides of the demo config."""


def config(out: Path, steps: int, overrides: dict[str, Any]) -> Path:
    """The demo config with absolute paths, no validation or checkpoints, and `overrides`."""
    fields = json.loads(DEMO.read_text())
    # The demo trains with output preservation and its text encoder: each setting here starts
    # from the plain run (the denoiser's LoRA alone) and adds what it names.
    dropped = ("preservation", "train_text_encoder")
    fields = {k: v for k, v in fields.items() if not k.startswith("_") and k not in dropped}
    for key in ("pretrained_model", "image_dir"):
        fields[key] = str((DEMO.parent / fields[key]).resolve())
    fields.update(
        output_dir=str(out / "run"),
        cache_dir=str(out / "cache"),
        max_train_steps=steps,
        checkpointing_steps=0,
        validation_steps=0,
        validation_prompt=[],
        report_to="none",
        cpu_threads=1,
        **overrides,
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(fields, indent=1))
    return path


def planned_passes(path: Path) -> str:
    """The denoiser's rows per sample the estimator plans for this config, with gradients and
    without (`kit.config.preservation.denoiser_rows`): what `kit estimate` sizes them by."""
    from kit.config import load_config
    from kit.config.preservation import denoiser_rows

    grad, frozen = denoiser_rows(load_config(path))
    return f"{grad} + {frozen} frozen"


def measure(steps: int, rounds: int, warmup: int, work: Path) -> list[dict[str, Any]]:
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    passes: dict[str, str] = {}
    for r in range(rounds):
        for name, overrides in SETTINGS.items():
            out = work / f"{name.replace(' ', '_')}-{r}"
            path = config(out, steps, overrides)
            passes[name] = planned_passes(path)
            run_process(name, [sys.executable, "-m", "kit", "train", str(path)], out / "log.txt")
            rates[name].append(steady(kit_times(out), warmup))
            print(f"{name}, round {r + 1}: {rates[name][-1]:.2f} steps/s", flush=True)
    plain = statistics.mean(rates["plain"])
    return [
        {
            "setting": name,
            "steps_per_s": round(statistics.mean(v), 3),
            "time_per_step_vs_plain": round(plain / statistics.mean(v), 2),
            "planned_denoiser_rows": passes[name],
        }
        for name, v in rates.items()
    ]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | steps/s | time per step vs plain | denoiser rows per sample (estimate) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['steps_per_s']:.2f} | {r['time_per_step_vs_plain']:.2f}× | "
            f"{r['planned_denoiser_rows']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--work", type=Path, help="a folder for the runs (else a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.steps, args.rounds, args.warmup, args.work or Path(tmp))
    print(json.dumps(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
