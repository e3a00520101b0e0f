"""SD3 / SD3.5 in Stability's original MMDiT layout: full transformer weights and adapter files.

diffusers names the transformer `transformer_blocks.N.attn.to_q`, ...; Stability's checkpoints,
sd-scripts, ComfyUI and Forge name it `joint_blocks.N.x_block.attn.qkv`, ... Three things make
the layouts more than a renaming:

* q, k and v are one fused `qkv` Linear in the original, three Linears in diffusers (for the
  image side `attn`, the text side `context_block.attn` and SD3.5's second image attention
  `attn2`). `module_map` gives each diffusers module its rows of the fused weight.
* The last block's text side is "pre-only": it keeps its q, k, v and its modulation but has no
  output projection and no MLP, and its modulation (like the final layer's) holds two chunks in
  the order shift, scale where diffusers' continuous norm wants scale, shift.
* SD3.5 adds per-head RMS norms of q and k (`ln_q`, `ln_k`) and, in SD3.5-medium's first
  blocks, the second attention `attn2` whose modulation has 9 chunks instead of 6.

Adapter files follow sd-scripts' SD3 LoRA naming (`lora_unet_<original module, dots as
underscores>.lora_down.weight / .lora_up.weight / .alpha`), the one name every SD3 client
resolves: ComfyUI and Forge turn each `diffusion_model.<key>.weight` of the loaded model into
`lora_unet_<key with _>`, and sd-scripts builds its modules under the same names. A LoRA on
q, k and v becomes one LoRA on `qkv` whose down matrix stacks the parts' downs and whose up
matrix is block-diagonal, which is the same update, exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from kit.errors import ConfigError, KitError

Tensor = torch.Tensor

KOHYA_PREFIX = "lora_unet"
"""Stem prefix of denoiser modules in sd-scripts' SD3 LoRA files (and in ComfyUI / Forge)."""

LYCORIS_DIFFUSERS_PREFIX = "lycoris"
"""Stem prefix of ComfyUI's other SD3 adapter naming: diffusers module names, which ComfyUI
maps onto the fused rows itself (SimpleTuner's LyCORIS files use it)."""

# Diffusers module (under the transformer) → original module, outside the blocks.
_TOP = {
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "proj_out": "final_layer.linear",
}

# Inside block N: diffusers suffix → (original suffix, part of a fused q/k/v or None).
_QKV = {
    "attn.to_q": ("x_block.attn.qkv", 0),
    "attn.to_k": ("x_block.attn.qkv", 1),
    "attn.to_v": ("x_block.attn.qkv", 2),
    "attn.add_q_proj": ("context_block.attn.qkv", 0),
    "attn.add_k_proj": ("context_block.attn.qkv", 1),
    "attn.add_v_proj": ("context_block.attn.qkv", 2),
    "attn2.to_q": ("x_block.attn2.qkv", 0),
    "attn2.to_k": ("x_block.attn2.qkv", 1),
    "attn2.to_v": ("x_block.attn2.qkv", 2),
}
_BLOCK = {
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn2.to_out.0": "x_block.attn2.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
}
_BLOCKS = "transformer_blocks."
_QKV_PARTS = 3

Parts = dict[str, Tensor]
"""One module's adapter tensors by part name (`lora_A.weight`, `hada_w1_a`, ...)."""
Members = dict[int, tuple[str, Parts, float]]
"""The adapted parts of one fused q/k/v: part index → (diffusers module, tensors, peft scale)."""


def _split(module: str) -> tuple[str, int | None]:
    """(original module, part of a fused q/k/v or None) for a diffusers module name; KitError
    naming the module when the original layout has no place for it."""
    if module in _TOP:
        return _TOP[module], None
    head, _, rest = module.partition(".")
    index, _, suffix = rest.partition(".")
    if head + "." == _BLOCKS and index.isdigit():
        if suffix in _QKV:
            orig, part = _QKV[suffix]
            return f"joint_blocks.{index}.{orig}", part
        if suffix in _BLOCK:
            return f"joint_blocks.{index}.{_BLOCK[suffix]}", None
    raise KitError(f"{module}: no module of the SD3 original (MMDiT) layout corresponds to it")


def _needs_swap(module: str, rows: int, in_features: int) -> bool:
    """Whether a module's output rows come as (scale, shift) in diffusers and (shift, scale) in
    the original: the final layer's modulation and the pre-only last block's text modulation.
    That last one is told apart by its shape: two chunks (2·dim rows) where other blocks have six."""
    if module == "norm_out.linear":
        return True
    return module.endswith(".norm1_context.linear") and rows == 2 * in_features


