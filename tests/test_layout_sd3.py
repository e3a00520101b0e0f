"""SD3's original (MMDiT) layout: full weights round-trip through diffusers' own single-file
loader, and adapter files applied the way ComfyUI / Forge / sd-scripts apply them give back
peft's merged weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
from peft import (
    LoraConfig,
    get_peft_model_state_dict,
    inject_adapter_in_model,
)
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from torch import nn

from kit.errors import ConfigError, KitError
from kit.families import get_family
from kit.families.sd3.layout import (
    kohya_lora,
    module_map,
    swapped_modules,
    to_original,
)
from kit.families.shipped import config_source

# SD3.5's additions at tiny size: q/k RMS norms and the second image attention, in the first
# block and in the pre-only last one.
DUAL = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 3,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "joint_attention_dim": 96,
    "caption_projection_dim": 32,
    "pooled_projection_dim": 64,
    "out_channels": 16,
    "pos_embed_max_size": 96,
    "qk_norm": "rms_norm",
    "dual_attention_layers": [0, 2],
}
ALPHA, RANK = 8.0, 4
FF = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
EVERYWHERE = [
    *FF,
    "norm1.linear",
    "norm1_context.linear",
    "norm_out.linear",
    "proj_out",
    "context_embedder",
    "pos_embed.proj",
    "linear_1",
    "linear_2",
]


def _randomize(module: nn.Module, seed: int, only: tuple[str, ...] = ()) -> None:
    """Every parameter (or those whose name has one of `only`) drawn afresh, so that halves,
    parts and norms are all told apart."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not only or any(s in name for s in only):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module", params=["tiny", "dual"])
def base(request, tiny_base, tmp_path_factory):
    """(model folder, transformer with random weights): the kit's tiny SD3 and a tiny SD3.5."""
    if request.param == "tiny":
        folder = tiny_base("sd3")
        model = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    else:
        folder = tmp_path_factory.mktemp("sd35-tiny")
        torch.manual_seed(0)
        model = SD3Transformer2DModel(**DUAL)
        model.save_pretrained(folder / "transformer")
    _randomize(model, seed=3)
    return folder, model.eval()


# ------------------------------------------------------------------ full weights


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_full_weights_round_trip_through_diffusers_single_file_loader(base, tmp_path, prefix):
    folder, model = base
    state = model.state_dict()
    path = tmp_path / "sd3.safetensors"
    save_file(to_original(state, model.config, prefix=prefix), str(path))

    back = SD3Transformer2DModel.from_single_file(
        str(path), config=str(folder), subfolder="transformer", local_files_only=True
    ).state_dict()
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_original_keys_are_stabilitys(base):
    _, model = base
    orig = to_original(model.state_dict(), model.config)
    last = model.config.num_layers - 1
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    assert orig["joint_blocks.0.x_block.attn.qkv.weight"].shape == (3 * dim, dim)
    assert orig["pos_embed"].shape[-1] == dim and "x_embedder.proj.weight" in orig
    # The pre-only text side keeps q, k, v and a two-chunk modulation, nothing else.
    assert f"joint_blocks.{last}.context_block.attn.qkv.weight" in orig
    assert orig[f"joint_blocks.{last}.context_block.adaLN_modulation.1.weight"].shape[0] == 2 * dim
    assert not any(k.startswith(f"joint_blocks.{last}.context_block.mlp") for k in orig)
    assert f"joint_blocks.{last}.context_block.attn.proj.weight" not in orig
    dual = bool(model.config.dual_attention_layers)
    assert ("joint_blocks.0.x_block.attn2.qkv.weight" in orig) == dual
    assert ("joint_blocks.0.x_block.attn.ln_q.weight" in orig) == dual


