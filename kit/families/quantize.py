"""The frozen base stored quantized (`base_quantization`): adapters train in full precision on
top of int8, fp8 or nf4 weights, so a base that does not fit a card in bf16 can still be tuned.

Only weights are quantized: every matmul still runs in the run's dtype on weights unpacked layer
by layer, and the adapters' own weights stay fp32. Which library does it, and why:

- `int8` and `fp8`: optimum-quanto (`qint8` / `qfloat8` weights, one scale per output row). Its
  weight-only matmuls are plain PyTorch on CPU, CUDA and MPS, so the CPU test suite trains on a
  quantized base exactly as a GPU does, with nothing to compile. Its `QLinear` is a subclass of
  `nn.Linear`, so peft 0.21's ordinary LoRA, LoHa and LoKr layers wrap it (peft has no layer
  of its own for quanto and needs none), and importing it changes nothing in the libraries
  beside it. One exception: on CUDA GPUs of compute capability 8.0 and newer it keeps float8
  weights in its Marlin layout, whose kernels it compiles with nvcc on first use, so fp8 is
  refused there, naming int8 (the same memory, plain kernels).
- `nf4`: bitsandbytes' `Linear4bit` (QLoRA's NormalFloat4 with double-quantized scales), the
  4-bit format peft has a dedicated LoRA / DoRA layer for. Its kernels are CUDA ones in the
  official build, so nf4 is refused elsewhere, naming int8, which runs everywhere.
- torchao was not chosen, though peft has a layer for its int8 weights: installed beside
  diffusers 0.42 and transformers 5 it is imported by every `import peft` and every diffusers
  model import (transformers' torchao quantizer imports it), and logs warnings there (CUDA
  extensions that a CPU build of torch cannot load, tensor classes diffusers asks for that
  torchao 0.17 and later no longer have): noise in every command and notebook of the kit,
  quantized or not.
- bitsandbytes' LLM.int8 was not chosen for int8: CUDA only, and slower than a weight-only
  int8 matmul.

What is quantized: the `nn.Linear` layers of the repeated blocks (a module path with an index
in it, as `transformer_blocks.3.attn.to_q` or `encoder.block.7.layer.1.DenseReluDense.wi_0`),
which hold nearly all of a denoiser's and a T5's weights. The AdaLN modulation projections in
the blocks (`norm1.linear` in diffusers' naming) are among them, as in diffusers' bitsandbytes
path, which quantizes every Linear of Flux: they are a quarter of Flux's weights, and with a
scale per output row they are stored like any other projection. What keeps the run's dtype:
convolutions and the norms themselves; the layers outside the blocks (the input and output
projections, whose errors reach the prediction directly, and the time, text and guidance
embedders: small, and every token goes through them); the layers a model class keeps in
precision (`_keep_in_fp32_modules`, such as T5's `wo`); anything named an embedding; and
layers under `MIN_FEATURES` wide, where a scale per row saves little.

Export and merge load the unquantized base as usual (clients load a LoRA on the base they
have), so what a client draws with the export differs a little from the images training drew
on the quantized base; export verification therefore compares against images the kit redraws
on the unquantized base (`kit.export.writer`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kit.errors import ConfigError, KitError
from kit.families.base import Components, Family

KINDS = ("none", "int8", "fp8", "nf4")
"""The values of `base_quantization`."""

BACKENDS = {"int8": "optimum-quanto", "fp8": "optimum-quanto", "nf4": "bitsandbytes"}
"""The pip package that quantizes each kind."""

QUANTIZED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear,)
"""The module kinds that are quantized (inside the repeated blocks; see `quantizable_layers`)."""

KEPT_NAMES = ("embed",)
"""Name parts of layers that keep the run's dtype wherever they are."""

MIN_FEATURES = 16
"""Layers with fewer input or output features than this keep the run's dtype."""

NF4_BLOCK = 64
"""Weights per nf4 scale (bitsandbytes' default block)."""

SCALE_BLOCK = 256
"""nf4 scales per second-level fp32 scale (bitsandbytes' double quantization)."""


@dataclass
class QuantReport:
    """What `quantize` did to one module."""

    kind: str
    backend: str
    layers: list[str] = field(default_factory=list)
    """The quantized layers' paths."""
    kept: list[str] = field(default_factory=list)
    """The module's other `nn.Linear` layers, which keep the run's dtype."""
    bytes_before: int = 0
    """Bytes of the quantized layers' weights before (in the dtype they were quantized from)."""
    bytes_after: int = 0
    """Bytes of the same weights quantized (codes and scales)."""

    def describe(self, part: str = "") -> str:
        """One line for the console: how many layers, and the bytes saved."""
        mib = 1 << 20
        what = f"{part}: " if part else ""
        return (
            f"{what}{len(self.layers)} Linear layers stored {self.kind} ({self.backend}), "
            f"{self.bytes_before / mib:.1f} MiB → {self.bytes_after / mib:.1f} MiB; "
            f"{len(self.kept)} kept in full precision"
        )


# ------------------------------------------------------------------ refusals


