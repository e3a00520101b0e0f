"""How the frozen base is stored: quantized Linear weights, blocks swapped to host memory.

The trace counts every frozen weight in the run's dtype. Two settings change where those bytes
live without changing the step itself, so they are arithmetic on an inventory the trace takes
once from the meta-device parts (and caches with it):

- `base_quantization` stores the layers `kit.families.quantize` quantizes (the Linear layers
  of the repeated blocks of the denoiser, and of the family's `quantized_text_encoders`) as
  int8 / fp8 codes with a scale per row, or nf4 with block scales; their sizes are that
  module's own `estimated_bytes`. Each quantized layer is unpacked into the compute dtype for
  its matmul, one layer at a time.
- `blocks_to_swap` keeps the frozen weights of the last N of the family's transformer blocks
  (`Family.swap_blocks`, in forward order, as kit.train.offload swaps them) in host RAM. They
  leave the GPU; at most two of them are on it at a time (the block computing, and the next
  one arriving on a side stream), and what trains stays on the GPU.

The refusals mirror the trainer's, so the estimator never prices a run that would not start.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kit.errors import ConfigError, KitError
from kit.families import Family
from kit.families import quantize as quant

KINDS = ("int8", "fp8", "nf4")
"""The quantized kinds of `base_quantization`."""
STAGING_BLOCKS = 2  # swapped blocks on the GPU at once: the one computing, the one arriving
SWAP_SLOWDOWN = 0.5
"""Extra time per step when every block is swapped: the copies overlap the compute in part."""
QUANT_SLOWDOWN = {"none": 1.0, "fp8": 1.08, "int8": 1.1, "nf4": 1.25}
"""Time per step relative to an unquantized base: each layer is unpacked before its matmul."""


GIB = 2**30
CUDA_CONTEXT = int(0.45 * GIB)  # CUDA context and kernels, outside PyTorch's allocator
ALLOCATOR_RESERVE = 0.08  # cached but unused blocks (fragmentation), as a share of the peak


# ---------------------------------------------------------------- inventory (inside the trace)


def quant_inventory(
    parts: dict[str, nn.Module],
    family: Family,
    dtype: torch.dtype,
    waiting: dict[str, nn.Module] | None = None,
) -> dict[str, dict[str, int]]:
    """Part → bytes of its quantizable layers in `dtype` (`none`) and stored as each kind,
    with the largest such weight; taken before an adapter wraps the layers, as training
    quantizes them before it attaches one.

    `waiting`: models of the denoiser kept in host RAM while another trains
    (`Family.host_resident`, Wan 2.2's experts), left out of the denoiser's entry (the GPU
    holds one expert); `waiting_inventory` sizes them."""
    # Every text encoder: `text_encoder_quantization` stores any of them quantized.
    names = [n for n in parts if n != "vae"]
    out = {}
    for name in names:
        out[name] = _quant_sizes(parts[name], dtype)
    for module in (waiting or {}).values():
        if "denoiser" in out and any(m is module for m in parts["denoiser"].modules()):
            sizes = _quant_sizes(module, dtype)
            for kind in ("none", *KINDS):
                out["denoiser"][kind] -= sizes[kind]
    return out


def waiting_inventory(
    waiting: dict[str, nn.Module], dtype: torch.dtype
) -> dict[str, dict[str, int]]:
    """Label → the quantizable layers' sizes of each model of the denoiser that waits in host
    RAM (stored as `base_quantization` stores the denoiser: Wan 2.2's waiting expert)."""
    return {label: _quant_sizes(module, dtype) for label, module in waiting.items()}


def _quant_sizes(module: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    layers = quant.quantizable_layers(module)
    sizes = {"largest": 0}
    for kind in KINDS:
        sizes["none"], sizes[kind] = quant.estimated_bytes(module, kind, dtype)
    sizes["largest"] = max((module.get_submodule(n).weight.numel() for n in layers), default=0)
    return sizes


def swap_blocks(family: Family, denoiser: nn.Module) -> list[nn.Module]:
    """The blocks `blocks_to_swap` counts, in forward order; none where the family has no
    stack of transformer blocks (the UNets)."""
    try:
        return list(family.swap_blocks(denoiser))
    except KitError:
        return []


def block_inventory(family: Family, denoiser: nn.Module) -> list[int]:
    """Bytes of frozen weights in each swappable block, in forward order (what trains, such
    as an adapter's weights, stays on the GPU and is not counted)."""
    out = []
    for block in swap_blocks(family, denoiser):
        params = {id(p): p for p in block.parameters() if not p.requires_grad}
        out.append(sum(p.numel() * p.element_size() for p in params.values()))
    return out


# ---------------------------------------------------------------- refusals (as the trainer's)


def check_quant(kind: str, method: Any) -> None:
    """Refuse a `base_quantization` the trainer refuses for this method (kit.families.quantize),
    whatever machine it is estimated on: a missing library or a CPU here is not a refusal."""
    try:
        quant.check_quantization(kind, "cuda", method=method)
    except ConfigError:
        raise
    except KitError:
        pass  # the library is installed where the run trains


def check_swap(n: int, blocks: list[int], family: str, whole_denoiser: bool, kind: str) -> None:
    """Refuse a swap the trainer refuses (kit.train.offload), naming the key and the limit."""
    if n == 0:
        return
    if n < 0:
        raise ConfigError(f"blocks_to_swap: {n} must be 0 (no swapping) or more")
    if whole_denoiser:
        raise ConfigError(
            f"blocks_to_swap: {n} keeps frozen weights in CPU memory, and this method trains "
            "every weight of the denoiser; set blocks_to_swap: 0 or train an adapter"
        )
    if kind != "none":
        raise ConfigError(
            f"blocks_to_swap: {n} with base_quantization: {kind}: quantized weights are not "
            "swapped; set one of the two to 0 / none"
        )
    if not blocks:
        raise ConfigError(
            f"blocks_to_swap: the {family} denoiser has no stack of transformer blocks to swap; "
            "set blocks_to_swap: 0"
        )
    if n > len(blocks):
        raise ConfigError(
            f"blocks_to_swap: {n} is more than the {len(blocks)} transformer blocks of this "
            f"{family} denoiser; set it to at most {len(blocks)}"
        )


# ---------------------------------------------------------------- arithmetic (in the estimate)


def stored(kind: str, frozen_bytes: int, sizes: dict[str, int] | None) -> int:
    """Frozen bytes of a part once its quantizable layers are stored as `kind`."""
    if kind == "none" or sizes is None:
        return frozen_bytes
    return frozen_bytes - sizes["none"] + sizes[kind]


def swap_plan(blocks: list[int], n: int) -> dict[str, int]:
    """Bytes the last `n` blocks keep in host RAM, and the GPU memory the ones visiting take."""
    swapped = blocks[len(blocks) - n :] if n else []
    return {
        "host": sum(swapped),
        "staging": sum(sorted(swapped)[-STAGING_BLOCKS:]),
        "blocks": n,
    }


def swap_slowdown(n: int, blocks: list[int]) -> float:
    """Time per step relative to no swap: grows with the share of blocks swapped."""
    return 1.0 + SWAP_SLOWDOWN * n / max(1, len(blocks))


def swap_choices(blocks: list[int]) -> list[int]:
    """The swap counts the advice tries: none, then eighths of the stack up to all of it."""
    top = len(blocks)
    if not top:
        return [0]
    return sorted({0, top, *(max(1, round(top * i / 8)) for i in range(1, 8))})


__all__ = [
    "KINDS",
    "QUANT_SLOWDOWN",
    "STAGING_BLOCKS",
    "block_inventory",
    "check_quant",
    "check_swap",
    "on_accelerator",
    "quant_inventory",
    "stored",
    "swap_blocks",
    "swap_choices",
    "swap_plan",
    "swap_slowdown",
    "waiting_inventory",
]


@dataclass(frozen=True)
class Storage:
    """How the frozen base is kept: `base_quantization`, `blocks_to_swap` and
    `text_encoder_quantization`."""

    quantization: str = "none"
    swap: int = 0
    text: str = "none"
    """`text_encoder_quantization`: the text encoders stored quantized from the cache on."""

    def kind(self, part: str, family: Family) -> str:
        """How `part` is stored: the text encoders as `text` (where set), the denoiser and the
        family's large T5s as `quantization`."""
        if part not in ("denoiser", "vae") and self.text != "none":
            return self.text
        if part == "denoiser" or part in family.quantized_text_encoders:
            return self.quantization
        return "none"


def setup_phase(tr: dict[str, Any], storage: Storage, family: Family, half: int) -> dict[str, Any]:
    """GPU memory while the cache fills, before the first step, as kit.train.prepare orders it:
    the text encoders and the VAE are on the GPU (stored as `text_encoder_quantization` says;
    the T5s that `base_quantization` names are quantized only once they have encoded the
    captions; the VAE in fp32); the denoiser is loaded only after the cache is filled
    (quantized layer by layer, its swapped blocks never leaving host RAM), which the training
    step's estimate counts. The encoders' activations while they encode are not counted."""
    inv = tr["storage"]["quantized"]
    comps = {}
    for name, by_dtype in tr["frozen"].items():
        loaded = sum(by_dtype.values())
        if name == "vae":
            comps["vae_weights"] = loaded * 4 // half
        elif name != "denoiser":
            comps[f"{name}_weights"] = stored(storage.text, loaded, inv.get(name))
    allocated = sum(comps.values())
    comps["allocator_reserve"] = int(allocated * ALLOCATOR_RESERVE)
    comps["cuda_context"] = CUDA_CONTEXT
    late = [n for n in family.quantized_text_encoders if n in tr["frozen"]]
    why = "the text encoders and the VAE on the GPU while the cache fills"
    if storage.text != "none":
        why += f" (stored {storage.text})"
    elif storage.quantization != "none" and late:
        why += f" ({', '.join(late)} not yet quantized)"
    return {"components": comps, "total": sum(comps.values()), "why": why}


def frozen_by_dtype(frozen: dict[str, dict[str, int]]) -> dict[str, int]:
    """Frozen bytes by dtype, over every part."""
    out: dict[str, int] = defaultdict(int)
    for part in frozen.values():
        for dt, n in part.items():
            out[dt] += n
    return dict(out)


def on_accelerator(cfg: Any) -> str:
    """Which model of a denoiser of two (Wan 2.2 A14B's experts, `train_experts`) the training
    step holds on the GPU while the other waits in host RAM."""
    chosen = cfg.model.train_experts
    if chosen in ("high", "low"):
        return f"the {chosen}-noise expert, which trains"
    return (
        "the expert of the batch's timesteps (high noise at and above the boundary, low noise "
        "below), swapped with the other when a batch falls on the other side"
    )
