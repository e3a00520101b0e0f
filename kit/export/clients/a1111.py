"""AUTOMATIC1111's built-in Lora extension (`extensions-builtin/Lora/`), as a checker.

`model` is A1111's state dict (`shared.sd_model`): the UNet under `model.diffusion_model.` in
the LDM layout; SD1's text encoder under `cond_stage_model.transformer.` (HF CLIP names), SD2's
under `cond_stage_model.model.` (OpenCLIP); SDXL's under `conditioner.embedders.0.transformer.`
(HF CLIP-L) and `conditioner.embedders.1.model.` (OpenCLIP bigG, whose attention is one
`nn.MultiheadAttention` with a fused `in_proj_weight`; `fuse_openclip` converts HF names to it).
`aliases` is not used: A1111 derives everything from names.

The rules, as A1111 applies them (`networks.load_network`, `network_apply_weights`):

* Keys. A file key splits at its first dot into module and part. The module is renamed by
  `convert_diffusers_name_to_compvis` (`compvis_name`): diffusers UNet names to LDM names with
  the SD1 block arithmetic (so SDXL's `up_blocks_0_upsamplers_0_conv` misses: it lands on
  `output_blocks_2_1_conv`), `lora_te_text_model_encoder_layers_*` to the SD1 encoder (or SD2's
  OpenCLIP), `lora_te2_text_model_encoder_layers_*` to SDXL's OpenCLIP (`self_attn` -> `attn`,
  `mlp_fc1/2` -> `mlp_c_fc/c_proj`). Unfound, a `_q_proj/_k_proj/_v_proj` name is bound to its
  parent attention; then `lora_unet` -> `diffusion_model` verbatim (LDM-named files), or
  `lora_te1_text_model` -> SDXL's CLIP-L (`0_transformer_text_model`) or SD1's. Anything else
  is dropped with a debug log only.
* Parts. The first module type that accepts a module's parts wins: LoRA (`lora_up/lora_down`
  or `lora_A/lora_B`), LoHa (`hada_w1_a/w1_b/w2_a/w2_b`), IA3, LoKr (both factors, each full or
  low-rank), full (`diff`); none accepting is an AssertionError that fails the whole file, as
  is a LoRA on a layer that is not Linear, Conv2d or MultiheadAttention. `alpha`, `scale`,
  `dora_scale` are read by every type; other parts are ignored without a word.
* Arithmetic. ΔW·scale, scale = `scale` if given, else alpha/rank (rank: lora_down rows,
  hada_w1_b rows, LoKr's lokr_w2_b, else lokr_w1_b, rows; no low-rank factor or no alpha: 1).
  `diff` is unscaled and `diff_b` adds to the bias. The multiplier (strength) comes last.
  A RuntimeError while patching a layer is counted and leaves the layer unpatched.
* DoRA, for every type: V = W + scale·ΔW, norm per **input column** of V (over output and
  spatial axes, no epsilon) whatever dora_scale's shape, W' = V·dora_scale/norm, and the layer
  gets W + s·(W' − W). So dora_scale must be (1, in) / (1, in, 1, 1); an (out, 1) broadcasts
  silently to (out, in) on a Linear, an (out, 1, 1, 1) silently on a conv, and an (out, 1) on a
  conv fails (layer unpatched). Metadata is not read.
* OpenCLIP attention: q, k, v and out LoRAs are applied only when all four are present (to the
  three row blocks of in_proj_weight and to out_proj); any subset is silently dropped.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from kit.export.clients import Applied, Fatal, col_norm, f32, failed, ratio_note, scalar, shape

CLIENT = "A1111"

_RESNET = {
    "conv1": "in_layers_2",
    "conv2": "out_layers_3",
    "norm1": "in_layers_0",
    "norm2": "out_layers_0",
    "time_emb_proj": "emb_layers_1",
    "conv_shortcut": "skip_connection",
}
_QKV = re.compile(r"(.*)_([qkv]_proj)$")
_BASE_PARTS = ("alpha", "scale", "dora_scale", "bias")
_TYPE_PARTS = {
    "up_down": ("lora_up.weight", "lora_down.weight", "lora_mid.weight"),
    "a_b": ("lora_A.weight", "lora_B.weight"),
    "hada": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "ia3": ("weight", "on_input"),
    "kron": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "diff": ("diff", "diff_b"),
}


def compvis_name(stem: str, is_sd2: bool = False) -> str:
    """A1111's `convert_diffusers_name_to_compvis`: a kohya module name to its layer name."""
    if m := re.match(r"lora_unet_conv_in(.*)", stem):
        return f"diffusion_model_input_blocks_0_0{m[1]}"
    if m := re.match(r"lora_unet_conv_out(.*)", stem):
        return f"diffusion_model_out_2{m[1]}"
    if m := re.match(r"lora_unet_time_embedding_linear_(\d+)(.*)", stem):
        return f"diffusion_model_time_embed_{int(m[1]) * 2 - 2}{m[2]}"
    if m := re.match(r"lora_unet_down_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)", stem):
        part = _RESNET.get(m[4], m[4]) if m[2] == "resnets" else m[4]
        index = 1 + int(m[1]) * 3 + int(m[3])
        return f"diffusion_model_input_blocks_{index}_{1 if m[2] == 'attentions' else 0}_{part}"
    if m := re.match(r"lora_unet_mid_block_(attentions|resnets)_(\d+)_(.+)", stem):
        part = _RESNET.get(m[3], m[3]) if m[1] == "resnets" else m[3]
        return f"diffusion_model_middle_block_{1 if m[1] == 'attentions' else int(m[2]) * 2}_{part}"
    if m := re.match(r"lora_unet_up_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)", stem):
        part = _RESNET.get(m[4], m[4]) if m[2] == "resnets" else m[4]
        index = int(m[1]) * 3 + int(m[3])
        return f"diffusion_model_output_blocks_{index}_{1 if m[2] == 'attentions' else 0}_{part}"
    if m := re.match(r"lora_unet_down_blocks_(\d+)_downsamplers_0_conv", stem):
        return f"diffusion_model_input_blocks_{3 + int(m[1]) * 3}_0_op"
    if m := re.match(r"lora_unet_up_blocks_(\d+)_upsamplers_0_conv", stem):
        block = int(m[1])
        return f"diffusion_model_output_blocks_{2 + block * 3}_{2 if block > 0 else 1}_conv"
    if m := re.match(r"lora_te_text_model_encoder_layers_(\d+)_(.+)", stem):
        if is_sd2:
            return f"model_transformer_resblocks_{m[1]}_{_openclip_part(m[2])}"
        return f"transformer_text_model_encoder_layers_{m[1]}_{m[2]}"
    if m := re.match(r"lora_te2_text_model_encoder_layers_(\d+)_(.+)", stem):
        return f"1_model_transformer_resblocks_{m[1]}_{_openclip_part(m[2])}"
    return stem