def test_unknown_or_missing_weights_are_named(base):
    _, model = base
    state = dict(model.state_dict())
    with pytest.raises(KitError, match="extra.weight"):
        to_original({**state, "extra.weight": torch.zeros(1)}, model.config)
    del state["transformer_blocks.0.attn.to_k.weight"]
    with pytest.raises(KitError, match="transformer_blocks.0.attn.to_k.weight"):
        to_original(state, model.config)
    with pytest.raises(ConfigError, match="num_layers"):
        module_map({k: v for k, v in model.config.items() if k != "num_layers"})


# ------------------------------------------------------------------ module map


def _check_map(model: nn.Module, config) -> None:
    mapping = module_map(config)
    weighted = {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)}
    assert linears <= set(mapping) and set(mapping) == weighted
    modules = dict(model.named_modules())
    covered: dict[str, list[tuple[int, int]]] = {}
    for name, (orig, offset, count) in mapping.items():
        assert modules[name].weight.shape[0] == count, name
        covered.setdefault(orig, []).append((offset, count))
    # Each original module is cut into whole, non-overlapping row ranges from 0.
    for orig, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(
            a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)
        ), orig
        assert len(ranges) in (1, 3), orig


def test_module_map_covers_every_weight_of_the_tiny_models(base):
    _, model = base
    _check_map(model, model.config)
    last = model.config.num_layers - 1
    assert swapped_modules(model.config) == {
        "norm_out.linear",
        f"transformer_blocks.{last}.norm1_context.linear",
    }


@pytest.mark.slow
def test_module_map_covers_sd35_medium_as_released():
    from accelerate import init_empty_weights

    path = Path(config_source("sd35m")) / "transformer" / "config.json"
    config = json.loads(path.read_text())
    with init_empty_weights():
        model = SD3Transformer2DModel.from_config(config)
    _check_map(model, config)
    mapping = module_map(config)
    assert mapping["transformer_blocks.12.attn2.to_k"] == (
        "joint_blocks.12.x_block.attn2.qkv",
        1536,
        1536,
    )
    assert "transformer_blocks.13.attn2.to_q" not in mapping
    assert mapping["transformer_blocks.23.norm1_context.linear"][2] == 2 * 1536


# ------------------------------------------------------------------ adapters


def _adapt(model: nn.Module, config, seed: int = 1):
    """(peft weights, peft's merged state dict) for random adapter weights on a copy."""
    net = inject_adapter_in_model(config, copy.deepcopy(model))
    _randomize(net, seed, only=("lora_", "hada_", "lokr_"))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "magnitude" in name:
                p.abs_().add_(0.5)
    state = get_peft_model_state_dict(net)
    merged = dict(model.state_dict())
    for name, module in net.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[f"{name}.weight"] = module.get_base_layer().weight.detach().clone()
    return state, merged


def _delta(parts: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """A module's update with the readers' arithmetic (ComfyUI `lora.py` `calculate_weight`,
    Forge `patcher/lora.py` `merge_lora_to_weight`, sd-scripts `LoRAModule`)."""
    alpha = float(parts["alpha"])
    if "lora_up.weight" in parts:
        up, down = parts["lora_up.weight"], parts["lora_down.weight"]
        return (up.flatten(1) @ down.flatten(1)).reshape(shape) * alpha / down.shape[0]
    if "hada_w1_a" in parts:
        m1 = parts["hada_w1_a"] @ parts["hada_w1_b"]
        m2 = parts["hada_w2_a"] @ parts["hada_w2_b"]
        return (m1 * m2).reshape(shape) * alpha / parts["hada_w1_b"].shape[0]
    dim = None
    w1 = parts.get("lokr_w1")
    if w1 is None:
        dim, w1 = parts["lokr_w1_b"].shape[0], parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    w2 = parts.get("lokr_w2")
    if w2 is None:
        dim, w2 = parts["lokr_w2_b"].shape[0], parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    if w2.ndim == 4:  # a convolution's second factor keeps its kernel
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2).reshape(shape) * (alpha / dim if dim else 1.0)


