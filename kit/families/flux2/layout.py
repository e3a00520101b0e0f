"""FLUX.2 in the original (Black Forest Labs) layout, which ComfyUI and BFL's own code use.

diffusers' `Flux2Transformer2DModel` already keeps most of the original's fused weights: each
single block's `attn.to_qkv_mlp_proj` is BFL's `linear1` (q, k, v and the SwiGLU input) and its
`attn.to_out` is `linear2`. Only the double blocks split a weight: their image and text
attention hold q, k and v as three Linears where BFL has one `qkv` matrix (rows q, k, v). The
modulation is global (one Linear per stream for all blocks), and the final modulation
(`norm_out.linear`) stores its halves as (shift, scale) in BFL's layout and (scale, shift) in
diffusers', as in FLUX.1.

The tables below are diffusers' own conversion (`convert_flux2_transformer_checkpoint_to_diffusers`
in `diffusers/loaders/single_file_utils.py`, and `_convert_non_diffusers_flux2_lora_to_diffusers`
in `lora_conversion_utils.py`) read the other way; ComfyUI's model for FLUX.2
(`comfy/ldm/flux/model.py`, `Flux` with FLUX.2's params) has the same BFL names under
`diffusion_model.`.

Three files come out of them:

* the full transformer (`to_original`), read back by diffusers' `from_single_file`;
* a LoRA in sd-scripts' naming (`kohya_lora`): `lora_unet_<BFL path, dots as underscores>` with
  `lora_down`, `lora_up` and `alpha`, which ComfyUI matches to its weights and diffusers reads with
  `_convert_kohya_flux2_lora_to_diffusers`. A `qkv` gets one LoRA whose down matrix stacks the
  parts' downs and whose up matrix places each part's up in its own rows and columns (zeros
  elsewhere), so up @ down is each part's update in its rows; diffusers' reader finds that
  block structure and splits it back exactly;
* LoHa / LoKr (`lycoris_module`): whole modules under `lora_unet_<BFL path>` (ComfyUI's name
  for every weight of its model); the q / k / v parts of a `qkv` under
  `lora_transformer_<diffusers path>`, which ComfyUI maps onto rows of the fused weight through
  `comfy.utils.flux_to_diffusers` (FLUX.2's `model_base.Flux2` is a `model_base.Flux`, and the
  double blocks' attention names are FLUX.1's). A Kronecker product cannot be fused exactly.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from kit.errors import KitError
from kit.families import adapter_keys
from kit.families.flux import layout as flux_layout

COMFYUI_SINCE = {"dev": "0.8", "klein": "0.12"}
"""The first ComfyUI release that loads each FLUX.2 model and its LoRA files (measured): v0.3.64
has no FLUX.2; v0.8.0 builds the transformer with 48 heads hard-coded, dev's, so it cannot
build klein; v0.12.1 loads every file the kit writes."""

KOHYA_PREFIX = "lora_unet"
"""sd-scripts' key prefix, which ComfyUI accepts for every weight of its model."""
LYCORIS_PREFIX = "lora"
"""Prefix of the LyCORIS stems: `lora_unet_<BFL>` and `lora_transformer_<diffusers>` (ComfyUI)."""

SWAPPED_HALVES = frozenset({"norm_out.linear"})
"""Modules whose output halves are swapped between the layouts (diffusers: scale then shift)."""

