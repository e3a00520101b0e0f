"""Qwen-Image's ComfyUI layout: ComfyUI's model names (as data, from comfy/ldm/qwen_image) are
diffusers' own, and the kit's LoRA / LyCORIS files load to the trained adapter's merged weights
through both clients' readers: diffusers' Qwen converter (`load_lora_weights` on the file, then
`fuse_lora`) and ComfyUI's key rules and arithmetic (`kit.export.clients.comfyui`). Every
weight-bearing Linear of the model is covered, so no key of a file is skipped by either."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kit.errors import KitError
from kit.export.clients import comfyui
from kit.families import adapter_keys, get_family
from kit.families.qwen_image.layout import (
    comfy_weights,
    kohya_module,
    lora_unet_module,
    to_comfy,
)
from kit.families.shipped import shipped_dir
from kit.methods.adapters import adapter_state_dict

RANK, ALPHA = 4, 8.0  # alpha ≠ rank, so a lost or doubled scale shows
ADAPTER_PARTS = ("lora_", "hada_", "lokr_")


@pytest.fixture(scope="module")
def qwen_base(tiny_base) -> Path:
    return tiny_base("qwen_image")


def load_transformer(base: Path) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(base, subfolder="transformer").eval()


def linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def real_model() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    config = json.loads((shipped_dir("qwen-image") / "transformer/config.json").read_text())
    with torch.device("meta"):
        return QwenImageTransformer2DModel.from_config(config)


# ---------------------------------------------------------------- names


def test_comfy_names_are_the_diffusers_state_dict(qwen_base):
    model = load_transformer(qwen_base)
    assert sorted(comfy_weights(2)) == sorted(model.state_dict())
    real = real_model()
    assert sorted(comfy_weights(60)) == sorted(real.state_dict())


def test_every_linear_names_itself_in_both_readers(qwen_base):
    names = linears(real_model())
    assert len(names) == 6 + 60 * 14
    for name in names:
        assert kohya_module(name) == name
        assert lora_unet_module(name.replace(".", "_")) == name


def test_names_no_client_places_are_refused():
    with pytest.raises(KitError, match="ComfyUI's Qwen-Image model"):
        kohya_module("transformer_blocks.0.attn.to_qkv")
    with pytest.raises(KitError, match="ComfyUI's Qwen-Image model"):
        kohya_module("time_text_embed.addition_t_embedding")  # Qwen-Image-Layered's extra
    # A norm has a weight in ComfyUI's model, but diffusers' reader would rename it wrongly.
    with pytest.raises(KitError, match="diffusers' Qwen LoRA reader"):
        kohya_module("transformer_blocks.0.attn.norm_added_q")
    with pytest.raises(KitError, match="to_qkv"):
        to_comfy({"transformer_blocks.0.attn.to_qkv.weight": torch.zeros(1)}, {"num_layers": 1})


def test_single_file_reads_back_through_diffusers(qwen_base, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    family = get_family("qwen_image")
    comps = family.load(str(qwen_base), parts=("denoiser",))
    state = family.single_file_state_dict(comps)
    save_file(state, tmp_path / "qwen.safetensors")
    back = QwenImageTransformer2DModel.from_single_file(
        str(tmp_path / "qwen.safetensors"),
        config=str(qwen_base),
        subfolder="transformer",
        local_files_only=True,
    )
    theirs = back.state_dict()
    assert set(theirs) == set(state)
    assert all(torch.equal(theirs[k], state[k]) for k in state)


# ---------------------------------------------------------------- adapters


def adapted(base: Path, config) -> nn.Module:
    """The tiny transformer with an adapter on every Linear, its weights drawn at random."""
    model = load_transformer(base)
    model.add_adapter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ADAPTER_PARTS):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def merged_by_peft(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged in by peft."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {
        k.replace(".base_layer", ""): v.detach().clone()
        for k, v in model.state_dict().items()
        if not any(part in k for part in ADAPTER_PARTS)
    }


def comfy_merged(base: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file applied to ComfyUI's model by ComfyUI's rules; no key may be left unread."""
    family = get_family("qwen_image")
    comps = family.load(str(base), parts=("denoiser",))
    (model, aliases) = family.client_models(comps)["ComfyUI"]
    applied = comfyui.apply(tensors, {}, model, aliases=aliases)
    assert applied.clean, (applied.unconsumed[:3], applied.warnings[:3])
    out = {k.removeprefix("diffusion_model."): v for k, v in model.items()}
    out.update({k.removeprefix("diffusion_model."): v for k, v in applied.merged.items()})
    return out


def diffusers_merged(base: Path, path: Path) -> dict[str, torch.Tensor]:
    """The file loaded by QwenImagePipeline's own `load_lora_weights` and fused."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(base))
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return pipe.transformer.state_dict()


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.allclose(ours[key].float(), value, atol=1e-5, rtol=0), key


@pytest.mark.slow
def test_lora_file_loads_to_the_trained_merge_in_both_clients(qwen_base, tmp_path):
    from peft import LoraConfig

    model = adapted(
        qwen_base,
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=linears(load_transformer(qwen_base))),
    )
    family = get_family("qwen_image")
    tensors = family.kohya_state_dict(adapter_state_dict(model), ALPHA)
    assert "lora_unet_transformer_blocks_0_img_mlp_net_0_proj.lora_down.weight" in tensors
    assert "lora_unet_time_text_embed_timestep_embedder_linear_1.alpha" in tensors
    save_file(tensors, tmp_path / "kohya.safetensors")
    reference = merged_by_peft(model)
    changed = {
        k
        for k, v in reference.items()
        if not torch.equal(v, load_transformer(qwen_base).state_dict()[k])
    }
    assert len(changed) == 6 + 2 * 14  # every Linear's weight moved
    assert_same_weights(comfy_merged(qwen_base, tensors), reference)
    assert_same_weights(diffusers_merged(qwen_base, tmp_path / "kohya.safetensors"), reference)


@pytest.mark.parametrize("dora", [False, True])
def test_diffusers_file_loads_exactly(dora, qwen_base, tmp_path):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    targets = list(get_family("qwen_image").default_lora_targets)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, use_dora=dora)
    model = adapted(qwen_base, config)
    state = adapter_state_dict(model)
    config = model.peft_config["default"].to_dict()
    path = get_family("qwen_image").save_diffusers_lora(
        {"denoiser": state}, {"denoiser": config}, tmp_path
    )
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(qwen_base))
    pipe.load_lora_weights(str(path.parent))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_file_loads_to_the_trained_merge_in_comfyui(kind, qwen_base):
    from peft import LoHaConfig, LoKrConfig

    cls = LoHaConfig if kind == "loha" else LoKrConfig
    targets = list(get_family("qwen_image").default_lora_targets) + ["img_mlp.net.2"]
    model = adapted(qwen_base, cls(r=RANK, alpha=ALPHA, target_modules=targets))
    prefix, rename = get_family("qwen_image").lycoris_naming()
    tensors = adapter_keys.lycoris_keys(adapter_state_dict(model), ALPHA, RANK, prefix, rename)
    part = "hada_w1_a" if kind == "loha" else "lokr_w1"
    assert f"lora_unet_transformer_blocks_0_attn_to_q.{part}" in tensors
    assert_same_weights(comfy_merged(qwen_base, tensors), merged_by_peft(model))
