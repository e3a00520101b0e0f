"""The kit's real `train()` end to end against a plain training loop, and the VRAM estimator's speed.

Measured in one run, reported as ratios:

1. training: `kit.train.loop.train` on a fixed tiny config (tiny SD1.5, the example's 24 images,
   LoRA) against bench_step.py's stand-in for diffusers' text-to-image LoRA example script, in
   this process: the same model and data, a DataLoader that decodes images, and the VAE and
   text encoder run on every batch. Steady-state steps/s (after warm-up steps) and end-to-end seconds
   (load, data, training, saving the LoRA, one small validation image), the kit with a cold
   and with a warm latent cache;
2. the estimator: `kit.preflight.estimate.estimate` of the shipped SDXL architecture at 1024 px, the first
   call (one traced step on the meta device) against a repeat read from its cache.

Usage: python benchmarks/bench_e2e.py [--steps N] [--warmup N] [--resolution R] [--skip-estimate]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_step import kit_config, script_run  # this folder's: the same job, both sides

from kit.logs import quiet_libraries

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "datasets_example" / "images"

# The fixed setting both sides share (learning rate, seed and sampling: bench_step.py's).
BATCH, RANK = 2, 4


def _steady(times: list[float], warmup: int) -> float:
    """Steps/s between the end of warm-up step `warmup` and the last step."""
    return (len(times) - warmup) / (times[-1] - times[warmup - 1])


def job(steps: int, resolution: int) -> dict[str, Any]:
    """The fixed job both sides run, in bench_step.py's form."""
    return {"resolution": resolution, "batch": BATCH, "rank": RANK, "steps": steps}


def kit_run(base: Path, out: Path, cache: Path, steps: int, resolution: int) -> dict[str, Any]:
    """`kit.train.loop.train` on the fixed config: end-to-end seconds and per-step times."""
    from kit.config import load_config
    from kit.run.folder import RunDir
    from kit.train.loop import train

    # The run and its config beside each other; the cache shared between runs.
    path = kit_config(base, IMAGES, out, job(steps, resolution), bucket_step=32)
    cfg = load_config(path).replace(cache_dir=str(cache))
    start = time.perf_counter()
    train(cfg)
    total = time.perf_counter() - start
    times = [r["time"] for r in RunDir(Path(cfg.train.output_dir)).read_metrics()]
    return {"seconds": total, "times": times}


def plain_run(base: Path, out: Path, steps: int, resolution: int) -> dict[str, Any]:
    """bench_step.py's stand-in for diffusers' LoRA example, which encodes images and captions
    on every step, in this process: end-to-end seconds (loading included) and step times."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    times = script_run(base, IMAGES, out, job(steps, resolution))["times"]
    return {"seconds": time.perf_counter() - start, "times": times}


def training(steps: int, warmup: int, resolution: int) -> dict[str, Any]:
    """Both loops on one tiny model; the plain loop runs before and after the kit (mean)."""
    from kit.families import get_family

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = get_family("sd15").make_tiny(tmp / "tiny", seed=0)
        plain_run(base, tmp / "warm-up", min(steps, 4), resolution)  # first-call costs, once
        plain = [plain_run(base, tmp / "plain-1", steps, resolution)]
        cold = kit_run(base, tmp / "kit-cold", tmp / "cache", steps, resolution)
        warm = kit_run(base, tmp / "kit-warm", tmp / "cache", steps, resolution)
        plain.append(plain_run(base, tmp / "plain-2", steps, resolution))

    plain_sps = sum(_steady(p["times"], warmup) for p in plain) / len(plain)
    plain_s = sum(p["seconds"] for p in plain) / len(plain)
    kit_sps = (_steady(cold["times"], warmup) + _steady(warm["times"], warmup)) / 2
    return {
        "steps": steps,
        "warmup_steps": warmup,
        "resolution": resolution,
        "plain_steps_per_s": round(plain_sps, 2),
        "kit_steps_per_s": round(kit_sps, 2),
        "steps_per_s_ratio": round(kit_sps / plain_sps, 2),
        "plain_end_to_end_s": round(plain_s, 2),
        "kit_end_to_end_cold_cache_s": round(cold["seconds"], 2),
        "kit_end_to_end_warm_cache_s": round(warm["seconds"], 2),
        "end_to_end_ratio_cold": round(plain_s / cold["seconds"], 2),
        "end_to_end_ratio_warm": round(plain_s / warm["seconds"], 2),
    }


def estimator() -> dict[str, Any]:
    """Seconds of the first SDXL 1024 px estimate and of a cached repeat (fresh cache folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KIT_VRAM_CACHE"] = tmp
        from kit.config import from_dict
        from kit.preflight import estimate as memory

        cfg = from_dict(
            {
                "model_family": "sdxl",
                "pretrained_model": "stabilityai/stable-diffusion-xl-base-1.0",
                "resolution": 1024,
                "mixed_precision": "bf16",
                "gradient_checkpointing": True,
            }
        )
        start = time.perf_counter()
        first = memory.estimate(cfg)
        first_s = time.perf_counter() - start
        memory.forget_traces()  # a new process: only the disk cache remains
        start = time.perf_counter()
        again = memory.estimate(cfg)
        repeat_s = time.perf_counter() - start
    assert again.total_bytes == first.total_bytes
    return {
        "first_s": round(first_s, 2),
        "cached_repeat_s": round(repeat_s, 4),
        "ratio": round(first_s / repeat_s),
        "total_gib": round(first.total_bytes / 2**30, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of steps/s")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--skip-estimate", action="store_true")
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 0 and --steps")
    quiet_libraries()
    result: dict[str, Any] = {"training": training(args.steps, args.warmup, args.resolution)}
    if not args.skip_estimate:
        result["estimator"] = estimator()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
