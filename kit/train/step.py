"""One micro-step: a batch, its loss, the backward pass and (when accumulation is done) the update."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kit.errors import ConfigError, KitError
from kit.run.env import cpu_bf16
from kit.train.objective import denoising_loss, drop_captions
from kit.train.preserve import Preserver
from kit.train.state import TrainState


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of batch `index` of `epoch`: a pure function of the three, so that a batch can be
    read ahead (its caption variants drawn from a copy of its stream) without touching it."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A random stream of its own for one batch; also seeds the global RNG (dropout layers)."""
    value = batch_seed(seed, epoch, index)
    torch.manual_seed(value)
    return torch.Generator().manual_seed(value)


BatchLoader = Callable[[list[int], "list[int] | None"], dict[str, torch.Tensor]]
"""Reads a batch's cached tensors: `(indices, variants) -> batch` (`CachedDataset.load_batch`,
or a prefetcher that read it ahead)."""


def micro_step(
    s: TrainState, indices: list[int], index: int, load: BatchLoader | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Train on batch `index` of this epoch (its sample `indices`): this process's loss and, when
    this micro-step ended an optimizer step, the gradient norm, both as tensors on the device.

    Nothing here waits for the device: reading a number back (`float`, `.item()`) would stall
    the queue of kernels every micro-step, so the loop reads them only on the steps it logs.
    """
    t, acc = s.cfg.train, s.accelerator
    # Noise, timesteps, dropout, caption variants and caption dropout come from this batch's
    # own stream: the same numbers whichever process draws it, before or after a resume.
    s.generator = generator = batch_generator(t.seed, s.epoch, index)
    variants = s.data.draw_variants(len(indices), generator)
    batch = (load or s.data.load_batch)(indices, variants)
    dropped = drop_captions(batch, s.empty_text, s.cfg.objective.caption_dropout, generator)
    with acc.accumulate(*s.trained):
        # The frozen parts are in the half dtype and the trained ones fp32: autocast picks each
        # operation's dtype, for the live text encoders and a denoiser accelerate did not wrap.
        with acc.autocast():
            if s.method.live_text:
                captions = [
                    "" if d else s.data.variant_texts[i][variants[j] if variants else 0]
                    for j, (i, d) in enumerate(zip(indices, dropped, strict=True))
                ]
                text = s.family.encode_text(s.comps, captions)
                if isinstance(s.regular, Preserver):
                    kept = s.data.preserve_texts  # per sample and variant, as the captions
                    texts = [
                        kept[i][variants[j] if variants else 0] for j, i in enumerate(indices)
                    ] if kept else []  # fmt: skip
                    s.regular.add_live_text(s.family, s.comps, batch, text, texts)
                batch.update(text)
            loss = denoising_loss(s.family, s.comps, batch, generator, s.device, s.regular, s.drawn)
        acc.backward(loss)
        grad_norm = None
        if acc.sync_gradients:
            s.method.before_clip(s.comps)
            clip = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
            # DeepSpeed clips inside its own step and may report no norm here.
            grad_norm = acc.clip_grad_norm_(s.params, clip)
        # Inside `accumulate` these only act on the micro-step that ends an accumulation.
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
    return loss.detach().float(), grad_norm


def step_numbers(
    acc: Any, losses: list[torch.Tensor], grad_norm: torch.Tensor | float | None
) -> tuple[float, float | None]:
    """The loss of an optimizer step (its micro-steps' losses averaged over the processes, then
    over the micro-steps) and its gradient norm, as numbers: the one wait for the device.

    Every process must call it on the same steps (the average is a collective). The micro-steps
    are averaged in float64, one after the other, as Python adds the numbers.
    """
    values = acc.reduce(torch.stack([x.reshape(()) for x in losses]), "mean").tolist()
    total = 0.0
    for v in values:
        total += v
    norm = None if grad_norm is None else float(grad_norm)
    return total / len(values), norm


def guard_finite(
    loss: float,
    grad_norm: float | None,
    step: int,
    precision: str,
    scale: float | None,
    last_good: Path | None,
) -> None:
    """Stop on a non-finite loss (or, without a gradient scaler, a non-finite gradient)."""
    bad_grad = grad_norm is not None and not math.isfinite(grad_norm) and scale is None
    if math.isfinite(loss) and not bad_grad:
        return
    what = f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
    scale_note = f", loss scale {scale:g}" if scale is not None else ""
    keep = (
        f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
    )
    raise KitError(
        f"{what} at step {step} (mixed_precision={precision}{scale_note}); {keep}. "
        f"Usual fixes: a lower learning_rate, max_grad_norm 1.0, {_precision_fix(precision)}"
        "or checking the data for broken images."
    )


def _precision_fix(precision: str) -> str:
    """The precision to try instead of fp16, on this machine ('' when not in fp16)."""
    if precision != "fp16":
        return ""
    # bf16 has fp32's range: a GPU that has it trains in it, and so does a CPU that has it.
    gpu = torch.cuda.is_available()
    if torch.cuda.is_bf16_supported() if gpu else cpu_bf16():
        return "bf16 instead of fp16, "
    return "fp32 (mixed_precision no) instead of fp16, "


def check_compile(compile_: bool, blocks_to_swap: int, deepspeed: bool, device: Any) -> None:
    """Refuse `compile: true` where it cannot work, before anything is loaded."""
    if not compile_:
        return
    if blocks_to_swap:
        raise ConfigError(
            f"compile: true with blocks_to_swap {blocks_to_swap}: the swap moves weights between "
            "devices around every block, which a compiled graph cannot follow; use one of the two"
        )
    if deepspeed:
        raise ConfigError(
            "compile: true under DeepSpeed: the DeepSpeed engine wraps the denoiser in its own "
            "way; launch without DeepSpeed, or set compile: false"
        )
    kind = torch.device(device).type
    if kind == "cpu" and not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        raise ConfigError(
            "compile: true on the CPU needs a C++ compiler (g++ or clang++) on the PATH, which "
            "torch.compile builds its kernels with; install one, or set compile: false"
        )
    if kind == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "compile: true on a CUDA GPU needs triton (pip install triton), which torch.compile "
            "writes its GPU kernels in; or set compile: false"
        )
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"compile: true is supported on CPU and CUDA, not on {kind}")


def compile_denoiser(denoiser: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Compile the denoiser's forward in place (`nn.Module.compile`): the module, its class,
    its parameters and their names stay as they are, so saving, export and the method's hooks
    see the same model. The first call of each new input shape compiles (the warm-up)."""
    denoiser.compile(**options)  # torch.compile's options (a backend, a mode)
    return denoiser
