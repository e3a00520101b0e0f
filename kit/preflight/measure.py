"""Measuring a real training step of the configured shape, to hold the estimate against."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from kit.config import Config
from kit.families import get_family
from kit.methods import get_method
from kit.optim import make_optimizer
from kit.precision import torch_dtype
from kit.preflight.estimate import GIB, bucket_size, estimate


def real_step(
    cfg: Config, device: str = "cuda", steps: int = 2, *, on_ready: Any = None
) -> dict[str, Any]:
    """Run `steps` real training steps of the configured shape on random data.

    The same calls as kit.train.loop (family parts, method, optimizer, autocast), so the measured
    peak is comparable with `estimate`. On CUDA returns `torch.cuda.max_memory_allocated`;
    `on_ready()` is called when the model is loaded, just before the first step.
    """
    family = get_family(cfg.model.model_family, cfg)
    t = cfg.train
    precision = t.mixed_precision if device != "cpu" else "no"
    dtype = torch_dtype(precision)
    comps = family.load(cfg.model.pretrained_model, dtype=torch.float32)
    for m in comps.frozen_modules():
        m.to(device, dtype=dtype)
    method = get_method(cfg, family)
    method.attach(comps)
    params = method.parameters(comps)
    for p in params:
        p.data = p.data.float()
    denoiser = comps.denoiser
    if t.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    denoiser.train()
    optimizer = make_optimizer(params, t)
    parts = {"denoiser": denoiser, "vae": comps.vae}
    parts.update(
        {
            f"text_encoder{'_' + str(i + 1) if i else ''}": e
            for i, e in enumerate(comps.text_encoders)
        }
    )
    res = cfg.data.resolution
    height, width = bucket_size(cfg, res)
    args, kwargs = family.denoiser_inputs(parts, t.train_batch_size, height, width)
    real = functools.partial(_materialize, device=device)
    args, kwargs = torch.utils._pytree.tree_map(real, (args, kwargs))
    if on_ready is not None:
        on_ready()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    autocast = (
        torch.autocast("cuda", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    )
    for _ in range(steps):
        with autocast:
            out = denoiser(*args, **kwargs)
        pred = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
        if isinstance(pred, list):  # a transformer that returns one output per sample
            pred = torch.stack(pred)
        loss = (pred.float() - torch.randn_like(pred, dtype=torch.float32)).pow(2).mean()
        del out, pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    result: dict[str, Any] = {"device": device}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return result


def _materialize(x: Any, device: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        return torch.randn(x.shape, dtype=x.dtype, device=device)
    return torch.zeros(x.shape, dtype=x.dtype, device=device)


def measure(cfg: Config) -> dict[str, Any]:
    """Predicted against measured peak of one real step on this machine's GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("measuring needs a CUDA GPU")
    est = estimate(cfg)
    got = real_step(cfg, "cuda")
    measured = got["max_memory_allocated"]
    return {
        "predicted_gib": round(est.allocated_bytes / GIB, 3),
        "measured_gib": round(measured / GIB, 3),
        "error": round(est.allocated_bytes / measured - 1, 3),
    }


__all__ = ["measure", "real_step"]
