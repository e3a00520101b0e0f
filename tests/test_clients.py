"""The client readers: each one's key matching, its patch arithmetic and its DoRA convention.

Every expected weight is written out here by hand (plain matrix products, norms taken by
explicit loops) on small synthetic models named as each client names them; nothing here goes
through the kit's exporter. Where the LyCORIS package is installed, its own loader is the
reference for the LyCORIS reader.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kit.export.clients import Applied, a1111, comfyui, lycoris, sdscripts
from tests.ldm_names import ldm_unet_map

R = 2  # rank of every test adapter


def rand(*dims: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*dims, generator=g)


def lora(
    stem: str, out: int, inn: int, k: int | None = None, alpha: float | None = 1.0, seed: int = 0
):
    """kohya LoRA tensors for one layer (k: conv kernel size, None for a Linear)."""
    if k is None:
        down, up = rand(R, inn, seed=seed), rand(out, R, seed=seed + 1)
    else:
        down, up = rand(R, inn, k, k, seed=seed), rand(out, R, 1, 1, seed=seed + 1)
    parts = {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up}
    if alpha is not None:
        parts[f"{stem}.alpha"] = torch.tensor(alpha)
    return parts


def product(parts: dict, stem: str, like: torch.Tensor) -> torch.Tensor:
    """up @ down, reshaped to the layer."""
    up, down = parts[f"{stem}.lora_up.weight"], parts[f"{stem}.lora_down.weight"]
    return (up.reshape(up.shape[0], -1) @ down.reshape(R, -1)).reshape(like.shape)


def per_row(w: torch.Tensor) -> torch.Tensor:
    """‖row i‖ for every output row, by a loop, shaped to broadcast over w."""
    norms = torch.stack([w[i].pow(2).sum().sqrt() for i in range(w.shape[0])])
    return norms.reshape(-1, *[1] * (w.dim() - 1))


def per_col(w: torch.Tensor) -> torch.Tensor:
    """‖column j‖ (over the output and spatial axes) for every input column, by a loop."""
    norms = torch.stack([w[:, j].pow(2).sum().sqrt() for j in range(w.shape[1])])
    return norms.reshape(1, -1, *[1] * (w.dim() - 2))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def clean(result: Applied) -> Applied:
    assert result.unconsumed == [], result.unconsumed
    assert result.warnings == [], result.warnings
    return result


# ------------------------------------------------------------------ models in each naming

LIN = (12, 8)  # a Linear's weight
CONV = (6, 4, 3, 3)  # a 3x3 conv
PW = (6, 4, 1, 1)  # a 1x1 conv

# (diffusers module, LDM module) for the three UNet layers every test model has.
UNET = {
    "down_blocks.0.attentions.0.proj_in": "input_blocks.1.1.proj_in",
    "down_blocks.0.resnets.0.conv1": "input_blocks.1.0.in_layers.2",
    "down_blocks.0.resnets.0.conv_shortcut": "input_blocks.1.0.skip_connection",
}
SHAPES = dict(zip(UNET, (LIN, CONV, PW), strict=True))
KOHYA = {name: "lora_unet_" + name.replace(".", "_") for name in UNET}
ATTN, RES, SKIP = KOHYA.values()


def unet(prefix: str, ldm: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, ldm_name) in enumerate(UNET.items()):
        out[f"{prefix}{ldm_name if ldm else name}.weight"] = rand(*SHAPES[name], seed=100 + i)
        out[f"{prefix}{ldm_name if ldm else name}.bias"] = rand(SHAPES[name][0], seed=200 + i)
    return out


def clip(prefix: str, seed: int) -> dict[str, torch.Tensor]:
    layer = f"{prefix}text_model.encoder.layers.0"
    return {
        f"{layer}.self_attn.q_proj.weight": rand(8, 8, seed=seed),
        f"{layer}.self_attn.k_proj.weight": rand(8, 8, seed=seed + 1),
        f"{layer}.self_attn.v_proj.weight": rand(8, 8, seed=seed + 2),
        f"{layer}.self_attn.out_proj.weight": rand(8, 8, seed=seed + 3),
        f"{layer}.mlp.fc1.weight": rand(16, 8, seed=seed + 4),
        f"{layer}.layer_norm1.weight": rand(8, seed=seed + 5),
    }


def comfy_model() -> dict[str, torch.Tensor]:
    return (
        unet("diffusion_model.", ldm=True)
        | clip("clip_l.transformer.", 10)
        | clip("clip_g.transformer.", 20)
    )


COMFY_ALIASES = {f"{k}.weight": f"{v}.weight" for k, v in UNET.items()}


# ------------------------------------------------------------------ the shared LDM map


def _diffusers_unet_keys(blocks: int, attn_down: set[int], attn_up: set[int]) -> list[str]:
    keys = ["conv_in.weight", "time_embedding.linear_1.weight", "conv_out.weight"]
    for i in range(blocks):
        for j in range(2):
            keys.append(f"down_blocks.{i}.resnets.{j}.conv1.weight")
            if i in attn_down:
                keys.append(f"down_blocks.{i}.attentions.{j}.proj_in.weight")
        for j in range(3):
            keys.append(f"up_blocks.{i}.resnets.{j}.conv_shortcut.weight")
            if i in attn_up:
                keys.append(f"up_blocks.{i}.attentions.{j}.transformer_blocks.0.attn1.to_q.weight")
        if i < blocks - 1:
            keys += [
                f"down_blocks.{i}.downsamplers.0.conv.weight",
                f"up_blocks.{i}.upsamplers.0.conv.weight",
            ]
    return keys + [
        "mid_block.resnets.1.time_emb_proj.weight",
        "mid_block.attentions.0.proj_out.weight",
    ]


def test_ldm_map_agrees_with_a1111_for_sd1_and_with_sd_scripts_for_sdxl():
    sd1 = ldm_unet_map(_diffusers_unet_keys(4, {0, 1, 2}, {1, 2, 3}))
    for key, ldm in sd1.items():
        if key.startswith("time_embedding") or key.startswith("conv"):
            continue  # A1111 spells these without the part; compared below
        module = key[: -len(".weight")]
        assert a1111.compvis_name(
            "lora_unet_" + module.replace(".", "_")
        ) == "diffusion_model_" + ldm[: -len(".weight")].replace(".", "_"), key
    assert sd1["up_blocks.0.upsamplers.0.conv.weight"] == "output_blocks.2.1.conv.weight"
    assert sd1["down_blocks.2.downsamplers.0.conv.weight"] == "input_blocks.9.0.op.weight"
    sdxl = ldm_unet_map(_diffusers_unet_keys(3, {1, 2}, {0, 1}))
    for key, ldm in sdxl.items():
        module = key[: -len(".weight")].replace(".", "_")
        assert sdscripts.sai_name(module) == ldm[: -len(".weight")].replace(".", "_"), key
    assert sdxl["up_blocks.0.upsamplers.0.conv.weight"] == "output_blocks.2.2.conv.weight"


# ------------------------------------------------------------------ ComfyUI


def test_comfyui_lora_on_linear_and_convs_through_both_namings():
    model = comfy_model()
    parts = lora(ATTN, *LIN, alpha=1.0, seed=1) | lora(RES, 6, 4, k=3, alpha=4.0, seed=3)
    parts |= lora("lora_unet_input_blocks_1_0_skip_connection", 6, 4, k=1, alpha=None, seed=5)
    got = clean(comfyui.apply(parts, {}, model, strength=0.5, aliases=COMFY_ALIASES))
    w = "diffusion_model.input_blocks.1.1.proj_in.weight"
    close(got.merged[w], model[w] + 0.5 * (1.0 / R) * product(parts, ATTN, model[w]))
    w = "diffusion_model.input_blocks.1.0.in_layers.2.weight"
    close(got.merged[w], model[w] + 0.5 * (4.0 / R) * product(parts, RES, model[w]))
    w = "diffusion_model.input_blocks.1.0.skip_connection.weight"  # no alpha: scale 1
    stem = "lora_unet_input_blocks_1_0_skip_connection"
    close(got.merged[w], model[w] + 0.5 * product(parts, stem, model[w]))
    assert set(got.merged) == {
        k for k in model if k.startswith("diffusion_model.") and k.endswith("weight")
    }


def test_comfyui_text_encoder_prefixes():
    names = comfyui.key_map(comfy_model())
    layer = "text_model_encoder_layers_0_self_attn_q_proj"
    assert names[f"lora_te1_{layer}"] == names[f"lora_te_{layer}"]
    assert names[f"lora_te1_{layer}"].startswith("clip_l.")
    assert names[f"lora_te2_{layer}"].startswith("clip_g.")
    assert "lora_te1_text_model_encoder_layers_0_layer_norm1" not in names  # only the 6 layer kinds
    t5 = {"t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight": rand(8, 8, seed=1)}
    sd3 = comfyui.key_map(comfy_model() | t5)
    flux = comfyui.key_map(clip("clip_l.transformer.", 10) | t5)
    t5_stem = "encoder_block_0_layer_0_SelfAttention_q"
    assert f"lora_te3_{t5_stem}" in sd3 and f"lora_te2_{t5_stem}" not in sd3
    assert f"lora_te2_{t5_stem}" in flux and f"lora_te3_{t5_stem}" in flux


def test_comfyui_loha_and_lokr_scale_once():
    model = comfy_model()
    w = model["diffusion_model.input_blocks.1.1.proj_in.weight"]
    loha = {
        f"{ATTN}.hada_w{i}_{p}": rand(*((12, R) if p == "a" else (R, 8)), seed=10 * i + ord(p))
        for i in (1, 2)
        for p in "ab"
    }
    loha[f"{ATTN}.alpha"] = torch.tensor(3.0)
    got = clean(comfyui.apply(loha, {}, model, aliases=COMFY_ALIASES))
    want = (loha[f"{ATTN}.hada_w1_a"] @ loha[f"{ATTN}.hada_w1_b"]) * (
        loha[f"{ATTN}.hada_w2_a"] @ loha[f"{ATTN}.hada_w2_b"]
    )
    close(got.merged["diffusion_model.input_blocks.1.1.proj_in.weight"], w + (3.0 / R) * want)
    low = {
        f"{ATTN}.lokr_w1": rand(3, 2, seed=1),
        f"{ATTN}.lokr_w2_a": rand(4, R, seed=2),
        f"{ATTN}.lokr_w2_b": rand(R, 4, seed=3),
    }
    low[f"{ATTN}.alpha"] = torch.tensor(1.0)
    got = clean(comfyui.apply(low, {}, model, aliases=COMFY_ALIASES))
    kron = torch.kron(low[f"{ATTN}.lokr_w1"], low[f"{ATTN}.lokr_w2_a"] @ low[f"{ATTN}.lokr_w2_b"])
    close(got.merged["diffusion_model.input_blocks.1.1.proj_in.weight"], w + (1.0 / R) * kron)
    full = {
        f"{ATTN}.lokr_w1": rand(3, 2, seed=1),
        f"{ATTN}.lokr_w2": rand(4, 4, seed=4),
        f"{ATTN}.alpha": torch.tensor(1.0),
    }
    got = clean(
        comfyui.apply(full, {}, model, aliases=COMFY_ALIASES)
    )  # no low-rank factor: no alpha
    close(
        got.merged["diffusion_model.input_blocks.1.1.proj_in.weight"],
        w + torch.kron(full[f"{ATTN}.lokr_w1"], full[f"{ATTN}.lokr_w2"]),
    )


def test_comfyui_dora_per_output_uses_the_unmerged_norm():
    model = comfy_model()
    key = "diffusion_model.input_blocks.1.1.proj_in.weight"
    w = model[key]
    parts = lora(ATTN, *LIN, alpha=1.0, seed=1)
    m = w.norm(dim=1, keepdim=True) * 1.1
    parts[f"{ATTN}.dora_scale"] = m
    got = clean(comfyui.apply(parts, {}, model, strength=0.5, aliases=COMFY_ALIASES))
    v = w + (1.0 / R) * product(parts, ATTN, w)
    eps = torch.finfo(torch.float32).eps
    dora = v * m / (per_row(w) + eps)  # ComfyUI: ‖W‖, not ‖W + ΔW‖
    close(got.merged[key], w + 0.5 * (dora - w))
    peft = v * m / per_row(v)
    assert not torch.allclose(dora, peft, atol=1e-4)


def test_comfyui_dora_per_input_and_the_conv_shapes():
    model = comfy_model()
    key = "diffusion_model.input_blocks.1.0.in_layers.2.weight"
    w = model[key]
    parts = lora(RES, 6, 4, k=3, alpha=2.0, seed=3)
    v = w + (2.0 / R) * product(parts, RES, w)
    m = per_col(w) * 0.9  # (1, in, 1, 1)
    got = clean(comfyui.apply(parts | {f"{RES}.dora_scale": m}, {}, model, aliases=COMFY_ALIASES))
    close(got.merged[key], v * m / (per_col(v) + torch.finfo(torch.float32).eps))
    out_4d = per_row(w)  # (out, 1, 1, 1): fine
    got = clean(
        comfyui.apply(parts | {f"{RES}.dora_scale": out_4d}, {}, model, aliases=COMFY_ALIASES)
    )
    close(got.merged[key], v * out_4d / (per_row(w) + torch.finfo(torch.float32).eps))
    out_2d = per_row(w).reshape(6, 1)  # (out, 1) on a conv: ComfyUI logs an error
    got = comfyui.apply(parts | {f"{RES}.dora_scale": out_2d}, {}, model, aliases=COMFY_ALIASES)
    assert key not in got.merged and got.unconsumed == []
    assert any("ERROR" in w for w in got.warnings)


def test_comfyui_unconsumed_keys_and_aborts():
    model = comfy_model()
    parts = lora(ATTN, *LIN, seed=1) | {"lora_unet_nowhere.lora_up.weight": rand(4, R, seed=9)}
    parts |= {f"{ATTN}.hada_w1_b_typo": rand(R, 8, seed=8)}
    got = comfyui.apply(parts, {}, model, aliases=COMFY_ALIASES)
    assert got.unconsumed == sorted(["lora_unet_nowhere.lora_up.weight", f"{ATTN}.hada_w1_b_typo"])
    no_down = {f"{ATTN}.lora_up.weight": rand(12, R, seed=1)}
    got = comfyui.apply(no_down, {}, model, aliases=COMFY_ALIASES)
    assert (
        got.merged == {}
        and got.unconsumed == [f"{ATTN}.lora_up.weight"]
        and "KeyError" in got.warnings[0]
    )


def test_comfyui_diff_patches():
    model = comfy_model()
    w, b = (
        "diffusion_model.input_blocks.1.1.proj_in.weight",
        "diffusion_model.input_blocks.1.1.proj_in.bias",
    )
    parts = {f"{ATTN}.diff": rand(*LIN, seed=1), f"{ATTN}.diff_b": rand(12, seed=2)}
    got = clean(comfyui.apply(parts, {}, model, strength=0.5, aliases=COMFY_ALIASES))
    close(got.merged[w], model[w] + 0.5 * parts[f"{ATTN}.diff"])
    close(got.merged[b], model[b] + 0.5 * parts[f"{ATTN}.diff_b"])
    got = comfyui.apply({f"{ATTN}.diff": rand(12, 4, seed=1)}, {}, model, aliases=COMFY_ALIASES)
    assert w not in got.merged and "SHAPE MISMATCH" in got.warnings[0]


# ------------------------------------------------------------------ A1111


def a1111_sd1() -> dict[str, torch.Tensor]:
    return unet("model.diffusion_model.", ldm=True) | clip("cond_stage_model.transformer.", 10)


def a1111_sdxl() -> dict[str, torch.Tensor]:
    hf = clip("", 20)
    hf["text_model.encoder.layers.0.mlp.fc1.bias"] = rand(16, seed=30)
    model = unet("model.diffusion_model.", ldm=True) | clip(
        "conditioner.embedders.0.transformer.", 10
    )
    return model | {
        f"conditioner.embedders.1.model.{k}": v for k, v in a1111.fuse_openclip(hf).items()
    }


def test_a1111_lora_sd1_names_and_scale():
    model = a1111_sd1()
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    parts = (
        lora(ATTN, *LIN, alpha=1.0, seed=1)
        | lora(RES, 6, 4, k=3, alpha=None, seed=3)
        | lora(te, 8, 8, alpha=4.0, seed=5)
    )
    got = clean(a1111.apply(parts, {}, model, strength=0.5))
    w = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    close(got.merged[w], model[w] + 0.5 * (1.0 / R) * product(parts, ATTN, model[w]))
    w = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    close(got.merged[w], model[w] + 0.5 * product(parts, RES, model[w]))
    w = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    close(got.merged[w], model[w] + 0.5 * (4.0 / R) * product(parts, te, model[w]))


def test_a1111_dora_is_per_input_column():
    model = a1111_sd1()
    key = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    w = model[key]
    parts = lora(ATTN, *LIN, alpha=1.0, seed=1)
    v = w + (1.0 / R) * product(parts, ATTN, w)
    m = per_col(w) * 1.2  # (1, in)
    got = clean(a1111.apply(parts | {f"{ATTN}.dora_scale": m}, {}, model, strength=0.5))
    close(got.merged[key], w + 0.5 * (v * m / per_col(v) - w))
    out = per_row(w)  # (out, 1): divides by the column norms all the same
    got = a1111.apply(parts | {f"{ATTN}.dora_scale": out}, {}, model)
    close(got.merged[key], v * out / per_col(v))
    assert got.unconsumed == [] and "wrong weights" in got.warnings[0]


def test_a1111_dora_on_convs():
    model = a1111_sd1()
    key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    w = model[key]
    parts = lora(RES, 6, 4, k=3, alpha=1.0, seed=3)
    v = w + (1.0 / R) * product(parts, RES, w)
    m = per_col(w)  # (1, in, 1, 1)
    got = clean(a1111.apply(parts | {f"{RES}.dora_scale": m}, {}, model))
    close(got.merged[key], v * m / per_col(v))
    got = a1111.apply(parts | {f"{RES}.dora_scale": per_row(w).reshape(6, 1)}, {}, model)
    assert key not in got.merged and "left unpatched" in got.warnings[-1]


def test_a1111_sdxl_text_encoders_and_upsampler():
    model = a1111_sdxl()
    te1 = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    te2 = {
        p: f"lora_te2_text_model_encoder_layers_0_self_attn_{p}_proj"
        for p in ("q", "k", "v", "out")
    }
    parts = lora(te1, 8, 8, seed=1)
    for i, stem in enumerate(te2.values()):
        parts |= lora(stem, 8, 8, seed=10 + 2 * i)
    parts |= lora("lora_te2_text_model_encoder_layers_0_mlp_fc1", 16, 8, seed=30)
    got = clean(a1111.apply(parts, {}, model))
    w = "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    close(got.merged[w], model[w] + (1 / R) * product(parts, te1, model[w]))
    fused = "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"
    rows = [product(parts, te2[p], model[fused][:8]) for p in "qkv"]
    close(got.merged[fused], model[fused] + (1 / R) * torch.cat(rows))
    out = "conditioner.embedders.1.model.transformer.resblocks.0.attn.out_proj.weight"
    close(got.merged[out], model[out] + (1 / R) * product(parts, te2["out"], model[out]))
    fc = "conditioner.embedders.1.model.transformer.resblocks.0.mlp.c_fc.weight"
    assert fc in got.merged
    partial = {k: v for k, v in parts.items() if not k.startswith(te2["out"])}
    got = a1111.apply(partial, {}, model)
    assert fused not in got.merged and got.unconsumed == []
    assert "silently not applied" in got.warnings[0]
    up = lora("lora_unet_up_blocks_0_upsamplers_0_conv", 6, 4, k=3)  # SDXL's is output_blocks.2.2
    model["model.diffusion_model.output_blocks.2.2.conv.weight"] = rand(*CONV, seed=5)
    assert a1111.apply(up, {}, model).unconsumed == sorted(up)


def test_a1111_lycoris_types_and_refusals():
    model = a1111_sd1()
    key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    w = model[key]
    loha = {
        f"{RES}.hada_w{i}_{p}": rand(*((6, R) if p == "a" else (R, 36)), seed=10 * i + ord(p))
        for i in (1, 2)
        for p in "ab"
    }
    loha[f"{RES}.alpha"] = torch.tensor(1.0)
    got = clean(a1111.apply(loha, {}, model))
    h = (loha[f"{RES}.hada_w1_a"] @ loha[f"{RES}.hada_w1_b"]) * (
        loha[f"{RES}.hada_w2_a"] @ loha[f"{RES}.hada_w2_b"]
    )
    close(got.merged[key], w + (1.0 / R) * h.reshape(w.shape))
    full = {f"{RES}.diff": rand(*CONV, seed=3), f"{RES}.alpha": torch.tensor(8.0)}
    got = clean(a1111.apply(full, {}, model, strength=0.5))  # diff: no alpha scaling
    close(got.merged[key], w + 0.5 * full[f"{RES}.diff"])
    extra = lora(RES, 6, 4, k=3) | {f"{RES}.diff_b": rand(6, seed=1)}  # LoRA wins; diff_b unread
    assert a1111.apply(extra, {}, model).unconsumed == [f"{RES}.diff_b"]
    norm = lora("lora_te_text_model_encoder_layers_0_layer_norm1", 8, 8)
    got = a1111.apply(norm, {}, model)  # a LoRA on a LayerNorm fails the whole file
    assert got.merged == {} and "AssertionError" in got.warnings[0]


# ------------------------------------------------------------------ sd-scripts


def scripts_sd1() -> dict[str, torch.Tensor]:
    extra = {"unet.conv_in.weight": rand(4, 4, 3, 3, seed=7)}
    return unet("unet.", ldm=False) | clip("text_encoder.", 10) | extra


def test_sd_scripts_lora_and_what_it_skips():
    model = scripts_sd1()
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    parts = (
        lora(ATTN, *LIN, alpha=None, seed=1)
        | lora(RES, 6, 4, k=3, alpha=0.0, seed=3)
        | lora(te, 8, 8, alpha=1.0, seed=5)
    )
    parts[f"{ATTN}.dora_scale"] = rand(12, 1, seed=9)
    outside = lora("lora_unet_conv_in", 4, 4, k=3, seed=11)
    loha = {f"{SKIP}.hada_w1_a": rand(6, R, seed=12)}
    got = sdscripts.apply(parts | outside | loha, {}, model, strength=0.5)
    w = "unet.down_blocks.0.attentions.0.proj_in.weight"  # no alpha: alpha = rank
    close(got.merged[w], model[w] + 0.5 * product(parts, ATTN, model[w]))
    w = "unet.down_blocks.0.resnets.0.conv1.weight"  # alpha 0: alpha = rank
    close(got.merged[w], model[w] + 0.5 * product(parts, RES, model[w]))
    w = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.weight"
    close(got.merged[w], model[w] + 0.5 * (1.0 / R) * product(parts, te, model[w]))
    assert got.unconsumed == sorted([f"{ATTN}.dora_scale", *outside, *loha])
    assert "DoRA magnitude ignored" in got.warnings[0]


def test_sd_scripts_sdxl_converts_diffusers_names_and_checks_shapes():
    model = unet("unet.", ldm=True) | clip("text_encoder1.", 10) | clip("text_encoder2.", 20)
    model["unet.input_blocks.4.1.proj_in.weight"] = model.pop(
        "unet.input_blocks.1.1.proj_in.weight"
    )
    te2 = "lora_te2_text_model_encoder_layers_0_mlp_fc1"
    parts = lora("lora_unet_down_blocks_1_attentions_0_proj_in", *LIN, seed=1) | lora(
        te2, 16, 8, seed=3
    )
    parts |= lora(RES, 6, 4, k=3, seed=5)
    got = clean(sdscripts.apply(parts, {}, model))
    w = "unet.input_blocks.4.1.proj_in.weight"
    close(
        got.merged[w],
        model[w]
        + (1 / R) * product(parts, "lora_unet_down_blocks_1_attentions_0_proj_in", model[w]),
    )
    assert "unet.input_blocks.1.0.in_layers.2.weight" in got.merged
    assert "text_encoder2.text_model.encoder.layers.0.mlp.fc1.weight" in got.merged
    flat = {
        f"{RES}.lora_down.weight": rand(R, 4, seed=1),
        f"{RES}.lora_up.weight": rand(6, R, seed=2),
    }
    got = sdscripts.apply(flat, {}, model)  # 2-D factors for a 3x3 conv: size mismatch
    assert got.merged == {} and "size mismatch" in got.warnings[0]


# ------------------------------------------------------------------ LyCORIS


def test_lycoris_locon_dora_and_loha_scaling():
    model = scripts_sd1()
    key = "unet.down_blocks.0.attentions.0.proj_in.weight"
    w = model[key]
    parts = lora(ATTN, *LIN, alpha=1.0, seed=1)
    m = per_row(w) * 1.1
    got = clean(lycoris.apply(parts | {f"{ATTN}.dora_scale": m}, {}, model, strength=0.5))
    v = w + (1.0 / R) * product(parts, ATTN, w)
    ratio = m / (per_row(v) + torch.finfo(torch.float32).eps)
    close(got.merged[key], v * (0.5 * (ratio - 1) + 1))
    loha = {
        f"{ATTN}.hada_w{i}_{p}": rand(*((12, R) if p == "a" else (R, 8)), seed=10 * i + ord(p))
        for i in (1, 2)
        for p in "ab"
    }
    loha[f"{ATTN}.alpha"] = torch.tensor(1.0)
    h = (loha[f"{ATTN}.hada_w1_a"] @ loha[f"{ATTN}.hada_w1_b"]) * (
        loha[f"{ATTN}.hada_w2_a"] @ loha[f"{ATTN}.hada_w2_b"]
    )
    forward = lycoris.apply(loha, {}, model)
    close(forward.merged[key], w + 0.5 * h)
    assert "twice" in forward.warnings[0]
    merged = lycoris.apply(loha, {}, model, merge=True)
    close(merged.merged[key], w + 0.25 * h)


def test_lycoris_refusals():
    model = scripts_sd1()
    conv = "unet.down_blocks.0.resnets.0.conv1.weight"
    parts = lora(RES, 6, 4, k=3) | {f"{RES}.dora_scale": per_row(model[conv]).reshape(6, 1)}
    assert "cannot be copied" in lycoris.apply(parts, {}, model).warnings[0]
    per_input = lora(ATTN, *LIN) | {f"{ATTN}.dora_scale": rand(1, 8, seed=1)}
    assert "cannot be copied" in lycoris.apply(per_input, {}, model).warnings[0]
    assert "no alpha" in lycoris.apply(lora(ATTN, *LIN, alpha=None), {}, model).warnings[0]
    only_alpha = {f"{ATTN}.alpha": torch.tensor(1.0)}
    assert "recognises" in lycoris.apply(only_alpha, {}, model).warnings[0]
    sdxl = unet("unet.", ldm=True) | clip("text_encoder1.", 10) | clip("text_encoder2.", 20)
    diffusers_named = lora(ATTN, *LIN)  # LyCORIS does not rename: nothing loads
    got = lycoris.apply(diffusers_named, {}, sdxl)
    assert got.merged == {} and got.unconsumed == sorted(diffusers_named)


def test_lycoris_lokr_factor_shapes():
    assert lycoris.factorization(128) == (8, 16) and lycoris.factorization(127) == (1, 127)
    assert lycoris.factorization(250, 8) == (5, 50) and lycoris.factorization(360, 4) == (4, 90)
    model = scripts_sd1()
    key = "unet.down_blocks.0.attentions.0.proj_in.weight"
    good = {f"{ATTN}.lokr_w1": rand(3, 2, seed=1), f"{ATTN}.lokr_w2_a": rand(4, 1, seed=2)}
    good |= {f"{ATTN}.lokr_w2_b": rand(1, 4, seed=3), f"{ATTN}.alpha": torch.tensor(0.5)}
    got = lycoris.apply(good, {}, model)
    kron = torch.kron(
        good[f"{ATTN}.lokr_w1"], good[f"{ATTN}.lokr_w2_a"] @ good[f"{ATTN}.lokr_w2_b"]
    )
    close(got.merged[key], model[key] + 0.5 * kron)
    bad = {f"{ATTN}.lokr_w1": rand(3, 2, seed=1), f"{ATTN}.lokr_w2_a": rand(4, 2, seed=2)}
    bad |= {f"{ATTN}.lokr_w2_b": rand(2, 4, seed=3), f"{ATTN}.alpha": torch.tensor(1.0)}
    assert (
        "do not fit" in lycoris.apply(bad, {}, model).warnings[0]
    )  # rank 2 >= 4/2: LyCORIS wants w2 full


class _Unet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)


def _lycoris_files() -> dict[str, dict[str, torch.Tensor]]:
    conv_w = torch.ones(6, 1, 1, 1) * 2
    loha = {
        f"lora_unet_proj.hada_w{i}_{p}": rand(
            *((12, R) if p == "a" else (R, 8)), seed=10 * i + ord(p)
        )
        for i in (1, 2)
        for p in "ab"
    }
    return {
        "lora": lora("lora_unet_proj", *LIN, alpha=1.0, seed=1)
        | lora("lora_unet_conv", 6, 4, k=3, alpha=3.0, seed=3),
        "dora": lora("lora_unet_proj", *LIN, seed=1)
        | {"lora_unet_proj.dora_scale": rand(12, 1, seed=5).abs() + 1}
        | lora("lora_unet_conv", 6, 4, k=3, seed=3)
        | {"lora_unet_conv.dora_scale": conv_w},
        "loha": loha | {"lora_unet_proj.alpha": torch.tensor(1.0)},
        "lokr": {
            "lora_unet_proj.lokr_w1": rand(3, 2, seed=1),
            "lora_unet_proj.lokr_w2_a": rand(4, 1, seed=2),
            "lora_unet_proj.lokr_w2_b": rand(1, 4, seed=3),
            "lora_unet_proj.alpha": torch.tensor(0.5),
        },
        "full": {
            "lora_unet_proj.diff": rand(*LIN, seed=4),
            "lora_unet_proj.diff_b": rand(12, seed=5),
        },
    }


@pytest.mark.parametrize("name", ["lora", "dora", "loha", "lokr", "full"])
def test_lycoris_reader_matches_the_lycoris_package(name):
    import lycoris.kohya as kohya  # a declared test dependency: never skipped

    torch.manual_seed(0)
    base = _Unet()
    model = {f"unet.{k}": v.detach().clone() for k, v in base.state_dict().items()}
    file = _lycoris_files()[name]
    net, _ = kohya.create_network_from_weights(0.5, None, None, None, base, weights_sd=dict(file))
    ours = lycoris.apply(file, {}, model, strength=0.5)
    ours_merged = lycoris.apply(file, {}, model, merge=True)
    assert ours.unconsumed == [] and len(net.unet_loras) == len({k.split(".")[0] for k in file})
    for module in net.unet_loras:
        layer = module.org_module[0]
        key = "unet." + module.lora_name[len("lora_unet_") :] + ".weight"
        with torch.no_grad():
            weight, _ = module.get_merged_weight(1.0, layer.weight.shape, layer.weight.device)
            close(ours_merged.merged[key], weight.float())
            if isinstance(layer, nn.Linear):  # the forward at 0.5, probed with unit inputs
                module.apply_to()
                probe = torch.eye(8)
                got = module(probe) - module(torch.zeros(1, 8))  # minus the (patched) bias
                close(ours.merged[key], got.T)
                module.restore()
    assert math.isfinite(sum(float(t.sum()) for t in ours.merged.values()))


# ------------------------------------------------------------------ a real diffusers UNet


@pytest.mark.parametrize("xl", [False, True], ids=["sd1-layout", "sdxl-layout"])
def test_readers_agree_on_a_diffusers_unet_in_the_standard_layout(xl):
    """LoRA on every Linear and conv of a tiny two-resnets-per-block UNet: the clients that
    hold it in the LDM layout patch the same weights to the same values, and miss only what
    their rules say they miss."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    down = (
        ("DownBlock2D", "CrossAttnDownBlock2D") if xl else ("CrossAttnDownBlock2D", "DownBlock2D")
    )
    up = ("CrossAttnUpBlock2D", "UpBlock2D") if xl else ("UpBlock2D", "CrossAttnUpBlock2D")
    net = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(8, 16),
        layers_per_block=2,
        down_block_types=down,
        up_block_types=up,
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
        **(
            {
                "addition_embed_type": "text_time",
                "addition_time_embed_dim": 4,
                "projection_class_embeddings_input_dim": 16,
            }
            if xl
            else {}
        ),
    )
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    aliases = ldm_unet_map(weights)
    ldm = {aliases[k]: v for k, v in weights.items()}
    file: dict[str, torch.Tensor] = {}
    for i, (name, layer) in enumerate(net.named_modules()):
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            out, inn, *k = layer.weight.shape
            stem = "lora_unet_" + name.replace(".", "_")
            file[f"{stem}.lora_down.weight"] = rand(R, inn, *k, seed=i)
            file[f"{stem}.lora_up.weight"] = rand(out, R, *[1] * len(k), seed=i + 1000)
            file[f"{stem}.alpha"] = torch.tensor(1.0)
    comfy = comfyui.apply(
        file, {}, {"diffusion_model." + k: v for k, v in ldm.items()}, aliases=aliases
    )
    sdxl_marker = {"conditioner.embedders.0.transformer.x.weight": torch.zeros(1, 1)} if xl else {}
    auto = a1111.apply(
        file, {}, {"model.diffusion_model." + k: v for k, v in ldm.items()} | sdxl_marker
    )
    kohya = sdscripts.apply(file, {}, {"unet." + k: v for k, v in (ldm if xl else weights).items()})
    assert comfy.clean and not auto.warnings and not kohya.warnings
    missed = {k.split(".")[0] for k in kohya.unconsumed}
    assert missed == {
        "lora_unet_conv_in",
        "lora_unet_conv_out",
        "lora_unet_time_embedding_linear_1",
        "lora_unet_time_embedding_linear_2",
    } | ({"lora_unet_add_embedding_linear_1", "lora_unet_add_embedding_linear_2"} if xl else set())
    a1111_missed = {k.split(".")[0] for k in auto.unconsumed}
    assert a1111_missed == (
        {
            "lora_unet_add_embedding_linear_1",
            "lora_unet_add_embedding_linear_2",
            "lora_unet_up_blocks_0_upsamplers_0_conv",
        }
        if xl
        else set()
    )
    to_diffusers = {v: k for k, v in aliases.items()}
    for key, value in kohya.merged.items():
        diffusers_key = to_diffusers.get(key[len("unet.") :], key[len("unet.") :])
        close(comfy.merged["diffusion_model." + aliases[diffusers_key]], value)
    for key, value in auto.merged.items():
        close(comfy.merged[key[len("model.") :]], value)


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_two_independent_ldm_namings_agree(name, tiny_base):
    """The kit's LDM names (from the UNet config, `kit.families.ldm`) and this file's (from the
    keys alone) name every weight of the tiny UNets alike."""
    from diffusers import UNet2DConditionModel

    from kit.families.ldm import ldm_aliases

    unet = UNet2DConditionModel.from_pretrained(tiny_base(name), subfolder="unet")
    from_keys = ldm_unet_map(unet.state_dict())
    from_config = ldm_aliases(unet.config)
    weights = [k for k in unet.state_dict() if k.endswith(".weight")]
    assert weights and all(from_config[k] == from_keys[k] for k in weights)
