"""Qwen-Image's weight names in ComfyUI, and the LoRA key layout ComfyUI and diffusers both read.

ComfyUI's own Qwen-Image model (`comfy/ldm/qwen_image/model.py`, class
`QwenImageTransformer2DModel`) was written after diffusers' and keeps its module names: the
repackaged `diffusion_models/qwen_image_*.safetensors` files hold the diffusers keys verbatim,
and diffusers' `from_single_file` reads them with an identity mapping. So no weight is renamed;
what this module does is *check* that every name the kit writes is a weight ComfyUI's model has,
because a LoRA key ComfyUI cannot place is only logged ("lora key not loaded") and skipped: the
LoRA then silently does less, or nothing.

`COMFY_TOP` and `COMFY_BLOCK` are ComfyUI's weight-bearing modules, read off its model
definition (top level; one `transformer_blocks.N`), with the parameters each holds. The LoRA
names ComfyUI accepts for this model (`comfy/lora.py`, `model_lora_keys_unet`) are, for a weight
`diffusion_model.<path>.weight`: `lora_unet_<path with _>` and `diffusion_model.<path>` (the
generic rules for every model), and for Qwen-Image also the bare `<path>`, `transformer.<path>`
and `lycoris_<path with _>`. diffusers' reader (`_convert_non_diffusers_qwen_lora_to_diffusers`)
takes `diffusion_model.<path>` verbatim and rebuilds the dots of `lora_unet_<path with _>` by
its own rules (a list of module names whose underscores it keeps, such as `to_q`, `img_mlp`,
`to_add_out`), which `lora_unet_module` replays to refuse a name it would rebuild wrongly.
"""

from __future__ import annotations

from typing import Any

import torch

from kit.errors import KitError

COMFY_TOP: dict[str, tuple[str, ...]] = {
    "time_text_embed.timestep_embedder.linear_1": ("weight", "bias"),
    "time_text_embed.timestep_embedder.linear_2": ("weight", "bias"),
    "txt_norm": ("weight",),  # RMSNorm over the text encoder's width
    "img_in": ("weight", "bias"),
    "txt_in": ("weight", "bias"),
    "norm_out.linear": ("weight", "bias"),  # LastLayer: SiLU, Linear, affine-free LayerNorm
    "proj_out": ("weight", "bias"),
}
"""ComfyUI's modules outside the blocks → their parameters."""

COMFY_BLOCK: dict[str, tuple[str, ...]] = {
    "img_mod.1": ("weight", "bias"),  # Sequential(SiLU, Linear)
    "txt_mod.1": ("weight", "bias"),
    "img_mlp.net.0.proj": ("weight", "bias"),  # FeedForward: GELU(proj), Dropout, Linear
    "img_mlp.net.2": ("weight", "bias"),
    "txt_mlp.net.0.proj": ("weight", "bias"),
    "txt_mlp.net.2": ("weight", "bias"),
    "attn.to_q": ("weight", "bias"),
    "attn.to_k": ("weight", "bias"),
    "attn.to_v": ("weight", "bias"),
    "attn.add_q_proj": ("weight", "bias"),
    "attn.add_k_proj": ("weight", "bias"),
    "attn.add_v_proj": ("weight", "bias"),
    "attn.to_out.0": ("weight", "bias"),
    "attn.to_add_out": ("weight", "bias"),
    "attn.norm_q": ("weight",),  # RMSNorms over one head
    "attn.norm_k": ("weight",),
    "attn.norm_added_q": ("weight",),
    "attn.norm_added_k": ("weight",),
}
"""ComfyUI's modules inside `transformer_blocks.N` → their parameters (the norms `img_norm1`,
`img_norm2`, `txt_norm1`, `txt_norm2` are affine-free and hold none)."""

# diffusers' reader keeps the underscores of these runs of words in a `lora_unet_` name.
_DIFFUSERS_KEPT = {
    ("to", "q"),
    ("to", "k"),
    ("to", "v"),
    ("to", "out"),
    ("add", "q"),
    ("add", "k"),
    ("add", "v"),
    ("txt", "mlp"),
    ("img", "mlp"),
    ("txt", "mod"),
    ("img", "mod"),
    ("add", "q", "proj"),
    ("add", "k", "proj"),
    ("add", "v", "proj"),
    ("to", "add", "out"),
}
# ... and maps these top-level names explicitly.
_DIFFUSERS_TOP = {
    "img_in": "img_in",
    "txt_in": "txt_in",
    "proj_out": "proj_out",
    "norm_out_linear": "norm_out.linear",
    "time_text_embed_timestep_embedder_linear_1": "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed_timestep_embedder_linear_2": "time_text_embed.timestep_embedder.linear_2",
}


def comfy_weights(num_layers: int) -> list[str]:
    """Every parameter key of ComfyUI's Qwen-Image model with `num_layers` blocks (no prefix)."""
    keys = [f"{m}.{p}" for m, ps in COMFY_TOP.items() for p in ps]
    for i in range(num_layers):
        keys += [f"transformer_blocks.{i}.{m}.{p}" for m, ps in COMFY_BLOCK.items() for p in ps]
    return keys


def to_comfy(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A diffusers `QwenImageTransformer2DModel` state dict as ComfyUI's model names it (the
    same keys), refusing any key ComfyUI's model has no weight for."""
    known = set(comfy_weights(int(config["num_layers"])))
    unknown = sorted(set(state) - known)
    if unknown:
        raise KitError(
            f"'{unknown[0]}' (and {len(unknown) - 1} more): no weight of that name in ComfyUI's "
            "Qwen-Image model, so a client would not load it; only QwenImageTransformer2DModel's "
            "own weights (without the Qwen-Image-Layered / 2.1 extras) can be written"
        )
    return {k: v.contiguous() for k, v in state.items()}


def lora_unet_module(flat: str) -> str:
    """The module diffusers' Qwen LoRA reader makes of `lora_unet_<flat>` (its rules replayed:
    explicit top-level names, else `transformer_blocks.` + words joined by dots except the
    kept runs)."""
    if flat in _DIFFUSERS_TOP:
        return _DIFFUSERS_TOP[flat]
    parts = flat.removeprefix("transformer_blocks_").split("_")
    merged, i = [], 0
    while i < len(parts):
        for n in (3, 2):
            if tuple(parts[i : i + n]) in _DIFFUSERS_KEPT:
                merged.append("_".join(parts[i : i + n]))
                i += n
                break
        else:
            merged.append(parts[i])
            i += 1
    return "transformer_blocks." + ".".join(merged)


def kohya_module(module: str) -> str:
    """A denoiser module's name in the ComfyUI-layout file (the same path), refused unless it is
    a weight-bearing module of ComfyUI's model that diffusers' reader also names back right."""
    top = module in COMFY_TOP
    parts = module.split(".", 2)
    block = (
        len(parts) == 3
        and parts[0] == "transformer_blocks"
        and parts[1].isdigit()
        and parts[2] in COMFY_BLOCK
    )
    if not (top or block):
        raise KitError(
            f"'{module}': no module of that name in ComfyUI's Qwen-Image model (the LoRA key "
            "would be skipped there); adapt only QwenImageTransformer2DModel's own layers"
        )
    if lora_unet_module(module.replace(".", "_")) != module:
        raise KitError(
            f"'{module}': diffusers' Qwen LoRA reader would name `lora_unet_"
            f"{module.replace('.', '_')}` back as a different module; leave it out of "
            "lora_target_modules"
        )
    return module
