"""ComfyUI's LoRA loader (`comfy/lora.py`, `comfy/weight_adapter/`), as a checker.

`model` is ComfyUI's state dict: the denoiser under `diffusion_model.` in its original layout
(LDM UNet names for SD1/SDXL, BFL names for Flux, MMDiT names for SD3, Wan's own names), text
encoders under `clip_l.transformer.`, `clip_g.transformer.`, `clip_h.transformer.`
(HF-transformers CLIP names, also for SDXL's OpenCLIP bigG) and `t5xxl.transformer.`. `aliases`
is what ComfyUI derives from the model config: for a UNet `comfy.utils.unet_to_diffusers`,
diffusers UNet parameter key -> key under `diffusion_model.` (`kit.families.ldm.ldm_aliases`
builds it from the UNet config); for Flux and SD3 see the end of this docstring.

The rules, as ComfyUI applies them:

* Keys. `model_lora_keys_unet` accepts `lora_unet_<original path>` for every denoiser weight,
  `lora_unet_<diffusers path>` and `lycoris_<diffusers path>` through the UNet aliases, and the
  bare / `unet.` diffusers forms. `model_lora_keys_clip` accepts, for CLIP layer weights only
  (`text_model.encoder.layers.N.{self_attn.{q,k,v,out}_proj, mlp.fc1, mlp.fc2}`),
  `lora_te_` and `lora_te1_` for clip_l (or clip_h), `lora_te2_` for clip_g when clip_l is
  present (`lora_te_` when it is alone), `lora_te{1,2}_text_projection`, and for T5 every weight
  as `lora_te{n}_`, n = 1 + (clip_g present) + (clip_l present), with clip_l alone also taking
  n = 2 (SD3: `lora_te3_`; Flux: `lora_te2_` and `lora_te3_`). `text_encoders.<key>` and
  `diffusion_model.<key>` are accepted verbatim. A file key under no accepted name is logged
  "lora key not loaded" and skipped; a target missing from the model is "NOT LOADED".
* Parts (`load_lora`). Per accepted name: `alpha` and `dora_scale` are always read; then LoRA
  (`lora_up/lora_down[/lora_mid]`, also `lora_B/lora_A` and the other diffusers spellings), LoHa
  (`hada_*`), LoKr (`lokr_*`); then `diff` / `diff_b` / `set_weight` / `w_norm` / `b_norm`,
  which replace an adapter on the same weight. An up without its down is a KeyError that aborts
  the whole load.
* Arithmetic (`calculate_weight`, float32). LoRA: W += s·(alpha/rank)·(up·down) reshaped to W.
  LoHa: s·(alpha/rank)·(w1a·w1b ⊙ w2a·w2b), rank = hada_w1_b rows. LoKr: s·kron(w1, w2), times
  alpha/rank only when a factor is low-rank (rank = lokr_w2_b rows, else lokr_w1_b rows). A
  missing alpha means scale 1; alpha 0 means scale 0. diff: W += s·diff, refused on a shape
  mismatch. Any exception (bad reshape, bad broadcast) is logged and leaves W untouched.
* DoRA (`weight_decompose`), for any of the three adapters: V = W + (alpha/rank)·ΔW; when
  `dora_scale.shape[0] == out` the norm is taken per output row **of the unmerged W** (not of
  V), otherwise per input column of V (over output and spatial axes); W' = V·dora_scale/norm
  (in place, so a dora_scale that would enlarge the shape fails) and the strength blends:
  W + s·(W' − W). So (out, 1) fits a Linear, (out, 1, 1, 1) a conv, (1, in) / (1, in, 1, 1) the
  per-input convention; (out, 1) on a conv fails. The metadata (`dora_wd`, ...) is not read.

Flux and SD3 files named after diffusers' modules. ComfyUI knows the model's class; here the
denoiser keys tell it (`layout`: "bfl" when `double_blocks.0.img_attn.norm.key_norm` and `img_in`
are there, "mmdit" for `joint_blocks.0.context_block.attn.qkv`, else "ldm"), as in
`comfy/model_detection.py`. For those two, `unet_to_diffusers` gives nothing, so no
`lora_unet_<diffusers path>` name exists; instead `flux_to_diffusers` / `mmdit_to_diffusers`
map each diffusers weight onto the original one, either whole or as a row slice
`(key, (0, offset, rows))` of a fused weight (q, k, v of `qkv`; q, k, v and the MLP input of
`linear1`), some with `swap_scale_shift` (Flux's and SD3's `norm_out.linear`, SD3's last
`norm1_context.linear`). An alias value here is that entry: a key, or
`(key, offset, rows[, swap])` (`kit.families.adapter_keys.offset_aliases` builds them from the kit's layout maps).

* Names (`model_lora_keys_unet`). Flux: `transformer.<path>`, `lycoris_<path with _>`,
  `lora_transformer_<path with _>` and the bare `<path>`, plus
  `diffusion_model.single_blocks.N.linear1_qkv` for the first 3·hidden rows of `linear1`
  (hidden = the rows of `txt_in`, else of `img_in`). SD3: `transformer.<path>`,
  `base_model.model.<path>`, `lora_transformer_<path with _>` and `lycoris_<path with _>`
  (no bare path). ComfyUI slices SD3's q / k / v by 64·depth with depth = `x_embedder` rows
  // 64, and swaps `joint_blocks.{depth - 1}`: true of every released SD3 / SD3.5, where the
  width is 64 × the block count; the aliases carry the model's actual rows.
* Arithmetic (`calculate_weight`). The weight is narrowed to the slice and the adapter runs on
  the slice alone (the reshape to its shape, DoRA's norms and its `dora_scale.shape[0]` test);
  the swap is applied to the update only: W += swap(s·scale·ΔW), DoRA's V = W + swap(scale·ΔW)
  with `dora_scale` itself not swapped, and `diff` too, but not `set`. `diff_b` / `b_norm` of
  a sliced or swapped name go to the key `().bias` (the tuple's `[:-len(".weight")]`), which
  ComfyUI reports NOT LOADED.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kit.export.clients import (
    Applied,
    Fatal,
    col_norm,
    f32,
    failed,
    ratio_note,
    row_norm,
    scalar,
    shape,
)

CLIENT = "ComfyUI"

# CLIP layer modules ComfyUI maps for the `lora_te*` names: HF path -> kohya spelling.
_CLIP_MODULES = (
    ("mlp.fc1", "mlp_fc1"),
    ("mlp.fc2", "mlp_fc2"),
    ("self_attn.k_proj", "self_attn_k_proj"),
    ("self_attn.q_proj", "self_attn_q_proj"),
    ("self_attn.v_proj", "self_attn_v_proj"),
    ("self_attn.out_proj", "self_attn_out_proj"),
)
_CLIP_LAYERS = 32

# (up, down, mid) suffixes of the LoRA spellings, in the order ComfyUI tries them.
_LORA_FORMS = (
    (".lora_up.weight", ".lora_down.weight", ".lora_mid.weight"),
    ("_lora.up.weight", "_lora.down.weight", None),
    (".lora_B.weight", ".lora_A.weight", None),
    (".lora.up.weight", ".lora.down.weight", None),
    (".lora_B", ".lora_A", None),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight", None),
    (".lora_B.default.weight", ".lora_A.default.weight", None),
)
_HADA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
_UNMODELLED = ("a1.weight", "oft_blocks")


class Slice(NamedTuple):
    """A patch target that is part of a model weight: ComfyUI's `(key, (0, offset, rows))`,
    with `swap` for its `swap_scale_shift` on the update."""

    key: str
    offset: int
    rows: int
    swap: bool = False


Target = str | Slice
"""What a file stem patches: a whole model weight, or rows of one."""
Alias = str | tuple[str, int, int] | tuple[str, int, int, bool]
"""An alias value: the model key (under `diffusion_model.`), or (key, offset, rows[, swap])."""

_PREFIX = "diffusion_model."
# The names `model_lora_keys_unet` gives a diffusers path, per layout: (prefix, separator).
_SPELLINGS = {
    "bfl": (("transformer.", "."), ("lycoris_", "_"), ("lora_transformer_", "_"), ("", ".")),
    "mmdit": (
        ("transformer.", "."),
        ("base_model.model.", "."),
        ("lora_transformer_", "_"),
        ("lycoris_", "_"),
    ),
    # Lumina2 / Z-Image: the names `z_image_to_diffusers` gives (q, k, v as rows of `qkv`).
    "lumina2": (("diffusion_model.", "."), ("transformer.", "."), ("lycoris_", "_"), ("", ".")),
}
_LAYOUTS = ("ldm", "bfl", "mmdit", "lumina2")
_FLUX_HIDDEN = 3072  # ComfyUI's default when neither txt_in nor img_in tells the width


def detect_layout(model: dict[str, torch.Tensor]) -> str:
    """Which of ComfyUI's diffusers-name maps this denoiser gets ("mmdit" for SD3, "bfl" for
    Flux, "lumina2" for Lumina 2 / Z-Image, "ldm" for a UNet), by the keys
    `comfy/model_detection.py` tests, SD3's first."""
    if f"{_PREFIX}joint_blocks.0.context_block.attn.qkv.weight" in model:
        return "mmdit"
    if f"{_PREFIX}cap_embedder.1.weight" in model:
        return "lumina2"
    norm = f"{_PREFIX}double_blocks.0.img_attn.norm.key_norm."
    if f"{_PREFIX}img_in.weight" in model and any(norm + p in model for p in ("scale", "weight")):
        return "bfl"
    return "ldm"


