"""kohya-ss sd-scripts' own LoRA network (`networks/lora.py`), as a checker.

`model` holds sd-scripts' model classes under `unet.` and `text_encoder.` (SD1: one encoder,
prefix `lora_te_`) or `text_encoder1.` / `text_encoder2.` (SDXL: prefixes `lora_te1_` /
`lora_te2_`), each in that class's own module names: SD1's UNet (`library/original_unet.py`)
in diffusers names, SDXL's (`library/sdxl_original_unet.py`) in the LDM names
(`input_blocks.4.1.transformer_blocks.0.attn1.to_q`), the text encoders in HF-transformers names.
A model with `unet.input_blocks.` is taken as SDXL. `aliases` is not used.

The rules, as `create_network_from_weights` + `LoRANetwork` + `LoRAInfModule.merge_to` apply
them (and `load_state_dict(strict=False)` on the hooked network, which agrees):

* Keys. SDXL only: when any key holds `down_blocks` / `up_blocks`, every `lora_unet_` module
  name is rewritten to the LDM name by the first diffusers prefix of
  `sdxl_model_util.make_unet_conversion_map` it contains (`sai_name`). Modules exist only for
  Linear and Conv2d layers inside the target classes: Transformer2DModel, ResnetBlock2D,
  Downsample2D, Upsample2D in the UNet (so not conv_in, conv_out, time or label embeddings),
  CLIPAttention and CLIPMLP in the encoders; and only where the file has a `lora_down`.
* Parts. Only `lora_down.weight`, `lora_up.weight` and `alpha` are read. `dora_scale`,
  `lora_mid`, LoHa / LoKr / `diff` parts, and keys for layers outside the targets are silently
  ignored: a DoRA file loads as its plain LoRA, a LyCORIS-only file as nothing.
* Arithmetic. W += s·(alpha/rank)·(up·down) (3×3 convs through the conv composition, the same
  ΔW), rank = lora_down rows. A missing alpha, or alpha 0, means alpha = rank (scale 1). Shapes
  must be the layer's own (down (r, in[, kh, kw]), up (out, r[, 1, 1])): anything else is a
  size-mismatch error that stops the load.
"""

from __future__ import annotations

import re

import torch

from kit.export.clients import Applied, Fatal, f32, failed, scalar, shape

CLIENT = "sd-scripts"

_ROOTS_SD1 = (("unet.", "lora_unet"), ("text_encoder.", "lora_te"))
_ROOTS_SDXL = (
    ("unet.", "lora_unet"),
    ("text_encoder1.", "lora_te1"),
    ("text_encoder2.", "lora_te2"),
)
# Modules inside the target classes, by name: SD1's diffusers-named UNet, SDXL's LDM-named
# one (every input block but the first conv, the middle and the output blocks), CLIP.
_UNET_SD1 = re.compile(r"(^|\.)(attentions|resnets|downsamplers|upsamplers)\.\d+\.")
_UNET_SDXL = re.compile(r"^(input_blocks\.([1-9]|\d\d+)|middle_block|output_blocks\.\d+)\.\d+\.")
_TEXT = re.compile(r"(^|\.)(self_attn|mlp)\.")
_READ = ("lora_down.weight", "lora_up.weight", "alpha")