# Double blocks: diffusers module → (BFL module, index of its third in a fused qkv, or None).
_DOUBLE: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("img_attn.qkv", 0),
    "attn.to_k": ("img_attn.qkv", 1),
    "attn.to_v": ("img_attn.qkv", 2),
    "attn.add_q_proj": ("txt_attn.qkv", 0),
    "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", None),
    "attn.to_add_out": ("txt_attn.proj", None),
    "ff.linear_in": ("img_mlp.0", None),
    "ff.linear_out": ("img_mlp.2", None),
    "ff_context.linear_in": ("txt_mlp.0", None),
    "ff_context.linear_out": ("txt_mlp.2", None),
}
_SINGLE: dict[str, tuple[str, int | None]] = {
    "attn.to_qkv_mlp_proj": ("linear1", None),
    "attn.to_out": ("linear2", None),
}
_TOP: dict[str, str] = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "proj_out": "final_layer.linear",
}
# RMSNorm scales of the attention: diffusers `<module>.weight` → BFL `<module>.scale`, named
# as in FLUX.1's blocks.
_DOUBLE_NORMS, _SINGLE_NORMS = flux_layout.DOUBLE_NORMS, flux_layout.SINGLE_NORMS

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_KINDS = {
    "transformer_blocks": ("double_blocks", _DOUBLE, _DOUBLE_NORMS),
    "single_transformer_blocks": ("single_blocks", _SINGLE, _SINGLE_NORMS),
}

# The modules diffusers' reader of sd-scripts FLUX.2 files (`_convert_kohya_flux2_lora_to_
# diffusers`) maps; it logs and drops any other key, so a file holding one is refused.
_KOHYA_READ_TOP = frozenset(
    {
        "img_in",
        "txt_in",
        "time_in.in_layer",
        "time_in.out_layer",
        "final_layer.linear",
    }
)

# What ComfyUI's `flux_to_diffusers` maps for a FLUX.2 model under diffusers names: FLUX.1's
# names that FLUX.2's diffusers model shares (the double blocks' attention, the embedders and
# the output), each onto the weight (or rows) of the same BFL module as here.
_COMFY_DIFFUSERS_DOUBLE = tuple(k for k in _DOUBLE if k.startswith("attn."))
_COMFY_DIFFUSERS_TOP = ("x_embedder", "context_embedder", "norm_out.linear", "proj_out")


def locate(module: str) -> tuple[str, int | None] | None:
    """A diffusers Linear's BFL module and its third of a fused `qkv` (None: the whole weight),
    or None when the original layout has no such module."""
    match = _BLOCK.match(module)
    if match:
        kind, index, rest = match.groups()
        prefix, table, _ = _KINDS[kind]
        if rest not in table:
            return None
        bfl, third = table[rest]
        return f"{prefix}.{index}.{bfl}", third
    if module in _TOP:
        return _TOP[module], None
    return None


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(a, b) → (b, a) along the rows: diffusers' (scale, shift) ↔ BFL's (shift, scale)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


# ------------------------------------------------------------------ the full transformer


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers FLUX.2 transformer state dict → the same weights in BFL's layout (bare keys,
    transformer only: ComfyUI's diffusion model file, which `from_single_file` reads back).

    Every key must find its place; q, k, v of a double block are stacked into `qkv`.
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        match = _BLOCK.match(module)
        if match and param == "weight":
            kind, index, rest = match.groups()
            prefix, _, norms = _KINDS[kind]
            if rest in norms:
                out[f"{prefix}.{index}.{norms[rest]}.scale"] = tensor
                continue
        located = locate(module)
        if located is None:
            raise KitError(
                f"FLUX.2 transformer weights: '{key}' has no place in the original layout; "
                "is this a plain Flux2Transformer2DModel?"
            )
        bfl, third = located
        if module in SWAPPED_HALVES:
            tensor = _swap_halves(tensor)
        if third is None:
            out[f"{bfl}.{param}"] = tensor
        else:
            fused[f"{bfl}.{param}"][third] = tensor
    for key, parts in fused.items():
        if sorted(parts) != [0, 1, 2]:
            raise KitError(f"FLUX.2 transformer weights: '{key}' lacks some of q, k, v")
        out[key] = torch.cat([parts[i] for i in range(3)], dim=0)
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------ LoRA


