"""VRAM estimate: peak training memory by component, from one traced step and arithmetic.

`trace` (kit.preflight.trace) runs the configured step on the meta device; weights, gradients,
optimizer state and EMA follow from the trained parameters' shapes. Traces are remembered in
this process and on disk, keyed by what they depend on.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.data.buckets import assign_bucket, make_buckets
from kit.families import get_family
from kit.families.identity import fingerprint
from kit.families.shipped import config_source
from kit.methods import get_method
from kit.preflight.trace import Shape, trace

GIB = 2**30
# Memory each card reports to PyTorch (`total_memory`), in GiB: a little under the label.
GPUS = {
    "T4 16GB": 14.6,
    "RTX 3060 12GB": 11.7,
    "RTX 4090 24GB": 23.6,
    "L4 24GB": 22.0,
    "A100 40GB": 39.4,
    "A100 80GB": 79.1,
    "H100 80GB": 79.1,
}
NO_BF16 = {"T4 16GB"}  # cards without bf16: mixed precision there means fp16
CUDA_CONTEXT = int(0.45 * GIB)  # CUDA context and kernels, outside PyTorch's allocator
ALLOCATOR_RESERVE = 0.08  # cached but unused blocks (fragmentation), as a share of the peak
VERSION = 2  # bump when the trace changes: keys the on-disk cache

# ---------------------------------------------------------------- the result


@dataclass
class Estimate:
    """Peak training memory by component, in bytes; the components add up to the total."""

    components: dict[str, int]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    """Finer breakdowns: activations by module group, frozen weights by dtype, peak phase."""

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def allocated_bytes(self) -> int:
        """The peak of live tensors: what `torch.cuda.max_memory_allocated` reports."""
        c = self.components
        return self.total_bytes - c.get("allocator_reserve", 0) - c.get("cuda_context", 0)

    def fits(self, budget_gib: float) -> bool:
        """True when the peak is within `budget_gib`."""
        return self.total_bytes <= budget_gib * GIB

    def cards(self) -> list[dict[str, Any]]:
        """One row per common card: its memory, whether the run fits, and the headroom."""
        return [
            {
                "card": name,
                "GiB": gib,
                "fits": self.fits(gib),
                "headroom_gib": round(gib - self.total_bytes / GIB, 2),
            }
            for name, gib in GPUS.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the card table."""
        return {
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GIB, 3),
            "allocated_bytes": self.allocated_bytes,
            "components": dict(self.components),
            "details": self.details,
            "settings": self.settings,
            "fits": {name: self.fits(gib) for name, gib in GPUS.items()},
            "notes": self.notes,
        }


# ---------------------------------------------------------------- cache


def _cache_dir() -> Path:
    base = os.environ.get("KIT_VRAM_CACHE") or Path.home() / ".cache" / "kit" / "vram"
    return Path(base)


def _trace_key(cfg: Config, shape: Shape) -> str:
    source = config_source(cfg.model.pretrained_model)
    configs = {}
    if Path(source).is_dir():
        for f in sorted(Path(source).glob("*/config.json")):
            configs[f.parent.name] = json.loads(f.read_text())
    m, d = cfg.model, cfg.data
    return fingerprint(
        {
            "v": VERSION,
            "family": m.model_family,
            "source": source if not configs else "",
            "configs": configs,
            "model": [m.max_sequence_length, m.use_t5],
            "frames": [d.num_frames, d.frame_stride],
            "network": cfg.to_dict()["network"],
            "shape": shape.__dict__,
        }
    )


_MEMO: dict[str, dict[str, Any]] = {}


def cached_trace(cfg: Config, shape: Shape) -> dict[str, Any]:
    """`trace`, remembered in this process and on disk (a repeat costs a file read)."""
    key = _trace_key(cfg, shape)
    if key in _MEMO:
        return _MEMO[key]
    path = _cache_dir() / f"{key}.json"
    if path.is_file():
        with contextlib.suppress(ValueError, OSError):
            _MEMO[key] = json.loads(path.read_text())
            return _MEMO[key]
    result = trace(cfg, shape)
    _MEMO[key] = result
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return result


# ---------------------------------------------------------------- the estimate


def bucket_size(cfg: Config, resolution: int) -> tuple[int, int]:
    """(height, width) of the bucket the estimate traces at this resolution.

    The buckets are those training generates (kit.data.buckets): with `area` buckets, which all
    hold about the same pixels, the square one; with `pixel` buckets, the one with the most pixels.
    """
    d = cfg.data
    step = d.bucket_step or get_family(cfg.model.model_family, cfg).bucket_step
    buckets = make_buckets(resolution, d.resolution_type, step, d.max_aspect_ratio)
    if cfg.data.resolution_type == "area":
        width, height = assign_bucket(1, 1, buckets)
    else:
        width, height = max(buckets, key=lambda b: (b[0] * b[1], b[0]))
    return height, width