def _by_stem(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        stem, part = key.split(".", 1)
        grouped.setdefault(stem, {})[part] = value.float()
    return grouped


def _apply_original(orig: dict[str, torch.Tensor], tensors) -> dict[str, torch.Tensor]:
    """A `lora_unet_` file applied the way ComfyUI and Forge resolve it: the stem is the
    loaded model's `<key>.weight` with dots as underscores. Every stem must match."""
    stems = {
        "lora_unet_" + k[: -len(".weight")].replace(".", "_"): k
        for k in orig
        if k.endswith(".weight")
    }
    out = dict(orig)
    for stem, parts in _by_stem(tensors).items():
        key = stems[stem]
        weight = out[key]
        merged = weight + _delta(parts, weight.shape)
        if "dora_scale" in parts:
            norm = merged.flatten(1).norm(dim=1).reshape(-1, *([1] * (merged.ndim - 1)))
            merged = merged * parts["dora_scale"].reshape(norm.shape) / norm
        out[key] = merged
    return out


def _assert_close(back: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> None:
    assert set(back) == set(merged)
    for key, value in merged.items():
        torch.testing.assert_close(back[key], value, atol=1e-5, rtol=0, msg=key)


def _round_trip(model, tensors, merged, apply) -> None:
    orig = to_original(model.state_dict(), model.config)
    applied = apply(orig, tensors)
    _assert_close(convert_sd3_transformer_checkpoint_to_diffusers(applied), merged)


@pytest.mark.parametrize("extra", [FF, EVERYWHERE], ids=["default+ff", "everywhere"])
def test_kohya_lora_applied_like_comfyui_equals_peft_merge(base, extra):
    _, model = base
    targets = [*get_family("sd3").default_lora_targets, *extra]
    state, merged = _adapt(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    tensors = kohya_lora(state, ALPHA, RANK)
    assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight" in tensors
    assert not any("to_q" in k or "add_q_proj" in k for k in tensors)
    # sd-scripts' rule for the fused rank: alpha / rows of down is the trained alpha / rank.
    qkv = "lora_unet_joint_blocks_0_context_block_attn_qkv"
    assert tensors[f"{qkv}.lora_down.weight"].shape[0] == 3 * RANK
    assert float(tensors[f"{qkv}.alpha"]) == ALPHA / RANK * 3 * RANK
    _round_trip(model, tensors, merged, _apply_original)


def test_per_module_ranks_without_rank_keep_each_modules_scale(base):
    _, model = base
    # q at rank 2 beside k and v at 4: the fused module folds the unequal scales into its blocks.
    targets = ["to_q", "to_k", "to_v", "norm_out.linear"]
    pattern = {"to_q": 2}
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, rank_pattern=pattern)
    state, merged = _adapt(model, lora)
    tensors = kohya_lora(state, ALPHA)
    assert tensors["lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight"].shape[0] == 10
    _round_trip(model, tensors, merged, _apply_original)


def test_kohya_dora_applied_with_row_norms_equals_peft_merge(base):
    _, model = base
    targets = ["to_q", "to_k", "to_v", "to_out.0", "norm_out.linear"]
    state, merged = _adapt(
        model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, use_dora=True)
    )
    tensors = kohya_lora(state, ALPHA, RANK)
    assert tensors["lora_unet_joint_blocks_0_x_block_attn_qkv.dora_scale"].shape[1] == 1
    _round_trip(model, tensors, merged, _apply_original)

    partial, _ = _adapt(
        model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q"], use_dora=True)
    )
    with pytest.raises(KitError, match="DoRA on part of q, k, v"):
        kohya_lora(partial, ALPHA, RANK)


def test_foreign_weights_are_refused():
    with pytest.raises(KitError, match="not a LoRA weight"):
        kohya_lora({"transformer_blocks.0.attn.to_q.hada_w1_a": torch.zeros(2, 2)}, ALPHA, RANK)
    with pytest.raises(KitError, match="no module of the SD3 original"):
        kohya_lora({"transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(2, 2)}, ALPHA, RANK)
