"""Z-Image's original weight layout: the names of Tongyi-MAI's own checkpoint files and ComfyUI.

The kit trains diffusers' `ZImageTransformer2DModel`. ComfyUI holds the same network as its
Lumina2 / NextDiT model (`comfy/ldm/lumina/model.py`), whose names follow the original code: one
fused `attention.qkv` per block instead of `to_q` / `to_k` / `to_v`, `attention.out` for
`attention.to_out.0`, `q_norm` / `k_norm` for `norm_q` / `norm_k`, and `x_embedder` /
`final_layer` for the patch-size-keyed `all_x_embedder.2-1` / `all_final_layer.2-1`.

The rename is written down once, as data (`BLOCK`, `TOP`), in the direction ComfyUI's
`comfy/utils.py: z_image_to_diffusers` states it (diffusers name → original name, with q, k and
v as row slices of `qkv`) and diffusers' `single_file_utils.py:
convert_z_image_transformer_checkpoint_to_diffusers` inverts it. From it:

* `module_map`: every diffusers module of a transformer → (original module, row offset, rows),
  what ComfyUI aliases each diffusers LoRA name to;
* `to_original`: a full state dict → the original keys with q, k, v fused (the single file
  ComfyUI's `diffusion_models` folder holds and `from_single_file` reads back).

ComfyUI spells each diffusers LoRA name `diffusion_model.<path>`, `transformer.<path>`,
`lycoris_<path with _>` or the bare `<path>` (the Lumina2 branch of `model_lora_keys_unet`; the
kit's reader, `kit.export.clients.comfyui`, holds those spellings). The LoRA file itself keeps
diffusers' module names under `diffusion_model.` (see `LORA_PREFIX`), the one spelling that both
readers take in full.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kit.errors import KitError

COMFYUI_SINCE = "0.8"
"""The first ComfyUI release that loads Z-Image and its LoRA files: v0.3.64 has no Z-Image;
v0.8.0 and v0.12.1 load every file the kit writes (measured)."""

LORA_PREFIX = "diffusion_model."
"""Key prefix of the kit's Z-Image LoRA / LyCORIS files, followed by the diffusers module path.

