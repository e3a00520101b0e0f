"""Krea 2's original weight layout: the names of Krea's own checkpoint files and ComfyUI's.

The kit trains diffusers' `Krea2Transformer2DModel`. Krea's reference code and ComfyUI
(`comfy/ldm/krea2/model.py`, `SingleStreamDiT`) name the same network differently: `blocks.N`
for `transformer_blocks.N`, `txtfusion` for `text_fusion`, `attn.wq / wk / wv / wo / gate` for
`attn.to_q / to_k / to_v / to_out.0 / to_gate`, `mlp` for `ff`, `prenorm / postnorm` for
`norm1 / norm2`, RMSNorm weights as `.scale`, each block's six modulation vectors flattened into
`mod.lin`, and `first`, `tmlp`, `tproj`, `txtmlp`, `last` for the embedders and the final layer.
No weight is fused or split: every diffusers module is one original module.

The rename is written once, as data (`TOP`, `INNER`), in the direction diffusers'
`single_file_utils.convert_krea2_transformer_checkpoint_to_diffusers` inverts and ComfyUI's
`comfy/utils.py: krea2_to_diffusers` states (diffusers name → original name).

The LoRA file the kit writes for ComfyUI (its "kohya" export) holds `diffusion_model.<original
path>.lora_A.weight / .lora_B.weight` with the scale folded into `lora_B` and no alpha: the
layout of Krea's reference trainer. Checked against ComfyUI's own code (Comfy-Org/ComfyUI at
commit 17358c8f, a 0.38-series snapshot; `comfy/ldm/krea2/model.py` as of comfyanonymous/ComfyUI
08381b1a): `model_lora_keys_unet` accepts `diffusion_model.<model key>` for every weight of any
model, and its Krea2 branch adds the diffusers names (`diffusion_model.`, `transformer.`,
`lycoris_` or bare) through `krea2_to_diffusers`; the file uses the first, generic form, which
the kit's ComfyUI reader models as it is. diffusers' `_convert_non_diffusers_krea2_lora_to_diffusers`
strips the prefix, renames the modules and reads only `lora_A / lora_B` weights (an `alpha` key
would make it refuse the file). LoHa / LoKr files take the same module names with LyCORIS'
parts, which ComfyUI reads the same way (diffusers reads no LyCORIS file).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

from kit.errors import KitError
from kit.families.adapter_keys import MAGNITUDE, magnitude_shape

LORA_PREFIX = "diffusion_model."
"""Key prefix of the kit's Krea 2 LoRA / LyCORIS files, followed by the original module path."""

# Outside the blocks: diffusers module (or bare parameter) → original.
TOP: dict[str, str] = {
    "img_in": "first",
    "time_embed.linear_1": "tmlp.0",
    "time_embed.linear_2": "tmlp.2",
    "time_mod_proj": "tproj.1",
    "txt_in.norm": "txtmlp.0",
    "txt_in.linear_1": "txtmlp.1",
    "txt_in.linear_2": "txtmlp.3",
    "text_fusion.projector": "txtfusion.projector",
    "final_layer.linear": "last.linear",
    "final_layer.norm": "last.norm",
    "final_layer.scale_shift_table": "last.modulation.lin",
}
# The stacks of blocks: diffusers prefix → original prefix.
STACKS: dict[str, str] = {
    "transformer_blocks": "blocks",
    "text_fusion.layerwise_blocks": "txtfusion.layerwise_blocks",
    "text_fusion.refiner_blocks": "txtfusion.refiner_blocks",
}
# Inside a transformer or text-fusion block: diffusers module → original module.
INNER: dict[str, str] = {
    "attn.to_q": "attn.wq",
    "attn.to_k": "attn.wk",
    "attn.to_v": "attn.wv",
    "attn.to_out.0": "attn.wo",
    "attn.to_gate": "attn.gate",
    "attn.norm_q": "attn.qknorm.qnorm",
    "attn.norm_k": "attn.qknorm.knorm",
    "ff.gate": "mlp.gate",
    "ff.up": "mlp.up",
    "ff.down": "mlp.down",
    "norm1": "prenorm",
    "norm2": "postnorm",
    "scale_shift_table": "mod.lin",
}
_NORMS = ("norm", "norm1", "norm2", "norm_q", "norm_k")
"""Krea2RMSNorm modules: their `weight` is the original's `scale`."""
_BLOCK = re.compile(
    r"(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)"
    r"\.(\d+)\.(.+)"
)


def original_module(module: str) -> str:
    """A diffusers module path (or a bare parameter such as a `scale_shift_table`) → the
    original one; a path the original layout lacks is refused."""
    block = _BLOCK.fullmatch(module)
    if block and block.group(3) in INNER:
        return f"{STACKS[block.group(1)]}.{block.group(2)}.{INNER[block.group(3)]}"
    if module in TOP:
        return TOP[module]
    raise KitError(
        f"'{module}': no module of that name in Krea 2's original layout (ComfyUI's model would "
        "not load it); only Krea2Transformer2DModel's own weights can be written there"
    )


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `Krea2Transformer2DModel` state dict → the original keys (ComfyUI's diffusion-model
    file, which diffusers' `from_single_file` reads back)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if leaf == "scale_shift_table":
            new = original_module(key)
            if new.endswith("mod.lin"):  # a block's (6, dim) table is one flat vector there
                value = value.reshape(-1)
        else:
            new = f"{original_module(owner)}.{leaf}"
            if leaf == "weight" and owner.rsplit(".", 1)[-1] in _NORMS:
                new = f"{original_module(owner)}.scale"
        out[new] = value.contiguous()
    return out


def lora_file(state: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA / DoRA weights of the transformer → `diffusion_model.<original>.lora_A/B`, the
    scale alpha / rank folded into `lora_B` (no alpha key: diffusers' converter refuses one,
    and ComfyUI then scales by 1); DoRA's magnitude as `dora_scale` (out, 1)."""
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state.items():
        module, _, part = key.partition(".lora_")
        modules[module]["lora_" + part] = value
    out: dict[str, torch.Tensor] = {}
    for module, parts in modules.items():
        unknown = set(parts) - {"lora_A.weight", "lora_B.weight", MAGNITUDE}
        if unknown or "lora_A.weight" not in parts:
            raise KitError(f"'{module}': {sorted(parts)} is not a LoRA this layout can hold")
        stem = LORA_PREFIX + original_module(module)
        down = parts["lora_A.weight"]
        out[f"{stem}.lora_A.weight"] = down.contiguous()
        up = parts["lora_B.weight"] * (alpha / down.shape[0])
        out[f"{stem}.lora_B.weight"] = up.contiguous()
        if MAGNITUDE in parts:
            out[f"{stem}.dora_scale"] = magnitude_shape(parts[MAGNITUDE], down).contiguous()
    return out
