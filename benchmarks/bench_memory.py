"""Accuracy of the VRAM estimate against a measured peak, one table per run.

With a CUDA GPU: the estimate's allocated bytes against `torch.cuda.max_memory_allocated` of
two real steps of the real SD1.5 / SDXL LoRA configs (`--real`, needs the weights).
Without one: the same comparison on small SD1.5 / SDXL models (the real architectures with a
fifth of the width, SDXL with fewer transformer layers; random init, written in diffusers
layout and loaded back through `from_pretrained`), whose peaks are hundreds of MiB. The measured
peak is an independent method: the process's peak resident memory (VmHWM, reset just before
loading) during two real steps, minus its resident memory before the model was loaded. Each case
runs in a fresh process with glibc told to return freed blocks at once, so resident memory
follows live tensors.

Usage: python benchmarks/bench_memory.py [--quick] [--out benchmarks/memory_cpu.md]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _config(family: str, base: str, res: int, batch: int, ckpt: bool, precision: str):
    from kit.config import Config

    cfg = Config()
    cfg.model.model_family = family
    cfg.model.pretrained_model = base
    cfg.data.resolution = res
    cfg.train.train_batch_size = batch
    cfg.train.gradient_checkpointing = ckpt
    cfg.train.mixed_precision = precision
    cfg.network.lora_rank = 16
    return cfg


# How the small models differ from the shipped configs (everything else is kept).
SMALL = {
    "sd15": {"width": 5},
    "sdxl": {
        "width": 5,
        "attention_head_dim": [2, 4, 8],
        "transformer_layers_per_block": [1, 2, 3],
    },
}


def small_model(family: str, out: Path) -> Path:
    """The shipped UNet config at reduced width (and depth), random init, with tiny encoders."""
    import torch
    from diffusers import UNet2DConditionModel

    from kit.families import get_family
    from kit.families.shipped import shipped_dir

    get_family(family).make_tiny(out, seed=0)
    tiny = UNet2DConditionModel.load_config(out / "unet")
    config = dict(UNet2DConditionModel.load_config(shipped_dir(family) / "unet"))
    change = dict(SMALL[family])
    width = change.pop("width")
    config["block_out_channels"] = [c // width for c in config["block_out_channels"]]
    # The text-facing sizes follow the tiny text encoders the UNet is paired with.
    text_facing = ("cross_attention_dim", "projection_class_embeddings_input_dim")
    for key in (*text_facing, "addition_time_embed_dim", "sample_size"):
        if key in tiny:
            config[key] = tiny[key]
    config.update(change)
    torch.manual_seed(0)
    UNet2DConditionModel.from_config(config).save_pretrained(out / "unet")
    return out


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(spec: dict) -> None:
    """One case in this process: print the measured peak as JSON."""
    import torch

    from kit.logs import quiet_libraries
    from kit.preflight.measure import real_step

    quiet_libraries()
    torch.set_num_threads(2)
    cfg = _config(**spec)
    device = "cuda" if torch.cuda.is_available() and spec["precision"] != "no" else "cpu"
    # Warm up on a throwaway copy at 64 px: lazy imports, kernel and thread-pool set-up.
    warm = _config(**{**spec, "res": 64, "batch": 1})
    real_step(warm, device, steps=1)
    gc.collect()
    # Baseline before any weight of the measured run is read.
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    out = real_step(cfg, device, steps=2)
    out["rss_peak_delta"] = _status("VmHWM") - baseline
    print(json.dumps(out))


def run_case(spec: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    env.setdefault("OMP_NUM_THREADS", "2")
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the lower resolution only")
    parser.add_argument("--real", action="store_true", help="real SD1.5/SDXL weights on a GPU")
    parser.add_argument(
        "--family", action="append", choices=("sd15", "sdxl"), help="only these (repeatable)"
    )
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    from kit.logs import quiet_libraries
    from kit.preflight.estimate import estimate

    quiet_libraries()
    os.environ.setdefault("KIT_VRAM_CACHE", tempfile.mkdtemp(prefix="kit-vram-"))
    tmp = Path(tempfile.mkdtemp(prefix="kit-bench-mem-"))
    families = {}
    for name in args.family or ("sd15", "sdxl"):
        if args.real:
            families[name] = {
                "sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5",
                "sdxl": "stabilityai/stable-diffusion-xl-base-1.0",
            }[name]
        else:
            families[name] = str(small_model(name, tmp / name))
    precision = "bf16" if args.real else "no"
    # On 2 CPU cores a step of the small models at 512 px, batch 4, takes about a minute.
    resolutions = (512, 1024) if args.real else (256, 512)
    resolutions = resolutions[:1] if args.quick else resolutions
    rows = []
    for (name, base), res, batch, ckpt in itertools.product(
        families.items(), resolutions, (1, 4), (False, True)
    ):
        spec = {"family": name, "base": base, "res": res, "batch": batch, "ckpt": ckpt}
        spec["precision"] = precision
        start = time.perf_counter()
        est = estimate(_config(**spec))
        est_s = time.perf_counter() - start
        got = run_case(spec)
        measured = got.get("max_memory_allocated", got["rss_peak_delta"])
        predicted = est.allocated_bytes
        rows.append(
            {
                "model": name if args.real else f"{name} small",
                "px": res,
                "batch": batch,
                "ckpt": "on" if ckpt else "off",
                "predicted_mib": predicted / 2**20,
                "measured_mib": measured / 2**20,
                "error": predicted / measured - 1,
                "estimate_s": est_s,
            }
        )
        r = rows[-1]
        print(
            f"{r['model']:>10} {res:>5}px b{batch} ckpt {r['ckpt']:>3}: predicted "
            f"{r['predicted_mib']:8.1f} MiB, measured {r['measured_mib']:8.1f} MiB, "
            f"error {r['error']:+.1%}  (estimate {est_s:.1f} s)",
            flush=True,
        )
    worst = max(abs(r["error"]) for r in rows)
    method = (
        "torch.cuda.max_memory_allocated, bf16"
        if args.real
        else "peak RSS delta (VmHWM), fp32 on CPU"
    )
    lines = [
        f"Measured by {method}; LoRA rank 16 on the attention projections, AdamW, two steps.",
        "",
        "| model | px | batch | checkpointing | estimate MiB | measured MiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['px']} | {r['batch']} | {r['ckpt']} | "
            f"{r['predicted_mib']:.1f} | {r['measured_mib']:.1f} | {r['error']:+.1%} |"
        )
    lines.append("")
    lines.append(f"Worst error: {worst:.1%}.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
