"""VRAM estimate: one real training step of the configured shape, traced without weights or GPU.

The family builds its real denoiser from its config on the meta device (shapes, no data); the
configured network is attached; then one forward and backward pass runs under a dispatch mode
that counts the bytes of every live tensor storage, rounded as the CUDA caching allocator rounds
them. Two things the CPU build would do differently from a GPU are put right on the way:

- mixed precision follows CUDA autocast's op lists (matmuls and convolutions in half precision;
  norms, softmax, upsampling and a few more in fp32), emulated at the Python function level so
  autograd saves exactly the casts the GPU run saves;
- attention is stored as the flash / memory-efficient kernels store it: the output and the
  log-sum-exp, never the attention matrix.

Weights, gradients, optimizer state and EMA follow from the parameter shapes. `advise` searches
the settings that change memory for the cheapest ones that fit a budget.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kit.config import Config
from kit.families import Family, get_family
from kit.families.shipped import config_source

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
BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy")
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


# ---------------------------------------------------------------- CUDA autocast, emulated

_LOWER = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.prelu, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm, torch.addbmm,
    torch.einsum, torch.mv, torch.addmv, F.scaled_dot_product_attention,
}  # fmt: skip
_FP32 = {
    F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm, torch.exp, torch.Tensor.exp,
    torch.log, torch.Tensor.log, torch.log1p, torch.expm1, torch.rsqrt, torch.Tensor.rsqrt,
    torch.reciprocal, torch.Tensor.reciprocal, torch.pow, torch.Tensor.pow,
    torch.Tensor.__pow__, F.softplus, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.cosine_similarity, torch.logsumexp, torch.cdist, torch.erfinv, torch.acos, torch.asin,
}  # fmt: skip
_FP32_OPT_DTYPE = {
    F.softmax, F.log_softmax, torch.softmax, torch.Tensor.softmax, torch.log_softmax,
    torch.Tensor.log_softmax, torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum,
    torch.prod, torch.Tensor.prod,
}  # fmt: skip
_FP32_INTERPOLATE = {"nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear"}
_HALF = (torch.float16, torch.bfloat16)


def _heads_inner(like: torch.Tensor, last: int) -> torch.Tensor:
    """An empty (batch, heads, tokens, `last`) tensor laid out as the kernels write it.

    Flash and memory-efficient attention (and the CPU flash kernel) write (batch, tokens, heads,
    dim) and return a transposed view, so the `transpose(1, 2).reshape(batch, tokens, -1)` that
    follows attention is a free view. A heads-outer tensor would make that reshape copy, and the
    copy would be counted again where the output projection saves its input.
    """
    if like.dim() != 4:
        return like.new_empty(*like.shape[:-1], last)
    b, h, n, _ = like.shape
    return like.new_empty(b, n, h, last).transpose(1, 2)


class _Attention(torch.autograd.Function):
    """Attention stored as flash / memory-efficient kernels store it: output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = _heads_inner(q, v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _out, lse = ctx.saved_tensors
        # The backward kernels hold a row statistic and an fp32 accumulator for dq.
        scratch = (lse.new_empty(lse.shape), q.new_empty(q.shape, dtype=torch.float32))
        del scratch
        return (
            _heads_inner(q, q.shape[-1]),
            _heads_inner(k, k.shape[-1]),
            _heads_inner(v, v.shape[-1]),
        )


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **_):
    if key.shape[-3] != query.shape[-3]:  # grouped heads: the kernels expand k and v
        n = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(n, -3), value.repeat_interleave(n, -3)
    return _Attention.apply(query, key, value)


