"""Wan's original weight layout: the names of Wan-AI's own checkpoints, musubi-tuner and ComfyUI.

The kit trains diffusers' `WanTransformer3DModel`, whose modules carry diffusers names
(`blocks.0.attn1.to_q`, `ffn.net.0.proj`, `condition_embedder.time_proj`). The released
checkpoints, ComfyUI's `WanModel` and musubi-tuner's trainer name the same weights after the
original code (`blocks.0.self_attn.q`, `ffn.0`, `time_projection.1`), and a file in one naming
loads nowhere that expects the other. This module renames, tensor for tensor, in that direction:

* `to_original`: a full transformer state dict, keys without any prefix, as the repackaged
  `diffusion_models` files are (ComfyUI and diffusers' `from_single_file` both read that).
* `kohya_lora`: peft LoRA weights as musubi-tuner saves them, `lora_unet_<module with _>` with
  `lora_down.weight`, `lora_up.weight` and `alpha`; with a prefix ending in a dot
  (`diffusion_model.`) the module path keeps its dots instead.
* `lycoris_keys`: peft LoHa / LoKr weights in that same naming with LyCORIS part names.

Two renames are not word for word. The blocks' two layer norms swap numbers: the affine norm in
front of the cross-attention is `norm2` in diffusers but `norm3` in the original (whose `norm2`
is the affine-free one before the feed-forward). And the output head's modulation, a bare
parameter `scale_shift_table` at the top of the diffusers model, is `head.modulation`, while a
block's `scale_shift_table` is that block's `modulation`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kit.errors import KitError
from kit.families import adapter_keys

WAN22 = "https://github.com/Wan-Video/Wan2.2"


def _release(version: str, architecture: str) -> dict[str, str]:
    return {
        "ss_base_model_version": version,
        "modelspec.architecture": architecture,
        "modelspec.implementation": WAN22,
    }


RELEASES = {
    "Wan 2.2 T2V A14B (two experts)": _release("wan_2.2_14b", "wan2.2-t2v-a14b"),
    "Wan 2.2 I2V A14B (two experts)": _release("wan_2.2_14b", "wan2.2-i2v-a14b"),
    "Wan 2.2 TI2V 5B": _release("wan_2.2_5b", "wan2.2-ti2v-5b"),
}
"""The version metadata of each Wan 2.2 variant (Wan 2.1 keeps musubi-tuner's `wan2.1`). The
`ss_base_model_version` values are ai-toolkit's for the same releases (`wan_2.2_14b` for A14B,
T2V and I2V alike, `wan_2.2_5b`); musubi-tuner writes `wan2.1` for every Wan, which tells a LoRA
browser nothing about 2.2."""


def _block_table() -> dict[str, str]:
    """Module paths (or bare parameters) inside one block: diffusers → original."""
    table = {
        "norm1": "norm1",
        "norm2": "norm3",
        "norm3": "norm2",
        "ffn.net.0.proj": "ffn.0",
        "ffn.net.2": "ffn.2",
        "scale_shift_table": "modulation",
        # Image-to-video: the extra key / value projections of the image tokens.
        "attn2.add_k_proj": "cross_attn.k_img",
        "attn2.add_v_proj": "cross_attn.v_img",
        "attn2.norm_added_k": "cross_attn.norm_k_img",
    }
    parts = (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))
    parts += (("norm_q", "norm_q"), ("norm_k", "norm_k"))
    for ours, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn")):
        for part, short in parts:
            table[f"{ours}.{part}"] = f"{theirs}.{short}"
    return table


_BLOCK = _block_table()

# Module paths (or bare parameters) outside the blocks: diffusers → original.
_TOP: dict[str, str] = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    # Image-to-video: the CLIP image tokens' projection (`img_emb.proj` is LayerNorm, Linear,
    # GELU, Linear, LayerNorm), and first-last-frame's learned position table.
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",
    "norm_out": "head.norm",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
}

_BLOCK_PATH = re.compile(r"blocks\.(\d+)\.(.+)")


def _by_prefix(path: str, table: dict[str, str]) -> str | None:
    """`path` with its longest leading module path in `table` renamed; None when none is."""
    for ours in sorted(table, key=len, reverse=True):
        if path == ours or path.startswith(ours + "."):
            return table[ours] + path[len(ours) :]
    return None


def original_name(name: str) -> str:
    """The original name of a diffusers module, parameter or state-dict key of the Wan
    transformer (`blocks.3.attn2.to_out.0.weight` → `blocks.3.cross_attn.o.weight`).

    Raises KitError for a name the original layout has no place for (VACE blocks, fused
    `to_qkv` projections, or a model that is not Wan's).
    """
    block = _BLOCK_PATH.fullmatch(name)
    if block:
        rest = _by_prefix(block.group(2), _BLOCK)
        renamed = None if rest is None else f"blocks.{block.group(1)}.{rest}"
    else:
        renamed = _by_prefix(name, _TOP)
    if renamed is None:
        raise KitError(
            f"'{name}': no weight of that name in Wan's original layout (the file would not "
            "load in ComfyUI or musubi-tuner); only WanTransformer3DModel's own weights can be "
            "written there"
        )
    return renamed


def _weight_owners(config: dict[str, Any]) -> list[str]:
    """The model's weight-bearing names: each module that holds a `weight` or `bias` itself,
    and the full name of each other parameter (the `scale_shift_table`s, `pos_embed`)."""
    from diffusers import WanTransformer3DModel

    # On the meta device: the names for a 14B config cost nothing to list.
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(dict(config))
    names: list[str] = []
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if param_name in ("weight", "bias"):
                if module_name not in names:
                    names.append(module_name)
            else:
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def module_map(config: dict[str, Any]) -> dict[str, str]:
    """Diffusers name → original name for every weight-bearing module of the transformer that
    `config` (its `config.json`) describes, and for each bare parameter by its full name
    (`scale_shift_table` → `head.modulation`, `blocks.0.scale_shift_table` →
    `blocks.0.modulation`)."""
    return {name: original_name(name) for name in _weight_owners(config)}


def to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A diffusers `WanTransformer3DModel` state dict → the same tensors under the original
    keys, with no prefix (what ComfyUI's diffusion-model loader and diffusers' `from_single_file`
    read). Every key must be a weight of the model `config` describes."""
    names = module_map(config)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if key in names:
            new = names[key]
        elif owner in names and leaf in ("weight", "bias"):
            new = f"{names[owner]}.{leaf}"
        else:
            raise KitError(
                f"'{key}': not a weight of the Wan transformer this config describes "
                f"({config.get('num_layers')} blocks); the original layout cannot hold it"
            )
        if new in out:
            raise KitError(f"'{key}': a second weight for the original '{new}'")
        out[new] = value.contiguous()
    return out


def kohya_lora(
    peft_state: dict[str, torch.Tensor], alpha: float, rank: int, prefix: str = "lora_unet"
) -> dict[str, torch.Tensor]:
    """peft LoRA weights of the Wan transformer (`blocks.0.attn1.to_q.lora_A.weight`, ...) →
    musubi-tuner's keys: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.lora_up.weight`
    and `.alpha`, plus `.dora_scale` for DoRA.

    `prefix="diffusion_model."` writes `diffusion_model.blocks.0.self_attn.q.lora_down.weight`
    instead; ComfyUI reads both. diffusers reads the dotted one whichever block projections are
    adapted, but its `lora_unet_` reader demands all of them (q, k, v, o of both attentions and
    both feed-forward layers, plus `k_img` / `v_img` for image-to-video) in every block, as
    musubi-tuner always trains them.
    """
    del rank  # the readers take each module's rank from its tensors
    return adapter_keys.lora_keys(peft_state, prefix, alpha, original_name)


def lycoris_keys(
    peft_state: dict[str, torch.Tensor], alpha: float, rank: int, prefix: str = "lora_unet"
) -> dict[str, torch.Tensor]:
    """peft LoHa / LoKr weights of the Wan transformer → LyCORIS keys in musubi-tuner's naming
    (`lora_unet_blocks_0_self_attn_q.hada_w1_a`, ..., `.alpha`), the update unchanged."""
    return adapter_keys.lycoris_keys(peft_state, alpha, rank, prefix, original_name)
