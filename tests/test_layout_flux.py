"""The Flux.1 original (Black Forest Labs) layout: full weights that diffusers' single-file loader
reads back exactly, and sd-scripts-style LoRA / LyCORIS files whose plain reader arithmetic gives
the update peft trained, checked through diffusers' own original → diffusers converter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kit.errors import KitError
from kit.families import get_family
from kit.families.adapter_keys import lycoris_keys as generic_lycoris_keys
from kit.families.flux.layout import (
    KOHYA_PREFIX,
    SWAPPED_HALVES,
    kohya_deltas,
    kohya_lora,
    lycoris_keys,
    module_map,
    to_original,
)
from tests.lycoris_reference import delta_weights

RANK, ALPHA = 4, 8.0  # alpha ≠ rank, so a lost or doubled scale shows


@pytest.fixture(scope="module")
def tiny_flux(tiny_base):
    return tiny_base("flux")


@pytest.fixture(scope="module")
def base(tiny_flux):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer").eval()


@pytest.fixture()
def any_width(monkeypatch):
    """diffusers' converter splits `linear1` at the released model's widths (hidden 3072, MLP
    12288) whatever the model; give it the tiny model's instead (hidden = rows / 7)."""
    split = torch.split

    def tiny_split(tensor, sizes, dim=0):
        if isinstance(sizes, list | tuple) and list(sizes) == [3072] * 3 + [12288]:
            hidden = tensor.shape[dim] // 7
            sizes = [hidden] * 3 + [4 * hidden]
        return split(tensor, sizes, dim)

    monkeypatch.setattr(torch, "split", tiny_split)


def _back_to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own converter, checking that it used every original key."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    checkpoint = dict(original)
    out = convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    assert not checkpoint, f"keys diffusers' converter left unread: {sorted(checkpoint)[:5]}"
    return out


def _flux_targets(extra: tuple[str, ...]) -> list[str]:
    return [*get_family("flux").default_lora_targets, *extra]


def _adapted(base: nn.Module, config, seed: int):
    """A peft copy of `base` with every adapter factor random, as training leaves them."""
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(p in name for p in ("lora_", "hada_", "lokr_")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _peft_weights(model) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {k.removeprefix("base_model.model."): v.detach().clone() for k, v in state.items()}


def _merged(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}


# ------------------------------------------------------------------ the module map


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _check_map(model: nn.Module) -> None:
    mapping = module_map(model.config)
    linears = _linears(model)
    assert set(mapping) == set(linears)
    heights: dict[str, list[tuple[int, int]]] = {}
    for name, (bfl, offset, count) in mapping.items():
        assert count == linears[name].out_features, name
        heights.setdefault(bfl, []).append((offset, count))
    for parts in heights.values():
        parts.sort()
        # The parts of a fused weight tile its rows with no gap or overlap.
        assert [o for o, _ in parts] == [sum(c for _, c in parts[:i]) for i in range(len(parts))]


def test_module_map_covers_every_linear(base):
    _check_map(base)
    inner = base.config.num_attention_heads * base.config.attention_head_dim
    mapping = module_map(base.config)
    assert mapping["transformer_blocks.0.attn.add_v_proj"] == (
        "double_blocks.0.txt_attn.qkv",
        2 * inner,
        inner,
    )
    assert mapping["single_transformer_blocks.0.proj_mlp"] == (
        "single_blocks.0.linear1",
        3 * inner,
        4 * inner,
    )
    assert mapping["norm_out.linear"][0] == "final_layer.adaLN_modulation.1"
    assert mapping["time_text_embed.guidance_embedder.linear_1"][0] == "guidance_in.in_layer"


def test_module_map_of_a_deeper_schnell_style_model():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=8,
            num_attention_heads=3,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            guidance_embeds=False,
            axes_dims_rope=(2, 2, 4),
        )
    _check_map(model)
    assert not any("guidance" in n for n in module_map(model.config))


