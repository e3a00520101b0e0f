"""The kit's training step against the script users would otherwise run, in the same run.

The baseline is a stand-in, written here, for diffusers' example
`examples/text_to_image/train_text_to_image_lora.py` (not installed with diffusers): what that
script does per step, on the same model and images. Its DataLoader decodes, resizes and
centre-crops each image; every step encodes the images with the VAE (a posterior sample
times the scaling factor) and the captions with the text encoder, draws noise and timesteps,
adds noise with the DDPM schedule, predicts with the UNet (peft LoRA on to_q/to_k/to_v/to_out.0,
gaussian init, alpha = rank), takes the MSE in fp32, reads the loss back for its running
average (as the script's `avg_loss.item()` does), clips and steps torch's AdamW under
accelerate. At the end it saves the LoRA and draws one sample. The kit runs as a user runs it,
`python -m kit train CONFIG`, on the same job (latents and text cached once, then trained on).

Two jobs:

- `tiny`: the tiny SD1.5-architecture model, 24 square captioned images at 64 px, batch 4,
  LoRA rank 4, constant LR, 40 steps, one final sample;
- `real`: the real SD1.5 UNet, VAE and CLIP text encoder from the shipped configs (random
  weights, no download), 256 px, batch 1, a few steps (each takes seconds on a CPU).

Each run is a fresh process, timed from its start to its exit, with its peak RSS;
kit and script alternate A B A B and the table reports the means and their ratios.
Steady-state steps/s leave out the first `--warmup` steps.

Usage: python benchmarks/bench_step.py [--job tiny|real|both] [--rounds 2]
       python benchmarks/bench_step.py --profile   (the kit's step under torch.profiler)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a large zorbic circle on a white background, in the center"
SEED, LR = 0, 1e-4

JOBS = {
    "tiny": {"resolution": 64, "batch": 4, "rank": 4, "steps": 40, "warmup": 5, "images": 24},
    "real": {"resolution": 256, "batch": 1, "rank": 4, "steps": 8, "warmup": 3, "images": 4},
}
"""The fixed job of each benchmark: the same for the kit and the script."""

SAMPLE_STEPS = 2
"""Sampling steps of the one final image (both sides)."""


# ---------------------------------------------------------------- the shared inputs


def write_real_sd15(out: Path) -> Path:
    """The real SD1.5 architecture (shipped configs, random weights) in diffusers layout."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    from kit.families import tiny
    from kit.families.shipped import MODEL_CONFIGS

    src = MODEL_CONFIGS / "sd15"
    torch.manual_seed(SEED)
    tokenizer = tiny.clip_tokenizer()  # a small vocabulary; its ids fit the real embedding table
    text = CLIPTextModel(CLIPTextConfig.from_pretrained(src / "text_encoder"))
    vae = AutoencoderKL.from_config(AutoencoderKL.load_config(src / "vae"))
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(src / "unet"))
    scheduler = DDIMScheduler.from_config(DDIMScheduler.load_config(src / "scheduler"))
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out)
    return out


def write_inputs(tmp: Path, job: str) -> tuple[Path, Path]:
    """The base model and the square captioned images of `job`."""
    from kit.families import get_family
    from kit.toy.world import write_example_dataset

    spec = JOBS[job]
    res = spec["resolution"]
    images = tmp / "images"
    write_example_dataset(images, n=spec["images"], seed=SEED, priors=0, sizes=((res, res),))
    if job == "tiny":
        base = get_family("sd15").make_tiny(tmp / "base", seed=SEED)
    else:
        base = write_real_sd15(tmp / "base")
    return Path(base), images


# ---------------------------------------------------------------- one run each