def _model_key(key: str) -> str:
    """An alias's target as a model key: original-layout keys never start with the prefix."""
    return key if key.startswith(_PREFIX) else _PREFIX + key


def _target(value: Alias) -> Target:
    if isinstance(value, str):
        return _model_key(value)
    key, offset, rows, *rest = value
    return Slice(_model_key(key), int(offset), int(rows), bool(rest[0]) if rest else False)


def key_map(
    model: dict[str, torch.Tensor],
    aliases: dict[str, Alias] | None = None,
    *,
    layout: str | None = None,
) -> dict[str, Target]:
    """Every adapter name ComfyUI accepts for this model -> the model weight (or rows) it
    patches. `layout` ("ldm", "bfl", "mmdit") overrides what the model's keys tell."""
    layout = layout or detect_layout(model)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout '{layout}': expected one of {', '.join(_LAYOUTS)}")
    out: dict[str, Target] = {}
    for key in model:
        if not key.startswith(_PREFIX):
            continue
        if key.endswith(".weight"):
            path = key[len(_PREFIX) : -len(".weight")]
            out["lora_unet_" + path.replace(".", "_")] = key
            out[key[: -len(".weight")]] = key
        else:
            out[key] = key
    for diffusers_key, value in (aliases or {}).items():
        if not diffusers_key.endswith(".weight"):
            continue
        target = _target(value)
        module = diffusers_key[: -len(".weight")]
        if layout != "ldm":
            for prefix, sep in _SPELLINGS[layout]:
                out[prefix + module.replace(".", sep)] = target
            continue
        out["lora_unet_" + module.replace(".", "_")] = target
        out["lycoris_" + module.replace(".", "_")] = target
        bare = module.replace(".to_", ".processor.to_")
        if bare.endswith(".to_out.0"):
            bare = bare[:-2]
        out[bare] = target
        out["unet." + bare] = target
    if layout == "bfl":
        _fused_qkv_names(model, out)
    _clip_names(model, out)
    return out