def forget_traces() -> None:
    """Forget the traces remembered in this process (the disk cache stays)."""
    _MEMO.clear()


def estimate(
    cfg: Config,
    *,
    resolution: int | None = None,
    batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = None,
    gradient_accumulation_steps: int | None = None,
    unload_encoders: bool = False,
    bucket: tuple[int, int] | None = None,
) -> Estimate:
    """Estimate peak VRAM of the configured run; keyword arguments override the config.

    `unload_encoders` assumes the text encoders and VAE leave the GPU once captions and
    latents are cached (kit.train.loop keeps them loaded, for validation).
    """
    t = cfg.train
    res = resolution or cfg.data.resolution
    height, width = (bucket[1], bucket[0]) if bucket else bucket_size(cfg, res)
    batch = batch_size or t.train_batch_size
    ckpt = t.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
    precision = mixed_precision or t.mixed_precision
    precision = "no" if precision == "fp32" else precision
    opt = optimizer or t.optimizer
    accum = gradient_accumulation_steps or t.gradient_accumulation_steps
    # The method decides what trains, and refuses a pair it cannot finish, before any trace.
    live_text = get_method(cfg, get_family(cfg.model.model_family, cfg)).live_text
    shape = Shape(height, width, batch, bool(ckpt), precision, accum > 1)
    tr = cached_trace(cfg, shape)
    comps: dict[str, int] = {}
    for name, by_dtype in tr["frozen"].items():
        if unload_encoders and name != "denoiser" and not live_text:
            continue
        comps[f"{name}_weights"] = sum(by_dtype.values())
    trained = tr["trained_bytes"]
    optim = tr["optimizer"][opt]
    comps["trainable_weights"] = trained
    comps["optimizer_state"] = optim["state"]
    o = cfg.objective
    ema = trained if o.ema_decay > 0 and not o.ema_on_cpu else 0
    comps["ema"] = ema
    persistent = sum(comps.values())

    peak = dict(tr["peak"])
    step_peak = sum(peak.values())
    grads_always = trained if shape.grads_persist else 0
    # The optimizer step: every gradient, plus the optimizer's temporaries (and EMA's move-in).
    ema_move = trained if o.ema_decay > 0 and o.ema_on_cpu else 0
    at_step = trained + max(optim["step"], ema_move)
    groups = {k: v for k, v in peak.items() if k not in ("batch", "loss", "backward", "gradients")}
    if step_peak + grads_always >= at_step:
        phase = "backward" if peak.get("backward", 0) or peak.get("gradients", 0) else "forward"
        comps["gradients"] = grads_always + peak.get("gradients", 0)
        comps["batch"] = peak.get("batch", 0) + peak.get("loss", 0)
        comps["activations"] = sum(groups.values())
        comps["backward_buffers"] = peak.get("backward", 0)
    else:
        phase = "optimizer step"
        groups = {}
        comps["gradients"] = trained
        comps["batch"] = 0
        comps["activations"] = 0
        comps["backward_buffers"] = at_step - trained
    allocated = sum(comps.values())
    comps["allocator_reserve"] = int(allocated * ALLOCATOR_RESERVE)
    comps["cuda_context"] = CUDA_CONTEXT

    encoders = sum(sum(v.values()) for n, v in tr["frozen"].items() if n != "denoiser")
    notes = [
        f"the peak falls in the {phase}; persistent state is {persistent / GIB:.2f} GiB",
        "activations come from one traced training step on the meta device; attention is "
        "counted as flash / memory-efficient kernels keep it (output and log-sum-exp)",
    ]
    if not unload_encoders and not live_text and encoders:
        notes.append(
            f"text encoders and VAE stay loaded ({encoders / GIB:.2f} GiB); with cached "
            "latents and captions they could leave the GPU"
        )
    if precision == "no":
        notes.append("fp32 training: bf16 mixed precision roughly halves activations")
    settings = {
        "resolution": res,
        "height": height,
        "width": width,
        "batch_size": batch,
        "gradient_accumulation_steps": accum,
        "gradient_checkpointing": bool(ckpt),
        "mixed_precision": precision,
        "optimizer": opt,
        "unload_encoders": unload_encoders,
        "trainable_params": tr["learned"],
    }
    details = {
        "activations_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "frozen_weights_by_dtype": _by_dtype(tr["frozen"]),
        "peak_phase": phase,
        "allocated_bytes": allocated,
    }
    return Estimate(comps, settings, notes, details)


def _by_dtype(frozen: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for by_dtype in frozen.values():
        for dt, n in by_dtype.items():
            out[dt] += n
    return dict(out)


__all__ = [
    "GIB",
    "GPUS",
    "NO_BF16",
    "Estimate",
    "bucket_size",
    "cached_trace",
    "estimate",
    "forget_traces",
]