def _kohya_readable(bfl: str, module: str) -> None:
    """Refuse a module diffusers' sd-scripts FLUX.2 reader would drop (ComfyUI reads it; a file
    that loads in one client and silently loses weights in the other is not written)."""
    if bfl.startswith(("double_blocks.", "single_blocks.")) or bfl in _KOHYA_READ_TOP:
        return
    raise KitError(
        f"{module}: diffusers' reader of FLUX.2 LoRA files in sd-scripts' naming drops "
        f"'{bfl}', so the file would load only in part there; leave it out of lora_targets or "
        "export the diffusers layout alone (--format diffusers)"
    )


def kohya_lora(peft_state: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA weights of a FLUX.2 transformer → sd-scripts' FLUX.2 LoRA keys, same update.

    peft scales each update by alpha / rank (the module's own rank). A whole module keeps its
    LoRA and alpha; the parts of a `qkv` become one LoRA of rank Σ ranks whose alpha keeps
    each part's scale (a part of another rank carries the difference in its up block).
    """
    groups: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for module, down, up in adapter_keys.linear_lora_pairs(peft_state, "FLUX.2's fused qkv"):
        located = locate(module)
        if located is None:
            raise KitError(f"{module}: not a FLUX.2 transformer Linear the original layout holds")
        bfl, third = located
        _kohya_readable(bfl, module)
        if module in SWAPPED_HALVES:
            up = _swap_halves(up)
        groups[bfl].append((-1 if third is None else third, down, up))
    out: dict[str, torch.Tensor] = {}
    for bfl, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        stem = f"{KOHYA_PREFIX}_{bfl.replace('.', '_')}"
        reference = parts[0][1].shape[0]
        if parts[0][0] < 0:
            _, down, up = parts[0]
        else:
            rows = parts[0][2].shape[0]
            down = torch.cat([d for _, d, _ in parts], dim=0)
            up = parts[0][2].new_zeros(3 * rows, down.shape[0])
            column = 0
            for third, part_down, part_up in parts:
                rank = part_down.shape[0]
                block = part_up if rank == reference else part_up * (reference / rank)
                up[third * rows : (third + 1) * rows, column : column + rank] = block
                column += rank
        # Readers scale by alpha / (down's rows); this alpha keeps the trained alpha / rank.
        out[f"{stem}.lora_down.weight"] = down.contiguous()
        out[f"{stem}.lora_up.weight"] = up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(float(alpha) * down.shape[0] / reference)
    return out


# ------------------------------------------------------------------ LoHa / LoKr


def lycoris_module(module: str) -> str:
    """A module's name in a FLUX.2 LyCORIS file, after the `lora` prefix: `unet.<BFL path>` for
    a whole weight, `transformer.<diffusers path>` for a part of a `qkv` (see the docstring)."""
    located = locate(module)
    if located is None:
        raise KitError(f"{module} is not a FLUX.2 transformer Linear ComfyUI maps")
    bfl, third = located
    return f"unet.{bfl}" if third is None else f"transformer.{module}"


# ------------------------------------------------------------------ ComfyUI's model


def comfy_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What ComfyUI's `flux_to_diffusers` derives for a FLUX.2 model (see the module docstring):
    diffusers weight key → `diffusion_model.<BFL>.weight`, or (that key, row offset, rows[,
    swap]) for a third of a `qkv` and for `norm_out.linear`."""
    out: dict[str, Any] = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        if param != "weight":
            continue
        match = _BLOCK.match(module)
        inside = match.group(3) if match and match.group(1) == "transformer_blocks" else None
        if inside not in _COMFY_DIFFUSERS_DOUBLE and module not in _COMFY_DIFFUSERS_TOP:
            continue
        bfl, third = locate(module)  # type: ignore[misc]
        target = f"diffusion_model.{bfl}.weight"
        rows = tensor.shape[0]
        if third is not None:
            out[key] = (target, third * rows, rows)
        elif module in SWAPPED_HALVES:
            out[key] = (target, 0, rows, True)
        else:
            out[key] = target
    return out
