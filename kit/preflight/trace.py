"""VRAM trace: one real training step of the configured shape, run without weights or GPU.

The family builds its real denoiser from its config on the meta device (shapes, no data); the
configured method marks what trains; then one forward and backward pass runs under a dispatch
mode that counts the bytes of every live tensor storage, rounded as the CUDA caching allocator
rounds them. Two things the CPU build would do differently from a GPU are put right on the way:

- mixed precision follows CUDA autocast's op lists (matmuls and convolutions in half precision;
  norms, softmax, upsampling and a few more in fp32), emulated at the Python function level so
  autograd saves exactly the casts the GPU run saves;
- attention is stored as the flash / memory-efficient kernels store it: the output and the
  log-sum-exp, never the attention matrix.

Weights, gradients and optimizer state follow from the trained parameters' shapes; what a
quantized base or block swap would do to the frozen weights follows from the inventory the trace
takes of them (kit.preflight.storage).
"""

from __future__ import annotations

import typing
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from kit.config import Config, TrainConfig
from kit.config.preservation import denoiser_rows
from kit.families import Family, get_family
from kit.families.shipped import config_source
from kit.methods import get_method
from kit.precision import torch_dtype
from kit.preflight.storage import block_inventory, quant_inventory, waiting_inventory

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this
OPTIMIZERS = typing.get_args(typing.get_type_hints(TrainConfig)["optimizer"])
"""The optimizers the config accepts; `optimizer_bytes` models each."""

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


class Autocast(TorchFunctionMode):
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


_INDEXING = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
)


def _on_meta(func: Any, args: Any, kwargs: dict) -> tuple[Any, dict]:
    """A layout mask a family gives on the CPU (its values decide shapes, which meta tensors
    cannot) joins meta tensors on the meta device; as an index it stays on the CPU, which meta
    tensors accept."""
    leaves, tree_map = torch.utils._pytree.tree_leaves, torch.utils._pytree.tree_map
    tensors = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if func in _INDEXING or not any(t.is_meta for t in tensors):
        return args, kwargs

    def lift(a: Any) -> Any:
        cpu = isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.ndim > 0
        return a.to("meta") if cpu else a

    return tree_map(lift, (args, kwargs))


class LiveBytes(TorchDispatchMode):
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
        args, kwargs = _on_meta(func, args, kwargs or {})
        out = func(*args, **kwargs)
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