def _fused_qkv_names(model: dict[str, torch.Tensor], out: dict[str, Target]) -> None:
    """Flux's `<single block>.linear1_qkv`: the q, k, v rows of `linear1` as one name."""
    hidden = _FLUX_HIDDEN
    for source in ("img_in.weight", "txt_in.weight"):  # ComfyUI reads both; txt_in wins
        if _PREFIX + source in model:
            hidden = model[_PREFIX + source].shape[0]
    for key in model:
        if key.endswith(".weight") and ".linear1." in key:
            out[key.replace(".linear1.weight", ".linear1_qkv")] = Slice(key, 0, 3 * hidden)


def _clip_names(model: dict[str, torch.Tensor], out: dict[str, Target]) -> None:
    for key in model:
        if key.endswith(".weight") and not key.startswith("diffusion_model."):
            out["text_encoders." + key[: -len(".weight")]] = key
    has_l = has_g = False
    for layer in range(_CLIP_LAYERS):
        for path, kohya in _CLIP_MODULES:
            tail = f"text_model_encoder_layers_{layer}_{kohya}"
            diffusers = f"text_model.encoder.layers.{layer}.{path}"
            key = f"clip_h.transformer.{diffusers}.weight"
            if key in model:
                out["lora_te_" + tail] = out["lora_te1_" + tail] = key
                out["text_encoder." + diffusers] = key
            key = f"clip_l.transformer.{diffusers}.weight"
            if key in model:
                out["lora_te_" + tail] = out["lora_te1_" + tail] = key
                out["text_encoder." + diffusers] = key
                has_l = True
            key = f"clip_g.transformer.{diffusers}.weight"
            if key in model:
                has_g = True
                if has_l:
                    out["lora_te2_" + tail] = key
                    out["text_encoder_2." + diffusers] = key
                else:
                    out["lora_te_" + tail] = key
                    out["text_encoder." + diffusers] = key
                    out["lora_prior_te_" + tail] = key
    for key in model:
        if key.endswith(".weight") and key.startswith("t5xxl.transformer."):
            path = key[len("t5xxl.transformer.") : -len(".weight")].replace(".", "_")
            index = 1 + has_g + has_l
            if has_l and not has_g:
                out[f"lora_te2_{path}"] = key
                index = 3
            out[f"lora_te{index}_{path}"] = key
    if "clip_g.transformer.text_projection.weight" in model:
        out["lora_prior_te_text_projection"] = "clip_g.transformer.text_projection.weight"
        out["lora_te2_text_projection"] = "clip_g.transformer.text_projection.weight"
    if "clip_l.transformer.text_projection.weight" in model:
        out["lora_te1_text_projection"] = "clip_l.transformer.text_projection.weight"