def test_config_without_sizes_is_refused():
    with pytest.raises(KitError, match="num_layers"):
        module_map({"num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 64})


# ------------------------------------------------------------------ the full transformer


def test_round_trip_through_diffusers_single_file(base, tiny_flux, tmp_path, any_width):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    state = base.state_dict()
    original = to_original(state, base.config)
    assert "double_blocks.0.img_attn.qkv.weight" in original
    assert "single_blocks.0.linear1.weight" in original
    assert "double_blocks.0.img_attn.norm.query_norm.scale" in original
    assert not any(
        k.startswith(("transformer_blocks", "single_transformer_blocks")) for k in original
    )
    # Every original key is read by diffusers' converter, and the result is the same state.
    back = _back_to_diffusers(original)
    assert set(back) == set(state)
    path = tmp_path / "flux1-tiny.safetensors"
    save_file(original, str(path))
    loaded = FluxTransformer2DModel.from_single_file(
        str(path), config=str(tiny_flux), subfolder="transformer", local_files_only=True
    )
    loaded_state = loaded.state_dict()
    assert set(loaded_state) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded_state[key], value), key


def test_final_modulation_halves_are_swapped(base):
    state = base.state_dict()
    original = to_original(state, base.config)
    scale, shift = state["norm_out.linear.weight"].chunk(2)
    assert torch.equal(original["final_layer.adaLN_modulation.1.weight"], torch.cat([shift, scale]))
    assert "norm_out.linear" in SWAPPED_HALVES


def test_foreign_or_missing_weights_are_refused(base):
    state = dict(base.state_dict())
    with pytest.raises(KitError, match="no place in the original layout"):
        to_original({**state, "controlnet_x_embedder.weight": torch.zeros(1)}, base.config)
    del state["single_transformer_blocks.0.proj_mlp.bias"]
    with pytest.raises(KitError, match="proj_mlp.bias' is missing"):
        to_original(state, base.config)


# ------------------------------------------------------------------ LoRA


def _apply_kohya(original: dict[str, torch.Tensor], kohya: dict[str, torch.Tensor]):
    """The plain kohya formula, W + alpha / rank · up @ down, on the original weights; every key
    of the file must name a weight of the model."""
    stems = {
        f"{KOHYA_PREFIX}_{k.removesuffix('.weight').replace('.', '_')}": k
        for k in original
        if k.endswith(".weight")
    }
    merged = {k: v.clone() for k, v in original.items()}
    files = {key.split(".", 1)[0] for key in kohya}
    for stem in files:
        assert stem in stems, f"{stem}: no such weight"
        down, up = kohya[f"{stem}.lora_down.weight"], kohya[f"{stem}.lora_up.weight"]
        alpha = float(kohya[f"{stem}.alpha"])
        merged[stems[stem]] += alpha / down.shape[0] * (up @ down)
    assert len(kohya) == 3 * len(files)  # down, up and alpha of each module, nothing else
    return merged


@pytest.mark.parametrize("every", [False, True], ids=["default-targets", "every-linear"])
def test_kohya_lora_gives_peft_merge(base, any_width, every):
    from peft import LoraConfig

    # Every Linear includes the final modulation, whose halves the layouts order differently.
    targets = list(module_map(base.config)) if every else _flux_targets(())
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    model = _adapted(base, config, seed=1)
    weights = _peft_weights(model)
    merged = _merged(model)

    kohya = kohya_lora(weights, ALPHA, RANK)
    # Fused: rank 3r for each qkv; linear1 holds q, k, v and, when trained, the MLP input.
    qkv = kohya[f"{KOHYA_PREFIX}_double_blocks_0_img_attn_qkv.lora_down.weight"]
    linear1 = kohya[f"{KOHYA_PREFIX}_single_blocks_0_linear1.lora_up.weight"]
    assert qkv.shape[0] == 3 * RANK
    assert linear1.shape[1] == (4 if every else 3) * RANK
    assert float(kohya[f"{KOHYA_PREFIX}_double_blocks_0_img_attn_qkv.alpha"]) == 3 * ALPHA
    if not every:
        # The untrained MLP rows of linear1 get no update.
        inner = base.config.num_attention_heads * base.config.attention_head_dim
        assert not linear1[3 * inner :].any()
    else:
        # diffusers' reader ignores the final layer's alpha: its scale sits in the up matrix.
        assert float(kohya[f"{KOHYA_PREFIX}_final_layer_adaLN_modulation_1.alpha"]) == RANK
        assert float(kohya[f"{KOHYA_PREFIX}_double_blocks_0_img_mlp_0.alpha"]) == ALPHA
    assert kohya_lora(weights, ALPHA).keys() == kohya.keys()  # rank read from the tensors

    applied = _back_to_diffusers(_apply_kohya(to_original(base.state_dict(), base.config), kohya))
    assert set(applied) == set(merged)
    for key, value in merged.items():
        assert torch.allclose(applied[key], value, atol=1e-5), key

    # The kit's own reader of such a file gives the same updates on the diffusers modules.
    deltas = kohya_deltas(kohya, base.config)
    state = base.state_dict()
    for name, delta in deltas.items():
        key = f"{name}.weight"
        assert torch.allclose(state[key] + delta, merged[key], atol=1e-5), name


def test_fused_parts_of_different_ranks_keep_their_scales(base):
    from peft import LoraConfig

    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=["to_q", "to_k", "to_v", "proj_mlp"],
        rank_pattern={"to_k": 2, "proj_mlp": 6},
    )
    model = _adapted(base, config, seed=2)
    weights = _peft_weights(model)
    merged = _merged(model)
    # peft scales each module by alpha / its own rank: the ranks come from the tensors.
    deltas = kohya_deltas(kohya_lora(weights, ALPHA), base.config)
    state = base.state_dict()
    for name, delta in deltas.items():
        key = f"{name}.weight"
        assert torch.allclose(state[key] + delta, merged[key], atol=1e-5), name


