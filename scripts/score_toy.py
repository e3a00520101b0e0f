"""Score the toy base model, or a LoRA trained on it, with plain diffusers and the kit's judge.

Nothing of the kit's training, validation or export code runs here: the pipeline is diffusers'
own `StableDiffusionPipeline`, the LoRA goes in through `load_lora_weights`, and only the toy
world's captions and the judge come from `kit`. So it checks what a user of the exported file gets.

    python scripts/score_toy.py base models/toy-sd15 --seeds 64
    python scripts/score_toy.py lora models/toy-sd15 runs/demo/run/exports/diffusers/<file> \\
        --trigger zorbic --seeds 32

`base` draws 64 scenes of the toy world (one seed each) and prints the judge's accuracy per
attribute. `lora` draws trigger prompts (the concept in scenes the dataset may not have) and
unrelated prompts (the base world), without and with the LoRA, and prints how often the concept
appears and how accurate the unrelated prompts stay, and how far they drift from the base's
images for the same prompt and seed (`kit.toy.drift`, the learning report's measures on the
same prompts and seeds). `--json FILE` also saves the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kit.toy import world as toyworld
from kit.toy.drift import drift_measures, drift_scenes
from kit.toy.judge import score

SETTINGS = {"num_inference_steps": 20, "width": 64, "height": 64}
"""How the learning report draws: DDIM 20 steps, 64x64, at the demo's guidance (`GUIDANCE`)."""
GUIDANCE = {"base": 5.0, "lora": 2.0}
"""Default guidance: the toy's usual 5 for the base, the demo's 2 for a LoRA (`--guidance`)."""


def pipeline(base: str):
    """The toy base as a plain diffusers pipeline, quiet."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        base, safety_checker=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, prompts: list[str], guidance: float) -> list:
    """One image per prompt, prompt i drawn with seed i."""
    return [
        pipe(
            p, generator=torch.Generator().manual_seed(i), guidance_scale=guidance, **SETTINGS
        ).images[0]
        for i, p in enumerate(prompts)
    ]


def judged(images: list, scenes: list[toyworld.Scene], concept: str, keep: dict | None = None):
    """Accuracy per attribute, and how many images show the concept color or shape; the
    judge's verdicts go to `keep["verdicts"]` when given."""
    result = score(images, scenes)
    verdicts = result.pop("verdicts")
    if keep is not None:
        keep["verdicts"] = verdicts
    shown = sum(concept in (v["color"], v["shape"]) for v in verdicts)
    return {**{k: round(v, 4) for k, v in result.items()}, "concept_rate": shown / len(verdicts)}


def score_base(base: str, seeds: int, seed: int = 123, guidance: float = GUIDANCE["base"]) -> dict:
    """The base model on `seeds` toy scenes (the seed of the scene list is fixed)."""
    scenes = toyworld.sample_scenes(seeds, seed)
    images = draw(pipeline(base), [toyworld.caption(s) for s in scenes], guidance)
    return judged(images, scenes, "")


def score_lora(
    base: str, lora: str, trigger: str, seeds: int, guidance: float = GUIDANCE["lora"]
) -> dict:
    """Trigger and unrelated prompts without, then with, the LoRA."""
    try:
        groups = drift_scenes(trigger, seeds)
    except ValueError:
        raise SystemExit(f"--trigger {trigger!r} is no toy-world concept") from None
    pipe = pipeline(base)
    out: dict = {}
    verdicts: dict = {}
    for label in ("before", "after"):
        if label == "after":
            pipe.load_lora_weights(lora)
        for name, scenes in groups.items():
            images = draw(pipe, [toyworld.caption(s) for s in scenes], guidance)
            kept: dict = {}
            out[f"{name}_{label}"] = judged(images, scenes, trigger, kept)
            verdicts[f"{name}_{label}"] = kept["verdicts"]
    out["drift"] = drift_measures(
        verdicts["unrelated_before"],
        verdicts["unrelated_after"],
        groups["unrelated"],
        verdicts["trigger_after"],
        trigger,
    )
    out["summary"] = {
        "concept_rate_before": out["trigger_before"]["concept_rate"],
        "concept_rate_after": out["trigger_after"]["concept_rate"],
        "unrelated_drop_points": round(
            100
            * sum(
                out["unrelated_before"][k] - out["unrelated_after"][k] for k in ("color", "shape")
            )
            / 2,
            1,
        ),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("base", help="score the base model")
    b.add_argument("base")
    b.add_argument("--seeds", type=int, default=64)
    b.add_argument("--json", default=None)
    b.add_argument("--guidance", type=float, default=GUIDANCE["base"])
    lo = sub.add_parser("lora", help="score a LoRA file on the base model")
    lo.add_argument("base")
    lo.add_argument("lora")
    lo.add_argument("--trigger", default=toyworld.TRIGGER_WORD)
    lo.add_argument("--seeds", type=int, default=32)
    lo.add_argument("--json", default=None)
    lo.add_argument("--guidance", type=float, default=GUIDANCE["lora"], help="the run's")
    args = parser.parse_args(argv)
    if args.what == "base":
        result = score_base(args.base, args.seeds, guidance=args.guidance)
    else:
        result = score_lora(args.base, args.lora, args.trigger, args.seeds, args.guidance)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
