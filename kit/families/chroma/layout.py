"""Chroma in the original (Black Forest Labs / lodestones) layout, which ComfyUI loads.

Chroma is FLUX.1-schnell with the per-block modulation projections removed: one small MLP, the
"approximator" (`distilled_guidance_layer`), computes every block's shift / scale / gate from the
timestep. So its double and single blocks are Flux.1's minus `img_mod` / `txt_mod` /
`modulation`, with the same fused `qkv` and `linear1` weights; its top level is `img_in`,
`txt_in`, the approximator and `final_layer.linear`. The fusing, the LoRA arithmetic and the
checks are `kit.families.flux.layout`'s, given this layout's own maps.

What each name is, and who reads it:

* the full transformer (`to_original`): ComfyUI's `diffusion_models` file, which diffusers'
  `ChromaTransformer2DModel.from_single_file` reads back (`convert_chroma_transformer_checkpoint_
  to_diffusers`);
* a LoRA (`kohya_lora`): `lora_unet_<original module, dots as underscores>`, fused as for Flux;
  ComfyUI accepts that name for every weight of its model. diffusers' reader of such files
  (`_convert_kohya_flux_lora_to_diffusers`, which ChromaPipeline's `load_lora_weights` uses)
  reads the blocks (a single block's `linear1` at the released widths only); it names `img_in`,
  `txt_in` and `final_layer.linear` without the `transformer.` prefix, so it leaves them
  unloaded, and it refuses approximator names. Those, none of them default targets, load in
  ComfyUI, the client this layout is for;
* LoHa / LoKr (`lycoris_module`): `lycoris_<diffusers module>`. ComfyUI's Chroma model class
  subclasses its Flux one (`comfy/model_base.py`), so `model_lora_keys_unet` maps those names
  through `comfy.utils.flux_to_diffusers`, which covers the blocks, `x_embedder`,
  `context_embedder` and `proj_out`, not the approximator (refused there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from kit.errors import KitError
from kit.families import adapter_keys
from kit.families.flux import layout as flux_layout

KOHYA_PREFIX = flux_layout.KOHYA_PREFIX
LYCORIS_PREFIX = flux_layout.LYCORIS_PREFIX

# Flux.1's per-block modulation Linears; Chroma's blocks read theirs from the approximator.
_MODULATION = frozenset({"norm1.linear", "norm1_context.linear", "norm.linear"})
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
# Top-level Linears outside the approximator: diffusers → original (as ComfyUI's Chroma names
# them, and as `flux_to_diffusers` maps them).
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear"}
_APPROXIMATOR = "distilled_guidance_layer"
# Inside the approximator, diffusers' `PixArtAlphaTextProjection` (linear_1 / linear_2) is the
# original `MLPEmbedder` (in_layer / out_layer); in_proj, out_proj and the norms keep their names.
_APPROX_LINEAR = re.compile(rf"^{_APPROXIMATOR}\.(in_proj|out_proj|layers\.(\d+)\.linear_([12]))$")


def _config_value(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise KitError(
            f"Chroma transformer config: no '{key}' (is this a ChromaTransformer2DModel?)"
        )
    return int(config[key])


def _sizes(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(double blocks, single blocks, hidden size, output width, approximator width, its layers)."""
    inner = _config_value(config, "num_attention_heads") * _config_value(
        config, "attention_head_dim"
    )
    channels = config.get("out_channels") or _config_value(config, "in_channels")
    patch = int(config.get("patch_size", 1))
    return (
        _config_value(config, "num_layers"),
        _config_value(config, "num_single_layers"),
        inner,
        patch * patch * int(channels),
        _config_value(config, "approximator_hidden_dim"),
        _config_value(config, "approximator_layers"),
    )


def _original_name(module: str) -> str | None:
    """A non-block Linear's original name, or None if Chroma has no such Linear."""
    if module in _TOP:
        return _TOP[module]
    match = _APPROX_LINEAR.match(module)
    if match is None:
        return None
    part, index, which = match.groups()
    if index is None:
        return module
    return f"{_APPROXIMATOR}.layers.{index}.{'in_layer' if which == '1' else 'out_layer'}"


def locate(module: str, inner: int, rows: int) -> tuple[str, int, int] | None:
    """Where a diffusers module's rows sit in the original layout (name, offset, rows), or None
    if Chroma's original layout has no place for it; `inner` is the hidden size."""
    match = _BLOCK.match(module)
    if match:
        if match.group(3) in _MODULATION:
            return None
        return flux_layout.locate_block(module, inner)
    name = _original_name(module)
    return None if name is None else (name, 0, rows)