def _conversion() -> list[tuple[str, str]]:
    """`make_unet_conversion_map` as (diffusers, LDM) module prefixes, underscored, in order."""
    pairs: list[tuple[str, str]] = []
    resnet = [
        ("in_layers.0.", "norm1."),
        ("in_layers.2.", "conv1."),
        ("out_layers.0.", "norm2."),
        ("out_layers.3.", "conv2."),
        ("emb_layers.1.", "time_emb_proj."),
        ("skip_connection.", "conv_shortcut."),
    ]
    layer: list[tuple[str, str]] = []
    for i in range(3):
        for j in range(2):
            layer.append((f"input_blocks.{3 * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            layer.append((f"input_blocks.{3 * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        for j in range(3):
            layer.append((f"output_blocks.{3 * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            layer.append((f"output_blocks.{3 * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        layer.append((f"input_blocks.{3 * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
        layer.append((f"output_blocks.{3 * i + 2}.2.", f"up_blocks.{i}.upsamplers.0."))
    layer.append(("middle_block.1.", "mid_block.attentions.0."))
    for j in range(2):
        layer.append((f"middle_block.{2 * j}.", f"mid_block.resnets.{j}."))
    for ldm, hf in layer:
        if "resnets" in hf:
            pairs += [(hf + h, ldm + s) for s, h in resnet]
        else:
            pairs.append((hf, ldm))
    pairs += [(f"time_embedding.linear_{j + 1}.", f"time_embed.{j * 2}.") for j in range(2)]
    pairs += [(f"add_embedding.linear_{j + 1}.", f"label_emb.0.{j * 2}.") for j in range(2)]
    pairs += [
        ("conv_in.", "input_blocks.0.0."),
        ("conv_norm_out.", "out.0."),
        ("conv_out.", "out.2."),
    ]
    seen: dict[str, str] = {}
    for hf, ldm in pairs:  # built as sd-scripts builds its dict: first position, last value
        seen[hf.replace(".", "_")[:-1]] = ldm.replace(".", "_")[:-1]
    return list(seen.items())


_CONVERSION = _conversion()


def sai_name(module: str) -> str | None:
    """A diffusers-named SDXL module (no prefix, underscored) in sd-scripts' LDM naming."""
    for hf, ldm in _CONVERSION:
        if hf in module:
            return module.replace(hf, ldm)
    return None


def _to_sai(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`convert_diffusers_to_sai_if_needed`, and new key -> file key."""
    origin = {k: k for k in tensors}
    if not any("down_blocks" in k or "up_blocks" in k for k in tensors):
        return dict(tensors), origin
    out = dict(tensors)
    found: bool | None = None  # sd-scripts never initialises its flag: see below
    for key in list(tensors):
        if not key.startswith("lora_unet_"):
            continue
        module = key[len("lora_unet_") :].split(".")[0]
        new = sai_name(module)
        if new is None:
            if found is None:
                raise Fatal(
                    f"{CLIENT}: UnboundLocalError converting {key}: no SDXL conversion for it"
                )
            continue  # and no warning either: the stale flag from an earlier key hides it
        found = True
        renamed = "lora_unet_" + new + key[len("lora_unet_") + len(module) :]
        out[renamed] = out.pop(key)
        origin[renamed] = origin.pop(key)
    return out, origin


def _targets(model: dict[str, torch.Tensor], sdxl: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """kohya module name -> (model key, weight) for every layer sd-scripts can put a LoRA on."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for root, prefix in _ROOTS_SDXL if sdxl else _ROOTS_SD1:
        for key, value in model.items():
            if not key.startswith(root) or not key.endswith(".weight") or value.dim() not in (2, 4):
                continue
            path = key[len(root) : -len(".weight")]
            if root == "unet.":
                rule = _UNET_SDXL if sdxl else _UNET_SD1
            else:
                rule = _TEXT
            if rule.search(path):
                out[f"{prefix}_{path.replace('.', '_')}"] = (key, value)
    return out


def apply(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    model: dict[str, torch.Tensor],
    *,
    strength: float = 1.0,
    aliases: dict[str, str] | None = None,
) -> Applied:
    """Load `tensors` into `model` as sd-scripts' `networks.lora` does, at multiplier `strength`."""
    del metadata, aliases  # the network module is chosen by the user, not by the metadata
    sdxl = any(k.startswith("unet.input_blocks.") for k in model)
    try:
        weights, origin = _to_sai(tensors) if sdxl else (dict(tensors), {k: k for k in tensors})
        return _merge(weights, origin, _targets(model, sdxl), strength)
    except Fatal as err:
        return failed(CLIENT, tensors, str(err))


def _merge(
    weights: dict[str, torch.Tensor],
    origin: dict[str, str],
    targets: dict[str, tuple[str, torch.Tensor]],
    strength: float,
) -> Applied:
    dims = {
        k.split(".")[0]: v.shape[0] for k, v in weights.items() if "lora_down" in k and "." in k
    }
    alphas = {k.split(".")[0]: v for k, v in weights.items() if "alpha" in k and "." in k}
    merged: dict[str, torch.Tensor] = {}
    read: set[str] = set()
    for name, (key, weight) in targets.items():
        if name not in dims:
            continue
        down_key, up_key = f"{name}.lora_down.weight", f"{name}.lora_up.weight"
        if up_key not in weights:
            read.add(down_key)
            continue  # the network keeps its zero-initialised lora_up: no change
        down, up = f32(weights[down_key]), f32(weights[up_key])
        rank = dims[name]
        want_down = (rank, weight.shape[1], *weight.shape[2:])
        want_up = (weight.shape[0], rank, *([1, 1] if weight.dim() == 4 else []))
        if tuple(down.shape) != want_down or tuple(up.shape) != want_up:
            raise Fatal(
                f"{CLIENT}: size mismatch for {name}: lora_down {shape(down)} / lora_up "
                f"{shape(up)}, the layer wants {shape(want_down)} / {shape(want_up)}"
            )
        alpha = scalar(alphas[name]) if name in alphas else float(rank)
        scale = (alpha if alpha != 0 else float(rank)) / rank
        delta = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        merged[key] = f32(weight) + strength * scale * delta
        read.update(k for k in (down_key, up_key, f"{name}.alpha") if k in weights)
    unread = sorted(origin[k] for k in weights if k not in read)
    warnings = [
        f"{CLIENT}: {origin[k]}: DoRA magnitude ignored, the layer gets the plain LoRA"
        for k in weights
        if k.endswith(".dora_scale") and f"{k.split('.')[0]}.lora_down.weight" in read
    ]
    return Applied(CLIENT, merged, unread, warnings)
