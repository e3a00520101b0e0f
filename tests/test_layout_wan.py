"""Wan's original layout: full weights and adapter files in the names ComfyUI and musubi-tuner use.

Each check reads the written tensors back the way a client does, independently of the writer:
diffusers' own original→diffusers converter and `from_single_file` for full weights, ComfyUI's
generic key rule (`lora_unet_` + the weight's path with underscores, or the dotted path after
`diffusion_model.`) with the plain LoRA / LoHa / LoKr / DoRA arithmetic for adapters, and
diffusers' Wan LoRA reader for the two LoRA namings it accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kit.errors import KitError
from kit.families import get_family
from kit.families.wan.layout import (
    kohya_lora,
    lycoris_keys,
    module_map,
    original_name,
    to_original,
)
from kit.methods.adapters import adapter_state_dict

ALPHA, RANK = 3.0, 4
ADAPTER_PARTS = ("lora_", "hada_", "lokr_")


@pytest.fixture(scope="module")
def wan_base(tiny_base) -> Path:
    return tiny_base("wan")


@pytest.fixture(scope="module")
def wan_config(wan_base) -> dict:
    return json.loads((wan_base / "transformer" / "config.json").read_text())


def load_transformer(base: Path) -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(base, subfolder="transformer")


def tiny_i2v() -> nn.Module:
    """An image-to-video transformer: CLIP image tokens and the extra k_img / v_img projections."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=36,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=128,
        num_layers=2,
        image_dim=16,
        added_kv_proj_dim=64,
        rope_max_seq_len=32,
    )


def from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own reader of original Wan checkpoints (what `from_single_file` runs)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state))


# ---------------------------------------------------------------- full weights


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_module_map_names_every_weight_once(kind, wan_base):
    model = load_transformer(wan_base) if kind == "t2v" else tiny_i2v()
    names = module_map(dict(model.config))
    holders = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv3d | nn.LayerNorm | nn.RMSNorm)
        and any(True for _ in m.parameters(recurse=False))
    ]
    assert holders and set(holders) <= set(names)
    assert len(set(names.values())) == len(names)  # no two weights share an original name
    for key in model.state_dict():
        owner = key.rpartition(".")[0]
        assert key in names or owner in names, key
    if kind == "i2v":
        assert names["blocks.1.attn2.add_k_proj"] == "blocks.1.cross_attn.k_img"
        assert names["blocks.1.attn2.norm_added_k"] == "blocks.1.cross_attn.norm_k_img"
        assert names["condition_embedder.image_embedder.ff.net.2"] == "img_emb.proj.3"


def test_the_layer_norms_and_modulations_take_their_original_places(wan_config):
    names = module_map(wan_config)
    # The affine norm before the cross-attention is the original's norm3.
    assert names["blocks.0.norm2"] == "blocks.0.norm3"
    assert names["scale_shift_table"] == "head.modulation"
    assert names["blocks.1.scale_shift_table"] == "blocks.1.modulation"
    assert names["proj_out"] == "head.head"
    assert names["condition_embedder.time_proj"] == "time_projection.1"


def test_full_weights_load_back_exactly_with_from_single_file(wan_base, wan_config, tmp_path):
    from diffusers import WanTransformer3DModel

    model = load_transformer(wan_base)
    state = model.state_dict()
    original = to_original(state, wan_config)
    # The keys ComfyUI's detector and loader look for, with no prefix.
    assert {"head.modulation", "head.head.weight", "blocks.0.ffn.0.weight"} <= set(original)
    assert {"patch_embedding.weight", "blocks.1.self_attn.o.weight"} <= set(original)
    # diffusers' converter gives back exactly the model's keys: none left over, none missing.
    converted = from_original(original)
    assert set(converted) == set(state)
    path = tmp_path / "wan_t2v.safetensors"
    save_file(original, str(path))
    back = WanTransformer3DModel.from_single_file(
        str(path), config=str(wan_base), subfolder="transformer", local_files_only=True
    )
    loaded = back.state_dict()
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert loaded[key].device.type != "meta", key
        assert torch.equal(loaded[key], value), key


def test_image_to_video_weights_round_trip():
    model = tiny_i2v()
    state = model.state_dict()
    original = to_original(state, dict(model.config))
    assert {"img_emb.proj.0.weight", "blocks.0.cross_attn.v_img.weight"} <= set(original)
    assert "blocks.0.cross_attn.norm_k_img.weight" in original
    converted = from_original(original)
    assert set(converted) == set(state)
    assert all(torch.equal(converted[k], state[k]) for k in state)


