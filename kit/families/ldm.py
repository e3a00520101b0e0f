"""The original single-file layout of SD 1.x, SD 2.x and SDXL checkpoints (the "LDM" layout).

A1111, Forge and ComfyUI load one `.safetensors` file whose keys follow the module tree of the
original Stability code, not the diffusers one. diffusers converts that layout into its own;
this module goes the other way, from the structure of the diffusers configs (block types,
`layers_per_block`, which blocks attend), so it holds for any size of these architectures.

The UNet numbering of the original code, which everything here follows:

- `input_blocks` is one flat list: `0` is the input convolution; then, for each level, one
  entry per residual layer (`.0` the resnet, `.1` its transformer when the level attends)
  and, on every level but the last, one entry for the downsampler (`.0.op`).
- `middle_block` is `0` resnet, `1` transformer, `2` resnet.
- `output_blocks` is one flat list, deepest level first, `layers + 1` entries per level
  (`.0` the resnet, `.1` the transformer); the last entry of every level but the final one
  ends with the upsampler, `.1.conv` without attention, `.2.conv` with it.

Inside a resnet the original names its layers by position in small `Sequential`s
(`in_layers.0` the first norm, `in_layers.2` the first conv, `emb_layers.1` the time
projection, `out_layers.0` / `out_layers.3` the second norm and conv, `skip_connection` the
shortcut); a transformer's inner names are the same in both layouts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kit.errors import KitError

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."

LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    # Each layout's text encoders, in the family's order: (kind, key prefix).
    "sd1": (("clip", "cond_stage_model.transformer."),),
    "sd2": (("open_clip", "cond_stage_model.model."),),
    "sdxl": (
        ("clip", "conditioner.embedders.0.transformer."),
        ("open_clip", "conditioner.embedders.1.model."),
    ),
}
"""The structural layouts a family can ask for, each with where its text encoders live."""

_DOWN_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
_UP_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
_MID_TYPES = ("UNetMidBlock2DCrossAttn",)

_RESNET_LEAVES = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
"""A diffusers resnet's layers → their place in the original resnet's `Sequential`s."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A value of a diffusers config, which may be a dict or a `FrozenDict` with attributes."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _per_level(value: Any, levels: int) -> list[int]:
    """`layers_per_block` as one count per level (diffusers allows an int or a list)."""
    if isinstance(value, int):
        return [value] * levels
    counts = [int(v) for v in value]
    if len(counts) != levels:
        raise KitError(f"unet config: layers_per_block {list(value)} does not give {levels} levels")
    return counts


def _checked(kinds: Any, allowed: tuple[str, ...], key: str) -> list[str]:
    kinds = list(kinds)
    for kind in kinds:
        if kind not in allowed:
            raise KitError(
                f"unet config: {key} '{kind}' has no place in the original single-file layout "
                f"(it knows {', '.join(allowed)})"
            )
    return kinds