def _openclip_part(rest: str) -> str:
    if "mlp_fc1" in rest:
        return rest.replace("mlp_fc1", "mlp_c_fc")
    if "mlp_fc2" in rest:
        return rest.replace("mlp_fc2", "mlp_c_proj")
    return rest.replace("self_attn", "attn")


def fuse_openclip(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF CLIP text-model weights (`text_model.encoder.layers.N...`) in OpenCLIP naming.

    What a LoRA can reach in SDXL's second encoder as A1111 holds it: per layer `attn`
    (q, k, v stacked into `in_proj_weight` / `in_proj_bias`, `out_proj`), `mlp.c_fc`,
    `mlp.c_proj`, `ln_1`, `ln_2`; plus `ln_final`. Prefix the result with
    `conditioner.embedders.1.model.` (or `cond_stage_model.model.` for SD2).
    """
    out: dict[str, torch.Tensor] = {}
    layer = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    rename = {
        "self_attn.out_proj": "attn.out_proj",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
        "layer_norm1": "ln_1",
        "layer_norm2": "ln_2",
    }
    for key, value in hf.items():
        if key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key.rsplit(".", 1)[1]] = value
        m = layer.match(key)
        if not m:
            continue
        n, module, param = m.groups()
        if module in rename:
            out[f"transformer.resblocks.{n}.{rename[module]}.{param}"] = value
        elif module == "self_attn.q_proj":
            parts = [hf[key.replace(".q_proj.", f".{p}_proj.")] for p in "qkv"]
            out[f"transformer.resblocks.{n}.attn.in_proj_{param}"] = torch.cat(parts, 0)
    return out


@dataclasses.dataclass
class _Layer:
    kind: str
    """linear, conv, norm, mha (an OpenCLIP attention), mha_out (its out_proj), container."""
    weight: str | None = None
    """The model key of its weight (of `in_proj_weight` for an attention)."""


def _layers(model: dict[str, torch.Tensor]) -> dict[str, _Layer]:
    """A1111's `network_layer_mapping`: layer name -> what the layer is."""
    if any(k.startswith("conditioner.embedders.") for k in model):
        roots = [("model.", "")] + [(f"conditioner.embedders.{i}.", f"{i}_") for i in range(8)]
    else:
        roots = [("model.", ""), ("cond_stage_model.", "")]
    layers: dict[str, _Layer] = {}
    for key, value in model.items():
        root, prefix = next(((r, p) for r, p in roots if key.startswith(r)), ("", None))
        if prefix is None or "." not in key[len(root) :]:
            continue
        path, param = key[len(root) :].rsplit(".", 1)
        bits = path.split(".")
        for depth in range(len(bits)):  # every enclosing module is a layer name too
            layers.setdefault(prefix + "_".join(bits[:depth]), _Layer("container"))
        name = prefix + "_".join(bits)
        if param == "in_proj_weight":
            layers[name] = _Layer("mha", key)
        elif param == "weight":
            layers[name] = _Layer(
                {2: "linear", 4: "conv", 1: "norm"}.get(value.dim(), "container"), key
            )
        else:
            layers.setdefault(name, _Layer("container"))
    for name, layer in list(layers.items()):
        if layer.kind == "mha" and name + "_out_proj" in layers:
            layers[name + "_out_proj"].kind = "mha_out"
    return layers


def _match(stem: str, layers: dict[str, _Layer], is_sd2: bool) -> tuple[str, _Layer | None]:
    key = compvis_name(stem, is_sd2)
    layer = layers.get(key)
    if layer is None and (m := _QKV.match(key)):
        layer = layers.get(m[1])
    if layer is None and "lora_unet" in stem:
        key = stem.replace("lora_unet", "diffusion_model")
        layer = layers.get(key)
    elif layer is None and "lora_te1_text_model" in stem:
        key = stem.replace("lora_te1_text_model", "0_transformer_text_model")
        layer = layers.get(key)
        if layer is None:
            key = stem.replace("lora_te1_text_model", "transformer_text_model")
            layer = layers.get(key)
    return key, layer


def _module_type(w: dict[str, torch.Tensor]) -> str | None:
    if "lora_up.weight" in w and "lora_down.weight" in w:
        return "up_down"
    if "lora_A.weight" in w and "lora_B.weight" in w:
        return "a_b"
    if all(p in w for p in _TYPE_PARTS["hada"][:4]):
        return "hada"
    if "weight" in w:
        return "ia3"
    has_1 = "lokr_w1" in w or ("lokr_w1_a" in w and "lokr_w1_b" in w)
    has_2 = "lokr_w2" in w or ("lokr_w2_a" in w and "lokr_w2_b" in w)
    if has_1 and has_2:
        return "kron"
    if "diff" in w:
        return "diff"
    if any(p in w for p in ("w_norm", "a1.weight", "oft_blocks", "oft_diag")):
        return "unmodelled"
    return None


def _delta(
    kind: str, w: dict[str, torch.Tensor], layer: _Layer, orig: torch.Tensor
) -> tuple[torch.Tensor, list[int], int | None]:
    """calc_updown's ΔW (before finalize), its output shape and the rank for alpha."""
    if kind in ("up_down", "a_b"):
        up = f32(w["lora_up.weight" if kind == "up_down" else "lora_B.weight"])
        down = f32(w["lora_down.weight" if kind == "up_down" else "lora_A.weight"])
        if layer.kind == "conv":
            if down.dim() == 2:
                down = down.reshape(down.shape[0], -1, 1, 1)
            up = up.reshape(up.shape[0], up.shape[1], 1, 1)
        else:
            down, up = down.reshape(down.shape[0], -1), up.reshape(up.shape[0], -1)
        out_shape = [up.shape[0], down.shape[1], *down.shape[2:]]
        delta = (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(out_shape)
        return delta, out_shape, down.shape[0]
    if kind == "hada":
        w1a, w1b, w2a, w2b = (f32(w[p]) for p in _TYPE_PARTS["hada"][:4])
        out_shape = [w1a.shape[0], w1b.shape[1], *(w1b.shape[2:] if w1b.dim() == 4 else ())]
        one = (w1a.reshape(w1a.shape[0], -1) @ w1b.reshape(w1b.shape[0], -1)).reshape(out_shape)
        two = (w2a.reshape(w2a.shape[0], -1) @ w2b.reshape(w2b.shape[0], -1)).reshape(out_shape)
        return one * two, out_shape, w1b.shape[0]
    if kind == "kron":
        w1 = f32(w["lokr_w1"]) if "lokr_w1" in w else f32(w["lokr_w1_a"]) @ f32(w["lokr_w1_b"])
        w2 = f32(w["lokr_w2"]) if "lokr_w2" in w else f32(w["lokr_w2_a"]) @ f32(w["lokr_w2_b"])
        rank = w["lokr_w1_b"].shape[0] if "lokr_w1_b" in w else None
        rank = w["lokr_w2_b"].shape[0] if "lokr_w2_b" in w else rank
        out_shape = [w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]]
        if orig.dim() == 4:
            out_shape = list(orig.shape)
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        return torch.kron(w1, w2).reshape(out_shape), out_shape, rank
    diff = f32(w["diff"])
    return diff, list(diff.shape), None


def _updown(
    name: str,
    kind: str,
    w: dict[str, torch.Tensor],
    layer: _Layer,
    orig: torch.Tensor,
    strength: float,
) -> tuple[torch.Tensor, list[str]]:
    """calc_updown + finalize_updown: the update A1111 adds to `orig`."""
    delta, out_shape, rank = _delta(kind, w, layer, orig)
    if len(out_shape) == 4:
        delta = delta.reshape(out_shape)
    if orig.numel() == delta.numel():
        delta = delta.reshape(orig.shape)
    if "scale" in w:
        delta = delta * scalar(w["scale"])
    elif rank is not None and "alpha" in w:
        delta = delta * (scalar(w["alpha"]) / rank)
    notes: list[str] = []
    if "dora_scale" in w:
        magnitude = f32(w["dora_scale"])
        merged = delta + orig
        norm = col_norm(merged)
        note = ratio_note(CLIENT, name, magnitude, norm)
        notes += [note] if note else []
        delta = merged * (magnitude / norm) - orig
    return delta * strength, notes


def _add(name: str, orig: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`weight.copy_(weight + updown)`: a broadcast that grows the shape raises, as there."""
    total = orig + delta
    if total.shape != orig.shape:
        raise RuntimeError(f"the update {shape(delta)} does not fit the weight {shape(orig)}")
    return total


def apply(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    model: dict[str, torch.Tensor],
    *,
    strength: float = 1.0,
    aliases: dict[str, str] | None = None,
) -> Applied:
    """Load `tensors` into `model` as `<lora:name:strength>` does in A1111 (both multipliers)."""
    del metadata, aliases  # A1111 reads neither
    layers = _layers(model)
    is_sd2 = "model_transformer_resblocks" in layers
    matched: dict[str, tuple[_Layer, dict[str, torch.Tensor], dict[str, str]]] = {}
    unread: list[str] = []
    for file_key, value in tensors.items():
        stem, _, part = file_key.partition(".")
        if stem == "bundle_emb":
            continue  # embeddings bundled with the LoRA: read by the embedding loader
        key, layer = _match(stem, layers, is_sd2)
        if layer is None:
            unread.append(file_key)
            continue
        entry = matched.setdefault(key, (layer, {}, {}))
        entry[1][part] = value
        entry[2][part] = file_key
    try:
        return _patch(matched, model, strength, unread)
    except Fatal as err:
        return failed(CLIENT, tensors, str(err))


def _patch(
    matched: dict[str, tuple[_Layer, dict[str, torch.Tensor], dict[str, str]]],
    model: dict[str, torch.Tensor],
    strength: float,
    unread: list[str],
) -> Applied:
    modules: dict[str, tuple[str, _Layer, dict[str, torch.Tensor]]] = {}
    for key, (layer, w, names) in matched.items():
        kind = _module_type(w)
        if kind is None:
            raise Fatal(
                f"{CLIENT}: AssertionError: no module type accepts {key}'s keys: {', '.join(w)}"
            )
        if kind in ("up_down", "a_b") and layer.kind not in ("linear", "conv", "mha", "mha_out"):
            raise Fatal(
                f"{CLIENT}: AssertionError: Lora layer {key} matched a layer of unsupported type"
            )
        if layer.weight is None:
            raise Fatal(f"{CLIENT}: {key} names a layer without a weight; loading the file fails")
        if kind in ("ia3", "unmodelled") or any(
            p in w for p in ("lora_mid.weight", "hada_t1", "lokr_t2")
        ):
            raise Fatal(
                f"{CLIENT}: {key}: IA3 / norm / GLoRA / OFT and tucker parts are not modelled here"
            )
        used = set(_BASE_PARTS) | set(_TYPE_PARTS[kind])
        unread += [names[p] for p in w if p not in used]
        modules[key] = (kind, layer, w)
    merged: dict[str, torch.Tensor] = {}
    warnings: list[str] = []
    for key, (kind, layer, w) in modules.items():
        if layer.kind in ("mha", "mha_out"):
            continue  # the attention applies these, below
        try:
            warnings += _one(key, kind, layer, w, model, merged, strength)
        except RuntimeError as err:
            warnings.append(f"{CLIENT}: layer {key}: {err} (left unpatched)")
    warnings += _attention(modules, model, merged, strength)
    return Applied(CLIENT, merged, sorted(unread), warnings)


def _one(
    key: str,
    kind: str,
    layer: _Layer,
    w: dict[str, torch.Tensor],
    model: dict[str, torch.Tensor],
    merged: dict[str, torch.Tensor],
    strength: float,
) -> list[str]:
    """One Linear / Conv2d layer: `weight.copy_(weight + updown)`, `bias += ex_bias`."""
    assert layer.weight is not None
    orig = merged.get(layer.weight, f32(model[layer.weight]))
    delta, notes = _updown(key, kind, w, layer, orig, strength)
    if delta.shape != orig.shape:
        notes.append(
            f"{CLIENT}: {key}: the update {shape(delta)} broadcasts over the weight {shape(orig)}"
        )
    total = _add(key, orig, delta)
    if kind == "diff" and "diff_b" in w:
        bias_key = layer.weight[: -len("weight")] + "bias"
        bias = f32(w["diff_b"]) * strength
        merged[bias_key] = (
            merged.get(bias_key, f32(model[bias_key])) + bias if bias_key in model else bias
        )
    merged[layer.weight] = total
    return notes


def _attention(
    modules: dict[str, tuple[str, _Layer, dict[str, torch.Tensor]]],
    model: dict[str, torch.Tensor],
    merged: dict[str, torch.Tensor],
    strength: float,
) -> list[str]:
    """LoRAs on an OpenCLIP attention: q, k, v and out all together, or not at all."""
    warnings: list[str] = []
    groups: dict[str, dict[str, tuple[str, _Layer, dict[str, torch.Tensor]]]] = {}
    for key, module in modules.items():
        if module[1].kind == "mha_out":
            groups.setdefault(key[: -len("_out_proj")], {})["out"] = module
        elif module[1].kind == "mha" and (m := _QKV.match(key)):
            groups.setdefault(m[1], {})[m[2][0]] = module
        elif module[1].kind == "mha":
            warnings.append(f"{CLIENT}: layer {key}: couldn't find supported operation")
    for name, found in groups.items():
        missing = [p for p in ("q", "k", "v", "out") if p not in found]
        if missing:
            warnings.append(
                f"{CLIENT}: {name}: q/k/v/out LoRAs on an attention apply only all together; "
                f"without {', '.join(missing)} the others are silently not applied"
            )
            continue
        fused_key = found["q"][1].weight
        out_key = found["out"][1].weight
        assert fused_key is not None and out_key is not None
        try:
            fused, out = f32(model[fused_key]), f32(model[out_key])
            updates = []
            for part, chunk in zip("qkv", fused.chunk(3, 0), strict=True):
                kind, layer, w = found[part]
                delta, notes = _updown(f"{name}_{part}_proj", kind, w, layer, chunk, strength)
                warnings += notes
                updates.append(delta)
            kind, layer, w = found["out"]
            delta_out, notes = _updown(f"{name}_out_proj", kind, w, layer, out, strength)
            warnings += notes
            merged[fused_key] = _add(name, fused, torch.cat(updates, 0))
            merged[out_key] = _add(name + "_out_proj", out, delta_out)
        except RuntimeError as err:
            warnings.append(f"{CLIENT}: layer {name}: {err} (left unpatched)")
    return warnings