class _Autocast(TorchFunctionMode):
    """CUDA autocast's casting rules, applied above autograd so the same casts are saved."""

    def __init__(self, dtype: torch.dtype | None, cache: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache = cache

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if isinstance(x, list | tuple):
            return type(x)(self._cast(a, dtype) for a in x)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype:
            return x
        if x.is_leaf and x.requires_grad:  # autocast caches casts of trained weights
            key = id(x)
            if key not in self.cache or self.cache[key].dtype != dtype:
                self.cache[key] = x.to(dtype)
            return self.cache[key]
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.dtype is not None:
            if func in _LOWER:
                args, kwargs = (
                    self._cast(args, self.dtype),
                    {k: self._cast(v, self.dtype) for k, v in kwargs.items()},
                )
            elif func in _FP32 or (
                func is F.interpolate and kwargs.get("mode", "nearest") in _FP32_INTERPOLATE
            ):
                args = self._cast(args, torch.float32)
            elif (
                func in _FP32_OPT_DTYPE
                and kwargs.get("dtype") is None
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].dtype in _HALF
            ):
                kwargs = {**kwargs, "dtype": torch.float32}
        if func is F.scaled_dot_product_attention:
            return _attention(*args, **kwargs)
        return func(*args, **kwargs)


# ---------------------------------------------------------------- live bytes


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created inside, until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = "batch"
        self.sizes: dict[int, tuple[int, str]] = {}
        self.by_tag: dict[str, int] = defaultdict(int)
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        # Views and in-place results share an input's storage: nothing new is allocated.
        inputs = {
            a.untyped_storage()._cdata
            for a in leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            return
        n = -(-storage.nbytes() // BLOCK) * BLOCK
        self.sizes[key] = (n, self.tag)
        self.by_tag[self.tag] += n
        self.live += n
        weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = dict(self.by_tag)

    def retag(self, t: torch.Tensor, tag: str) -> None:
        key = t.untyped_storage()._cdata
        if key in self.sizes:
            n, old = self.sizes[key]
            self.by_tag[old] -= n
            self.by_tag[tag] += n
            self.sizes[key] = (n, tag)

    def _free(self, key: int) -> None:
        n, tag = self.sizes.pop(key)
        self.by_tag[tag] -= n
        self.live -= n


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Shape:
    """What one traced step depends on (everything else is arithmetic on parameter shapes)."""

    height: int
    width: int
    batch: int
    checkpointing: bool
    precision: str
    grads_persist: bool
    """Gradient accumulation: gradients live through the next forward pass."""


def _group_names(denoiser: nn.Module) -> dict[str, nn.Module]:
    """Module groups the activations are reported by: top-level parts; short lists by index."""
    groups = {}
    for name, child in denoiser.named_children():
        if isinstance(child, nn.ModuleList) and len(child) <= 4:
            groups.update({f"{name}.{i}": m for i, m in enumerate(child)})
        else:
            groups[name] = child
    return groups


def _trained_tensors(cfg: Config, family: Family, parts: dict[str, nn.Module]) -> int:
    """Make the configured network trainable on the meta model; the count it learns."""
    from kit.methods.network import adapter_config

    for m in parts.values():
        m.requires_grad_(False)
    kind = cfg.network.network_type
    denoiser = parts["denoiser"]
    if kind == "full":
        denoiser.requires_grad_(True)
        encoders = [m for n, m in parts.items() if n.startswith("text_encoder")]
        if cfg.network.train_text_encoder and encoders:
            encoders[0].requires_grad_(True)
        return sum(p.numel() for m in parts.values() for p in m.parameters() if p.requires_grad)
    if kind == "textual_inversion":
        learned = 0
        for name, m in parts.items():
            if name.startswith("text_encoder") and hasattr(m, "get_input_embeddings"):
                # The whole table receives gradients and optimizer state; the new rows learn.
                weight = m.get_input_embeddings().weight
                weight.requires_grad_(True)
                learned += len(cfg.network.placeholder_tokens) * weight.shape[1]
        return learned
    denoiser.add_adapter(adapter_config(cfg, family, denoiser))
    return sum(p.numel() for p in denoiser.parameters() if p.requires_grad)


def _optimizer_bytes(shapes: list[tuple[int, ...]]) -> dict[str, dict[str, int]]:
    """State and step temporaries of each optimizer over fp32 parameters of these shapes."""
    n = sum(_numel(s) for s in shapes)
    largest = max((_numel(s) for s in shapes), default=0)
    eight_bit = sum(
        2 * _numel(s) + 8 * -(-_numel(s) // 256) if _numel(s) >= 4096 else 8 * _numel(s)
        for s in shapes
    )
    factored = sum(
        4 * (_numel(s[:-1]) + _numel(s[:-2] + s[-1:])) if len(s) >= 2 else 4 * _numel(s)
        for s in shapes
    )
    return {
        "adamw": {"state": 8 * n, "step": 4 * n},  # foreach: one fp32 temporary per weight
        "adamw8bit": {"state": eight_bit, "step": 0},
        "adafactor": {"state": factored, "step": 12 * largest},
        "prodigy": {"state": 16 * n, "step": 8 * largest},
    }


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _checkpoint_func(state: dict[str, Any]):
    """Non-reentrant checkpointing whose recomputation runs under the same autocast rules."""
    from torch.utils.checkpoint import checkpoint

    def run(module, *args):
        def call(*a):
            if state["active"]:
                return module(*a)
            with _Autocast(state["dtype"], state["cache"]):
                return module(*a)

        return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=False)

    return run


def _text_inputs(family: Family, parts: dict[str, nn.Module], batch: int) -> dict[str, Any]:
    """Token ids for each text encoder, at the length the family feeds it."""
    out = {}
    for name, m in parts.items():
        if not name.startswith("text_encoder"):
            continue
        c = m.config
        length = getattr(c, "max_position_embeddings", 0) or (
            family.cfg.model.max_sequence_length or 256
        )
        out[name] = torch.zeros(batch, min(length, 512), dtype=torch.long, device="meta")
    return out


def trace(cfg: Config, shape: Shape) -> dict[str, Any]:
    """One forward and backward pass of the configured network; the bytes, by what holds them."""
    family = get_family(cfg.model.model_family, cfg)
    parts = family.empty_parts(config_source(cfg.model.pretrained_model))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(shape.precision)
    weight_dtype = half or torch.float32
    for m in parts.values():
        m.to(device="meta", dtype=weight_dtype)
    learned = _trained_tensors(cfg, family, parts)
    trained = [p for m in parts.values() for p in m.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()  # trained weights stay fp32, as in kit.train.loop
    frozen: dict[str, dict[str, int]] = {}
    for name, m in parts.items():
        for p in m.parameters():
            if not p.requires_grad:
                by_dtype = frozen.setdefault(name, {})
                dt = str(p.dtype).removeprefix("torch.")
                by_dtype[dt] = by_dtype.get(dt, 0) + p.numel() * p.element_size()
    denoiser = parts["denoiser"]
    state: dict[str, Any] = {"active": False, "dtype": half, "cache": {}}
    if shape.checkpointing:
        denoiser.enable_gradient_checkpointing(_checkpoint_func(state))
    denoiser.train()
    live_text = cfg.network.network_type == "textual_inversion" or (
        cfg.network.network_type == "full" and cfg.network.train_text_encoder
    )
    if shape.grads_persist:
        for p in trained:
            p.grad = torch.zeros_like(p)

    counter = _LiveBytes()
    hooks = []
    for gname, module in _group_names(denoiser).items():

        def pre(_m, _a, gname=gname):
            if counter.tag not in ("backward", "loss"):
                counter.tag = gname

        hooks.append(module.register_forward_pre_hook(pre))
    for p in trained:
        hooks.append(
            p.register_post_accumulate_grad_hook(lambda p: counter.retag(p.grad, "gradients"))
        )
    try:
        with counter:
            counter.tag = "batch"
            args, kwargs = family.denoiser_inputs(parts, shape.batch, shape.height, shape.width)
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            text_ids = _text_inputs(family, parts, shape.batch) if live_text else {}
            extra = []
            for name, ids in text_ids.items():
                counter.tag = name
                with _Autocast(half, state["cache"]):
                    extra.append(parts[name](input_ids=ids)[0])
            counter.tag = "other"
            state["active"] = True
            with _Autocast(half, state["cache"]):
                out = denoiser(*args, **kwargs)
            state["active"] = False
            state["cache"].clear()
            pred = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
            counter.tag = "loss"
            target = torch.empty(pred.shape, dtype=torch.float32, device="meta")
            loss = (pred.float() - target).pow(2).flatten(1).mean(1).mean()
            for e in extra:  # the text encoders' graphs join the loss, as live captions do
                loss = loss + e.float().mean() * 0
            del out, pred, target, extra, args, kwargs
            counter.tag = "backward"
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    peak = {k: v for k, v in counter.at_peak.items() if v > 0}
    shapes = [tuple(p.shape) for p in trained]
    return {
        "peak": peak,
        "frozen": frozen,
        "trained_bytes": sum(p.numel() * 4 for p in trained),
        "optimizer": _optimizer_bytes(shapes),
        "learned": learned,
        "parts": sorted(parts),
    }


# ---------------------------------------------------------------- cache


def _cache_dir() -> Path:
    base = os.environ.get("KIT_VRAM_CACHE") or Path.home() / ".cache" / "kit" / "vram"
    return Path(base)


def _trace_key(cfg: Config, shape: Shape) -> str:
    from kit.families.identity import fingerprint

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
    """(height, width) of the largest bucket at this resolution."""
    if cfg.data.resolution_type == "area":
        return resolution, resolution
    step = cfg.data.bucket_step or get_family(cfg.model.model_family, cfg).bucket_step
    long = int(resolution * cfg.data.max_aspect_ratio) // step * step
    return resolution, max(resolution, long)


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
    shape = Shape(height, width, batch, bool(ckpt), precision, accum > 1)
    tr = cached_trace(cfg, shape)

    live_text = cfg.network.network_type == "textual_inversion" or (
        cfg.network.network_type == "full" and cfg.network.train_text_encoder
    )
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


# ---------------------------------------------------------------- advice


@dataclass(frozen=True)
class Option:
    """One setting the advice may change, with its expected cost in time per sample."""

    name: str
    value: Any
    cost: float


def _options(cfg: Config, card: str | None) -> dict[str, list[Option]]:
    t = cfg.train
    res = cfg.data.resolution
    step = cfg.data.bucket_step or get_family(cfg.model.model_family, cfg).bucket_step
    effective = t.train_batch_size * t.gradient_accumulation_steps
    batches = sorted({b for b in (t.train_batch_size, 4, 2, 1) if b <= t.train_batch_size})
    half = "fp16" if card in NO_BF16 else "bf16"
    precisions = [Option("mixed_precision", half, 1.0)]
    if t.mixed_precision != "no":
        precisions = [Option("mixed_precision", t.mixed_precision, 1.0)]
    elif card is None or card not in NO_BF16:
        precisions.append(Option("mixed_precision", "no", 2.0))
    optimizers = [Option("optimizer", t.optimizer, 1.0)]
    for name, cost in (("adamw8bit", 1.02), ("adafactor", 1.05), ("adamw", 1.0)):
        if name != t.optimizer:
            optimizers.append(Option("optimizer", name, cost))
    live_text = cfg.network.network_type == "textual_inversion" or (
        cfg.network.network_type == "full" and cfg.network.train_text_encoder
    )
    return {
        "batch": [
            Option("batch", (b, -(-effective // b)), 1.0 + 0.15 * (t.train_batch_size / b - 1) / 2)
            for b in batches
        ],
        "gradient_checkpointing": [
            Option("gradient_checkpointing", v, 1.3 if v else 1.0) for v in (False, True)
        ],
        "mixed_precision": precisions,
        "optimizer": optimizers,
        "unload_encoders": [Option("unload_encoders", False, 1.0)]
        + ([] if live_text else [Option("unload_encoders", True, 1.01)]),
        "resolution": [
            Option("resolution", r, 1.0 + 1.0 * i)
            for i, r in enumerate(range(res, max(step * 4, res // 2) - 1, -step * 2))
        ],
    }


def advise(
    cfg: Config, budget_gib: float, *, card: str | None = None, top: int = 3, max_traces: int = 24
) -> list[dict[str, Any]]:
    """The `top` cheapest settings that fit `budget_gib`, cheapest first, with their peaks.

    Cost is the expected time per sample relative to the config (plus a steep penalty for a
    lower resolution, which changes what is learned). Candidates are tried in order of cost, so
    only the traces that might fit are run.
    """
    opts = _options(cfg, card)
    combos = []
    for combo in itertools.product(*opts.values()):
        cost = functools.reduce(lambda a, o: a * o.cost, combo, 1.0)
        combos.append((cost, combo))
    combos.sort(key=lambda c: c[0])
    found: list[dict[str, Any]] = []
    traced: set[tuple] = set()
    for cost, combo in combos:
        s = {o.name: o.value for o in combo}
        key = (s["batch"][0], s["gradient_checkpointing"], s["mixed_precision"], s["resolution"])
        if key not in traced and len(traced) >= max_traces:
            continue
        traced.add(key)
        est = estimate(
            cfg,
            resolution=s["resolution"],
            batch_size=s["batch"][0],
            gradient_accumulation_steps=s["batch"][1],
            gradient_checkpointing=s["gradient_checkpointing"],
            mixed_precision=s["mixed_precision"],
            optimizer=s["optimizer"],
            unload_encoders=s["unload_encoders"],
        )
        if est.fits(budget_gib):
            found.append(_advice_row(cfg, est, cost))
            if len(found) >= top:
                break
    return found


def _advice_row(cfg: Config, est: Estimate, cost: float) -> dict[str, Any]:
    s = est.settings
    t = cfg.train
    changes = []
    for key, now in (
        ("resolution", cfg.data.resolution),
        ("batch_size", t.train_batch_size),
        ("gradient_accumulation_steps", t.gradient_accumulation_steps),
        ("gradient_checkpointing", t.gradient_checkpointing),
        ("mixed_precision", t.mixed_precision),
        ("optimizer", t.optimizer),
        ("unload_encoders", False),
    ):
        if s[key] != now:
            changes.append(f"{key}={s[key]}")
    return {
        "changes": ", ".join(changes) or "(as configured)",
        "peak_gib": round(est.total_bytes / GIB, 2),
        "slowdown": round(cost, 2),
        "settings": {k: s[k] for k in s if k not in ("height", "width", "trainable_params")},
        "estimate": est,
    }


# ---------------------------------------------------------------- measuring a real step


def real_step(
    cfg: Config, device: str = "cuda", steps: int = 2, *, on_ready: Any = None
) -> dict[str, Any]:
    """Run `steps` real training steps of the configured shape on random data.

    The same pieces as kit.train.loop (family parts, network, optimizer, autocast), so the measured
    peak is comparable with `estimate`. On CUDA returns `torch.cuda.max_memory_allocated`;
    `on_ready()` is called when the model is loaded, just before the first step.
    """
    from kit.methods.network import build_network
    from kit.optim import make_optimizer

    family = get_family(cfg.model.model_family, cfg)
    t = cfg.train
    precision = t.mixed_precision if device != "cpu" else "no"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    comps = family.load(cfg.model.pretrained_model, dtype=torch.float32)
    for m in comps.frozen_modules():
        m.to(device, dtype=dtype)
    net = build_network(cfg, family)
    net.attach(comps)
    params = net.parameters(comps)
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


__all__ = [
    "GIB",
    "GPUS",
    "Estimate",
    "advise",
    "bucket_size",
    "estimate",
    "measure",
    "real_step",
]
