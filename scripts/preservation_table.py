"""The demo's concept trained with and without output preservation (and with base-prediction
targets), same seeds and steps, each scored by the learning report's drift measures.

    python scripts/preservation_table.py runs/preservation            # every setting
    python scripts/preservation_table.py runs/preservation --only none output "output w4"

Each setting trains `datasets_example/config.json` (its own seed, steps and data) with one change,
then draws the drift prompts (`kit.toy.drift`, the same 32 prompts and seeds as
`scripts/score_toy.py`) with the adapter at scale 0 and 1. Prints a markdown table and writes
`table.json` in the output folder. The base-prediction setting splits the example's images into
a concept folder and a prior folder (`role: prior`, `target: base_prediction`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "datasets_example" / "config.json"
PINK = {"zorbic": "pink"}
BEFORE = {"preservation": None}
"""Each setting's baseline: the demo config without preservation, so the table compares one
change at a time (the demo's own setting is `output w4`)."""


def _output(weight: float, **more: object) -> dict:
    return {"preservation": {"kind": "output", "class_words": PINK, "weight": weight}, **more}


NO_TEXT = {"train_text_encoder": False}

SETTINGS: dict[str, dict] = {
    "none": {},
    "output": _output(1.0),
    "blank": {"preservation": {"kind": "blank", "weight": 1.0}},
    "prior_prediction": {"_split": True},
    "output+prior_prediction": _output(1.0, _split=True),
    "output w4": _output(4.0),
    "output w8": _output(8.0),
    "output w4+prior_prediction": _output(4.0, _split=True),
    "none, no text encoder": NO_TEXT,
    "output, no text encoder": _output(1.0, **NO_TEXT),
    "output w4, no text encoder": _output(4.0, **NO_TEXT),
    "none, 360 steps": {"max_train_steps": 360},
    "output, 360 steps": _output(1.0, max_train_steps=360),
}
"""Setting name → the demo config's overrides (`_split`: prior images as a base-prediction set)."""


def split_dataset(out: Path) -> list[dict]:
    """The example's images as two datasets: the concept, and its prior images as a prior set
    trained toward the base model's prediction."""
    images = ROOT / "datasets_example" / "images"
    concept, prior = out / "concept", out / "prior"
    for folder in (concept, prior):
        folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(images.iterdir()):
        shutil.copy(f, (prior if f.name.startswith("prior_") else concept) / f.name)
    return [
        {"name": "concept", "image_dir": str(concept)},
        {"name": "prior", "image_dir": str(prior), "role": "prior", "target": "base_prediction"},
    ]


def run_setting(name: str, out: Path, seeds: int, extra: dict) -> dict:
    """Train one setting and measure it."""
    from kit.config import load_config
    from kit.toy.learning import run_drift
    from kit.train.loop import train

    changes = dict(SETTINGS[name])
    split = changes.pop("_split", False)
    changes.update(extra)
    if split:
        changes.update(image_dir="", prior_images=[], datasets=split_dataset(out / "data"))
    run = out / "run"
    overrides = {**BEFORE, "output_dir": str(run), "validation_steps": 0, **changes}
    cfg = load_config(DEMO, overrides)
    started = time.perf_counter()
    train(cfg, overwrite=True)
    seconds = time.perf_counter() - started
    return {"setting": name, "train_seconds": round(seconds, 1), **run_drift(run, seeds)}


COLUMNS = (
    ("setting", "setting"),
    ("concept_rate_after", "concept"),
    ("color_drift", "color drift"),
    ("shape_agreement", "shape agreement"),
    ("position_agreement", "position agreement"),
    ("unrelated_color_after", "color after"),
    ("unrelated_shape_before", "shape before"),
    ("unrelated_shape_after", "shape after"),
    ("color_error_after", "color off its name"),
    ("concept_color_distance", "learned color to data's"),
)


DISTANCES = ("color_drift", "color_error_after", "concept_color_distance")


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| " + " | ".join(h for _, h in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for r in rows:
        # Shares with two decimals; RGB distances as measured (one decimal).
        cells = [
            str(r.get(k)) if k in DISTANCES or k == "setting" else f"{r[k]:.2f}" for k, _ in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--only", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--seeds", type=int, default=32, help="drift prompts per group")
    parser.add_argument(
        "--set",
        nargs=2,
        action="append",
        metavar=("KEY", "JSON"),
        default=[],
        help="a further override for every setting, e.g. --set max_train_steps 240",
    )
    parser.add_argument("--label", default="", help="added to each setting's name in the table")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as models/toy-sd15 was measured: the numbers repeat exactly
    extra = {k: json.loads(v) for k, v in args.set}
    out = Path(args.out_dir).resolve()  # the run configs are read from datasets_example/
    rows = []
    for name in args.only:
        label = f"{name} {args.label}" if args.label else name
        rows.append({**run_setting(name, out / label.replace(" ", "_"), args.seeds, extra)})
        rows[-1]["setting"] = label
        print(json.dumps(rows[-1]), flush=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
