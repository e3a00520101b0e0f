"""The estimate of a LoRA on the real Wan 2.2 video models (A14B's two experts, one expert alone,
TI2V-5B), with quantization and block swapping, beside the figures other trainers publish.

    python benchmarks/bench_video_estimates.py            # a markdown table (a trace per shape)
    python benchmarks/bench_video_estimates.py --json

Every architecture is built from the configs the kit ships (kit/families/<family>/configs) on the
meta device: nothing is downloaded, nothing is measured. "One 14B expert alone" is the A14B's
high-noise transformer as a base of its own (its configs without `transformer_2`: Wan 2.1
T2V 14B's architecture): the same expert on the accelerator, with nothing waiting in host RAM.
The A14B rows store both experts as `base_quantization` says (the waiting one too, in host RAM)
and swap the last `blocks_to_swap` blocks of the expert on the accelerator.
Settings: LoRA rank 16, batch 1, bf16, gradient checkpointing, AdamW; each row's clip (or image)
size is its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from kit.config import from_dict
from kit.errors import KitError
from kit.families.shipped import shipped_dir
from kit.preflight.estimate import GIB, GPUS, estimate

A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
TI2V = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
CARD = "RTX 4090 24GB"

CLIP = (832, 480, 81)
"""Width, height and frames of the clip most rows train on: 480p, 5 s at 16 fps (Wan's default)."""
IMAGE = (1024, 1024, 1)
"""ai-toolkit's 24 GB Wan 2.2 14B example trains on images (num_frames 1) up to 1024 px."""

# (label, base, train_experts, base_quantization, blocks_to_swap, (w, h, frames), published)
ROWS = [
    ("A14B, one expert", A14B, "high", "none", 0, CLIP, "24 GB with 4-bit quantization"),
    ("A14B, one expert", A14B, "high", "int8", 0, CLIP, ""),
    ("A14B, one expert", A14B, "high", "fp8", 0, CLIP, ""),
    ("A14B, one expert", A14B, "high", "nf4", 0, CLIP, ""),
    ("A14B, one expert", A14B, "high", "none", 20, CLIP, ""),
    ("A14B, one expert", A14B, "high", "none", 40, CLIP, ""),
    ("A14B, one expert", A14B, "high", "none", 0, IMAGE, ""),
    ("A14B, one expert", A14B, "high", "nf4", 0, IMAGE, "24 GB with 4-bit quantization"),
    ("A14B, one expert", A14B, "high", "nf4", 0, (832, 480, 33), ""),
    ("A14B, one expert", A14B, "high", "none", 30, (832, 480, 33), ""),
    ("A14B, both experts", A14B, "both", "none", 0, CLIP, "~96 GB system RAM, both held"),
    ("A14B, both experts", A14B, "both", "int8", 0, CLIP, ""),
    ("A14B, both experts", A14B, "both", "fp8", 0, CLIP, ""),
    ("A14B, both experts", A14B, "both", "nf4", 0, CLIP, ""),
    ("A14B, both experts", A14B, "both", "none", 20, CLIP, ""),
    ("A14B, both experts", A14B, "both", "nf4", 0, IMAGE, ""),
    ("A14B, both experts", A14B, "both", "nf4", 0, (832, 480, 33), ""),
    ("A14B, both experts", A14B, "both", "none", 30, (832, 480, 33), ""),
    ("one 14B expert alone", "expert", "", "none", 0, CLIP, ""),
    ("one 14B expert alone", "expert", "", "nf4", 0, CLIP, ""),
    ("TI2V-5B", TI2V, "", "none", 0, CLIP, "-"),
    ("TI2V-5B", TI2V, "", "int8", 0, CLIP, "-"),
    ("TI2V-5B", TI2V, "", "fp8", 0, CLIP, "-"),
    ("TI2V-5B", TI2V, "", "none", 15, CLIP, "-"),
    ("TI2V-5B", TI2V, "", "none", 0, (1280, 704, 121), "-"),
]


def one_expert_base(dst: Path) -> Path:
    """The A14B's configs with only its high-noise `transformer`: one 14B Wan transformer (the
    architecture of Wan 2.1 T2V 14B) as a base of its own, configs only."""
    src = shipped_dir("wan22-t2v-a14b")
    dst.mkdir(parents=True, exist_ok=True)
    for sub in ("transformer", "text_encoder", "vae", "scheduler"):
        shutil.copytree(src / sub, dst / sub, dirs_exist_ok=True)
    index = json.loads((src / "model_index.json").read_text())
    for key in ("transformer_2", "boundary_ratio"):
        index.pop(key, None)
    (dst / "model_index.json").write_text(json.dumps(index, indent=2))
    return dst


def settings(base: str, experts: str, frames: int) -> dict:
    """The LoRA run of a row."""
    out = {
        "model_family": "wan",
        "pretrained_model": base,
        "resolution": 512,
        "num_frames": frames,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "lora_rank": 16,
        "train_batch_size": 1,
    }
    return {**out, "train_experts": experts} if experts else out


def row(
    label: str, base: str, experts: str, quant: str, swap: int, shape: tuple, published: str
) -> dict:
    """One row: the estimate, or the kit's refusal in its own words."""
    w, h, frames = shape
    out = {
        "model": label,
        "train_experts": experts or "-",
        "base_quantization": quant,
        "blocks_to_swap": swap,
        "shape": f"{w}x{h}x{frames}f" if frames > 1 else f"{w}x{h} image",
        "published": published,
    }
    cfg = from_dict(settings(base, experts, frames))
    try:
        est = estimate(cfg, base_quantization=quant, blocks_to_swap=swap, bucket=(w, h))
    except KitError as e:
        return {**out, "refused": str(e).split(";")[0].split(" (")[0]}
    d = est.details
    waiting = sum(d["waiting_in_host_ram"].values())
    return {
        **out,
        # The expert on the accelerator, less the blocks swapped out to host RAM.
        "denoiser_gpu_gib": round(est.components["denoiser_weights"] / GIB, 1),
        "step_gib": round(est.total_bytes / GIB, 1),
        "setup_gib": round(est.setup_bytes / GIB, 1),
        "waiting_host_gib": round(waiting / GIB, 1),
        "host_gib": round(est.host_bytes / GIB, 1),
        "host_phase": d["host_phase"],
        "on_accelerator": d["on_accelerator"],
        CARD: est.fits(GPUS[CARD]),
    }


def table(rows: list[dict]) -> list[str]:
    """The rows as markdown."""
    head = ["model", "experts", "clip", "quant", "swap", "denoiser on GPU", "step GiB", "setup GiB"]
    head += ["waiting in host RAM", "host RAM GiB", f"fits {CARD}", "published"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["train_experts"], r["shape"], r["base_quantization"]]
        cells.append(r["blocks_to_swap"])
        if "refused" in r:
            cells += [f"refused: {r['refused']}", "", "", "", "", "", r["published"]]
        else:
            cells += [r["denoiser_gpu_gib"], r["step_gib"], r["setup_gib"]]
            cells += [r["waiting_host_gib"] or "-", f"{r['host_gib']} ({r['host_phase']})"]
            cells += ["yes" if r[CARD] else "no", r["published"] or ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        expert = str(one_expert_base(Path(tmp) / "wan-14b-expert"))
        rows = [row(m[0], expert if m[1] == "expert" else m[1], *m[2:]) for m in ROWS]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return 0
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
