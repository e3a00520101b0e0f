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

Three jobs:

- `tiny`: the tiny SD1.5-architecture model, 24 square captioned images at 64 px, batch 4,
  LoRA rank 4, constant LR, 40 steps, one final sample;
- `real`: the real SD1.5 UNet, VAE and CLIP text encoder from the shipped configs (random
  weights, no download), 256 px, batch 1, a few steps (each takes seconds on a CPU);
- `sdxl`: the real SDXL architecture from the shipped configs (random weights) at 1024 px in
  bf16, for a GPU, against a stand-in for the SDXL variant of the same script
  (`train_text_to_image_lora_sdxl.py`); `--tiny` runs it on the tiny SDXL at 64 px (a smoke
  test on the CPU). See `compare_sdxl`: it also reports peak VRAM and model-FLOPs utilisation.

Each run is a fresh process, timed from its start to its exit, with its peak RSS;
kit and script alternate A B A B and the table reports the means and their ratios.
Steady-state steps/s leave out the first `--warmup` steps.

`--busy N` runs N other jobs beside both sides, each keeping one CPU busy: the machine a
user shares with a build, another notebook or another user.

`--precision bf16` trains both sides in bf16 (the kit's `mixed_precision: bf16`, the script's
`--mixed_precision bf16`): on a CPU with bf16 instructions that is what a user would pick.

Usage: python benchmarks/bench_step.py [--job tiny|real|both] [--rounds 2] [--busy N]
       [--precision no|bf16]
       python benchmarks/bench_step.py --job sdxl [--device cuda] [--tiny] [--steps 8]
       python benchmarks/bench_step.py --profile   (the kit's step under torch.profiler)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a checkout that is not installed (a lent GPU machine)
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
    """The real SD1.5 architecture (shipped configs, random weights) in diffusers layout,
    built by gpu_check's `build_model` in fp32 on the CPU."""
    from kit.families.shipped import shipped_dir

    return sibling("gpu_check").build_model("sd15", shipped_dir("sd15"), out, "float32", "cpu")


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


def kit_config(base: Path, images: Path, out: Path, spec: dict[str, Any], **extra: Any) -> Path:
    """A job (`JOBS[...]` or `sdxl_spec`) as a kit config file, for `kit train CONFIG` (what a
    user runs); `extra` adds the fields one job sets (family, targets, precision…)."""
    path = out / "config.json"
    fields = {
        "model_family": "sd15",
        "pretrained_model": str(base),
        "image_dir": str(images),
        "cache_dir": str(out / "cache"),
        "output_dir": str(out / "run"),
        "resolution": spec["resolution"],
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
        **extra,
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


def square_pixels(file: Path, res: int, random_crop: bool = False) -> tuple[Any, tuple, tuple]:
    """What the example scripts' transforms make of one image: the short side resized to
    `res`, a `res`² crop (centred, or at random as the SDXL script's default), scaled to
    [-1, 1], channels first; with the original (height, width) and the crop's (top, left)."""
    import torch
    from PIL import Image

    with Image.open(file) as im:
        im = im.convert("RGB")
        original = (im.height, im.width)
        scale = res / min(im.size)
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BILINEAR)
        if random_crop:
            top, left = random.randint(0, im.height - res), random.randint(0, im.width - res)
        else:
            top, left = (im.height - res) // 2, (im.width - res) // 2
        im = im.crop((left, top, left + res, top + res))
        raw = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return raw.view(res, res, 3).permute(2, 0, 1).float() / 127.5 - 1, original, (top, left)


def script_run(
    base: Path, images: Path, out: Path, spec: dict[str, Any], precision: str = "no"
) -> dict[str, Any]:
    """The stand-in for diffusers' train_text_to_image_lora.py (see the module docstring) on
    a job (`resolution`, `batch`, `rank`, `steps`: `JOBS[...]`, or bench_e2e.py's).
    `precision` bf16 does what the script does under `--mixed_precision bf16`: the UNet, VAE
    and text encoder in bf16 (the LoRA weights too: the script upcasts them for fp16 only),
    accelerate's autocast, the images cast to bf16 for the VAE, the sample in bf16."""
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
    from transformers import CLIPTextModel, CLIPTokenizer

    res, batch, rank, steps = spec["resolution"], spec["batch"], spec["rank"], spec["steps"]
    accelerator = Accelerator(mixed_precision=precision)
    weight_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(SEED)
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
        m.to(dtype=weight_dtype)
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
        pixels = square_pixels(files[i], res)[0]  # the script's torchvision transforms
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
                latents = vae.encode(b["pixel_values"].to(weight_dtype)).latent_dist.sample()
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
        torch_dtype=weight_dtype,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad(), accelerator.autocast():
        image = pipe(
            PROMPT,
            num_inference_steps=SAMPLE_STEPS,
            height=res,
            width=res,
            generator=torch.Generator().manual_seed(SEED),
        ).images[0]
    image.save(out / "sample.png")
    return {"times": times}


def one(side: str, base: Path, images: Path, out: Path, job: str, precision: str) -> None:
    """The script's run in this process; prints its JSON result (step times) on the last line."""
    from kit.logs import quiet_libraries

    quiet_libraries()
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(script_run(base, images, out, JOBS[job], precision)))