def _swap_halves(t: Tensor) -> Tensor:
    """Rows (a, b) → (b, a): converts between shift-scale and scale-shift order, both ways."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


# ------------------------------------------------------------------ config


def _get(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConfigError(f"transformer config: '{key}' is missing; SD3's config.json sets it")
    return config[key]


def _dims(config: Mapping[str, Any]) -> dict[str, Any]:
    """What the layout depends on: block count, widths, SD3.5's extra attention and qk norms."""
    heads, head_dim = (
        int(_get(config, "num_attention_heads")),
        int(_get(config, "attention_head_dim")),
    )
    patch = int(_get(config, "patch_size"))
    out_channels = config.get("out_channels") or _get(config, "in_channels")
    return {
        "layers": int(_get(config, "num_layers")),
        "dim": heads * head_dim,
        "head_dim": head_dim,
        "caption_dim": int(config.get("caption_projection_dim") or heads * head_dim),
        "out_rows": patch * patch * int(out_channels),
        # SD3.5's additions: configs written before SD3.5 have neither key.
        "dual": {int(i) for i in config.get("dual_attention_layers") or ()},
        "qk_norm": config.get("qk_norm") is not None,
    }


def module_map(config: Mapping[str, Any]) -> dict[str, tuple[str, int, int]]:
    """Every weight-carrying diffusers module → (original module, row offset, row count).

    A q, k or v projection holds `count` rows from `offset` of the fused `qkv`; every other
    module is its original module whole (offset 0, all its rows). Norms of q and k (SD3.5) are
    included with their `head_dim` weights. `config` is the transformer's config (its
    `config.json` or `model.config`).
    """
    d = _dims(config)
    dim, last = d["dim"], d["layers"] - 1
    rows = {
        "pos_embed.proj": dim,
        "time_text_embed.timestep_embedder.linear_1": dim,
        "time_text_embed.timestep_embedder.linear_2": dim,
        "time_text_embed.text_embedder.linear_1": dim,
        "time_text_embed.text_embedder.linear_2": dim,
        "context_embedder": d["caption_dim"],
        "norm_out.linear": 2 * dim,
        "proj_out": d["out_rows"],
    }
    out = {module: (_TOP[module], 0, n) for module, n in rows.items()}
    for i in range(d["layers"]):
        sides = ["attn.to_", "attn.add_"] + (["attn2.to_"] if i in d["dual"] else [])
        block: dict[str, int] = {
            "attn.to_out.0": dim,
            "norm1.linear": (9 if i in d["dual"] else 6) * dim,
            "norm1_context.linear": (2 if i == last else 6) * dim,
            "ff.net.0.proj": 4 * dim,
            "ff.net.2": dim,
        }
        if i != last:  # the pre-only text side has no output projection and no MLP
            block.update(
                {"attn.to_add_out": dim, "ff_context.net.0.proj": 4 * dim, "ff_context.net.2": dim}
            )
        if i in d["dual"]:
            block["attn2.to_out.0"] = dim
        if d["qk_norm"]:
            norms = ["attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k"]
            norms += ["attn2.norm_q", "attn2.norm_k"] if i in d["dual"] else []
            block.update(dict.fromkeys(norms, d["head_dim"]))
        for side in sides:
            for letter in "qkv":
                block[f"{side}{letter}_proj" if side == "attn.add_" else f"{side}{letter}"] = dim
        for suffix, n in block.items():
            orig, part = _split(f"{_BLOCKS}{i}.{suffix}")
            out[f"{_BLOCKS}{i}.{suffix}"] = (orig, (part or 0) * n, n)
    return out


# ------------------------------------------------------------------ full weights


def swapped_modules(config: Mapping[str, Any]) -> frozenset[str]:
    """Diffusers modules whose two output-row halves are exchanged in the original layout: the
    final layer's modulation and the pre-only last block's text modulation."""
    last = int(_get(config, "num_layers")) - 1
    return frozenset({"norm_out.linear", f"{_BLOCKS}{last}.norm1_context.linear"})