ComfyUI maps `diffusion_model.<diffusers path>` onto its weights, q / k / v as row slices of the
fused `qkv` (the Lumina2 branch of `model_lora_keys_unet`), and diffusers'
`_convert_non_diffusers_z_image_lora_to_diffusers` (LoRA) and
`_convert_non_diffusers_lokr_to_diffusers` (LoKr) strip the prefix and read the rest as its own
names: one module per trained module, for every adapter kind. `lora_unet_<diffusers path>`
(`..._attention_to_q`) has no ComfyUI name (its `lora_unet_` names are the original paths only);
`lora_unet_<original path>` loads in both, but must fuse q, k and v into one `qkv` adapter of
three times the rank, which a Kronecker (LoKr) or Hadamard (LoHa) product cannot hold."""

# Inside each block (`layers.N`, `noise_refiner.N`, `context_refiner.N`): diffusers module →
# (original module, index of the part among the fused parts). From ComfyUI's
# `z_image_to_diffusers` (`add_block_keys`); q, k, v are the three equal row blocks of `qkv`,
# as diffusers' `convert_z_image_fused_attention` chunks it.
BLOCK: dict[str, tuple[str, int]] = {
    "attention.to_q": ("attention.qkv", 0),
    "attention.to_k": ("attention.qkv", 1),
    "attention.to_v": ("attention.qkv", 2),
    "attention.to_out.0": ("attention.out", 0),
    "attention.norm_q": ("attention.q_norm", 0),
    "attention.norm_k": ("attention.k_norm", 0),
    "attention_norm1": ("attention_norm1", 0),
    "attention_norm2": ("attention_norm2", 0),
    "ffn_norm1": ("ffn_norm1", 0),
    "ffn_norm2": ("ffn_norm2", 0),
    "feed_forward.w1": ("feed_forward.w1", 0),
    "feed_forward.w2": ("feed_forward.w2", 0),
    "feed_forward.w3": ("feed_forward.w3", 0),
    "adaLN_modulation.0": ("adaLN_modulation.0", 0),
}
FUSED_PARTS = {"attention.qkv": 3}
"""Original modules that hold several diffusers modules, and how many (equal row blocks)."""

# Outside the blocks: diffusers module or bare parameter → original (ComfyUI's `MAP_BASIC`).
TOP: dict[str, str] = {
    "all_final_layer.2-1.linear": "final_layer.linear",
    "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
    "all_x_embedder.2-1": "x_embedder",
    "cap_embedder.0": "cap_embedder.0",
    "cap_embedder.1": "cap_embedder.1",
    "t_embedder.mlp.0": "t_embedder.mlp.0",
    "t_embedder.mlp.2": "t_embedder.mlp.2",
    "x_pad_token": "x_pad_token",
    "cap_pad_token": "cap_pad_token",
}
BARE = ("x_pad_token", "cap_pad_token")
"""The parameters `TOP` names that belong to no module."""

_BLOCK_PATH = re.compile(r"(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)")


def _original(module: str) -> tuple[str, int]:
    """A diffusers module path (or bare parameter) → (original path, part index)."""
    block = _BLOCK_PATH.fullmatch(module)
    if block and block.group(3) in BLOCK:
        original, part = BLOCK[block.group(3)]
        return f"{block.group(1)}.{block.group(2)}.{original}", part
    if module in TOP:
        return TOP[module], 0
    raise KitError(
        f"'{module}': no weight of that name in Z-Image's original layout (ComfyUI's model would "
        "not load it); only ZImageTransformer2DModel's own text-to-image weights (patch size 2, "
        "no SigLIP / Omni parts) can be written there"
    )


def _owners(config: dict[str, Any]) -> dict[str, int]:
    """Each weight-bearing module (or bare parameter) of the transformer `config` describes → its
    output rows, built on the meta device (free for the 6B config)."""
    from diffusers import ZImageTransformer2DModel

    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(dict(config))
    owners: dict[str, int] = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight", "bias"):
            owners.setdefault(module, param.shape[0])
        else:
            owners[name] = param.shape[0]
    return owners


def module_map(config: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """Diffusers module → (original module, row offset, rows) for every weight-bearing module of
    the transformer: q, k and v are row slices of their block's `attention.qkv`."""
    out = {}
    for module, rows in _owners(config).items():
        original, part = _original(module)
        out[module] = (original, part * rows, rows)
    return out


def weight_modules(config: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """`module_map` without the bare parameters (the pad tokens): the modules a LoRA can adapt,
    each aliased by ComfyUI through its `.weight`."""
    return {m: v for m, v in module_map(config).items() if m not in BARE}


def original_name(module: str) -> str:
    """The original module a diffusers module's weights live in (q, k, v → their `qkv`)."""
    return _original(module)[0]


def to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A `ZImageTransformer2DModel` state dict → the original keys, q, k and v fused row-wise
    into `attention.qkv` (what ComfyUI's diffusion-model loader and diffusers'
    `from_single_file` read). Every key must be a weight of the model `config` describes."""
    names = module_map(config)
    fused: dict[str, list[torch.Tensor | None]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if key in names:
            target, leaf = names[key][0], ""
            owner = key
        elif owner in names and leaf in ("weight", "bias"):
            target = names[owner][0]
        else:
            raise KitError(
                f"'{key}': not a weight of the Z-Image transformer this config describes "
                f"({config.get('n_layers')} layers); the original layout cannot hold it"
            )
        new = f"{target}.{leaf}" if leaf else target
        parts = FUSED_PARTS.get(target.split(".", 2)[-1], 1)
        if parts > 1:
            slot = fused.setdefault(new, [None] * parts)
            slot[names[owner][1] // names[owner][2]] = value
            continue
        if new in out:
            raise KitError(f"'{key}': a second weight for the original '{new}'")
        out[new] = value.contiguous()
    for new, slot in fused.items():
        if any(t is None for t in slot):
            raise KitError(f"'{new}': q, k and v must all be given to write the fused weight")
        out[new] = torch.cat(slot, dim=0).contiguous()  # type: ignore[arg-type]
    return out