def spawn(
    side: str, base: Path, images: Path, out: Path, job: str, precision: str = "no"
) -> dict[str, Any]:
    """Run `side` in a fresh process: its step times, seconds from start to exit and peak RSS.

    The kit side is `python -m kit train CONFIG`, the command a user runs; the script side this
    file's stand-in. Each child's own peak RSS comes from `wait4`."""
    out.mkdir(parents=True, exist_ok=True)
    if side == "kit":
        cmd = [
            sys.executable,
            "-m",
            "kit",
            "train",
            str(
                kit_config(base, images, out, JOBS[job], bucket_step=32, mixed_precision=precision)
            ),
        ]
    else:
        cmd = [sys.executable, __file__, "--one", side, "--job", job, "--precision", precision]
        cmd += ["--base", str(base), "--images", str(images), "--out", str(out)]
    text, seconds, rss = run_process(side, cmd, out / f"{side}.log")
    times = kit_times(out) if side == "kit" else json.loads(text.strip().splitlines()[-1])["times"]
    return {"times": times, "seconds": seconds, "peak_rss_mib": rss}


def run_process(
    side: str, cmd: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[str, float, float]:
    """Run `cmd` to its end, its output in `log`: (that output, seconds from start to exit, its
    own peak RSS in MiB from `wait4`). A failed run stops the benchmark with its log's tail."""
    start = time.perf_counter()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{side} run failed:\n{text[-3000:]}")
    return text, seconds, usage.ru_maxrss / 1024


def steady(times: list[float], warmup: int) -> float:
    """Steps/s after the first `warmup` steps."""
    return (len(times) - warmup) / (times[-1] - times[warmup - 1])


@contextlib.contextmanager
def busy_jobs(n: int):
    """`n` other jobs on the machine while the runs go: processes that each keep one CPU busy
    (a build, a second notebook, another user's training on a shared machine)."""
    jobs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # running before the first run starts
        yield
    finally:
        for j in jobs:
            j.kill()
            j.wait()


def compare(job: str, rounds: int, busy: int = 0, precision: str = "no") -> dict[str, Any]:
    """Kit and script alternating `rounds` times each on one job in `precision` (no: fp32),
    with `busy` other jobs keeping CPUs busy meanwhile; means and ratios."""
    spec = JOBS[job]
    runs: dict[str, list[dict[str, Any]]] = {"kit": [], "script": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, images = write_inputs(tmp, job)
        with busy_jobs(busy):
            for r in range(rounds):
                for side in ("kit", "script"):
                    out = tmp / f"{side}-{r}"
                    runs[side].append(spawn(side, base, images, out, job, precision))

    def mean(side: str, key: str) -> float:
        values = [
            steady(x["times"], spec["warmup"]) if key == "steps_per_s" else x[key]
            for x in runs[side]
        ]
        return sum(values) / len(values)

    out: dict[str, Any] = {"job": job, **spec, "rounds": rounds, "busy_jobs": busy}
    out["precision"] = precision
    for key in ("seconds", "steps_per_s", "peak_rss_mib"):
        out[f"kit_{key}"] = round(mean("kit", key), 3)
        out[f"script_{key}"] = round(mean("script", key), 3)
    out["end_to_end_ratio"] = round(out["kit_seconds"] / out["script_seconds"], 2)
    out["steps_per_s_ratio"] = round(out["kit_steps_per_s"] / out["script_steps_per_s"], 2)
    out["peak_rss_ratio"] = round(out["kit_peak_rss_mib"] / out["script_peak_rss_mib"], 2)
    return out


# ---------------------------------------------------------------- the SDXL job (a GPU's)

SDXL_JOB = {
    "resolution": 1024,
    "batch": 1,
    "rank": 4,
    "steps": 8,
    "warmup": 3,
    "images": 4,
    "precision": "bf16",
    "checkpointing": False,
}
"""The SDXL job, the same on both sides: the script's own defaults where it has them (1024 px,
LoRA rank 4 with alpha = rank, learning rate 1e-4, constant schedule, AdamW with weight decay
1e-2, no gradient checkpointing, no TF32 switch), batch 1 (its default of 16 is not what a
single card runs), bf16 mixed precision (`accelerate`'s setting for the script,
`mixed_precision: bf16` for the kit). `--checkpointing` turns gradient checkpointing on for
both, as a 24 GB card would need."""

TINY_SDXL_PX = 64
"""The tiny SDXL's training resolution (`--tiny`)."""

LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
"""The UNet modules the script adapts, also the kit's SDXL defaults."""

PEAK_BF16_TFLOPS = (
    ("GH200", 989.5),
    ("H200 NVL", 835.5),
    ("H200", 989.5),
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H100", 989.5),
    ("A100", 312.0),
    ("L40S", 362.05),
    ("L40", 181.05),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 6000 Ada", 364.25),
    ("RTX A6000", 154.8),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("T4", 65.0),
)
"""Peak dense bf16 tensor-core TFLOP/s per card, from the vendor's datasheets (NVIDIA's product
pages and architecture whitepapers), without sparsity, with fp32 accumulation where the card
has two rates (the GeForce and RTX cards); matched in order, as whole words, against
`torch.cuda.get_device_name()`. H100 and H200 SXM ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
share one rate. T4 has no bf16: its fp16 rate is given. A card not listed gets no MFU."""


def peak_bf16_flops(device_name: str) -> float | None:
    """The card's peak dense bf16 FLOP/s (`PEAK_BF16_TFLOPS`), or None when not listed."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", device_name):
            return tflops * 1e12
    return None


def sdxl_spec(
    tiny: bool = False,
    steps: int | None = None,
    warmup: int | None = None,
    checkpointing: bool = False,
) -> dict[str, Any]:
    """The SDXL job as run: `SDXL_JOB`, at 64 px on the tiny model, with its step counts."""
    spec = {**SDXL_JOB, "tiny": tiny, "checkpointing": checkpointing}
    if tiny:
        spec["resolution"] = TINY_SDXL_PX
    spec["steps"] = steps or spec["steps"]
    spec["warmup"] = spec["warmup"] if warmup is None else warmup
    if not 1 <= spec["warmup"] < spec["steps"]:
        raise SystemExit(f"--warmup {spec['warmup']} must be at least 1 and below --steps")
    return spec


def write_sdxl_base(out: Path, tiny: bool, device: str) -> Path:
    """The SDXL base: the tiny model, or the real architecture from the shipped configs with
    random weights (built on `device`, stored in fp16, by gpu_check's `build_model`)."""
    from kit.families import get_family
    from kit.families.shipped import shipped_dir

    if tiny:
        return Path(get_family("sdxl").make_tiny(out, seed=SEED))
    return sibling("gpu_check").build_model("sdxl", shipped_dir("sdxl"), out, "float16", device)


def sibling(name: str) -> Any:
    """Another script of this folder, imported by path (the folder is not a package)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def sdxl_kit_config(base: Path, images: Path, out: Path, spec: dict[str, Any]) -> Path:
    """The SDXL job as a kit config file."""
    return kit_config(
        base,
        images,
        out,
        spec,
        model_family="sdxl",
        lora_target_modules=LORA_TARGETS,
        mixed_precision=spec["precision"],
        gradient_checkpointing=spec["checkpointing"],
    )


class VramProbe:
    """Peak `torch.cuda.max_memory_allocated` of this process: while loading (up to the first
    step; the kit also fills its cache there), over the training steps, and over the whole run
    (the final sample included). Nothing on a machine without CUDA."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.setup: int | None = None
        self.train: int | None = None

    def start(self) -> None:
        """Training starts: the loading peak is kept, the training peak measured from here."""
        if self.cuda:
            self.torch.cuda.synchronize()
            self.setup = self.torch.cuda.max_memory_allocated()
            self.torch.cuda.reset_peak_memory_stats()

    def step(self) -> None:
        """A step ended (after its loss was read back, so the device is done with it)."""
        if self.cuda:
            self.train = self.torch.cuda.max_memory_allocated()

    def result(self) -> dict[str, Any]:
        if not self.cuda:
            return {"device_name": "cpu", "setup_peak": None, "train_peak": None, "peak": None}
        whole = max(self.setup or 0, self.torch.cuda.max_memory_allocated())
        return {
            "device_name": self.torch.cuda.get_device_name(),
            "setup_peak": self.setup,
            "train_peak": self.train,
            "peak": whole,
        }


def sdxl_kit_run(config: Path) -> dict[str, Any]:
    """The kit's side: what `kit train CONFIG` runs (`load_config`, then `train`), in this
    process so that a callback can mark where training starts and read each step's peak."""
    from kit.config import load_config
    from kit.train.loop import train

    probe = VramProbe()
    times: list[float] = []
    losses: list[float] = []

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "start":
            probe.start()
        elif event["kind"] == "step":
            times.append(time.perf_counter())
            losses.append(event["loss"])
            probe.step()

    train(load_config(config), callbacks=[on_event])
    return {"times": times, "losses": losses, **probe.result()}


def sdxl_script_run(base: Path, images: Path, out: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for diffusers' train_text_to_image_lora_sdxl.py: what it does per step.

    Its data pipeline resizes each image's short side to the resolution (bilinear), crops at a
    random place, normalises to [-1, 1], tokenizes the caption for both CLIP tokenizers, and
    keeps the original size and crop corner. The UNet and both text encoders are cast to bf16,
    the VAE kept in fp32 (the script upcasts the SDXL VAE when no other VAE is given). Every step
    encodes the pixels with the fp32 VAE (a posterior sample times the scaling factor, then cast
    to bf16), draws DDPM noise and timesteps, builds the six size/crop ids, runs both text
    encoders (penultimate hidden states side by side, the second's projected pooled output),
    predicts with the UNet under accelerate's bf16 autocast (peft LoRA on the attention
    projections, gaussian init, alpha = rank), takes the MSE in fp32, reads the gathered loss
    back (`.item()`), clips at 1.0 and steps torch's AdamW; after the step it reads the loss
    back again for its progress bar. At the end it saves the LoRA, reloads the pipeline in bf16
    with the LoRA loaded and draws the sample under autocast, as its final validation does
    (one image of `SAMPLE_STEPS` steps here, the same as the kit's).
    """
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from diffusers.optimization import get_scheduler
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    res, batch, steps = spec["resolution"], spec["batch"], spec["steps"]
    accelerator = Accelerator(mixed_precision=spec["precision"], cpu=not torch.cuda.is_available())
    probe = VramProbe()
    random.seed(SEED)
    torch.manual_seed(SEED)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"], torch.float32)
    device = accelerator.device
    tokenizers = [
        AutoTokenizer.from_pretrained(base, subfolder=sub, use_fast=False)
        for sub in ("tokenizer", "tokenizer_2")
    ]
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    encoders = [
        CLIPTextModel.from_pretrained(base, subfolder="text_encoder"),
        CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder_2"),
    ]
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    for m in (vae, unet, *encoders):
        m.requires_grad_(False)
    unet.to(device, dtype=dtype)
    vae.to(device, dtype=torch.float32)
    for enc in encoders:
        enc.to(device, dtype=dtype)
    unet.add_adapter(
        LoraConfig(
            r=spec["rank"],
            lora_alpha=spec["rank"],
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS,
        )
    )
    if spec["checkpointing"]:
        unet.enable_gradient_checkpointing()
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)

    files = sorted(images.glob("*.png"))
    captions = [f.with_suffix(".txt").read_text().strip() for f in files]

    def example(i: int) -> dict[str, Any]:
        pixels, original, (top, left) = square_pixels(files[i], res, random_crop=True)
        ids = [
            tok(
                captions[i],
                padding="max_length",
                max_length=tok.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids[0]
            for tok in tokenizers
        ]
        return {
            "pixel_values": pixels,
            "ids": ids,
            "time_ids": [*original, top, left, res, res],
        }

    def collate(idx: list[int]) -> dict[str, Any]:
        rows = [example(i) for i in idx]
        return {
            "pixel_values": torch.stack([r["pixel_values"] for r in rows]),
            "ids_1": torch.stack([r["ids"][0] for r in rows]),
            "ids_2": torch.stack([r["ids"][1] for r in rows]),
            "time_ids": [r["time_ids"] for r in rows],
        }

    loader = torch.utils.data.DataLoader(
        list(range(len(files))), batch_size=batch, shuffle=True, collate_fn=collate
    )
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(
        unet, optimizer, loader, lr_scheduler
    )
    unet.train()
    probe.start()
    times: list[float] = []
    losses: list[float] = []
    while len(times) < steps:
        for b in loader:
            with accelerator.accumulate(unet):
                latents = vae.encode(b["pixel_values"].to(device)).latent_dist.sample()
                latents = (latents * vae.config.scaling_factor).to(dtype)
                noise = torch.randn_like(latents)
                t = torch.randint(
                    0,
                    noise_scheduler.config.num_train_timesteps,
                    (latents.shape[0],),
                    device=device,
                ).long()
                noisy = noise_scheduler.add_noise(latents, noise, t)
                time_ids = torch.tensor(b["time_ids"], device=device, dtype=dtype)
                hidden = []
                for enc, key in zip(encoders, ("ids_1", "ids_2"), strict=True):
                    got = enc(b[key].to(device), output_hidden_states=True)
                    pooled = got[0]  # the second encoder's is the one used
                    hidden.append(got.hidden_states[-2])
                pred = unet(
                    noisy,
                    t,
                    torch.cat(hidden, dim=-1),
                    added_cond_kwargs={"time_ids": time_ids, "text_embeds": pooled},
                    return_dict=False,
                )[0]
                target = (
                    noise_scheduler.get_velocity(latents, noise, t)
                    if noise_scheduler.config.prediction_type == "v_prediction"
                    else noise
                )
                loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
                _ = accelerator.gather(loss.repeat(batch)).mean().item()  # its train_loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach().item())  # its progress bar's step_loss
            times.append(time.perf_counter())
            probe.step()
            if len(times) == steps:
                break
    unet = accelerator.unwrap_model(unet)
    lora = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionXLPipeline.save_lora_weights(out, unet_lora_layers=lora, safe_serialization=True)
    del unet, encoders
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    pipe = StableDiffusionXLPipeline.from_pretrained(base, vae=vae, torch_dtype=dtype)
    pipe.load_lora_weights(out)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    with torch.autocast(device.type):
        image = pipe(
            PROMPT,
            num_inference_steps=SAMPLE_STEPS,
            height=res,
            width=res,
            generator=torch.Generator(device=device).manual_seed(SEED),
        ).images[0]
    image.save(out / "sample.png")
    return {"times": times, "losses": losses, **probe.result()}


def unet_step_flops(base: Path, spec: dict[str, Any]) -> int:
    """Model FLOPs of one training step: the UNet's forward and backward with the job's LoRA, at
    the job's shape, counted by `torch.utils.flop_counter.FlopCounterMode` on the meta device
    (shapes only: no weights, no memory, the same on any machine).

    The same work for both sides, so the MFUs compare as their steps/s do: the script's VAE and
    text-encoder passes each step are not counted (they are overhead the kit's cache removes),
    nor is gradient checkpointing's second forward (a recomputation, not model work). The
    backward is what autograd runs for LoRA: gradients of the activations through the frozen
    layers and of the LoRA weights, none of the frozen weights."""
    import torch
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    from kit.logs import quiet_libraries

    quiet_libraries()
    cfg = UNet2DConditionModel.load_config(base / "unet")
    vae = json.loads((base / "vae" / "config.json").read_text())
    dtype = torch.bfloat16
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(cfg).to(dtype)
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=spec["rank"],
            lora_alpha=spec["rank"],
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS,
        )
    )
    side = spec["resolution"] // 2 ** (len(vae["block_out_channels"]) - 1)
    b, meta = spec["batch"], {"device": "meta", "dtype": dtype}
    pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    sample = torch.zeros(b, cfg["in_channels"], side, side, **meta)
    context = torch.zeros(b, 77, cfg["cross_attention_dim"], **meta)
    added = {"text_embeds": torch.zeros(b, pooled, **meta), "time_ids": torch.zeros(b, 6, **meta)}
    steps = torch.zeros(b, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        pred = unet(sample, steps, context, added_cond_kwargs=added, return_dict=False)[0]
        F.mse_loss(pred.float(), torch.zeros_like(pred).float()).backward()
    return int(counter.get_total_flops())


def sdxl_env(device: str) -> dict[str, str]:
    """A child's environment: the checkout importable, no downloads, no GPU for `--device cpu`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def spawn_sdxl(
    side: str, base: Path, images: Path, out: Path, spec: dict[str, Any], device: str
) -> dict[str, Any]:
    """One side of the SDXL job in a fresh process: what it measured, its seconds from start to
    exit and its peak RSS."""
    out.mkdir(parents=True, exist_ok=True)
    job = {"spec": spec, "base": str(base), "images": str(images), "out": str(out)}
    if side == "kit":
        job["config"] = str(sdxl_kit_config(base, images, out, spec))
    (out / "job.json").write_text(json.dumps(job))
    cmd = [sys.executable, __file__, "--one-sdxl", side, "--spec", str(out / "job.json")]
    text, seconds, rss = run_process(side, cmd, out / f"{side}.log", sdxl_env(device))
    got = json.loads(text.strip().splitlines()[-1])
    return {**got, "seconds": seconds, "peak_rss_mib": rss}


def one_sdxl(side: str, job_file: Path) -> None:
    """One side of the SDXL job in this process; prints its JSON result on the last line."""
    from kit.logs import quiet_libraries

    quiet_libraries()
    job = json.loads(job_file.read_text())
    if side == "kit":
        got = sdxl_kit_run(Path(job["config"]))
    else:
        got = sdxl_script_run(Path(job["base"]), Path(job["images"]), Path(job["out"]), job["spec"])
    print(json.dumps(got), flush=True)


def compare_sdxl(
    *,
    tiny: bool = False,
    device: str = "cpu",
    steps: int | None = None,
    warmup: int | None = None,
    rounds: int = 1,
    checkpointing: bool = False,
    base: str | Path | None = None,
    work: str | Path | None = None,
) -> dict[str, Any]:
    """Kit and script on the SDXL job, alternating `rounds` times: steps/s (steady), peak VRAM
    (over the training steps and over the whole run), MFU, end to end and peak RSS per side.

    `base` is an SDXL folder to train on (else one is written: the tiny model, or the real
    architecture with random weights); `work` a folder for the images and the runs (else a
    temporary one). MFU = model FLOPs per step (`unet_step_flops`) × steps/s / the card's peak
    bf16 FLOP/s (`peak_bf16_flops`); None, with a note, on a CPU or an unlisted card.
    """
    from kit.logs import quiet_libraries
    from kit.toy.world import write_example_dataset

    quiet_libraries()
    spec = sdxl_spec(tiny, steps, warmup, checkpointing)
    with contextlib.ExitStack() as stack:
        root = Path(work) if work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        images = root / "images"
        if not (images / "done").is_file():
            res = spec["resolution"]
            write_example_dataset(
                images, n=spec["images"], seed=SEED, priors=0, sizes=((res, res),)
            )
            (images / "done").write_text("")
        base = Path(base) if base else write_sdxl_base(root / "base", tiny, device)
        flops = unet_step_flops(base, spec)
        runs: dict[str, list[dict[str, Any]]] = {"kit": [], "script": []}
        for r in range(rounds):
            for side in ("kit", "script"):
                runs[side].append(
                    spawn_sdxl(side, base, images, root / f"{side}-{r}", spec, device)
                )
    return sdxl_summary(spec, rounds, flops, runs)


def sdxl_summary(
    spec: dict[str, Any], rounds: int, flops: int, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The means over the rounds, the ratios kit / script, and each side's MFU."""

    def mean(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return sum(got) / len(got) if got else None

    name = runs["kit"][0]["device_name"]
    peak = peak_bf16_flops(name)
    out: dict[str, Any] = {"job": "sdxl", **spec, "rounds": rounds, "device_name": name}
    out["flops_per_step"] = flops
    out["peak_bf16_flops"] = peak
    if peak is None:
        out["mfu_note"] = f"no peak bf16 FLOP/s known for {name!r}: MFU left out"
    for side in ("kit", "script"):
        got = runs[side]
        rate = mean([steady(x["times"], spec["warmup"]) for x in got])
        out[f"{side}_steps_per_s"] = round(rate, 4)
        out[f"{side}_seconds"] = round(mean([x["seconds"] for x in got]), 2)
        out[f"{side}_peak_rss_mib"] = round(mean([x["peak_rss_mib"] for x in got]), 1)
        for key in ("train_peak", "peak", "setup_peak"):
            v = mean([x[key] for x in got])
            out[f"{side}_{key}_gib"] = None if v is None else round(v / 2**30, 3)
        out[f"{side}_mfu"] = None if peak is None else round(flops * rate / peak, 4)
        out[f"{side}_last_loss"] = got[-1]["losses"][-1] if got[-1]["losses"] else None

    def ratio(key: str) -> float | None:
        k, s = out[f"kit_{key}"], out[f"script_{key}"]
        return round(k / s, 3) if k is not None and s else None

    out["steps_per_s_ratio"] = ratio("steps_per_s")
    out["end_to_end_ratio"] = ratio("seconds")
    out["train_peak_ratio"] = ratio("train_peak_gib")
    out["peak_ratio"] = ratio("peak_gib")
    return out


def sdxl_table(r: dict[str, Any]) -> str:
    """The SDXL comparison as markdown: the job, then one row per measure."""

    def cell(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    peak = r.get("peak_bf16_flops")
    checkpointing = "gradient checkpointing" if r["checkpointing"] else "no gradient checkpointing"
    model = "the tiny SDXL" if r["tiny"] else "the real SDXL architecture (random weights)"
    lines = [
        f"SDXL LoRA, the kit against a stand-in for diffusers' "
        f"`train_text_to_image_lora_sdxl.py`: {model} at {r['resolution']} px, "
        f"batch {r['batch']}, rank {r['rank']}, {r['precision']}, "
        f"{checkpointing}, {r['steps']} steps (steps/s after {r['warmup']}), {r['rounds']} "
        f"round(s), on {r['device_name']}. Model FLOPs per step (the UNet's forward and "
        f"backward, counted): {r['flops_per_step'] / 1e12:.3g} TFLOP; the card's peak: "
        + (f"{peak / 1e12:.4g} TFLOP/s dense bf16." if peak else f"unknown ({r.get('mfu_note')})."),
        "",
        "| | kit | script | kit / script |",
        "|---|---|---|---|",
    ]
    rows = [
        ("steps/s (steady)", "steps_per_s", ".3f", "steps_per_s_ratio"),
        ("MFU", "mfu", ".1%", None),
        ("peak VRAM, training steps (GiB)", "train_peak_gib", ".2f", "train_peak_ratio"),
        ("peak VRAM, whole run (GiB)", "peak_gib", ".2f", "peak_ratio"),
        ("end to end (s)", "seconds", ".1f", "end_to_end_ratio"),
        ("peak RSS (MiB)", "peak_rss_mib", ".0f", None),
    ]
    for label, key, fmt, ratio in rows:
        lines.append(
            f"| {label} | {cell(r[f'kit_{key}'], fmt)} | {cell(r[f'script_{key}'], fmt)} | "
            f"{cell(r[ratio], '.2f') if ratio else '–'} |"
        )
    speed, vram = r["steps_per_s_ratio"], r["train_peak_ratio"]
    if speed is not None and vram is not None:
        met = speed >= 1.2 and vram <= 1.0
        lines += [
            "",
            f"Target (steps/s at least 1.2× the script's at no more VRAM in the training steps): "
            f"{'met' if met else 'not met'} ({speed:.2f}×, VRAM {vram:.2f}×).",
        ]
    return "\n".join(lines) + "\n"


def profile(steps: int = 6) -> None:
    """The kit's step on the tiny job under torch.profiler: the operators that cost most."""
    import torch

    from kit.config import load_config
    from kit.data.buckets import epoch_batches
    from kit.logs import quiet_libraries
    from kit.train.prepare import prepare
    from kit.train.step import micro_step

    quiet_libraries()
    spec = JOBS["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, images = write_inputs(tmp, "tiny")
        cfg = load_config(kit_config(base, images, tmp, spec, bucket_step=32))
        s = prepare(cfg)
        batches = epoch_batches(s.data.plan, spec["batch"], SEED, 0)
        micro_step(s, batches[0], 0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(1, steps):
                micro_step(s, batches[i % len(batches)], i % len(batches))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["tiny", "real", "both", "sdxl"], default="both")
    parser.add_argument("--rounds", type=int, help="A B pairs per job (2; sdxl 1)")
    parser.add_argument(
        "--busy", type=int, default=0, help="other jobs keeping a CPU busy each meanwhile (0)"
    )
    parser.add_argument(
        "--precision",
        choices=("no", "bf16"),
        default="no",
        help="tiny and real jobs: fp32 (no), or bf16 on both sides (a CPU with bf16 instructions)",
    )
    parser.add_argument("--profile", action="store_true")
    sdxl = parser.add_argument_group("the sdxl job")
    sdxl.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    sdxl.add_argument("--tiny", action="store_true", help="the tiny SDXL at 64 px (a smoke test)")
    sdxl.add_argument("--steps", type=int, help=f"training steps ({SDXL_JOB['steps']})")
    sdxl.add_argument(
        "--warmup", type=int, help=f"steps left out of steps/s ({SDXL_JOB['warmup']})"
    )
    sdxl.add_argument("--checkpointing", action="store_true", help="gradient checkpointing, both")
    sdxl.add_argument("--base", type=Path, help="an SDXL folder to train on (else one is built)")
    sdxl.add_argument("--work", type=Path, help="a folder for images and runs (else a temporary)")
    sdxl.add_argument("--json", type=Path, help="also write the result to this file")
    parser.add_argument("--one", choices=["kit", "script"], help=argparse.SUPPRESS)
    parser.add_argument("--one-sdxl", choices=["kit", "script"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--images", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.base, args.images, args.out, args.job, args.precision)
        return
    if args.one_sdxl:
        one_sdxl(args.one_sdxl, args.spec)
        return
    if args.profile:
        profile()
        return
    if args.job == "sdxl":
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(
                    "--device cuda: no CUDA GPU here (--tiny --device cpu smoke-tests)"
                )
        elif not args.tiny:
            raise SystemExit("--job sdxl on the CPU runs the tiny model only: add --tiny")
        result = compare_sdxl(
            tiny=args.tiny,
            device=args.device,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds or 1,
            checkpointing=args.checkpointing,
            base=args.base,
            work=args.work,
        )
        print(json.dumps(result, indent=2))
        print(sdxl_table(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    jobs = ["tiny", "real"] if args.job == "both" else [args.job]
    results = [compare(job, args.rounds or 2, args.busy, args.precision) for job in jobs]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
