"""Flux.1 in the original (Black Forest Labs) layout, which ComfyUI, Forge and sd-scripts use.

The kit trains diffusers' `FluxTransformer2DModel`; the original layout fuses some of its
projections into one weight. Each double block's image and text attention hold q, k and v as one
`qkv` matrix, and each single block's `linear1` holds q, k, v and the MLP input, stacked by rows
in that order. Everything else is a rename, except the final modulation (`norm_out.linear`), whose
two halves are stored as (shift, scale) in the original layout and (scale, shift) in diffusers.

Three files come out of this mapping:

* the full transformer (`to_original`), which diffusers' single-file loader reads back exactly;
* a LoRA in sd-scripts' naming (`kohya_lora`): `lora_unet_<original module, dots as
  underscores>` with `lora_down.weight`, `lora_up.weight` and `alpha`. A fused weight gets one
  LoRA whose down matrix stacks the parts' downs and whose up matrix places each part's up in its
  own rows and columns, zeros elsewhere: up @ down is then each part's update in its rows and
  nothing in the rows of parts that were not trained. Readers take the rank from the tensors
  (down's row count) and scale by alpha / rank, so alpha is rewritten for the stacked rank;
* LoHa / LoKr (`lycoris_keys`) under `lycoris_<diffusers module>`: ComfyUI and Forge map those
  names onto the fused weights with a row offset, so no fusing is needed (and a Kronecker product
  could not be fused exactly anyway).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kit.errors import KitError
from kit.families import adapter_keys

KOHYA_PREFIX = "lora_unet"
"""Key prefix of sd-scripts' Flux LoRA modules (the one ComfyUI matches to its own weights)."""
LYCORIS_PREFIX = "lycoris"
"""Key prefix of LyCORIS modules named after diffusers' modules, as ComfyUI and Forge map them."""

SWAPPED_HALVES = frozenset({"norm_out.linear"})
"""Modules whose output halves are swapped between the layouts (diffusers: scale then shift)."""

# Each entry: diffusers module (inside its block) → (original module, row offset, row count),
# offset and count in units of the hidden size. diffusers' Flux blocks fix the MLP at 4× hidden.
_DOUBLE: dict[str, tuple[str, int, int]] = {
    "norm1.linear": ("img_mod.lin", 0, 6),
    "norm1_context.linear": ("txt_mod.lin", 0, 6),
    "attn.to_q": ("img_attn.qkv", 0, 1),
    "attn.to_k": ("img_attn.qkv", 1, 1),
    "attn.to_v": ("img_attn.qkv", 2, 1),
    "attn.add_q_proj": ("txt_attn.qkv", 0, 1),
    "attn.add_k_proj": ("txt_attn.qkv", 1, 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2, 1),
    "attn.to_out.0": ("img_attn.proj", 0, 1),
    "attn.to_add_out": ("txt_attn.proj", 0, 1),
    "ff.net.0.proj": ("img_mlp.0", 0, 4),
    "ff.net.2": ("img_mlp.2", 0, 1),
    "ff_context.net.0.proj": ("txt_mlp.0", 0, 4),
    "ff_context.net.2": ("txt_mlp.2", 0, 1),
}
_SINGLE: dict[str, tuple[str, int, int]] = {
    "norm.linear": ("modulation.lin", 0, 3),
    "attn.to_q": ("linear1", 0, 1),
    "attn.to_k": ("linear1", 1, 1),
    "attn.to_v": ("linear1", 2, 1),
    "proj_mlp": ("linear1", 3, 4),
    "proj_out": ("linear2", 0, 1),
}
# Top-level modules; a count of 0 stands for the output projection's own width.
_TOP: dict[str, tuple[str, int, int]] = {
    "x_embedder": ("img_in", 0, 1),
    "context_embedder": ("txt_in", 0, 1),
    "time_text_embed.timestep_embedder.linear_1": ("time_in.in_layer", 0, 1),
    "time_text_embed.timestep_embedder.linear_2": ("time_in.out_layer", 0, 1),
    "time_text_embed.text_embedder.linear_1": ("vector_in.in_layer", 0, 1),
    "time_text_embed.text_embedder.linear_2": ("vector_in.out_layer", 0, 1),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", 0, 2),
    "proj_out": ("final_layer.linear", 0, 0),
}
_GUIDANCE: dict[str, tuple[str, int, int]] = {
    "time_text_embed.guidance_embedder.linear_1": ("guidance_in.in_layer", 0, 1),
    "time_text_embed.guidance_embedder.linear_2": ("guidance_in.out_layer", 0, 1),
}
# RMSNorm scales of the attention: diffusers `<module>.weight` → original `<module>.scale`.
_DOUBLE_NORMS = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}