_WAN_FUN = "lora_unet__blocks_0_cross_attn_k.lora_down.weight"


def _convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`comfy/lora_convert.py`: the one rename that can touch kohya-style files (Wan Fun)."""
    if _WAN_FUN not in tensors:
        return dict(tensors)
    return {
        ("lora_unet_" + k[len("lora_unet__") :] if k.startswith("lora_unet__") else k): v
        for k, v in tensors.items()
    }


def _patches(
    lora: dict[str, torch.Tensor], names: dict[str, Target], warnings: list[str]
) -> tuple[dict[Target, tuple[str, dict]], set[str]]:
    """`load_lora`: target -> (kind, tensors) and the file keys it read."""
    patches: dict[Target, tuple[str, dict]] = {}
    read: set[str] = set()
    for stem, target in names.items():
        alpha = lora.get(f"{stem}.alpha")
        dora = lora.get(f"{stem}.dora_scale")
        read.update(k for k in (f"{stem}.alpha", f"{stem}.dora_scale") if k in lora)
        common = {"alpha": alpha, "dora_scale": dora}
        for up, down, mid in _LORA_FORMS:
            if stem + up not in lora:
                continue
            if stem + down not in lora:
                raise Fatal(
                    f"{CLIENT}: KeyError '{stem + down}' aborts the load ({stem + up} has no down)"
                )
            parts = {"up": lora[stem + up], "down": lora[stem + down], **common}
            read.update((stem + up, stem + down))
            extra = [k for k in (stem + mid if mid else "", f"{stem}.reshape_weight") if k in lora]
            read.update(extra)
            if extra:
                warnings.append(
                    f"{CLIENT}: {stem}: {', '.join(extra)} not modelled here; not checked"
                )
            else:
                patches[target] = ("lowrank", parts)
            break
        if f"{stem}.hada_w1_a" in lora:
            missing = [p for p in _HADA if f"{stem}.{p}" not in lora]
            if missing:
                raise Fatal(f"{CLIENT}: KeyError '{stem}.{missing[0]}' aborts the load")
            parts = {p: lora[f"{stem}.{p}"] for p in _HADA}
            read.update(f"{stem}.{p}" for p in _HADA)
            if f"{stem}.hada_t1" in lora:
                read.update(k for k in (f"{stem}.hada_t1", f"{stem}.hada_t2") if k in lora)
                warnings.append(f"{CLIENT}: {stem}: hada_t1/t2 not modelled here; not checked")
            else:
                patches[target] = ("hadamard", {**parts, **common})
        found = {p: lora[f"{stem}.{p}"] for p in _LOKR if f"{stem}.{p}" in lora}
        if any(p in found for p in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a")):
            read.update(f"{stem}.{p}" for p in found)
            if "lokr_t2" in found:
                warnings.append(f"{CLIENT}: {stem}: lokr_t2 not modelled here; not checked")
            else:
                patches[target] = ("kronecker", {**found, **common})
        for part in _UNMODELLED:
            if f"{stem}.{part}" in lora:
                warnings.append(
                    f"{CLIENT}: {stem}: {part.split('.')[0]} adapters are not modelled here"
                )
        if isinstance(target, Slice):
            bias: str | None = "().bias"  # ComfyUI slices the tuple: '{}.bias'.format(())
        else:
            bias = target[: -len(".weight")] + ".bias" if target.endswith(".weight") else None
        for part, kind, on_bias in (
            ("w_norm", "diff", False),
            ("b_norm", "diff", True),
            ("diff", "diff", False),
            ("diff_b", "diff", True),
            ("set_weight", "set", False),
        ):
            key = f"{stem}.{part}"
            if key not in lora or (on_bias and bias is None):
                continue
            if part == "b_norm" and f"{stem}.w_norm" not in lora:
                continue  # ComfyUI reads b_norm only next to a w_norm
            read.add(key)
            patches[bias if on_bias else target] = (kind, {"value": lora[key]})
    return patches, read


def _scale(parts: dict, rank: int | None) -> float:
    alpha = parts.get("alpha")
    if alpha is None or rank is None:
        return 1.0
    return scalar(alpha) / rank


def _update(kind: str, parts: dict, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The unscaled ΔW reshaped to W, and its alpha / rank scale."""
    if kind == "lowrank":
        up, down = f32(parts["up"]), f32(parts["down"])
        delta = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        return delta, _scale(parts, down.shape[0])
    if kind == "hadamard":
        w1 = f32(parts["hada_w1_a"]) @ f32(parts["hada_w1_b"])
        w2 = f32(parts["hada_w2_a"]) @ f32(parts["hada_w2_b"])
        return (w1 * w2).reshape(weight.shape), _scale(parts, parts["hada_w1_b"].shape[0])
    rank = None
    for factor in ("1", "2"):
        if f"lokr_w{factor}" not in parts and f"lokr_w{factor}_b" not in parts:
            raise RuntimeError(f"lokr_w{factor} has neither a full nor a complete low-rank form")
    if "lokr_w1" in parts:
        w1 = f32(parts["lokr_w1"])
    else:
        rank = parts["lokr_w1_b"].shape[0]
        w1 = f32(parts["lokr_w1_a"]) @ f32(parts["lokr_w1_b"])
    if "lokr_w2" in parts:
        w2 = f32(parts["lokr_w2"])
    else:
        rank = parts["lokr_w2_b"].shape[0]
        w2 = f32(parts["lokr_w2_a"]) @ f32(parts["lokr_w2_b"])
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2).reshape(weight.shape), _scale(parts, rank)