def to_original(
    state: Mapping[str, Tensor], config: Mapping[str, Any], prefix: str = ""
) -> dict[str, Tensor]:
    """A diffusers SD3Transformer2DModel state dict → the original layout, the same weights.

    `prefix` goes before every key: "" for a diffusion-model-only file (ComfyUI's
    `diffusion_models` folder), "model.diffusion_model." for an all-in-one checkpoint. Every key
    of `state` must find its place, or KitError names the first that does not.
    """
    swapped = swapped_modules(config)
    pieces: dict[str, dict[int, Tensor]] = defaultdict(dict)
    whole: dict[str, Tensor] = {}
    used: set[str] = set()
    for module, (orig, offset, count) in module_map(config).items():
        fused = _split(module)[1] is not None
        for param in ("weight", "bias"):
            key = f"{module}.{param}"
            if key not in state:
                if param == "weight":
                    raise KitError(f"{key}: missing from the state dict the config describes")
                continue
            t = state[key]
            used.add(key)
            if t.shape[0] != count:
                raise KitError(f"{key}: {t.shape[0]} rows where the config gives {count}")
            t = _swap_halves(t) if module in swapped else t
            if fused:
                pieces[f"{orig}.{param}"][offset] = t
            else:
                whole[f"{orig}.{param}"] = t
    for key, parts in pieces.items():
        if len(parts) != _QKV_PARTS:
            raise KitError(f"{key}: needs q, k and v, the state dict has {len(parts)} of them")
        whole[key] = torch.cat([parts[o] for o in sorted(parts)], dim=0)
    if "pos_embed.pos_embed" not in state:
        raise KitError("pos_embed.pos_embed: missing (the config needs pos_embed_max_size)")
    whole["pos_embed"] = state["pos_embed.pos_embed"]
    used.add("pos_embed.pos_embed")
    left = sorted(set(state) - used)
    if left:
        raise KitError(f"{left[0]}: no place for it in the SD3 original layout ({len(left)} keys)")
    return {prefix + k: v.contiguous() for k, v in whole.items()}


# ------------------------------------------------------------------ LoRA


def _group(state: Mapping[str, Tensor], parts: set[str], what: str) -> dict[str, dict[str, Tensor]]:
    """peft keys `<module>.<part>` → module → part → tensor; KitError for a foreign part."""
    modules: dict[str, dict[str, Tensor]] = defaultdict(dict)
    for key, value in state.items():
        found = next((p for p in parts if key.endswith("." + p)), None)
        if found is None:
            raise KitError(f"{key}: not a {what} weight (parts: {', '.join(sorted(parts))})")
        modules[key[: -len(found) - 1]][found] = value
    return modules


def kohya_lora(
    peft_state: Mapping[str, Tensor], alpha: float, rank: int | None = None
) -> dict[str, Tensor]:
    """peft LoRA (and DoRA) weights on the diffusers SD3 transformer → sd-scripts' SD3 keys.

    Keys are `lora_unet_<original module>.lora_down.weight`, `.lora_up.weight` and `.alpha`
    (plus `.dora_scale` for DoRA), as ComfyUI, Forge and sd-scripts read them: the update is
    alpha / rank · up @ down, rank being the rows of down. Parts of a fused `qkv` become one
    module: down stacks the parts' downs, up places each part's up in its rows and its own
    columns (zeros elsewhere), and alpha is written so that alpha / (summed rank) equals the
    trained scale. `rank` is the trained rank (None: each module's own).
    """
    magnitude = "lora_magnitude_vector"
    modules = _group(peft_state, {"lora_A.weight", "lora_B.weight", magnitude}, "LoRA")
    fused: dict[str, Members] = defaultdict(dict)
    out: dict[str, Tensor] = {}
    for module, parts in modules.items():
        orig, part = _split(module)
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            raise KitError(f"{module}: needs both lora_A.weight and lora_B.weight")
        down, up = parts["lora_A.weight"], parts["lora_B.weight"]
        scale = alpha / (rank or down.shape[0])  # peft's scale, r its config rank
        stem = f"{KOHYA_PREFIX}_{orig.replace('.', '_')}"
        if part is not None:
            fused[stem][part] = (module, parts, scale)
            continue
        swap = _needs_swap(module, up.shape[0], down.shape[1])
        out[f"{stem}.lora_down.weight"] = down.contiguous()
        out[f"{stem}.lora_up.weight"] = (_swap_halves(up) if swap else up).contiguous()
        out[f"{stem}.alpha"] = torch.tensor(scale * down.shape[0])
        if magnitude in parts:
            # DoRA's magnitude is per output row, shaped (rows, 1) as kohya readers broadcast it.
            m = parts[magnitude]
            out[f"{stem}.dora_scale"] = (_swap_halves(m) if swap else m).reshape(-1, 1)
    for stem, members in fused.items():
        out.update(_fused_lora(stem, members, magnitude))
    return out