def test_a_weight_the_original_layout_lacks_is_refused(wan_config):
    state = {"blocks.0.attn1.to_qkv.weight": torch.zeros(192, 64)}  # fused projections
    with pytest.raises(KitError, match=r"blocks\.0\.attn1\.to_qkv\.weight"):
        to_original(state, wan_config)
    with pytest.raises(KitError, match="vace_blocks"):
        original_name("vace_blocks.0.proj_out.weight")


# ---------------------------------------------------------------- adapters


def adapted(base: Path, config) -> nn.Module:
    """The tiny transformer with an adapter on the family's default targets plus the
    feed-forward layers, every adapter weight drawn at random (so no factor is zero)."""
    model = load_transformer(base)
    model.add_adapter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ADAPTER_PARTS):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def targets() -> list[str]:
    return [*get_family("wan").default_lora_targets, "ffn.net.0.proj", "ffn.net.2"]


def base_weights(model: nn.Module, config: dict) -> dict[str, torch.Tensor]:
    """The adapted model's own (unmerged) weights in the original layout."""
    state = {
        k.replace(".base_layer", ""): v
        for k, v in model.state_dict().items()
        if not any(part in k for part in ADAPTER_PARTS)
    }
    return to_original(state, config)


def merged_by_peft(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged in by peft, in diffusers naming."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {
        k.replace(".base_layer", ""): v.detach().clone()
        for k, v in model.state_dict().items()
        if not any(part in k for part in ADAPTER_PARTS)
    }


def comfy_stems(original: dict[str, torch.Tensor], prefix: str) -> dict[str, str]:
    """ComfyUI's generic adapter key → weight rule (`model_lora_keys_unet`): `lora_unet_` and
    the weight's path with underscores, or the dotted path after `diffusion_model.`."""
    out = {}
    for key in original:
        if key.endswith(".weight"):
            path = key.removesuffix(".weight")
            stem = prefix + path if prefix.endswith(".") else f"{prefix}_{path.replace('.', '_')}"
            out[stem] = key
    return out


def group(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """File keys by module stem: the stem is everything before the first dot, or for a dotted
    prefix everything before the part names."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        for part in ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale", "hada_", "lokr_"):
            stem, sep, rest = key.partition("." + part)
            if sep:
                groups.setdefault(stem, {})[part + rest] = value
                break
        else:
            raise AssertionError(f"{key}: no part a reader knows")
    return groups


def plain_delta(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A module's update as LyCORIS-style readers compute it, scaled by alpha / rank."""
    alpha = float(parts["alpha"])
    if "lora_down.weight" in parts:
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        return (up @ down) * (alpha / down.shape[0])
    if "hada_w1_a" in parts:
        w1 = parts["hada_w1_a"] @ parts["hada_w1_b"]
        w2 = parts["hada_w2_a"] @ parts["hada_w2_b"]
        return w1 * w2 * (alpha / parts["hada_w1_b"].shape[0])
    w1 = parts.get("lokr_w1")
    w1 = w1 if w1 is not None else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    w2 = parts.get("lokr_w2")
    w2 = w2 if w2 is not None else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    inner = [parts[p].shape[0] for p in ("lokr_w1_b", "lokr_w2_b") if p in parts]
    return torch.kron(w1, w2).reshape(shape) * (alpha / inner[0] if inner else 1.0)


def apply_plainly(
    original: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """The original weights with a file's updates added; every key of the file must be used."""
    stems = comfy_stems(original, prefix)
    out = dict(original)
    used = 0
    for stem, parts in group(tensors).items():
        assert stem in stems, f"{stem}: ComfyUI finds no weight for it"
        key = stems[stem]
        weight = original[key] + plain_delta(parts, original[key].shape)
        if "dora_scale" in parts:
            norm = weight.norm(dim=1, keepdim=True)
            weight = weight * (parts["dora_scale"] / norm)
        out[key] = weight
        used += len(parts)
    assert used == len(tensors)
    return out


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.allclose(ours[key], value, atol=1e-5, rtol=0), key


@pytest.mark.parametrize("prefix", ["lora_unet", "diffusion_model."])
def test_lora_file_applied_plainly_equals_peft_merge(prefix, wan_base, wan_config):
    from peft import LoraConfig

    model = adapted(wan_base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets()))
    base = base_weights(model, wan_config)
    tensors = kohya_lora(adapter_state_dict(model), ALPHA, RANK, prefix)
    if prefix == "lora_unet":
        # musubi-tuner's names for the module of each kind.
        assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in tensors
        assert "lora_unet_blocks_1_cross_attn_o.lora_up.weight" in tensors
        assert float(tensors["lora_unet_blocks_1_ffn_2.alpha"]) == ALPHA
    else:
        assert "diffusion_model.blocks.0.ffn.0.lora_down.weight" in tensors
    merged = from_original(apply_plainly(base, tensors, prefix))
    assert_same_weights(merged, merged_by_peft(model))


@pytest.mark.parametrize(
    ("prefix", "chosen"),
    [("lora_unet", "full"), ("diffusion_model.", "default")],
    ids=["lora_unet-every-projection", "diffusion_model-attention-only"],
)
def test_diffusers_reads_the_lora_file_as_peft_trained_it(prefix, chosen, wan_base):
    from diffusers import WanPipeline
    from peft import LoraConfig

    chosen_targets = targets() if chosen == "full" else list(get_family("wan").default_lora_targets)
    model = adapted(wan_base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=chosen_targets))
    state = adapter_state_dict(model)
    # diffusers' reader scales some factors in place: hand it copies, keep `state` as trained.
    tensors = {k: v.clone() for k, v in kohya_lora(state, ALPHA, RANK, prefix).items()}
    read = WanPipeline.lora_state_dict(tensors)
    assert {k.removeprefix("transformer.") for k in read} == set(state)
    for key in state:
        if key.endswith("lora_A.weight"):
            b_key = key.replace("lora_A", "lora_B")
            ours = read[f"transformer.{b_key}"] @ read[f"transformer.{key}"]
            assert torch.allclose(ours, state[b_key] @ state[key] * (ALPHA / RANK), atol=1e-6)