# The block tables for other BFL-layout models (Chroma's blocks are these without modulation).
DOUBLE_BLOCK: Mapping[str, tuple[str, int, int]] = _DOUBLE
"""diffusers module inside a double block → (original module, offset, rows in hidden units)."""
SINGLE_BLOCK: Mapping[str, tuple[str, int, int]] = _SINGLE
"""The same for a single block."""
DOUBLE_NORMS: Mapping[str, str] = _DOUBLE_NORMS
"""diffusers RMSNorm inside a double block → original module holding its `scale`."""
SINGLE_NORMS: Mapping[str, str] = _SINGLE_NORMS
"""The same for a single block."""

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_BLOCK_KINDS = {
    "transformer_blocks": ("double_blocks", _DOUBLE, _DOUBLE_NORMS),
    "single_transformer_blocks": ("single_blocks", _SINGLE, _SINGLE_NORMS),
}


def _fused_units(table: dict[str, tuple[str, int, int]]) -> dict[str, int]:
    """Original module → its height in hidden-size units, for modules several parts fill."""
    parts: dict[str, list[int]] = defaultdict(list)
    for bfl, _, count in table.values():
        parts[bfl].append(count)
    return {bfl: sum(counts) for bfl, counts in parts.items() if len(counts) > 1}


_FUSED = {**_fused_units(_DOUBLE), **_fused_units(_SINGLE)}
"""Fused original modules (by their name inside a block) → height in hidden-size units."""


# ------------------------------------------------------------------ the module map


def _config_value(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise KitError(f"Flux transformer config: no '{key}' (is this a FluxTransformer2DModel?)")
    return config[key]


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int, int, bool]:
    """(double blocks, single blocks, hidden size, output width, guidance) of a config."""
    inner = int(_config_value(config, "num_attention_heads")) * int(
        _config_value(config, "attention_head_dim")
    )
    channels = config.get("out_channels") or _config_value(config, "in_channels")
    patch = int(config.get("patch_size", 1))
    return (
        int(_config_value(config, "num_layers")),
        int(_config_value(config, "num_single_layers")),
        inner,
        patch * patch * int(channels),
        bool(config.get("guidance_embeds", False)),
    )


def _locate(name: str, inner: int, out_rows: int) -> tuple[str, int, int] | None:
    """Where a diffusers module's rows sit in the original layout, or None if it has no place."""
    match = _BLOCK.match(name)
    if match:
        kind, index, rest = match.groups()
        prefix, table, _ = _BLOCK_KINDS[kind]
        if rest not in table:
            return None
        bfl, offset, count = table[rest]
        return f"{prefix}.{index}.{bfl}", offset * inner, count * inner
    entry = _TOP.get(name) or _GUIDANCE.get(name)
    if entry is None:
        return None
    bfl, offset, count = entry
    return bfl, offset * inner, (count * inner) if count else out_rows


def locate_block(name: str, inner: int) -> tuple[str, int, int] | None:
    """Where a block module's rows (`transformer_blocks.0.attn.to_k`) sit in the original layout
    for hidden size `inner`; None for a name outside the blocks or not in their tables."""
    return _locate(name, inner, 0) if _BLOCK.match(name) else None


def _fused_rows(bfl: str, inner: int) -> int | None:
    """Height of a fused original module (`double_blocks.0.img_attn.qkv`), None if not fused."""
    inside = bfl.split(".", 2)[-1] if bfl.startswith(("double_blocks.", "single_blocks.")) else ""
    units = _FUSED.get(inside)
    return None if units is None else units * inner


def module_map(config: Mapping[str, Any]) -> dict[str, tuple[str, int, int]]:
    """diffusers module name → (original module name, row offset, row count) for every Linear.

    `config` is the transformer's config (`transformer.config` or its `config.json`). A fused
    part gives where its rows sit in the original weight (`attn.to_k` of double block 0 →
    `("double_blocks.0.img_attn.qkv", hidden, hidden)`); any other module has offset 0 and its
    full height. `norm_out.linear` (in `SWAPPED_HALVES`) maps whole, with its halves swapped.
    """
    layers, singles, inner, out_rows, guidance = _dims(config)
    names = [*_TOP, *(_GUIDANCE if guidance else ())]
    names += [f"transformer_blocks.{i}.{rest}" for i in range(layers) for rest in _DOUBLE]
    names += [f"single_transformer_blocks.{i}.{rest}" for i in range(singles) for rest in _SINGLE]
    out = {}
    for name in names:
        located = _locate(name, inner, out_rows)
        assert located is not None  # every name above comes from the tables
        out[name] = located
    return out