def _fused_lora(stem: str, members: Members, magnitude: str) -> dict[str, Tensor]:
    """One kohya module for the q / k / v LoRAs of a fused `qkv`, the same update exactly."""
    order = sorted(members)
    downs = [members[p][1]["lora_A.weight"] for p in order]
    ups = [members[p][1]["lora_B.weight"] for p in order]
    rows = {u.shape[0] for u in ups}
    if len(rows) != 1:
        raise KitError(f"{stem}: q, k and v adapters of unequal widths {sorted(rows)}")
    width, total = rows.pop(), sum(d.shape[0] for d in downs)
    part_scales = [members[p][2] for p in order]
    uniform = all(s == part_scales[0] for s in part_scales)
    up = ups[0].new_zeros(_QKV_PARTS * width, total)
    col = 0
    for p, u, s in zip(order, ups, part_scales, strict=True):
        # Unequal scales (per-module ranks) are folded into the up blocks; alpha is then total.
        up[p * width : (p + 1) * width, col : col + u.shape[1]] = u if uniform else u * s
        col += u.shape[1]
    out = {
        f"{stem}.lora_down.weight": torch.cat(downs, dim=0).contiguous(),
        f"{stem}.lora_up.weight": up,
        f"{stem}.alpha": torch.tensor((part_scales[0] if uniform else 1.0) * total),
    }
    mags = [members[p][1].get(magnitude) for p in order]
    if any(m is not None for m in mags):
        # DoRA rescales each output row of the fused weight, so every row needs its magnitude:
        # rows of an unadapted part would need the base weight's own norms, which are not here.
        if len(order) != _QKV_PARTS or any(m is None for m in mags):
            raise KitError(
                f"{stem}: DoRA on part of q, k, v cannot be written fused; adapt all three"
            )
        out[f"{stem}.dora_scale"] = torch.cat(mags, dim=0).reshape(-1, 1)
    return out


# ------------------------------------------------------------------ LoHa / LoKr