def test_dora_file_applied_plainly_equals_peft_merge(wan_base, wan_config):
    from peft import LoraConfig

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets(), use_dora=True)
    model = adapted(wan_base, config)
    with torch.no_grad():  # magnitudes near the weights' own row norms, as trained ones are
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.copy_(p.abs() + 1.0)
    state = adapter_state_dict(model)
    base = base_weights(model, wan_config)
    tensors = kohya_lora(state, ALPHA, RANK)
    assert tensors["lora_unet_blocks_0_ffn_0.dora_scale"].shape == (128, 1)
    merged = from_original(apply_plainly(base, tensors, "lora_unet"))
    assert_same_weights(merged, merged_by_peft(model))


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_file_applied_plainly_equals_peft_merge(kind, wan_base, wan_config):
    from peft import LoHaConfig, LoKrConfig

    cls = LoHaConfig if kind == "loha" else LoKrConfig
    model = adapted(wan_base, cls(r=RANK, alpha=ALPHA, target_modules=targets()))
    state = adapter_state_dict(model)
    base = base_weights(model, wan_config)
    tensors = lycoris_keys(state, ALPHA, RANK)
    part = "hada_w1_a" if kind == "loha" else "lokr_w1"
    assert f"lora_unet_blocks_0_self_attn_q.{part}" in tensors
    merged = from_original(apply_plainly(base, tensors, "lora_unet"))
    assert_same_weights(merged, merged_by_peft(model))


def test_image_to_video_adapters_take_the_image_projection_names():
    state = {
        "blocks.2.attn2.add_k_proj.lora_A.weight": torch.zeros(RANK, 64),
        "blocks.2.attn2.add_v_proj.lora_B.weight": torch.zeros(64, RANK),
    }
    tensors = kohya_lora(state, ALPHA, RANK)
    assert set(tensors) == {
        "lora_unet_blocks_2_cross_attn_k_img.lora_down.weight",
        "lora_unet_blocks_2_cross_attn_k_img.alpha",
        "lora_unet_blocks_2_cross_attn_v_img.lora_up.weight",
        "lora_unet_blocks_2_cross_attn_v_img.alpha",
    }


def test_adapter_weights_the_layout_cannot_hold_are_refused():
    with pytest.raises(KitError, match="hada_w1_a"):
        kohya_lora({"blocks.0.attn1.to_q.hada_w1_a": torch.zeros(64, RANK)}, ALPHA, RANK)
    with pytest.raises(KitError, match="lora_A"):
        lycoris_keys({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(RANK, 64)}, ALPHA, RANK)


def test_the_lora_file_saves_as_safetensors(wan_base, tmp_path):
    from peft import LoraConfig

    model = adapted(wan_base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets()))
    tensors = kohya_lora(adapter_state_dict(model), ALPHA, RANK)
    path = tmp_path / "wan_lora.safetensors"
    save_file(tensors, str(path))
    back = load_file(str(path))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
