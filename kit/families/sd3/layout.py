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