def test_lora_weights_the_layout_cannot_hold_are_refused():
    up, down = torch.zeros(32, 4), torch.zeros(4, 32)
    with pytest.raises(KitError, match="not a Flux transformer Linear"):
        kohya_lora({"pos_embed.x.lora_A.weight": down, "pos_embed.x.lora_B.weight": up}, 4.0, 4)
    with pytest.raises(KitError, match="DoRA"):
        kohya_lora(
            {
                "transformer_blocks.0.attn.to_q.lora_A.weight": down,
                "transformer_blocks.0.attn.to_q.lora_B.weight": up,
                "transformer_blocks.0.attn.to_q.lora_magnitude_vector": torch.ones(32),
            },
            4.0,
            4,
        )
    with pytest.raises(KitError, match="output rows"):
        kohya_lora(
            {
                "single_transformer_blocks.0.proj_mlp.lora_A.weight": down,
                "single_transformer_blocks.0.proj_mlp.lora_B.weight": up,  # 32 rows, not 4 × 32
            },
            4.0,
            4,
        )


# ------------------------------------------------------------------ LoHa / LoKr


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_keys_map_onto_the_original_weights(base, any_width, kind):
    from peft import LoHaConfig, LoKrConfig

    targets = _flux_targets(("proj_mlp", "norm_out.linear"))
    if kind == "loha":
        config = LoHaConfig(r=RANK, alpha=ALPHA, target_modules=targets)
    else:
        config = LoKrConfig(r=RANK, alpha=ALPHA, target_modules=targets)
    model = _adapted(base, config, seed=3)
    weights = _peft_weights(model)
    merged = _merged(model)

    tensors = lycoris_keys(weights, ALPHA, RANK)
    expected = generic_lycoris_keys(weights, ALPHA, RANK, "lycoris")
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
    # ComfyUI's names: `lycoris_` and the diffusers module, dots as underscores.
    assert any(k.startswith("lycoris_single_transformer_blocks_0_attn_to_q.") for k in tensors)

    # As ComfyUI applies them: each module's update into its rows of the original weight
    # (halves swapped for the final modulation), then back through diffusers' converter.
    mapping = module_map(base.config)
    original = {k: v.clone() for k, v in to_original(base.state_dict(), base.config).items()}
    for name, delta in delta_weights(tensors, base, "lycoris").items():
        bfl, offset, count = mapping[name]
        if name in SWAPPED_HALVES:
            delta = torch.cat(delta.chunk(2)[::-1])
        original[f"{bfl}.weight"][offset : offset + count] += delta
    applied = _back_to_diffusers(original)
    for key, value in merged.items():
        assert torch.allclose(applied[key], value, atol=1e-5), key


def test_lycoris_keys_refuse_other_weights():
    with pytest.raises(KitError, match="not a LoHa or LoKr weight"):
        lycoris_keys({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32)}, 4.0, 4)
    with pytest.raises(KitError, match="ComfyUI maps"):
        lycoris_keys({"pos_embed.x.hada_w1_a": torch.zeros(4, 32)}, 4.0, 4)


@pytest.mark.slow
def test_diffusers_reads_the_file_exactly_at_the_released_widths():
    """diffusers' reader of sd-scripts Flux files assumes Flux.1's widths (hidden 3072) and drops
    the final layer's alpha; LoRA tensors alone at those widths show it reads the fused LoRAs
    (all parts trained, or some), per-part ranks and the final layer as trained."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    hidden, rank = 3072, 2
    shapes = {  # module → (in, out) at Flux.1's widths
        "transformer_blocks.0.attn.to_q": (hidden, hidden),
        "transformer_blocks.0.attn.to_k": (hidden, hidden),
        "transformer_blocks.0.attn.to_v": (hidden, hidden),
        "transformer_blocks.0.attn.add_k_proj": (hidden, hidden),  # one part of three
        "single_transformer_blocks.0.attn.to_q": (hidden, hidden),
        "single_transformer_blocks.0.attn.to_k": (hidden, hidden),
        "single_transformer_blocks.0.attn.to_v": (hidden, hidden),
        "single_transformer_blocks.1.attn.to_q": (hidden, hidden),
        "single_transformer_blocks.1.attn.to_k": (hidden, hidden),
        "single_transformer_blocks.1.attn.to_v": (hidden, hidden),
        "single_transformer_blocks.1.proj_mlp": (hidden, 4 * hidden),
        "norm_out.linear": (hidden, 2 * hidden),
        "proj_out": (hidden, 64),
    }
    gen = torch.Generator().manual_seed(4)
    weights = {}
    for name, (fan_in, fan_out) in shapes.items():
        weights[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        weights[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    converted = _convert_kohya_flux_lora_to_diffusers(kohya_lora(weights, ALPHA, rank))
    for name in shapes:
        key = f"transformer.{name}" if f"transformer.{name}.lora_A.weight" in converted else name
        got = converted[f"{key}.lora_B.weight"] @ converted[f"{key}.lora_A.weight"]
        want = weights[f"{name}.lora_B.weight"] @ weights[f"{name}.lora_A.weight"] * (ALPHA / rank)
        assert torch.allclose(got, want, atol=1e-4), name
