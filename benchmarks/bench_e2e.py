"""The kit's real `train()` end to end against a plain training loop, and the VRAM estimator's speed.

Measured in one run, reported as ratios:

1. training: `kit.train.loop.train` on a fixed tiny config (tiny SD1.5, the example's 24 images,
   LoRA) against a plain loop in the style of the common text-to-image LoRA example scripts,
   written here: the same model and data, a DataLoader that decodes images, and the VAE and text
   encoder run on every batch. Steady-state steps/s (after warm-up steps) and end-to-end seconds
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

import torch
from bench_step import square_pixels  # this folder's: the example scripts' transforms

from kit.logs import quiet_libraries

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "datasets_example" / "images"
PROMPT = "a large zorbic circle on a white background, in the center"

# The fixed setting both loops share.
BATCH, RANK, LR, SEED, SAMPLE_STEPS = 2, 4, 1e-4, 0, 2


def _steady(times: list[float], warmup: int) -> float:
    """Steps/s between the end of warm-up step `warmup` and the last step."""
    return (len(times) - warmup) / (times[-1] - times[warmup - 1])


def kit_run(base: Path, out: Path, cache: Path, steps: int, resolution: int) -> dict[str, Any]:
    """`kit.train.loop.train` on the fixed config: end-to-end seconds and per-step times."""
    from kit.config import from_dict
    from kit.run.folder import RunDir
    from kit.train.loop import train

    cfg = from_dict(
        {
            "model_family": "sd15",
            "pretrained_model": str(base),
            "image_dir": str(IMAGES),
            "cache_dir": str(cache),
            "output_dir": str(out),
            "resolution": resolution,
            "bucket_step": 32,
            "lora_rank": RANK,
            "lora_alpha": RANK,
            "learning_rate": LR,
            "lr_scheduler": "constant",
            "train_batch_size": BATCH,
            "max_train_steps": steps,
            "checkpointing_steps": 0,
            "validation_prompt": [PROMPT],
            "validation_seeds": [SEED],
            "validation_num_inference_steps": SAMPLE_STEPS,
            "report_to": "none",
            "seed": SEED,
        }
    )
    start = time.perf_counter()
    train(cfg)
    total = time.perf_counter() - start
    times = [r["time"] for r in RunDir(out).read_metrics()]
    return {"seconds": total, "times": times}


def plain_run(base: Path, out: Path, steps: int, resolution: int) -> dict[str, Any]:
    """A plain loop that encodes images and captions on every step, as example scripts do."""
    import torch.nn.functional as F
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from transformers import CLIPTextModel, CLIPTokenizer

    start = time.perf_counter()
    torch.manual_seed(SEED)
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=RANK,
            lora_alpha=RANK,
            init_lora_weights="gaussian",
            target_modules=["to_k", "to_q", "to_v", "to_out.0"],
        )
    )
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)

    files = sorted(IMAGES.glob("*.png"))
    captions = [f.with_suffix(".txt").read_text().strip() for f in files]

    def load(i: int) -> dict[str, torch.Tensor]:
        pixels = square_pixels(files[i], resolution)[0]  # the usual transforms
        ids = tokenizer(
            captions[i],
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids[0]
        return {"pixels": pixels, "ids": ids}

    loader = torch.utils.data.DataLoader(
        list(range(len(files))),
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        collate_fn=lambda idx: {
            k: torch.stack([s[k] for s in map(load, idx)]) for k in ("pixels", "ids")
        },
        generator=torch.Generator().manual_seed(SEED),
    )
    unet.train()
    times, step, loop_start = [], 0, time.perf_counter()
    while step < steps:
        for batch in loader:
            latents = vae.encode(batch["pixels"]).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (BATCH,))
            noisy = noise_scheduler.add_noise(latents, noise, t)
            hidden = text_encoder(batch["ids"], return_dict=False)[0]
            if noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, t)
            else:
                target = noise
            pred = unet(noisy, t, hidden, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), target.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            times.append(time.perf_counter() - loop_start)
            if step == steps:
                break

    lora = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=lora)
    unet.eval()
    pipe = StableDiffusionPipeline.from_pretrained(
        base,
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        safety_checker=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(
            PROMPT,
            num_inference_steps=SAMPLE_STEPS,
            height=resolution,
            width=resolution,
            generator=torch.Generator().manual_seed(SEED),
        )
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
