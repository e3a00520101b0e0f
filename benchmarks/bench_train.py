"""Training throughput on the tiny model, as ratios measured in one run.

1. cached latents and text embeddings vs. encoding images and captions every step;
2. gradient checkpointing on vs. off.

Usage: python benchmarks/bench_train.py [--steps N] [--resolution R]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kit.config import from_dict
from kit.data.buckets import epoch_batches
from kit.data.cache import build_cache
from kit.data.pixels import load_pixels
from kit.families import get_family
from kit.logs import quiet_libraries
from kit.methods import get_method

ROOT = Path(__file__).resolve().parent.parent


def steps_per_second(fn, steps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resolution", type=int, default=128)
    args = parser.parse_args()
    print(json.dumps(measure(args.steps, args.resolution), indent=2))


def measure(steps: int, resolution: int, checkpointing: bool = True) -> dict[str, float]:
    """Steps/s with the cache, the ratio to encoding every step and (optionally) checkpointing."""
    args = argparse.Namespace(steps=steps, resolution=resolution)
    quiet_libraries()
    torch.manual_seed(0)
    family = get_family("sd15")
    with tempfile.TemporaryDirectory() as tmp:
        base = family.make_tiny(Path(tmp) / "tiny")
        cfg = from_dict(
            {
                "pretrained_model": str(base),
                "image_dir": str(ROOT / "datasets_example/images"),
                "cache_dir": str(Path(tmp) / "cache"),
                "resolution": args.resolution,
                "bucket_step": 32,
                "train_batch_size": 2,
            }
        )
        comps = family.load(str(base))
        data = build_cache(cfg, family, comps)
        method = get_method(cfg, family)
        method.attach(comps)
        opt = torch.optim.AdamW(method.parameters(comps), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        batches = epoch_batches(data.plan, 2, 0, 0)
        state = {"i": 0}

        def step(encode: bool) -> None:
            idx = batches[state["i"] % len(batches)]
            state["i"] += 1
            if encode:
                pixels = torch.stack(
                    [load_pixels(data.samples[i].image, data.plan.placements[i]) for i in idx]
                )
                latents = family.encode_images(comps, pixels)
                cond = family.encode_text(comps, [data.samples[i].caption for i in idx])
            else:
                batch = data.load_batch(idx)
                latents = batch.pop("latents")
                cond = batch
            draw = family.noise_and_target(comps, latents, gen)
            pred = family.predict(comps, draw.noisy, draw.timesteps, cond)
            loss = torch.nn.functional.mse_loss(pred, draw.target)
            loss.backward()
            opt.step()
            opt.zero_grad()

        comps.denoiser.train()
        cached = steps_per_second(lambda: step(False), args.steps)
        encoded = steps_per_second(lambda: step(True), args.steps)
        result = {
            "resolution": args.resolution,
            "cached_steps_per_s": round(cached, 2),
            "encoded_steps_per_s": round(encoded, 2),
            "cache_speedup_vs_encoding_each_step": round(cached / encoded, 2),
        }
        if checkpointing:
            comps.denoiser.enable_gradient_checkpointing()
            checkpointed = steps_per_second(lambda: step(False), args.steps)
            result["checkpointing_speed_ratio"] = round(checkpointed / cached, 2)
    return result


if __name__ == "__main__":
    main()