def _norm_map(config: Mapping[str, Any]) -> dict[str, str]:
    """diffusers RMSNorm parameter → original parameter, for every attention norm."""
    layers, singles, *_ = _dims(config)
    out = {}
    for kind, count in (("transformer_blocks", layers), ("single_transformer_blocks", singles)):
        prefix, _, norms = _BLOCK_KINDS[kind]
        for i in range(count):
            for ours, theirs in norms.items():
                out[f"{kind}.{i}.{ours}.weight"] = f"{prefix}.{i}.{theirs}.scale"
    return out


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(a, b) → (b, a) along the rows: diffusers' (scale, shift) ↔ the original (shift, scale)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


# ------------------------------------------------------------------ the full transformer


def to_original(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """A diffusers Flux transformer state dict → the same weights in the original layout.

    Every key must be used and every original weight filled: a state dict of another model, or of
    a Flux variant with extra parts, is refused rather than written incomplete. Tensors that need
    no change are the state's own, not copies. The result is what Black Forest Labs publish as
    `flux1-dev.safetensors` (bare keys, transformer only), which ComfyUI loads as a diffusion
    model and diffusers' `FluxTransformer2DModel.from_single_file` reads.
    """
    _, _, inner, _, _ = _dims(config)
    return fuse(state, module_map(config), _norm_map(config), inner)


def fuse(
    state: Mapping[str, torch.Tensor],
    modules: Mapping[str, tuple[str, int, int]],
    norms: Mapping[str, str],
    inner: int,
) -> dict[str, torch.Tensor]:
    """`to_original` for any BFL-layout model: `modules` as `module_map` gives it (diffusers
    Linear → original module, row offset, rows), `norms` diffusers parameter → original key for
    the weights that are only renamed, `inner` the hidden size. Every key of `state` must be
    placed and every fused weight filled (Chroma's layout reuses this with its own maps)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    used: set[str] = set()
    for name, (bfl, offset, count) in modules.items():
        for suffix in ("weight", "bias"):
            key = f"{name}.{suffix}"
            if key not in state:
                raise KitError(f"Flux transformer weights: '{key}' is missing")
            tensor = state[key]
            if tensor.shape[0] != count:
                raise KitError(
                    f"Flux transformer weights: '{key}' has {tensor.shape[0]} rows, the config "
                    f"gives {count}"
                )
            if name in SWAPPED_HALVES:
                tensor = _swap_halves(tensor)
            pieces[f"{bfl}.{suffix}"].append((offset, tensor))
            used.add(key)
    out: dict[str, torch.Tensor] = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        rows = 0
        for offset, tensor in parts:
            assert offset == rows, f"{key}: parts leave a gap at row {rows}"
            rows += tensor.shape[0]
        fused = _fused_rows(key.rsplit(".", 1)[0], inner)
        assert fused is None or fused == rows, f"{key}: {rows} rows of {fused}"
        tensor = parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts], dim=0)
        out[key] = tensor.contiguous()
    for ours, theirs in norms.items():
        if ours not in state:
            raise KitError(f"Flux transformer weights: '{ours}' is missing")
        out[theirs] = state[ours].contiguous()
        used.add(ours)
    extra = sorted(set(state) - used)
    if extra:
        raise KitError(
            f"Flux transformer weights: {len(extra)} keys have no place in the original layout "
            f"(first: {', '.join(extra[:3])}); is this a plain FluxTransformer2DModel?"
        )
    return out


# ------------------------------------------------------------------ LoRA


# diffusers' reader of sd-scripts Flux files (`_convert_kohya_flux_lora_to_diffusers`) drops the
# alpha of the final layer's modules; their scale goes into the up matrix (alpha = rank) instead.
_ALPHA_DROPPED = ("final_layer.",)


def kohya_lora(
    peft_state: Mapping[str, torch.Tensor],
    alpha: float,
    rank: int | None = None,
    locate: Callable[[str, int, int], tuple[str, int, int] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """peft LoRA weights of a Flux transformer → sd-scripts' Flux LoRA keys with the same update.

    peft scales each update by alpha / rank; `rank=None` takes each module's rank from its
    tensors. A module stays its own LoRA with that alpha; the parts of a fused weight become one
    LoRA of rank Σ ranks, whose alpha is rewritten to keep each part's scale (sd-scripts'
    `split_qkv` fuses the same way but keeps the parts' alpha, so its readers play those layers
    at 1/3 or 1/4 strength). The final layer's modules carry their scale in the up matrix with
    alpha = rank, the one form every reader, diffusers included, scales the same. The hidden
    size comes from the down matrices (a fused part's input is the hidden size), so no config
    is needed. `locate(module, hidden, rows)` places a module in the original layout (None: it
    has no place); the default is Flux.1's, another BFL-layout model passes its own.
    """
    locate = locate or _locate
    # Original module → its parts: (row offset, down, up, the part's rank in peft's scale).
    groups: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, int]]] = defaultdict(list)
    heights: dict[str, int | None] = {}
    for module, down, up in adapter_keys.linear_lora_pairs(peft_state, "the fused Flux layout"):
        inner = down.shape[1]
        located = locate(module, inner, up.shape[0])
        if located is None:
            raise KitError(f"{module}: not a Flux transformer Linear the original layout holds")
        bfl, offset, count = located
        height = _fused_rows(bfl, inner)
        if height is not None and up.shape[0] != count:
            raise KitError(
                f"{module}: {up.shape[0]} output rows, where a Flux block of hidden size {inner} "
                f"has {count}"
            )
        if module in SWAPPED_HALVES:
            up = _swap_halves(up)
        groups[bfl].append((offset, down, up, rank or down.shape[0]))
        heights[bfl] = height
    out: dict[str, torch.Tensor] = {}
    for bfl, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        stem = f"{KOHYA_PREFIX}_{bfl.replace('.', '_')}"
        height = heights[bfl]
        reference = parts[0][3]
        if height is None:
            _, down, up, _ = parts[0]
        else:
            down = torch.cat([d for _, d, _, _ in parts], dim=0)
            up = parts[0][2].new_zeros(height, down.shape[0])
            column = 0
            for offset, part_down, part_up, part_rank in parts:
                # One alpha serves the whole fused LoRA: a part of another rank (peft's
                # rank_pattern) carries the difference in its up block.
                block = part_up if part_rank == reference else part_up * (reference / part_rank)
                width = part_down.shape[0]
                up[offset : offset + part_up.shape[0], column : column + width] = block
                column += width
        # Readers scale by alpha / (down's rows); this alpha keeps the trained alpha / rank.
        file_alpha = float(alpha) * down.shape[0] / reference
        if bfl.startswith(_ALPHA_DROPPED):
            up, file_alpha = up * (file_alpha / down.shape[0]), float(down.shape[0])
        out[f"{stem}.lora_down.weight"] = down.contiguous()
        out[f"{stem}.lora_up.weight"] = up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(file_alpha, dtype=torch.float32)
    return out


def kohya_deltas(
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    modules: Mapping[str, tuple[str, int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """A Flux LoRA in sd-scripts' naming → diffusers module → the weight update it applies.

    The arithmetic of ComfyUI's and sd-scripts' readers: up @ down × alpha / (down's rows), or
    × 1 without alpha, split back into the diffusers modules (zeros for a fused part the file
    leaves untouched). It checks an export against the model that was trained, on any model
    size, where diffusers' own Flux LoRA reader assumes the released model's widths. `modules`
    is another BFL-layout model's map (default: `module_map(config)`, Flux.1's).
    """
    modules = module_map(config) if modules is None else modules
    by_stem: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for name, (bfl, offset, count) in modules.items():
        by_stem[f"{KOHYA_PREFIX}_{bfl.replace('.', '_')}"].append((name, offset, count))
    grouped: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        stem, _, part = key.partition(".")
        if part not in ("lora_down.weight", "lora_up.weight", "alpha"):
            raise KitError(f"{key}: not a LoRA weight (lora_down / lora_up / alpha)")
        if stem not in by_stem:
            raise KitError(f"{key}: no such module in this Flux transformer")
        grouped[stem][part] = value
    out: dict[str, torch.Tensor] = {}
    for stem, parts in grouped.items():
        if "lora_down.weight" not in parts or "lora_up.weight" not in parts:
            raise KitError(f"{stem}: a LoRA needs both lora_down.weight and lora_up.weight")
        down, up = parts["lora_down.weight"].float(), parts["lora_up.weight"].float()
        scale = float(parts["alpha"]) / down.shape[0] if "alpha" in parts else 1.0
        delta = (up @ down) * scale
        for name, offset, count in by_stem[stem]:
            rows = delta[offset : offset + count]
            out[name] = _swap_halves(rows) if name in SWAPPED_HALVES else rows
    return out


# ------------------------------------------------------------------ LoHa / LoKr


def lycoris_module(module: str) -> str:
    """A module's name in a Flux LyCORIS file: its diffusers name, which ComfyUI's
    `flux_to_diffusers` maps onto the fused original rows; refused where it maps nothing."""
    if _locate(module, 1, 1) is None:
        raise KitError(f"{module} is not a Flux transformer Linear ComfyUI maps")
    return module


def lycoris_keys(
    peft_state: Mapping[str, torch.Tensor], alpha: float, rank: int
) -> dict[str, torch.Tensor]:
    """peft LoHa / LoKr weights of a Flux transformer → `lycoris_<diffusers module>.<part>`.

    ComfyUI's `model_lora_keys_unet` (and Forge's copy of it) maps these names through
    `flux_to_diffusers` onto the original weights, with the row offset of a fused part (and the
    halves swapped for `norm_out.linear`); alpha is folded as `kit.families.adapter_keys` folds it.
    """
    return adapter_keys.lycoris_keys(dict(peft_state), alpha, rank, LYCORIS_PREFIX, lycoris_module)
