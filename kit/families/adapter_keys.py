"""Adapter weights in the kohya / LyCORIS file layout that A1111, Forge, ComfyUI and kohya's
own tools read: `<prefix>_<module path, dots as underscores>.<part>`.

The module path is the one the client's model uses (a family renames diffusers names into its
original layout where the clients use that); the parts are kohya's for LoRA (`lora_down`,
`lora_up`, `alpha`, `dora_scale`) and LyCORIS' for LoHa (`hada_w1_a` …) and LoKr (`lokr_w1` …).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kit.errors import KitError

LYCORIS_PARTS = {
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
}
MAGNITUDE = "lora_magnitude_vector"
"""peft's name of DoRA's per-output-row magnitude."""


def clip_key(key: str) -> str:
    """A CLIP text-encoder key in the layout every client names it by (`text_model.encoder…`):
    newer transformers drop the `text_model.` level of `CLIPTextModel`, which readers of shared
    files expect."""
    if key.startswith(("text_model.", "text_projection")):
        return key
    return f"text_model.{key}"


def clip_state(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A CLIP text encoder's weights under `prefix`, in the clients' naming (`clip_key`)."""
    return {prefix + clip_key(k): v for k, v in module.state_dict().items()}


def prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every key under `prefix`."""
    return {prefix + k: v for k, v in state.items()}


def _same(module: str) -> str:
    return module


def stem(prefix: str, module: str) -> str:
    """A module's key stem: the prefix, then its path with dots as underscores; a prefix that
    ends in a dot (`diffusion_model.`) keeps the dotted path."""
    if prefix.endswith("."):
        return prefix + module
    return f"{prefix}_{module.replace('.', '_')}"


def magnitude_shape(magnitude: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """DoRA's magnitude shaped like its layer's weight with every axis but the output one
    reduced to 1: (out, 1) for a linear layer, (out, 1, 1, 1) for a convolution."""
    return magnitude.reshape(-1, *([1] * (down.ndim - 1)))


def lora_keys(
    state: dict[str, torch.Tensor],
    prefix: str,
    alpha: float,
    rename: Callable[[str], str] = _same,
) -> dict[str, torch.Tensor]:
    """peft LoRA / DoRA weights of one part → kohya keys, modules renamed by `rename`."""
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state.items():
        module, _, part = key.partition(".lora_")
        modules[module]["lora_" + part] = value
    out: dict[str, torch.Tensor] = {}
    for module, parts in modules.items():
        name = stem(prefix, rename(module))
        unknown = set(parts) - {"lora_A.weight", "lora_B.weight", MAGNITUDE}
        if unknown:
            raise KitError(
                f"'{module}': {sorted(unknown)} is not a LoRA weight the kohya layout can hold"
            )
        for part, kohya_part in (("lora_A.weight", "lora_down"), ("lora_B.weight", "lora_up")):
            if part in parts:
                out[f"{name}.{kohya_part}.weight"] = parts[part].contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
        if MAGNITUDE in parts:
            down = parts["lora_A.weight"]
            out[f"{name}.dora_scale"] = magnitude_shape(parts[MAGNITUDE], down).contiguous()
    return out


def lycoris_keys(
    state: dict[str, torch.Tensor],
    alpha: float,
    rank: int,
    prefix: str,
    rename: Callable[[str], str] = _same,
) -> dict[str, torch.Tensor]:
    """peft LoHa / LoKr weights (peft naming) → LyCORIS keys with the same update.

    peft scales each update by alpha / rank. Readers disagree on how often they apply a file's
    alpha (LyCORIS applies it twice to LoHa and low-rank LoKr, ComfyUI and A1111 once), so the
    scale is folded into the first factor and the file's alpha is the inner dimension
    (alpha / dim = 1, however often it is applied). A LoKr module with no low-rank factor is
    never scaled by its readers, but LyCORIS refuses a module without an alpha: it gets the
    trained rank.
    """
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state.items():
        module, part = key.rsplit(".", 1)
        if part not in LYCORIS_PARTS:
            raise KitError(f"'{key}': not a LoHa or LoKr weight the LyCORIS layout can hold")
        modules[module][part] = value
    out: dict[str, torch.Tensor] = {}
    for module, parts in modules.items():
        name = stem(prefix, rename(module))
        parts = dict(parts)
        first = next(p for p in ("hada_w1_a", "lokr_w1", "lokr_w1_a") if p in parts)
        parts[first] = parts[first] * (alpha / rank)
        dim = next(
            (parts[p].shape[0] for p in ("hada_w1_b", "lokr_w1_b", "lokr_w2_b") if p in parts),
            None,
        )
        for part, value in parts.items():
            out[f"{name}.{part}"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(dim if dim is not None else rank))
    return out


def offset_aliases(
    module_map: dict[str, tuple[str, int, int]], swapped: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """ComfyUI's diffusers-name aliases of a Flux / SD3 transformer from the kit's layout map.

    `module_map` is diffusers module -> (original module, row offset, row count), as
    `flux_layout.module_map(config)` and `sd3_layout.module_map(config)` give it; `swapped`
    names the modules whose row halves ComfyUI exchanges (`flux_layout.SWAPPED_HALVES`,
    `sd3_layout.swapped_modules(config)`). A part of a fused weight (an original module that
    several diffusers modules share) becomes `(diffusion_model.<original>.weight, offset,
    rows, swap)`, a swapped whole module `(key, 0, rows, True)`, and any other module the plain
    key, as ComfyUI's own maps have them (the form decides where a `diff_b` goes).
    """
    shared: dict[str, int] = {}
    for original, _, _ in module_map.values():
        shared[original] = shared.get(original, 0) + 1
    out: dict[str, Any] = {}
    for module, (original, offset, rows) in module_map.items():
        key = f"diffusion_model.{original}.weight"
        swap = module in swapped
        out[f"{module}.weight"] = (
            (key, offset, rows, swap) if shared[original] > 1 or swap or offset else key
        )
    return out


def fused_lora_modules(
    peft_state: dict[str, torch.Tensor], layout: str
) -> dict[str, dict[str, torch.Tensor]]:
    """peft LoRA keys grouped by module, {module: {"A": down, "B": up}}, for a layout that
    fuses modules (`layout` names it), where DoRA has no exact form: a fused weight's parts
    would need the base weight's norms."""
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in peft_state.items():
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if key.endswith(suffix):
                modules[key.removesuffix(suffix)][part] = value
                break
        else:
            if key.endswith(f".{MAGNITUDE}"):
                raise KitError(
                    f"{key}: DoRA has no exact form in {layout} (a fused weight's parts would "
                    "need the base weight's norms); export DoRA in the diffusers layout"
                )
            raise KitError(f"{key}: not a LoRA weight (lora_A / lora_B) this layout can hold")
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            raise KitError(f"{module}: LoRA weights need both lora_A and lora_B")
    return modules


def linear_lora_pairs(
    peft_state: dict[str, torch.Tensor], layout: str
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module, down, up) of each module of `fused_lora_modules`, sorted by module; a pair that
    is not a Linear's (2-D, ranks agreeing) is refused naming the module."""
    pairs = []
    for module, parts in sorted(fused_lora_modules(peft_state, layout).items()):
        down, up = parts["A"], parts["B"]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise KitError(
                f"{module}: LoRA shapes {tuple(down.shape)} / {tuple(up.shape)} are not a Linear's"
            )
        pairs.append((module, down, up))
    return pairs