_LOHA = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
_LOKR = {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"}


def _reader_dim(parts: Mapping[str, Tensor]) -> int | None:
    """The inner size readers divide alpha by (ComfyUI's `lora.py` / Forge's `patcher/lora.py`):
    LoHa's w1_b rows; LoKr's w2_b rows, else w1_b rows, else none (the update is unscaled)."""
    for name in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b"):
        if name in parts:
            return parts[name].shape[0]
    return None


def _written(parts: dict[str, Tensor], scale: float) -> tuple[dict[str, Tensor], Tensor]:
    """Parts and the alpha that makes a reader apply `scale`; an unscaled LoKr gets it in w1."""
    dim = _reader_dim(parts)
    if dim is None:
        # Readers apply a LoKr with no low-rank factor unscaled, whatever its alpha.
        return {**parts, "lokr_w1": parts["lokr_w1"] * scale}, torch.tensor(1.0)
    return parts, torch.tensor(scale * dim)


def _swap_rows(module: str, parts: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same update with its two row halves exchanged (scale-shift ↔ shift-scale)."""
    if "hada_w1_a" in parts:
        # Each factor pair's rows are the update's rows: permute both first factors.
        return {
            **parts,
            "hada_w1_a": _swap_halves(parts["hada_w1_a"]),
            "hada_w2_a": _swap_halves(parts["hada_w2_a"]),
        }
    # kron(w1, w2): row i·c + j comes from w1's row i, so halves of w1 are halves of the update.
    name = "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"
    if parts[name].shape[0] % 2:
        raise KitError(
            f"{module}: a LoKr whose first factor has an odd row count ({parts[name].shape[0]}) "
            "cannot have its scale and shift rows exchanged; set lokr_factor so it is even"
        )
    return {**parts, name: _swap_halves(parts[name])}


def lycoris_keys(
    peft_state: Mapping[str, Tensor],
    alpha: float,
    rank: int | None = None,
    *,
    layout: str = "original",
) -> dict[str, Tensor]:
    """peft LoHa / LoKr weights on the diffusers SD3 transformer → a LyCORIS file for SD3.

    `layout="original"`: stems `lora_unet_<original module>`, as sd-scripts + LyCORIS name
    them; ComfyUI and Forge both read it. A fused `qkv` holds its parts exactly for LoHa (block
    factors, as for LoRA) and for a LoKr on one of q, k, v (zero rows around it); a LoKr on two
    or three of them has no single Kronecker form, and KitError says to use the other layout.

    `layout="diffusers"`: stems `lycoris_<diffusers module>`, ComfyUI's other SD3 naming, where
    ComfyUI itself slices q, k, v into the fused weight and swaps the modulation halves. Exact
    for everything, but Forge does not read it (its SD3 diffusers-name mapping is disabled).

    Parts keep peft's names (`hada_w1_a` ..., `lokr_w1` ...); alpha is written so that readers'
    alpha / inner size is peft's alpha / `rank` (None: each module's own rank).
    """
    if layout not in ("original", "diffusers"):
        raise KitError(f"layout '{layout}': expected 'original' or 'diffusers'")
    modules = _group(peft_state, _LOHA | _LOKR, "LoHa or LoKr")
    out: dict[str, Tensor] = {}
    fused: dict[str, Members] = defaultdict(dict)
    for module, parts in modules.items():
        parts = dict(parts)
        scale = alpha / (rank or _trained_rank(module, parts))
        orig, part = _split(module)
        stem = f"{KOHYA_PREFIX}_{orig.replace('.', '_')}"
        if layout == "diffusers":
            stem = f"{LYCORIS_DIFFUSERS_PREFIX}_{module.replace('.', '_')}"
        elif part is not None:
            fused[stem][part] = (module, parts, scale)
            continue
        elif _needs_swap(module, *_update_shape(parts)):
            parts = _swap_rows(module, parts)
        parts, written_alpha = _written(parts, scale)
        out.update({f"{stem}.{name}": value.contiguous() for name, value in parts.items()})
        out[f"{stem}.alpha"] = written_alpha
    for stem, members in fused.items():
        out.update(_fused_lycoris(stem, members))
    return out


def _trained_rank(module: str, parts: Mapping[str, Tensor]) -> int:
    """peft's r read off the factors: the low-rank inner size readers divide by."""
    dim = _reader_dim(parts)
    if dim is None:
        raise KitError(f"{module}: a LoKr without low-rank factors needs the trained rank passed")
    return dim


def _update_shape(parts: Mapping[str, Tensor]) -> tuple[int, int]:
    """(rows, input features) of the update a LoHa / LoKr module makes."""
    if "hada_w1_a" in parts:
        return parts["hada_w1_a"].shape[0], parts["hada_w1_b"].shape[1]
    w1 = [parts[p] for p in ("lokr_w1", "lokr_w1_a", "lokr_w1_b") if p in parts]
    w2 = [parts[p] for p in ("lokr_w2", "lokr_w2_a", "lokr_w2_b") if p in parts]
    return w1[0].shape[0] * w2[0].shape[0], w1[-1].shape[1] * w2[-1].shape[1]


def _fused_lycoris(stem: str, members: Members) -> dict[str, Tensor]:
    """One LyCORIS module for the q / k / v adapters of a fused `qkv`, the same update."""
    order = sorted(members)
    scales = [members[p][2] for p in order]
    parts = [members[p][1] for p in order]
    if all("hada_w1_a" in p for p in parts):
        return _fused_loha(stem, order, parts, scales)
    if any("hada_w1_a" in p for p in parts):
        raise KitError(f"{stem}: LoHa and LoKr mixed within one fused q, k, v")
    if len(order) > 1:
        names = ", ".join(members[p][0] for p in order)
        raise KitError(
            f"{stem}: a LoKr on {len(order)} of q, k, v ({names}) has no single Kronecker form "
            "in the fused original layout; write lycoris_keys(..., layout='diffusers'), which "
            "ComfyUI loads (Forge does not), or leave all but one of them out of the targets"
        )
    p, lokr = order[0], dict(parts[0])
    # kron(w1, w2) rows come in blocks of w2's rows; a part's rows are whole blocks, so zero
    # rows of w1 around it place the part's update in its rows of the fused weight.
    name = "lokr_w1" if "lokr_w1" in lokr else "lokr_w1_a"
    w1 = lokr[name]
    padded = w1.new_zeros(_QKV_PARTS * w1.shape[0], *w1.shape[1:])
    padded[p * w1.shape[0] : (p + 1) * w1.shape[0]] = w1
    lokr[name] = padded
    lokr, a = _written(lokr, scales[0])
    return {**{f"{stem}.{k}": v.contiguous() for k, v in lokr.items()}, f"{stem}.alpha": a}


def _fused_loha(
    stem: str, order: list[int], parts: list[Parts], scales: list[float]
) -> dict[str, Tensor]:
    """(w1a·w1b) ⊙ (w2a·w2b) with block factors: each part's a-factors in its rows and own
    columns, b-factors stacked, so every part's rows are its own Hadamard product."""
    width = parts[0]["hada_w1_a"].shape[0]
    total = sum(p["hada_w1_b"].shape[0] for p in parts)
    uniform = all(s == scales[0] for s in scales)
    out: dict[str, Tensor] = {}
    for side in ("1", "2"):
        a_name, b_name = f"hada_w{side}_a", f"hada_w{side}_b"
        a = parts[0][a_name].new_zeros(_QKV_PARTS * width, total)
        col = 0
        for p, part, s in zip(order, parts, scales, strict=True):
            block = part[a_name]
            if not uniform and side == "1":
                block = block * s  # unequal scales folded into w1's blocks; alpha is then total
            a[p * width : (p + 1) * width, col : col + block.shape[1]] = block
            col += block.shape[1]
        out[f"{stem}.{a_name}"] = a
        out[f"{stem}.{b_name}"] = torch.cat([p[b_name] for p in parts], dim=0).contiguous()
    out[f"{stem}.alpha"] = torch.tensor((scales[0] if uniform else 1.0) * total)
    return out


# ------------------------------------------------------------------ reading a file back


def _file_delta(parts: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
    """The update one module of an adapter file makes, with ComfyUI's and Forge's arithmetic:
    alpha / inner size times up·down, (w1a·w1b) ⊙ (w2a·w2b) or kron(w1, w2)."""
    p = {k: v.float() for k, v in parts.items()}
    alpha = float(p["alpha"]) if "alpha" in p else None
    if "lora_up.weight" in p:
        dim = p["lora_down.weight"].shape[0]
        delta = p["lora_up.weight"].flatten(1) @ p["lora_down.weight"].flatten(1)
    elif "hada_w1_a" in p:
        dim = p["hada_w1_b"].shape[0]
        delta = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
    else:
        w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
        w2 = p["lokr_w2"] if "lokr_w2" in p else p["lokr_w2_a"] @ p["lokr_w2_b"]
        dim = _reader_dim(p)
        delta = torch.kron(w1[:, :, None, None] if w2.ndim == 4 else w1, w2)
    return delta.reshape(shape) * (alpha / dim if alpha is not None and dim else 1.0)


@torch.no_grad()
def merge_adapter_file(tensors: Mapping[str, Tensor], transformer: torch.nn.Module) -> int:
    """Add an SD3 adapter file's updates into a plain diffusers SD3 transformer, as ComfyUI
    would apply it to the original model; return how many file modules were applied.

    Reads both namings this module writes: `lora_unet_<original module>` (LoRA, DoRA, LoHa,
    LoKr; a fused module is rebuilt from its diffusers parts, updated, and cut back) and
    `lycoris_<diffusers module>`. So an export can be checked against the model that trained.
    """
    mapping = module_map(transformer.config)
    swapped = swapped_modules(transformer.config)
    modules = dict(transformer.named_modules())
    by_orig: dict[str, list[str]] = defaultdict(list)
    for module, (orig, _, _) in mapping.items():
        by_orig[f"{KOHYA_PREFIX}_{orig.replace('.', '_')}"].append(module)
    direct = {f"{LYCORIS_DIFFUSERS_PREFIX}_{m.replace('.', '_')}": m for m in mapping}
    grouped: dict[str, dict[str, Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        stem, _, part = key.partition(".")
        grouped[stem][part] = value
    for stem, parts in grouped.items():
        if stem in direct:
            weight = modules[direct[stem]].weight
            weight += _file_delta(parts, weight.shape).to(weight.dtype)
            continue
        if stem not in by_orig:
            raise KitError(f"{stem}: no module of this SD3 transformer has that name")
        members = sorted(by_orig[stem], key=lambda m: mapping[m][1])
        pieces = [modules[m].weight.float() for m in members]
        base = torch.cat(
            [_swap_halves(w) if m in swapped else w for m, w in zip(members, pieces, strict=True)]
        )
        merged = base + _file_delta(parts, base.shape)
        if "dora_scale" in parts:
            norm = merged.flatten(1).norm(dim=1).reshape(-1, *([1] * (merged.ndim - 1)))
            merged = merged * parts["dora_scale"].float().reshape(norm.shape) / norm
        for m in members:
            _, offset, count = mapping[m]
            rows = merged[offset : offset + count]
            modules[m].weight.copy_(_swap_halves(rows) if m in swapped else rows)
    return len(grouped)