def check_quantization(
    kind: str,
    device: torch.device | str,
    *,
    method: Any = None,
    deepspeed: bool = False,
    key: str = "base_quantization",
) -> None:
    """Refuse a `base_quantization` (or `key`) this run cannot use, before anything is loaded.

    `method` (a `kit.methods` method) says what it cannot train on (`quantization_refusal`),
    e.g. a denoiser that trains whole, whose weights must take gradient steps. `deepspeed`: the
    run is
    launched under DeepSpeed, whose engine re-places every weight of the model it wraps, which
    optimum-quanto's weights refuse ("Couldn't swap QLinear.weight"). `key` is the setting
    the messages name (`text_encoder_quantization` uses the same rules).
    """
    if kind not in KINDS:
        raise ConfigError(f"{key}: unknown value '{kind}' (choose from {', '.join(KINDS)})")
    if kind == "none":
        return
    why = method.quantization_refusal(kind) if method is not None else None
    if why:
        raise ConfigError(f"{key}: {kind} with network_type {method.name}: {why}")
    if deepspeed:
        raise KitError(
            f"{key}: {kind} under DeepSpeed: its engine re-places every weight of "
            "the model it wraps, which quantized weights refuse; launch without DeepSpeed (kit "
            f"accelerate-config without --deepspeed-stage), or set {key}: none"
        )
    dev = torch.device(device)
    if kind == "nf4" and dev.type != "cuda":
        raise KitError(
            f"{key}: nf4 needs a CUDA GPU (bitsandbytes' 4-bit kernels), and this "
            f"run is on {dev.type}; use {key}: int8, which runs here (half the "
            "memory of bf16 weights where nf4 takes a quarter)"
        )
    if kind == "fp8" and dev.type == "mps":
        raise KitError(
            f"{key}: fp8 cannot run on mps (Apple GPUs have no float8 type); use "
            f"{key}: int8, which runs there and takes the same memory"
        )
    _require(kind)
    if kind == "fp8" and _marlin_fp8(dev):
        raise KitError(
            f"{key}: fp8 on this GPU: optimum-quanto stores float8 weights on CUDA "
            "GPUs of compute capability 8.0 and newer in its Marlin layout, whose kernels it "
            f"compiles with nvcc on first use; use {key}: int8, the same memory with "
            "plain PyTorch kernels"
        )


def _marlin_fp8(device: torch.device) -> bool:
    """Whether optimum-quanto would keep fp8 weights on `device` in its compiled Marlin layout
    (it registers those kernels on Linux CUDA builds, and uses them from compute capability 8)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    from optimum.quanto.library.extensions import is_extension_available

    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = torch.cuda.get_device_capability(index)[0] >= 8
    return capable and is_extension_available("quanto_cuda")


def _require(kind: str) -> None:
    """Refuse a kind whose library is not installed, saying what to install."""
    package = BACKENDS[kind]
    module = "optimum.quanto" if package == "optimum-quanto" else package
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # `optimum` itself is missing
        found = False
    if not found:
        extra = "quantize" if package == "optimum-quanto" else "nf4"
        raise KitError(
            f"base_quantization: {kind} needs the {package} package, which is not installed: "
            f"pip install 'diffusion-tuning-kit[{extra}]' (or pip install {package})"
        )


# ------------------------------------------------------------------ which layers


def _keeps_precision(name: str, layer: nn.Linear, kept: set[str]) -> bool:
    parts = name.split(".")
    if not any(p.isdigit() for p in parts):
        return True  # outside the repeated blocks
    if any(k in name for k in KEPT_NAMES) or kept.intersection(parts):
        return True
    return min(layer.in_features, layer.out_features) < MIN_FEATURES


def quantizable_layers(module: nn.Module) -> list[str]:
    """Paths of the layers `quantize` stores quantized, in module order.

    Reads names and shapes only, so it works on a meta-device copy (the memory estimate).
    """
    # What the model class keeps in fp32 (diffusers and transformers both declare it so).
    kept = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return [
        name
        for name, layer in module.named_modules()
        if type(layer) in QUANTIZED_MODULES and not _keeps_precision(name, layer, kept)
    ]


def estimated_bytes(module: nn.Module, kind: str, dtype: torch.dtype) -> tuple[int, int]:
    """(before, after): bytes of the quantizable layers' weights in `dtype`, and quantized.

    int8 and fp8 keep one `dtype` scale per output row; nf4 packs two weights a byte, with one
    byte of scale per `NF4_BLOCK` weights and an fp32 scale per `SCALE_BLOCK` of those.
    """
    size = torch.empty((), dtype=dtype).element_size()
    before = after = 0
    for name in quantizable_layers(module):
        out_f, in_f = module.get_submodule(name).weight.shape
        n = out_f * in_f
        before += n * size
        if kind == "nf4":
            blocks = -(-n // NF4_BLOCK)
            after += -(-n // 2) + blocks + 4 * -(-blocks // SCALE_BLOCK) + 16 * 4
        else:
            after += n + out_f * size
    return before, after


def is_quantized(layer: nn.Module) -> bool:
    """Whether a layer's weight is stored quantized (by either library)."""
    weight = getattr(layer, "weight", None)
    if weight is None:
        return False
    cls = type(weight)
    return cls.__module__.startswith("optimum.quanto") or cls.__name__ == "Params4bit"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, counting a quantized tensor's codes and scales."""
    if hasattr(t, "__tensor_flatten__"):  # a wrapper tensor (quanto): the tensors inside it
        inner, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in inner)
    size = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)  # bitsandbytes keeps the scales beside the codes
    if state is not None:
        size += sum(
            v.numel() * v.element_size()
            for v in state.as_dict(packed=True).values()
            if isinstance(v, torch.Tensor)
        )
    return size


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, quantized ones by what they really hold."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(tensor_bytes(t) for t in tensors.values())