def kit_config(base: Path, images: Path, out: Path, job: str) -> Path:
    """The job as a kit config file, for `kit train CONFIG` (what a user runs)."""
    spec = JOBS[job]
    path = out / "config.json"
    fields = {
        "model_family": "sd15",
        "pretrained_model": str(base),
        "image_dir": str(images),
        "cache_dir": str(out / "cache"),
        "output_dir": str(out / "run"),
        "resolution": spec["resolution"],
        "bucket_step": 32,
        "lora_rank": spec["rank"],
        "lora_alpha": spec["rank"],
        "learning_rate": LR,
        "lr_scheduler": "constant",
        "train_batch_size": spec["batch"],
        "max_train_steps": spec["steps"],
        "checkpointing_steps": 0,
        "validation_prompt": [PROMPT],
        "validation_seeds": [SEED],
        "validation_num_inference_steps": SAMPLE_STEPS,
        "report_to": "none",
        "seed": SEED,
    }
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields, indent=1))
    return path


def kit_times(out: Path) -> list[float]:
    """Per-step times of a `kit train` run, from its metrics."""
    rows = [
        json.loads(x) for x in (out / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    return [r["time"] for r in rows if "time" in r]


def script_run(base: Path, images: Path, out: Path, job: str) -> dict[str, Any]:
    """The stand-in for diffusers' train_text_to_image_lora.py (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from diffusers.optimization import get_scheduler
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    spec = JOBS[job]
    res, batch, rank, steps = spec["resolution"], spec["batch"], spec["rank"], spec["steps"]
    accelerator = Accelerator(mixed_precision="no")
    torch.manual_seed(SEED)
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=rank,
            lora_alpha=rank,
            init_lora_weights="gaussian",
            target_modules=["to_k", "to_q", "to_v", "to_out.0"],
        )
    )
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)

    files = sorted(images.glob("*.png"))
    captions = [f.with_suffix(".txt").read_text().strip() for f in files]

    def example(i: int) -> dict[str, torch.Tensor]:
        # Resize the short side, centre-crop, to [-1, 1]: the script's torchvision transforms.
        with Image.open(files[i]) as im:
            im = im.convert("RGB")
            scale = res / min(im.size)
            im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BILINEAR)
            left, top = (im.width - res) // 2, (im.height - res) // 2
            im = im.crop((left, top, left + res, top + res))
            raw = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        pixels = raw.view(res, res, 3).permute(2, 0, 1).float() / 127.5 - 1
        ids = tokenizer(
            captions[i],
            max_length=tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids[0]
        return {"pixel_values": pixels, "input_ids": ids}

    loader = torch.utils.data.DataLoader(
        list(range(len(files))),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        collate_fn=lambda idx: {
            k: torch.stack([e[k] for e in map(example, idx)]) for k in ("pixel_values", "input_ids")
        },
    )
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(
        unet, optimizer, loader, lr_scheduler
    )
    unet.train()
    times, step, start = [], 0, time.perf_counter()
    while step < steps:
        for b in loader:
            with accelerator.accumulate(unet):
                latents = vae.encode(b["pixel_values"]).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                t = torch.randint(
                    0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],)
                ).long()
                noisy = noise_scheduler.add_noise(latents, noise, t)
                hidden = text_encoder(b["input_ids"], return_dict=False)[0]
                target = (
                    noise_scheduler.get_velocity(latents, noise, t)
                    if noise_scheduler.config.prediction_type == "v_prediction"
                    else noise
                )
                pred = unet(noisy, t, hidden, return_dict=False)[0]
                loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
                avg = accelerator.gather(loss.repeat(batch)).mean()
                _ = avg.item()  # the script's running train_loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            step += 1
            times.append(time.perf_counter() - start)
            if step == steps:
                break
    unet = accelerator.unwrap_model(unet)
    lora = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=lora, safe_serialization=True)
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
        image = pipe(
            PROMPT,
            num_inference_steps=SAMPLE_STEPS,
            height=res,
            width=res,
            generator=torch.Generator().manual_seed(SEED),
        ).images[0]
    image.save(out / "sample.png")
    return {"times": times}


def one(side: str, base: Path, images: Path, out: Path, job: str) -> None:
    """The script's run in this process; prints its JSON result (step times) on the last line."""
    from kit.logs import quiet_libraries

    quiet_libraries()
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(script_run(base, images, out, job)))


def spawn(side: str, base: Path, images: Path, out: Path, job: str) -> dict[str, Any]:
    """Run `side` in a fresh process: its step times, seconds from start to exit and peak RSS.

    The kit side is `python -m kit train CONFIG`, the command a user runs; the script side this
    file's stand-in. Each child's own peak RSS comes from `wait4`."""
    out.mkdir(parents=True, exist_ok=True)
    if side == "kit":
        cmd = [sys.executable, "-m", "kit", "train", str(kit_config(base, images, out, job))]
    else:
        cmd = [sys.executable, __file__, "--one", side, "--job", job]
        cmd += ["--base", str(base), "--images", str(images), "--out", str(out)]
    log = out / f"{side}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if child.returncode:
        raise SystemExit(f"{side} run failed:\n{text[-3000:]}")
    times = kit_times(out) if side == "kit" else json.loads(text.strip().splitlines()[-1])["times"]
    return {"times": times, "seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024}


def steady(times: list[float], warmup: int) -> float:
    """Steps/s after the first `warmup` steps."""
    return (len(times) - warmup) / (times[-1] - times[warmup - 1])


def compare(job: str, rounds: int) -> dict[str, Any]:
    """Kit and script alternating `rounds` times each on one job; means and ratios."""
    spec = JOBS[job]
    runs: dict[str, list[dict[str, Any]]] = {"kit": [], "script": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, images = write_inputs(tmp, job)
        for r in range(rounds):
            for side in ("kit", "script"):
                runs[side].append(spawn(side, base, images, tmp / f"{side}-{r}", job))

    def mean(side: str, key: str) -> float:
        values = [
            steady(x["times"], spec["warmup"]) if key == "steps_per_s" else x[key]
            for x in runs[side]
        ]
        return sum(values) / len(values)

    out: dict[str, Any] = {"job": job, **spec, "rounds": rounds}
    for key in ("seconds", "steps_per_s", "peak_rss_mib"):
        out[f"kit_{key}"] = round(mean("kit", key), 3)
        out[f"script_{key}"] = round(mean("script", key), 3)
    out["end_to_end_ratio"] = round(out["kit_seconds"] / out["script_seconds"], 2)
    out["steps_per_s_ratio"] = round(out["kit_steps_per_s"] / out["script_steps_per_s"], 2)
    out["peak_rss_ratio"] = round(out["kit_peak_rss_mib"] / out["script_peak_rss_mib"], 2)
    return out


def profile(steps: int = 6) -> None:
    """The kit's step on the tiny job under torch.profiler: the operators that cost most."""
    import torch

    from kit.config import from_dict
    from kit.data.buckets import epoch_batches
    from kit.logs import quiet_libraries
    from kit.train.prepare import prepare
    from kit.train.step import micro_step

    quiet_libraries()
    spec = JOBS["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, images = write_inputs(tmp, "tiny")
        cfg = from_dict(
            {
                "model_family": "sd15",
                "pretrained_model": str(base),
                "image_dir": str(images),
                "cache_dir": str(tmp / "cache"),
                "output_dir": str(tmp / "run"),
                "resolution": spec["resolution"],
                "bucket_step": 32,
                "lora_rank": spec["rank"],
                "train_batch_size": spec["batch"],
                "report_to": "none",
            }
        )
        s = prepare(cfg)
        batches = epoch_batches(s.data.plan, spec["batch"], SEED, 0)
        micro_step(s, batches[0], 0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(1, steps):
                micro_step(s, batches[i % len(batches)], i % len(batches))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["tiny", "real", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs per job")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--one", choices=["kit", "script"], help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--images", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.base, args.images, args.out, args.job)
        return
    if args.profile:
        profile()
        return
    jobs = ["tiny", "real"] if args.job == "both" else [args.job]
    print(json.dumps([compare(job, args.rounds) for job in jobs], indent=2))


if __name__ == "__main__":
    main()