def _decompose(
    key: str, weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor, strength: float
) -> tuple[torch.Tensor, list[str]]:
    merged = weight + delta
    # ComfyUI's per-output branch takes the norm of W, not of W + ΔW as DoRA does; the merged
    # weight carries that difference (it is not a warning: the client does it on purpose).
    per_output = magnitude.shape[0] == merged.shape[0]
    norm = (row_norm(weight) if per_output else col_norm(merged)) + torch.finfo(torch.float32).eps
    note = ratio_note(CLIENT, key, magnitude, norm)
    merged.mul_(magnitude / norm)  # in place, as ComfyUI does: an enlarging broadcast raises
    return weight + strength * (merged - weight), [note] if note else []


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """`swap_scale_shift`: the two row halves exchanged (its own inverse)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _calculate(
    key: str, kind: str, parts: dict, weight: torch.Tensor, strength: float, swap: bool = False
) -> tuple[torch.Tensor | None, list[str]]:
    """One patch on `weight` (the slice, for a sliced target); `swap` turns the update only."""
    turn = _swap_halves if swap else (lambda t: t)
    if kind == "set":
        return f32(parts["value"]).expand_as(weight).clone(), []
    if kind == "diff":
        value = f32(parts["value"])
        if value.shape != weight.shape:
            return None, [
                f"{CLIENT}: {key}: WARNING SHAPE MISMATCH, WEIGHT NOT MERGED "
                f"{shape(value)} != {shape(weight)}"
            ]
        return weight + turn(strength * value), []
    try:
        delta, scale = _update(kind, parts, weight)
        if parts.get("dora_scale") is not None:
            return _decompose(key, weight, turn(delta * scale), f32(parts["dora_scale"]), strength)
        return weight + turn((strength * scale) * delta), []
    except RuntimeError as err:
        return None, [f"{CLIENT}: ERROR {key}: {err} (weight left unpatched)"]


def _describe(target: Target) -> str:
    if isinstance(target, str):
        return target
    swap = ", swap_scale_shift" if target.swap else ""
    return f"{target.key} rows {target.offset}:{target.offset + target.rows}{swap}"


def apply(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    model: dict[str, torch.Tensor],
    *,
    strength: float = 1.0,
    aliases: dict[str, Alias] | None = None,
    layout: str | None = None,
) -> Applied:
    """Load `tensors` into `model` as ComfyUI's LoraLoader does, at `strength` (model and clip).

    `aliases` maps diffusers parameter keys to model keys or row slices (see the module's
    docstring); `layout` overrides the layout read off the model's keys (`detect_layout`).
    Patches on one weight apply in turn, each to its own rows, as `calculate_weight` does.
    """
    del metadata  # ComfyUI's loader reads no metadata
    lora = _convert(tensors)
    renamed = dict(zip(lora, tensors, strict=True))
    warnings: list[str] = []
    try:
        patches, read = _patches(lora, key_map(model, aliases, layout=layout), warnings)
    except Fatal as err:
        return failed(CLIENT, tensors, str(err))
    merged: dict[str, torch.Tensor] = {}
    for target, (kind, parts) in patches.items():
        key = target.key if isinstance(target, Slice) else target
        if key not in model:
            warnings.append(
                f"{CLIENT}: NOT LOADED {_describe(target)} (no such weight in the model)"
            )
            continue
        weight = merged[key] if key in merged else f32(model[key])
        if not isinstance(target, Slice):
            result, notes = _calculate(key, kind, parts, weight, strength)
            warnings += notes
            if result is not None:
                merged[key] = result
            continue
        stop = target.offset + target.rows
        if target.offset < 0 or target.rows < 0 or stop > weight.shape[0]:
            # `weight.narrow` raises outside ComfyUI's try: the patching itself fails.
            warnings.append(
                f"{CLIENT}: ERROR {_describe(target)}: outside the weight's {weight.shape[0]} rows"
                " (narrow raises; weight left unpatched)"
            )
            continue
        piece = weight[target.offset : stop]
        result, notes = _calculate(key, kind, parts, piece, strength, target.swap)
        warnings += notes
        if result is not None:
            weight = weight.clone()
            weight[target.offset : stop] = result
            merged[key] = weight
    unread = sorted(renamed[k] for k in lora if k not in read)
    warnings += [f"{CLIENT}: lora key not loaded: {k}" for k in unread]
    return Applied(CLIENT, merged, unread, warnings)
