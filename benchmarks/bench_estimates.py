"""The VRAM estimate of a LoRA on each model of 2026 at 1024 px, beside the figures the other
trainers publish for it, and the cheapest settings the advice finds for 24 and 16 GB cards.

    python benchmarks/bench_estimates.py            # a markdown table (minutes: one trace each)
    python benchmarks/bench_estimates.py --json

Every architecture is built from the config the kit ships (kit/families/model_configs), on the
meta device: nothing is downloaded. The settings are the ones those figures are usually quoted
for: LoRA rank 16, batch 1, bf16, gradient checkpointing, AdamW.
"""

from __future__ import annotations

import argparse
import json
import sys

from kit.config import from_dict
from kit.preflight.advice import advise
from kit.preflight.estimate import GIB, GPUS, estimate

# The published figures are those the other trainers' documentation gives for a LoRA on each
# model (as quoted in the kit's issue #28); "-" where none is quoted.
MODELS = [
    ("zimage", "Tongyi-MAI/Z-Image-Turbo", "32-40 GB in bf16"),
    ("zimage", "Tongyi-MAI/Z-Image", "-"),
    ("qwen_image", "Qwen/Qwen-Image", "~42 GB unquantized"),
    ("flux2", "black-forest-labs/FLUX.2-klein-4B", "~12 GB"),
    ("flux2", "black-forest-labs/FLUX.2-klein-9B", "~22 GB"),
    ("flux2", "black-forest-labs/FLUX.2-dev", "-"),
    ("chroma", "lodestones/Chroma1-HD", "-"),
]
CARDS = ("RTX 4090 24GB", "RTX 4080 16GB")


def settings(family: str, model: str) -> dict:
    """The LoRA run the published figures describe."""
    return {
        "model_family": family,
        "pretrained_model": model,
        "resolution": 1024,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "lora_rank": 16,
        "train_batch_size": 1,
    }


def row(family: str, model: str, published: str) -> dict:
    """One model's estimate and advice."""
    cfg = from_dict(settings(family, model))
    est = estimate(cfg)
    out = {
        "model": model,
        "step_gib": round(est.total_bytes / GIB, 1),
        "setup_gib": round(est.setup_bytes / GIB, 1),
        "host_gib": round(est.host_bytes / GIB, 1),
        "published": published,
    }
    for card in CARDS:
        if est.fits(GPUS[card]):
            out[card] = "fits as is"
            continue
        rows = advise(cfg, GPUS[card], card=card, top=1)
        out[card] = rows[0]["changes"] if rows else "no single-card setting"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    rows = [row(*m) for m in MODELS]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return 0
    head = ["model", "step GiB", "setup GiB", "host RAM GiB", "published", *CARDS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["model"], r["step_gib"], r["setup_gib"], r["host_gib"], r["published"]]
        cells += [f"`{r[c]}`" if "=" in r[c] else r[c] for c in CARDS]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