def module_map(config: Mapping[str, Any]) -> dict[str, tuple[str, int, int]]:
    """diffusers module → (original module, row offset, row count) for every Linear of a Chroma
    transformer with this config (`transformer.config` or its `config.json`)."""
    layers, singles, inner, out_rows, hidden, approx = _sizes(config)
    rows = {name: inner for name in ("x_embedder", "context_embedder")}
    rows["proj_out"] = out_rows
    rows[f"{_APPROXIMATOR}.in_proj"] = hidden
    rows[f"{_APPROXIMATOR}.out_proj"] = inner
    for i in range(approx):
        rows[f"{_APPROXIMATOR}.layers.{i}.linear_1"] = hidden
        rows[f"{_APPROXIMATOR}.layers.{i}.linear_2"] = hidden
    out: dict[str, tuple[str, int, int]] = {}
    for name, count in rows.items():
        located = locate(name, inner, count)
        assert located is not None  # every name above is one `_original_name` knows
        out[name] = located
    blocks = [
        f"transformer_blocks.{i}.{rest}"
        for i in range(layers)
        for rest in flux_layout.DOUBLE_BLOCK
        if rest not in _MODULATION
    ]
    blocks += [
        f"single_transformer_blocks.{i}.{rest}"
        for i in range(singles)
        for rest in flux_layout.SINGLE_BLOCK
        if rest not in _MODULATION
    ]
    for name in blocks:
        located = locate(name, inner, 0)
        assert located is not None
        out[name] = located
    return out


def norm_map(config: Mapping[str, Any]) -> dict[str, str]:
    """diffusers RMSNorm weight → original `scale`: the attention norms and the approximator's."""
    layers, singles, _, _, _, approx = _sizes(config)
    out = {}
    for i in range(layers):
        for ours, theirs in flux_layout.DOUBLE_NORMS.items():
            out[f"transformer_blocks.{i}.{ours}.weight"] = f"double_blocks.{i}.{theirs}.scale"
    for i in range(singles):
        for ours, theirs in flux_layout.SINGLE_NORMS.items():
            out[f"single_transformer_blocks.{i}.{ours}.weight"] = (
                f"single_blocks.{i}.{theirs}.scale"
            )
    for i in range(approx):
        out[f"{_APPROXIMATOR}.norms.{i}.weight"] = f"{_APPROXIMATOR}.norms.{i}.scale"
    return out


def comfy_keys(config: Mapping[str, Any]) -> set[str]:
    """The parameter names of ComfyUI's Chroma model (`comfy/ldm/chroma/model.py` `Chroma`, with
    its `Approximator` and `LastLayer` from `comfy/ldm/chroma/layers.py`, and the double /
    single stream blocks of `comfy/ldm/flux/layers.py` without their modulation): what its
    `diffusion_models` loader expects, written down from those definitions."""
    layers, singles, _, _, _, approx = _sizes(config)
    linears = ["img_in", "txt_in", "final_layer.linear"]
    linears += [f"{_APPROXIMATOR}.in_proj", f"{_APPROXIMATOR}.out_proj"]
    linears += [
        f"{_APPROXIMATOR}.layers.{i}.{p}" for i in range(approx) for p in ("in_layer", "out_layer")
    ]
    scales = [f"{_APPROXIMATOR}.norms.{i}" for i in range(approx)]
    for i in range(layers):
        for stream in ("img", "txt"):
            block = f"double_blocks.{i}.{stream}"
            linears += [
                f"{block}_attn.qkv",
                f"{block}_attn.proj",
                f"{block}_mlp.0",
                f"{block}_mlp.2",
            ]
            scales += [f"{block}_attn.norm.query_norm", f"{block}_attn.norm.key_norm"]
    for i in range(singles):
        linears += [f"single_blocks.{i}.linear1", f"single_blocks.{i}.linear2"]
        scales += [f"single_blocks.{i}.norm.query_norm", f"single_blocks.{i}.norm.key_norm"]
    return {f"{m}.{p}" for m in linears for p in ("weight", "bias")} | {
        f"{s}.scale" for s in scales
    }


# ------------------------------------------------------------------ the full transformer


def to_original(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """A diffusers Chroma transformer state dict → the same weights in the original layout (the
    file ComfyUI loads as a diffusion model); every key used, every original weight filled."""
    _, _, inner, _, _, _ = _sizes(config)
    return flux_layout.fuse(state, module_map(config), norm_map(config), inner)


# ------------------------------------------------------------------ adapters


def kohya_lora(
    peft_state: Mapping[str, torch.Tensor], alpha: float, rank: int | None = None
) -> dict[str, torch.Tensor]:
    """peft LoRA weights of a Chroma transformer → `lora_unet_<original module>` keys with the
    same update (fused as `flux_layout.kohya_lora` fuses them)."""
    return flux_layout.kohya_lora(peft_state, alpha, rank, locate=locate)


def kohya_deltas(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """A Chroma LoRA in that naming → diffusers module → the update ComfyUI's arithmetic gives."""
    return flux_layout.kohya_deltas(tensors, config, module_map(config))


def lycoris_module(module: str) -> str:
    """A module's name in a Chroma LyCORIS file: its diffusers name, which ComfyUI maps through
    `flux_to_diffusers`; refused where that map has no entry (the approximator)."""
    located = locate(module, 1, 1)
    if located is None or located[0].startswith(_APPROXIMATOR):
        raise KitError(
            f"{module} is not a Chroma transformer Linear ComfyUI maps under lycoris_ names "
            "(it maps the blocks, x_embedder, context_embedder and proj_out)"
        )
    return module


def comfy_aliases(config: Mapping[str, Any]) -> dict[str, Any]:
    """What ComfyUI's `flux_to_diffusers` gives a Chroma model: diffusers weight → original key
    or row slice, for every module it maps (the approximator is not among them)."""
    mapped = {k: v for k, v in module_map(config).items() if not k.startswith(_APPROXIMATOR)}
    return adapter_keys.offset_aliases(mapped)