def optimizer_bytes(shapes: list[tuple[int, ...]]) -> dict[str, dict[str, int]]:
    """State and step temporaries of each optimizer over fp32 parameters of these shapes."""
    n = sum(_numel(s) for s in shapes)
    largest = max((_numel(s) for s in shapes), default=0)
    eight_bit = sum(
        2 * _numel(s) + 8 * -(-_numel(s) // 256) if _numel(s) >= 4096 else 8 * _numel(s)
        for s in shapes
    )
    # A second moment kept as its row and column means where a weight has two or more axes
    # (Adafactor, CAME), whole for a vector.
    factored = sum(
        4 * (_numel(s[:-1]) + _numel(s[:-2] + s[-1:])) if len(s) >= 2 else 4 * _numel(s)
        for s in shapes
    )
    return {
        "adamw": {"state": 8 * n, "step": 4 * n},  # foreach: one fp32 temporary per weight
        "adamw8bit": {"state": eight_bit, "step": 0},
        "adafactor": {"state": factored, "step": 12 * largest},
        "prodigy": {"state": 16 * n, "step": 8 * largest},
        # lion-pytorch: the momentum; the update is built in two temporaries, one weight at a time.
        "lion": {"state": 4 * n, "step": 8 * largest},
        # came-pytorch: the momentum, and the factored second moment and confidence (the
        # instability of the update); 1-D weights keep one full second moment, no confidence.
        # Each weight also keeps its RMS, one fp32 scalar. The step holds the update, the
        # instability and its factored estimate, one weight at a time.
        "came": {
            "state": 4 * n + 2 * factored - _vectors(shapes) + 4 * len(shapes),
            "step": 12 * largest,
        },
        # schedulefree: z and the second moment; foreach divides every second moment at once.
        "schedulefree": {"state": 8 * n, "step": 4 * n},
    }


def _vectors(shapes: list[tuple[int, ...]]) -> int:
    """fp32 bytes of the weights of fewer than two axes (that `factored` counts whole)."""
    return sum(4 * _numel(s) for s in shapes if len(s) < 2)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _checkpoint_func(state: dict[str, Any]):
    """Non-reentrant checkpointing whose recomputation runs under the same autocast rules."""

    def run(module, *args):
        def call(*a):
            if state["active"]:
                return module(*a)
            with Autocast(state["dtype"], state["cache"]):
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
    """One forward and backward pass of the configured method; the bytes, by what holds them."""
    family = get_family(cfg.model.model_family, cfg)
    # A single-file base's architecture is its model_config's.
    parts = family.empty_parts(config_source(family.model_source(cfg.model.pretrained_model)))
    weight_dtype = torch_dtype(shape.precision)
    half = None if weight_dtype == torch.float32 else weight_dtype
    for m in parts.values():
        m.to(device="meta", dtype=weight_dtype)
    # Models of the denoiser that wait in host RAM while another trains (Wan 2.2's experts):
    # their quantizable layers are counted apart, as what host RAM holds of them.
    resident = family.host_resident(parts["denoiser"])
    quantizable = quant_inventory(parts, family, weight_dtype, resident)  # before an adapter
    waiting_quantizable = waiting_inventory(resident, weight_dtype)
    method = get_method(cfg, family)
    with torch.device("meta"):  # peft makes an adapter's layers on the CPU otherwise
        learned = method.mark_trainable(parts).trainable
    trained = [p for m in parts.values() for p in m.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()  # trained weights stay fp32, as in kit.train.loop
    # Models of the denoiser that wait in host RAM while another trains: not on the GPU.
    waiting = {id(p) for m in resident.values() for p in m.parameters()}
    host_resident = {
        label: sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
        for label, m in resident.items()
    }
    frozen: dict[str, dict[str, int]] = {}
    for name, m in parts.items():
        for p in m.parameters():
            if not p.requires_grad and id(p) not in waiting:
                by_dtype = frozen.setdefault(name, {})
                dt = str(p.dtype).removeprefix("torch.")
                by_dtype[dt] = by_dtype.get(dt, 0) + p.numel() * p.element_size()
    denoiser = parts["denoiser"]
    state: dict[str, Any] = {"active": False, "dtype": half, "cache": {}}
    if shape.checkpointing:
        denoiser.enable_gradient_checkpointing(_checkpoint_func(state))
    denoiser.train()
    live_text = method.live_text
    if shape.grads_persist:
        for p in trained:
            p.grad = torch.zeros_like(p)

    counter = LiveBytes()
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
    # Output preservation trains the batch and its preservation rows in one pass, after a pass
    # of the base (adapter off, no gradients) over the rows it compares with.
    trained_rows, base_rows = denoiser_rows(cfg)
    try:
        with counter:
            if base_rows:
                counter.tag = "other"
                args, kwargs = family.denoiser_inputs(
                    parts, shape.batch * base_rows, shape.height, shape.width
                )
                with torch.no_grad(), Autocast(half, state["cache"]):
                    denoiser(*args, **kwargs)
                state["cache"].clear()
                del args, kwargs
            counter.tag = "batch"
            args, kwargs = family.denoiser_inputs(
                parts, shape.batch * trained_rows, shape.height, shape.width
            )
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            inputs = sum(
                t.numel() * t.element_size()
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            )
            # Trained text encoders encode the captions and their preservation prompts.
            text_rows = shape.batch * trained_rows
            text_ids = _text_inputs(family, parts, text_rows) if live_text else {}
            extra = []
            for name, ids in text_ids.items():
                counter.tag = name
                with Autocast(half, state["cache"]):
                    extra.append(parts[name](input_ids=ids)[0])
            counter.tag = "other"
            state["active"] = True
            with Autocast(half, state["cache"]):
                out = denoiser(*args, **kwargs)
            state["active"] = False
            state["cache"].clear()
            pred = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
            if isinstance(pred, list):  # a transformer that returns one output per sample
                pred = torch.stack(pred)
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
        "inputs_bytes": inputs,
        "storage": {
            "quantized": quantizable,
            "waiting": waiting_quantizable,
            "blocks": block_inventory(family, denoiser),
        },
        "peak": peak,
        "frozen": frozen,
        "host_resident": host_resident,
        "trained_bytes": sum(p.numel() * 4 for p in trained),
        "optimizer": optimizer_bytes(shapes),
        "learned": learned,
        "parts": sorted(parts),
    }


__all__ = ["BLOCK", "OPTIMIZERS", "Autocast", "LiveBytes", "Shape", "optimizer_bytes", "trace"]
