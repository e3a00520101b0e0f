"""Test helper: the update a LyCORIS-layout file applies, computed by the plain formulas.

The LyCORIS file layout of LoHa and LoKr adapters (what A1111, Forge and ComfyUI load).

Keys are `<prefix>_<module path with dots as underscores>.<part>`: `hada_w1_a`, `hada_w1_b`,
`hada_w2_a`, `hada_w2_b` (LoHa) or `lokr_w1` / `lokr_w1_a` / `lokr_w1_b`, `lokr_w2` /
`lokr_w2_a` / `lokr_w2_b` (LoKr), plus `alpha`. Readers scale an update by alpha / rank, the rank
being the inner size of a low-rank factor; a LoKr module with no low-rank factor is not scaled.

`delta_weights` reads such a file with that arithmetic, independently of peft, so an export can
be checked against the model that was trained. It also reads kohya DoRA files (`lora_down`,
`lora_up`, `alpha`, `dora_scale`), which diffusers does not load.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def _key(prefix: str, module: str) -> str:
    return f"{prefix}_{module.replace('.', '_')}"


def _delta(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    alpha = float(parts["alpha"]) if "alpha" in parts else None
    if "hada_w1_a" in parts:
        w1 = parts["hada_w1_a"].float() @ parts["hada_w1_b"].float()
        w2 = parts["hada_w2_a"].float() @ parts["hada_w2_b"].float()
        dim = parts["hada_w1_b"].shape[0]
        delta = w1 * w2
    else:
        w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
        w2 = parts["lokr_w2"] if "lokr_w2" in parts else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
        dim = next((parts[p].shape[0] for p in ("lokr_w1_b", "lokr_w2_b") if p in parts), None)
        w1, w2 = w1.float(), w2.float()
        if w2.ndim == 4:
            w1 = w1[:, :, None, None]
        delta = torch.kron(w1, w2)
    scale = alpha / dim if alpha is not None and dim else 1.0
    return (delta * scale).reshape(shape)


def _dora_merge(weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The merged weight of a kohya LoRA with `dora_scale`: magnitude × direction of W + ΔW."""
    up, down = parts["lora_up.weight"].float(), parts["lora_down.weight"].float()
    scale = float(parts["alpha"]) / down.shape[0] if "alpha" in parts else 1.0
    merged = weight.float() + (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * scale
    norm = merged.flatten(1).norm(dim=1).reshape(-1, *([1] * (merged.ndim - 1)))
    magnitude = parts["dora_scale"].float().reshape(norm.shape)
    return merged * (magnitude / norm)


def delta_weights(
    tensors: dict[str, torch.Tensor], denoiser: nn.Module, prefix: str
) -> dict[str, torch.Tensor]:
    """Module name → the weight update a LyCORIS file applies to it."""
    by_key = {_key(prefix, name): (name, m) for name, m in denoiser.named_modules()}
    grouped: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        stem, part = key.split(".", 1)  # the stem has no dots; parts may ("lora_up.weight")
        grouped[stem][part] = value
    out = {}
    for stem, parts in grouped.items():
        if stem not in by_key:
            raise KeyError(f"{stem}: no such module in the model")
        name, module = by_key[stem]
        if "dora_scale" in parts:
            out[name] = _dora_merge(module.weight, parts) - module.weight.float()
        else:
            out[name] = _delta(parts, module.weight.shape)
    return out


@torch.no_grad()
def merge_into(tensors: dict[str, torch.Tensor], denoiser: nn.Module, prefix: str) -> int:
    """Add a LyCORIS file's updates into a plain model's weights; return how many modules."""
    deltas = delta_weights(tensors, denoiser, prefix)
    modules = dict(denoiser.named_modules())
    for name, delta in deltas.items():
        weight = modules[name].weight
        weight += delta.to(weight.dtype)
    return len(deltas)