def unet_blocks(unet_config: Any) -> dict[str, str]:
    """diffusers UNet module prefixes → their original names: every block, embedding and
    convolution outside the resnets' and transformers' own layers."""
    out = {
        "conv_in": "input_blocks.0.0",
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
    }
    # SDXL's size / pooled-text embedding, and the class embeddings of other variants, sit in
    # the original's `label_emb`: a Sequential of (Linear, SiLU, Linear), or one Embedding.
    if _get(unet_config, "addition_embed_type") == "text_time":
        out["add_embedding.linear_1"] = "label_emb.0.0"
        out["add_embedding.linear_2"] = "label_emb.0.2"
    if _get(unet_config, "class_embed_type") in ("timestep", "projection"):
        out["class_embedding.linear_1"] = "label_emb.0.0"
        out["class_embedding.linear_2"] = "label_emb.0.2"
    elif _get(unet_config, "num_class_embeds") is not None:
        out["class_embedding"] = "label_emb"

    down = _checked(_get(unet_config, "down_block_types"), _DOWN_TYPES, "down_block_types")
    up = _checked(_get(unet_config, "up_block_types"), _UP_TYPES, "up_block_types")
    _checked([_get(unet_config, "mid_block_type", _MID_TYPES[0])], _MID_TYPES, "mid_block_type")
    layers = _per_level(_get(unet_config, "layers_per_block"), len(down))

    entry = 1
    for level, kind in enumerate(down):
        for i in range(layers[level]):
            out[f"down_blocks.{level}.resnets.{i}"] = f"input_blocks.{entry}.0"
            if "Attn" in kind:
                out[f"down_blocks.{level}.attentions.{i}"] = f"input_blocks.{entry}.1"
            entry += 1
        if level < len(down) - 1:
            out[f"down_blocks.{level}.downsamplers.0.conv"] = f"input_blocks.{entry}.0.op"
            entry += 1

    out["mid_block.resnets.0"] = "middle_block.0"
    out["mid_block.attentions.0"] = "middle_block.1"
    out["mid_block.resnets.1"] = "middle_block.2"

    entry = 0
    for level, (kind, count) in enumerate(zip(up, reversed(layers), strict=True)):
        attends = "Attn" in kind
        for i in range(count + 1):
            out[f"up_blocks.{level}.resnets.{i}"] = f"output_blocks.{entry}.0"
            if attends:
                out[f"up_blocks.{level}.attentions.{i}"] = f"output_blocks.{entry}.1"
            if i == count and level < len(up) - 1:
                slot = 2 if attends else 1
                out[f"up_blocks.{level}.upsamplers.0.conv"] = f"output_blocks.{entry}.{slot}.conv"
            entry += 1
    return out


def unet_module_name(name: str, blocks: dict[str, str]) -> str | None:
    """The original name of one diffusers UNet module (`blocks` from `unet_blocks`), or None
    when the layout has no place for it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head not in blocks:
            continue
        rest = parts[cut:]
        if ".resnets." in f".{head}." and rest:
            leaf = _RESNET_LEAVES.get(rest[0])
            if leaf is None:
                return None
            rest = [leaf, *rest[1:]]
        return ".".join([blocks[head], *rest])
    return None


def _split(key: str) -> tuple[str, str]:
    module, _, param = key.rpartition(".")
    return module, param


def unet_module_names(unet_config: Any) -> dict[str, str]:
    """Every diffusers `UNet2DConditionModel` module that holds a weight → its original name
    (without the `model.diffusion_model.` prefix).

    The modules are read from the architecture the config builds (on the meta device, so no
    memory is spent), which is what makes the list complete for any size.
    """
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    blocks = unet_blocks(unet_config)
    config = dict(unet_config)
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(config)
    out = {}
    for name, module in unet.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        ldm = unet_module_name(name, blocks)
        if ldm is None:
            raise KitError(f"unet module '{name}' has no place in the original single-file layout")
        out[name] = ldm
    return out


def unet_to_ldm(
    state: dict[str, torch.Tensor], unet_config: Any, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """A diffusers UNet state dict in the original layout, each key under `prefix`."""
    blocks = unet_blocks(unet_config)
    out = {}
    for key, value in state.items():
        module, param = _split(key)
        ldm = unet_module_name(module, blocks)
        if ldm is None:
            raise KitError(f"unet weight '{key}' has no place in the original single-file layout")
        out[f"{prefix}{ldm}.{param}"] = value
    return out


# ------------------------------------------------------------------ the autoencoder

_VAE_ATTENTION = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}
"""The VAE's mid-block attention: diffusers' Linear layers → the original's 1×1 convolutions."""

_VAE_RESNET = re.compile(r"^(norm1|conv1|norm2|conv2|conv_shortcut)\.(weight|bias)$")
_VAE_SAME = {"conv_in", "conv_out", "quant_conv", "post_quant_conv"}