# ------------------------------------------------------------------ quantizing


def quantize(
    module: nn.Module,
    kind: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> QuantReport:
    """Store the quantizable layers of a frozen `module` quantized, in place.

    Each layer is moved to `device` (and cast to `dtype`, when given) on its own and quantized
    there, so a base still on the CPU never sits whole on the GPU in full precision: only the
    layer being quantized does. Everything else in `module` stays where it is; the caller moves
    it. Call `check_quantization` first.
    """
    if kind == "none":
        return QuantReport(kind, "")
    parts = getattr(module, "quantized_parts", None)
    if parts is not None:
        return _quantize_parts(parts(), kind, device=device, dtype=dtype)
    dev = torch.device(device)
    names = quantizable_layers(module)
    wanted = set(names)
    kept = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n not in wanted]
    report = QuantReport(kind, BACKENDS[kind], names, kept)
    make = _nf4_layer if kind == "nf4" else _quanto_layer
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        layer = getattr(parent, child)
        layer.to(device=dev, dtype=dtype)
        report.bytes_before += tensor_bytes(layer.weight)
        new = make(layer, kind, dev)
        new.requires_grad_(False)
        report.bytes_after += tensor_bytes(new.weight)
        setattr(parent, child, new)
    return report


def _quantize_parts(
    parts: Any, kind: str, *, device: torch.device | str, dtype: torch.dtype | None
) -> QuantReport:
    """A denoiser of several models (Wan 2.2's two experts, `quantized_parts`): each model in
    turn, then its `done()` (the expert that waits goes back to CPU memory quantized, so two
    are never on the device at once); one report, the layers named by their part."""
    report = QuantReport(kind, BACKENDS[kind])
    for prefix, part, done in parts:
        one = quantize(part, kind, device=device, dtype=dtype)
        report.layers += [f"{prefix}.{n}" for n in one.layers]
        report.kept += [f"{prefix}.{n}" for n in one.kept]
        report.bytes_before += one.bytes_before
        report.bytes_after += one.bytes_after
        done()
    return report


def quantize_text_encoders(
    family: Family, comps: Components, kind: str, *, device: torch.device | str
) -> dict[str, QuantReport]:
    """Quantize the loaded text encoders the family names (`quantized_text_encoders`), each in
    the dtype it holds; subfolder → what was done (nothing when no encoder is loaded)."""
    if kind == "none" or not comps.text_encoders:
        return {}
    subs = family.text_subfolders
    return {
        sub: quantize(enc, kind, device=device)
        for sub, enc in zip(subs, comps.text_encoders, strict=True)
        if sub in family.quantized_text_encoders
    }


def _quanto_layer(layer: nn.Linear, kind: str, device: torch.device) -> nn.Module:
    """The layer as an optimum-quanto `QLinear` with frozen int8 / float8 weights."""
    from optimum.quanto import qfloat8, qint8
    from optimum.quanto.nn import quantize_module

    new = quantize_module(layer, weights=qint8 if kind == "int8" else qfloat8)
    new.freeze()  # the float weight is replaced by its codes and per-row scales
    if device.type == "cpu":
        # quanto's CPU kernel for int8 weights and bf16 inputs (`_weight_int8pack_mm`)
        # refuses inputs that are not contiguous, which some of the UNet's layers receive.
        new.register_forward_pre_hook(_contiguous_input)
    return new


def _contiguous_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


def _nf4_layer(layer: nn.Linear, kind: str, device: torch.device) -> nn.Module:
    """The layer as a bitsandbytes `Linear4bit` (NF4, double-quantized scales), computing in
    the layer's dtype; the weight is packed as it moves to the CUDA `device`."""
    import bitsandbytes as bnb

    dtype = layer.weight.dtype
    new = bnb.nn.Linear4bit(
        layer.in_features,
        layer.out_features,
        bias=layer.bias is not None,
        compute_dtype=dtype,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    new.weight = bnb.nn.Params4bit(
        layer.weight.data,
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        module=new,
    )
    if layer.bias is not None:
        new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    return new.to(device)


__all__ = [
    "BACKENDS",
    "KINDS",
    "QUANTIZED_MODULES",
    "QuantReport",
    "check_quantization",
    "estimated_bytes",
    "is_quantized",
    "module_bytes",
    "quantizable_layers",
    "quantize",
    "quantize_text_encoders",
    "tensor_bytes",
]
