"""FLUX.2's original (Black Forest Labs) layout: full weights diffusers' single-file converter
reads back exactly, an sd-scripts-style LoRA that diffusers' own FLUX.2 reader and ComfyUI's
reader both turn into the update peft trained, and LoHa / LoKr files ComfyUI reads exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kit.errors import KitError
from kit.export.clients import comfyui
from kit.families import adapter_keys, get_family
from kit.families.flux2.layout import (
    LYCORIS_PREFIX,
    comfy_aliases,
    kohya_lora,
    lycoris_module,
    to_original,
)

RANK, ALPHA = 4, 8.0  # alpha ≠ rank, so a lost or doubled scale shows
# Besides the defaults: the double blocks' MLPs and outputs, the single blocks' output, the
# embedders and the final layer (every module kind diffusers' sd-scripts reader maps).
EXTRA = (
    "ff.linear_in",
    "ff_context.linear_out",
    "single_transformer_blocks.0.attn.to_out",  # `to_out` alone hits the double blocks' list
    "x_embedder",
    "context_embedder",
    "proj_out",
)


@pytest.fixture(scope="module")
def base(tiny_base):
    from diffusers import Flux2Transformer2DModel

    path = tiny_base("flux2")
    return Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer").eval()


def _targets(*extra: str) -> list[str]:
    return [*get_family("flux2").default_lora_targets, *EXTRA, *extra]


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


def _lora(base, seed=0, **extra):
    from peft import LoraConfig

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=_targets(), **extra)
    model = _adapted(base, config, seed)
    return _peft_weights(model), _merged(model)


def _comfy_model(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return adapter_keys.prefixed("diffusion_model.", to_original(state))


# ------------------------------------------------------------------ the full transformer


def test_round_trip_through_diffusers_single_file_converter(base):
    from diffusers.loaders.single_file_utils import (
        convert_flux2_transformer_checkpoint_to_diffusers,
    )

    state = base.state_dict()
    original = to_original(state)
    assert "double_blocks.0.img_attn.qkv.weight" in original
    assert "single_blocks.0.linear1.weight" in original
    assert "final_layer.adaLN_modulation.1.weight" in original
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(original))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_final_modulation_halves_are_swapped(base):
    state = base.state_dict()
    weight = state["norm_out.linear.weight"]
    half = weight.shape[0] // 2
    original = to_original(state)["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(original[:half], weight[half:])


def test_foreign_weights_are_refused(base):
    state = {**base.state_dict(), "extra.weight": torch.zeros(2)}
    with pytest.raises(KitError, match="extra.weight"):
        to_original(state)
    state = {k: v for k, v in base.state_dict().items() if ".attn.to_k." not in k}
    with pytest.raises(KitError, match="q, k, v"):
        to_original(state)


# ------------------------------------------------------------------ LoRA


def _deltas(converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """up @ down of each module of a diffusers-converted LoRA (the scale is baked in)."""
    out = {}
    for key, down in converted.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            up = converted[key.replace(".lora_A.", ".lora_B.")]
            out[module] = up.float() @ down.float()
    return out


@pytest.mark.parametrize("pattern", [{}, {"rank_pattern": {"to_k": 2, "add_v_proj": 6}}])
def test_diffusers_reader_gives_the_peft_update(base, pattern):
    """`_convert_kohya_flux2_lora_to_diffusers` (what Flux2LoraLoaderMixin runs on this file)
    turns it into exactly the trained update, also with parts of other ranks in one qkv."""
    from diffusers import Flux2Pipeline

    state, merged = _lora(base, **pattern)
    file = kohya_lora(state, ALPHA)
    assert all(k.startswith("lora_unet_") for k in file)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in file
    converted = Flux2Pipeline.lora_state_dict(dict(file))
    deltas = _deltas(converted)
    before = base.state_dict()
    changed = {k for k in before if not torch.equal(before[k], merged[k])}
    assert changed == {f"{m}.weight" for m in deltas}
    for module, delta in deltas.items():
        key = f"{module}.weight"
        torch.testing.assert_close(before[key] + delta, merged[key], atol=1e-5, rtol=1e-5)


def test_pipeline_loads_the_file_to_the_merged_weights(base):
    """The whole of `load_lora_weights` (converter, peft injection) and a fuse."""
    from diffusers import Flux2Pipeline

    state, merged = _lora(base, seed=1)
    pipe = Flux2Pipeline(None, None, None, None, copy.deepcopy(base))
    pipe.load_lora_weights(kohya_lora(state, ALPHA))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    got = pipe.transformer.state_dict()
    assert set(got) == set(merged)
    for key in merged:
        torch.testing.assert_close(got[key], merged[key], atol=1e-5, rtol=1e-5)


def test_comfyui_reads_every_key_to_the_merged_weights(base):
    state, merged = _lora(base, seed=2)
    model, want = _comfy_model(base.state_dict()), _comfy_model(merged)
    got = comfyui.apply(kohya_lora(state, ALPHA), {}, model, aliases=comfy_aliases(state))
    assert got.clean, (got.unconsumed, got.warnings[:3])
    changed = {k for k in model if not torch.equal(model[k], want[k])}
    assert set(got.merged) == changed
    assert any(k.endswith("img_attn.qkv.weight") for k in changed)
    for key in changed:
        torch.testing.assert_close(got.merged[key], want[key].float(), atol=1e-5, rtol=1e-5)


def test_weights_diffusers_would_drop_are_refused(base):
    from peft import LoraConfig

    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["single_stream_modulation.linear"]
    )
    state = _peft_weights(_adapted(base, config, 0))
    with pytest.raises(KitError, match="drops"):
        kohya_lora(state, ALPHA)
    dora = {"transformer_blocks.0.attn.to_q.lora_magnitude_vector": torch.ones(4)}
    with pytest.raises(KitError, match="DoRA"):
        kohya_lora(dora, ALPHA)


# ------------------------------------------------------------------ LoHa / LoKr


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_keys_map_onto_the_original_weights(base, kind):
    from peft import LoHaConfig, LoKrConfig

    cls = LoHaConfig if kind == "loha" else LoKrConfig
    config = cls(r=RANK, alpha=ALPHA, target_modules=_targets())
    model = _adapted(base, config, seed=3)
    state, merged = _peft_weights(model), _merged(model)
    file = adapter_keys.lycoris_keys(state, ALPHA, RANK, LYCORIS_PREFIX, lycoris_module)
    assert "lora_transformer_transformer_blocks_0_attn_to_q.alpha" in file
    assert "lora_unet_single_blocks_0_linear1.alpha" in file
    base_model, want = _comfy_model(base.state_dict()), _comfy_model(merged)
    got = comfyui.apply(file, {}, base_model, aliases=comfy_aliases(base.state_dict()))
    assert got.clean, (got.unconsumed, got.warnings[:3])
    changed = {k for k in base_model if not torch.equal(base_model[k], want[k])}
    assert set(got.merged) == changed
    for key in changed:
        torch.testing.assert_close(got.merged[key], want[key].float(), atol=1e-5, rtol=1e-5)


def test_lycoris_names_refuse_other_modules():
    with pytest.raises(KitError, match="not a FLUX.2"):
        lycoris_module("transformer_blocks.0.attn.norm_q")