def _vae_resnet(rest: str) -> str | None:
    if not _VAE_RESNET.match(rest):
        return None
    return rest.replace("conv_shortcut", "nin_shortcut")


def _vae_key(key: str, up_levels: int) -> tuple[str, bool] | None:
    """(original key, whether the weight is a Linear to reshape into a 1×1 convolution)."""
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        module, _ = _split(key)
        return (key, False) if module in _VAE_SAME else None
    module, param = _split(rest)
    if module in _VAE_SAME:
        return key, False
    if module == "conv_norm_out":
        return f"{side}.norm_out.{param}", False
    m = re.match(r"^mid_block\.resnets\.(\d+)\.(.+)$", rest)
    if m:
        leaf = _vae_resnet(m.group(2))
        return (f"{side}.mid.block_{int(m.group(1)) + 1}.{leaf}", False) if leaf else None
    m = re.match(r"^mid_block\.attentions\.0\.(.+)\.(weight|bias)$", rest)
    if m:
        name = _VAE_ATTENTION.get(m.group(1))
        if name is None:
            return None
        return f"{side}.mid.attn_1.{name}.{m.group(2)}", name != "norm" and m.group(2) == "weight"
    kind = "down" if side == "encoder" else "up"
    m = re.match(rf"^{kind}_blocks\.(\d+)\.(.+)$", rest)
    if not m:
        return None
    level = int(m.group(1))
    # The decoder's levels are numbered from the deepest in the original, from the top here.
    level = level if side == "encoder" else up_levels - 1 - level
    inner = m.group(2)
    sampler = "downsamplers.0.conv." if side == "encoder" else "upsamplers.0.conv."
    if inner.startswith(sampler):
        name = "downsample" if side == "encoder" else "upsample"
        return f"{side}.{kind}.{level}.{name}.conv.{inner[len(sampler) :]}", False
    m = re.match(r"^resnets\.(\d+)\.(.+)$", inner)
    if not m:
        return None
    leaf = _vae_resnet(m.group(2))
    return (f"{side}.{kind}.{level}.block.{m.group(1)}.{leaf}", False) if leaf else None


def vae_to_ldm(
    state: dict[str, torch.Tensor], vae_config: Any, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """A diffusers `AutoencoderKL` state dict in the original layout, each key under `prefix`.

    The mid-block attention's projections are Linear layers in diffusers and 1×1 convolutions
    in the original: their weights gain two trailing unit dimensions.
    """
    up_levels = len(_get(vae_config, "up_block_types"))
    out = {}
    for key, value in state.items():
        found = _vae_key(key, up_levels)
        if found is None:
            raise KitError(f"vae weight '{key}' has no place in the original single-file layout")
        name, to_conv = found
        out[f"{prefix}{name}"] = value.reshape(*value.shape, 1, 1) if to_conv else value
    return out


# ------------------------------------------------------------------ the text encoders


def _text_key(key: str) -> str:
    """A transformers CLIP key without its `text_model.` level (present or not by class and
    transformers version)."""
    return key.removeprefix("text_model.")


def clip_to_ldm(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A transformers CLIP text encoder as the original code nests it: the same layer names,
    under `prefix` and a `text_model.` level (SD1's `cond_stage_model.transformer.`, SDXL's
    first `conditioner.embedders.0.transformer.`)."""
    out = {}
    for key, value in state.items():
        rest = _text_key(key)
        where = rest if rest.startswith("text_projection.") else f"text_model.{rest}"
        out[f"{prefix}{where}"] = value
    return out


_OPEN_CLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
_OPEN_CLIP_TOP = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}


def open_clip_to_ldm(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A transformers CLIP text encoder in OpenCLIP's own layout, under `prefix` (SD2's
    `cond_stage_model.model.`, SDXL's second `conditioner.embedders.1.model.`).

    OpenCLIP keeps one fused input projection per attention (q, k and v stacked, in that order,
    as `in_proj_weight` / `in_proj_bias`), and its `text_projection` is a bare matrix applied as
    `x @ P`: the transpose of transformers' Linear weight.
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        rest = _text_key(key)
        if rest in _OPEN_CLIP_TOP:
            out[f"{prefix}{_OPEN_CLIP_TOP[rest]}"] = value
            continue
        if rest == "text_projection.weight":
            out[f"{prefix}text_projection"] = value.t().contiguous()
            continue
        m = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", rest)
        if not m:
            raise KitError(f"text encoder weight '{key}' has no place in the OpenCLIP layout")
        layer, module, param = m.groups()
        block = f"{prefix}transformer.resblocks.{layer}"
        qkv = re.match(r"^self_attn\.([qkv])_proj$", module)
        if qkv:
            fused.setdefault(f"{block}.attn.in_proj_{param}", {})[qkv.group(1)] = value
        elif module in _OPEN_CLIP_LAYER:
            out[f"{block}.{_OPEN_CLIP_LAYER[module]}.{param}"] = value
        else:
            raise KitError(f"text encoder weight '{key}' has no place in the OpenCLIP layout")
    for name, parts in fused.items():
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise KitError(f"text encoder: {name} lacks its {', '.join(missing)} projection")
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


# ------------------------------------------------------------------ the whole checkpoint


def _state(part: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(part, nn.Module):
        return {k: v.detach() for k, v in part.state_dict().items()}
    return dict(part)


def single_file_state_dict(
    unet: nn.Module | dict[str, torch.Tensor],
    vae: nn.Module | dict[str, torch.Tensor],
    text_encoders: list[nn.Module] | list[dict[str, torch.Tensor]],
    *,
    unet_config: Any,
    vae_config: Any,
    layout: str,
    prediction_type: str = "epsilon",
    zero_terminal_snr: bool = False,
) -> dict[str, torch.Tensor]:
    """The whole checkpoint (UNet, VAE and text encoders) in the original layout `layout`
    (`sd1`, `sd2` or `sdxl`).

    A v-prediction model carries an empty `v_pred` tensor, and one trained to zero terminal SNR
    an empty `ztsnr`: the markers ComfyUI reads to sample such an SDXL checkpoint correctly.
    """
    if layout not in LAYOUTS:
        raise KitError(f"unknown single-file layout '{layout}' (known: {', '.join(LAYOUTS)})")
    encoders = LAYOUTS[layout]
    if len(text_encoders) != len(encoders):
        raise KitError(
            f"the {layout} single-file layout holds {len(encoders)} text encoder(s), "
            f"got {len(text_encoders)}"
        )
    out = unet_to_ldm(_state(unet), unet_config, UNET_PREFIX)
    out.update(vae_to_ldm(_state(vae), vae_config, VAE_PREFIX))
    for (kind, prefix), encoder in zip(encoders, text_encoders, strict=True):
        convert = open_clip_to_ldm if kind == "open_clip" else clip_to_ldm
        out.update(convert(_state(encoder), prefix))
    if prediction_type == "v_prediction":
        out["v_pred"] = torch.tensor([])
    if zero_terminal_snr:
        out["ztsnr"] = torch.tensor([])
    return {k: v.contiguous() for k, v in out.items()}


def components_state_dict(comps: Any, layout: str) -> dict[str, torch.Tensor]:
    """A loaded model (`kit.families.base.Components`, every part loaded) as one checkpoint in
    `layout`, marked v-prediction / zero-terminal-SNR as its noise schedule says."""
    if comps.denoiser is None or comps.vae is None or not comps.text_encoders:
        raise KitError(
            "a single-file checkpoint holds the denoiser, the VAE and the text encoders; "
            f"load them all (missing: {', '.join(comps.missing_parts())})"
        )
    schedule = comps.noise_scheduler.config
    return single_file_state_dict(
        comps.denoiser,
        comps.vae,
        comps.text_encoders,
        unet_config=comps.denoiser.config,
        vae_config=comps.vae.config,
        layout=layout,
        prediction_type=_get(schedule, "prediction_type", "epsilon"),
        zero_terminal_snr=bool(_get(schedule, "rescale_betas_zero_snr", False)),
    )


def layout_of(state: dict[str, Any]) -> str:
    """The layout of a checkpoint, read from its keys as the clients read it: SDXL's second,
    OpenCLIP encoder; SD2's single OpenCLIP encoder; else SD1's CLIP."""
    if any(k.startswith(LAYOUTS["sdxl"][1][1]) for k in state):
        return "sdxl"
    if any(k.startswith(LAYOUTS["sd2"][0][1]) for k in state):
        return "sd2"
    return "sd1"


def _open_clip_from_file(
    checkpoint: dict[str, torch.Tensor], config_source: str, subfolder: str, cls: Any, prefix: str
) -> nn.Module:
    """Text encoder `subfolder` with its weights read from the OpenCLIP keys under `prefix` by
    diffusers' own converter, every weight required."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    model = cls(cls.config_class.from_pretrained(config_source, subfolder=subfolder))
    state = convert_open_clip_checkpoint(model, checkpoint, prefix=prefix)
    if not hasattr(model, "text_model"):  # transformers' flattened CLIPTextModel
        state = {_text_key(k): v for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_pipeline(
    pipeline_class: str,
    path: str,
    config_source: str,
    layout: str,
    pipeline_kwargs: dict[str, Any],
) -> Any:
    """diffusers' pipeline `pipeline_class` read from a checkpoint in `layout` with diffusers'
    own `from_single_file`, the diffusers folder (or hub id) `config_source` giving the configs.

    `from_single_file` tells SDXL's two encoders apart by their width: when both are equally
    wide (as in tiny test models) it fills the second one from the first one's keys. The second
    one is then read from its own keys with diffusers' OpenCLIP converter, passed in ready.
    """
    import diffusers
    import transformers
    from safetensors.torch import load_file

    cls = getattr(diffusers, pipeline_class)
    kwargs = dict(pipeline_kwargs)
    encoders = LAYOUTS[layout]
    if len(encoders) > 1:
        names = ["text_encoder"] + [f"text_encoder_{i + 1}" for i in range(1, len(encoders))]
        index = cls.load_config(config_source)
        classes = [getattr(transformers, index[n][1]) for n in names]
        widths = [
            c.config_class.from_pretrained(config_source, subfolder=n).hidden_size
            for c, n in zip(classes, names, strict=True)
        ]
        if len(set(widths)) < len(widths):
            checkpoint = load_file(str(path))
            for (kind, prefix), name, c in zip(encoders, names, classes, strict=True):
                if kind == "open_clip":
                    kwargs[name] = _open_clip_from_file(checkpoint, config_source, name, c, prefix)
    return cls.from_single_file(str(path), config=str(config_source), **kwargs)


def open_clip_text(config: Any) -> bool:
    """Whether a transformers CLIP text config is an OpenCLIP model (SD2's ViT-H, SDXL's
    ViT-bigG): OpenCLIP uses exact GELU, OpenAI's CLIP (SD1's ViT-L) its quick approximation."""
    return _get(config, "hidden_act") == "gelu"


__all__ = [
    "LAYOUTS",
    "UNET_PREFIX",
    "VAE_PREFIX",
    "clip_to_ldm",
    "components_state_dict",
    "layout_of",
    "load_pipeline",
    "open_clip_text",
    "open_clip_to_ldm",
    "single_file_state_dict",
    "unet_blocks",
    "unet_module_name",
    "unet_module_names",
    "unet_to_ldm",
    "vae_to_ldm",
]


def ldm_aliases(unet_config: Any) -> dict[str, str]:
    """What ComfyUI derives from an SD UNet's config (`unet_to_diffusers`): each diffusers
    weight key → the same weight's key in the original layout."""
    return {f"{d}.weight": f"{o}.weight" for d, o in unet_module_names(unet_config).items()}
