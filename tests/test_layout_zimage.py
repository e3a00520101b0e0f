"""Z-Image's original layout (ComfyUI's NextDiT, Tongyi-MAI's checkpoint files): full weights
that diffusers' single-file loader reads back exactly, and LoRA / LyCORIS files that diffusers'
own Z-Image converter and ComfyUI's rules (the kit's reader) both apply to the weights peft
trained, on every changed weight."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kit.errors import KitError
from kit.export.clients import comfyui
from kit.families import adapter_keys, get_family
from kit.families.zimage.layout import LORA_PREFIX, module_map, to_original, weight_modules

RANK, ALPHA = 4, 8.0  # alpha ≠ rank, so a lost or doubled scale shows
PEFT_PARTS = ("lora_", "hada_", "lokr_")


@pytest.fixture(scope="module")
def tiny_zimage(tiny_base):
    return tiny_base("zimage")


@pytest.fixture(scope="module")
def base(tiny_zimage):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel.from_pretrained(tiny_zimage, subfolder="transformer").eval()


def comfy_names(config) -> set[str]:
    """The parameters of ComfyUI's NextDiT built for a Z-Image config (`comfy/ldm/lumina/
    model.py` with `z_image_modulation`): fused `qkv` and `out` without bias, RMSNorm q / k
    norms, the block modulation `adaLN_modulation.0` (none in the context refiner), the final
    layer's `adaLN_modulation.1`, and the two pad tokens; no `norm_final` weight."""
    block = [
        "attention.qkv.weight",
        "attention.out.weight",
        "attention.q_norm.weight",
        "attention.k_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
        "attention_norm1.weight",
        "attention_norm2.weight",
        "ffn_norm1.weight",
        "ffn_norm2.weight",
    ]
    modulation = ["adaLN_modulation.0.weight", "adaLN_modulation.0.bias"]
    names = {
        "x_embedder.weight",
        "x_embedder.bias",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.0.bias",
        "t_embedder.mlp.2.weight",
        "t_embedder.mlp.2.bias",
        "cap_embedder.0.weight",
        "cap_embedder.1.weight",
        "cap_embedder.1.bias",
        "final_layer.linear.weight",
        "final_layer.linear.bias",
        "final_layer.adaLN_modulation.1.weight",
        "final_layer.adaLN_modulation.1.bias",
        "x_pad_token",
        "cap_pad_token",
    }
    for stack, count, modulated in (
        ("layers", config["n_layers"], True),
        ("noise_refiner", config["n_refiner_layers"], True),
        ("context_refiner", config["n_refiner_layers"], False),
    ):
        for i in range(count):
            names.update(f"{stack}.{i}.{p}" for p in block + (modulation if modulated else []))
    return names


# ------------------------------------------------------------------ full weights


def test_the_original_names_are_comfyuis(base):
    config = dict(base.config)
    original = to_original(base.state_dict(), config)
    assert set(original) == comfy_names(config)
    # q, k, v stacked in that order, as ComfyUI's JointAttention splits `qkv`.
    attn = base.layers[1].attention
    qkv = original["layers.1.attention.qkv.weight"]
    assert torch.equal(qkv, torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))


def test_module_map_slices_tile_the_fused_weights(base):
    config = dict(base.config)
    mapping = module_map(config)
    linears = {n for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    assert linears <= set(weight_modules(config))
    heights: dict[str, list[tuple[int, int]]] = {}
    for _, (original, offset, rows) in mapping.items():
        heights.setdefault(original, []).append((offset, rows))
    for parts in heights.values():
        parts.sort()
        assert [o for o, _ in parts] == [sum(r for _, r in parts[:i]) for i in range(len(parts))]
    dim = config["dim"]
    assert mapping["noise_refiner.0.attention.to_v"] == (
        "noise_refiner.0.attention.qkv",
        2 * dim,
        dim,
    )


def test_full_weights_load_back_exactly_with_from_single_file(base, tiny_zimage, tmp_path):
    from diffusers import ZImageTransformer2DModel
    from safetensors.torch import save_file

    path = tmp_path / "zimage.safetensors"
    save_file(to_original(base.state_dict(), dict(base.config)), path)
    back = ZImageTransformer2DModel.from_single_file(
        str(path), config=str(tiny_zimage), subfolder="transformer", local_files_only=True
    )
    ours, theirs = base.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_weights_the_original_layout_lacks_are_refused(base):
    config = dict(base.config)
    with pytest.raises(KitError, match="siglip"):
        to_original({"siglip_embedder.1.weight": torch.zeros(1)}, config)
    state = {k: v for k, v in base.state_dict().items() if "layers.0.attention.to_k" not in k}
    with pytest.raises(KitError, match="q, k and v"):
        to_original(state, config)


# ------------------------------------------------------------------ adapters


def _targets() -> str:
    """The family's default targets, every block's modulation and the linear layers outside the
    blocks (a regex: the final layer's `adaLN_modulation.0` is a SiLU)."""
    inner = [t.replace(".", r"\.") for t in get_family("zimage").default_lora_targets]
    inner.append(r"adaLN_modulation\.0")
    top = [r"all_x_embedder\.2-1", r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)",
           r"t_embedder\.mlp\.[02]", r"cap_embedder\.1"]  # fmt: skip
    blocks = rf"(layers|noise_refiner|context_refiner)\.\d+\.(attention\.)?({'|'.join(inner)})"
    return rf"^({blocks}|{'|'.join(top)})$"


def _adapted(base: nn.Module, config, seed: int = 0) -> nn.Module:
    """A peft copy of `base` with every adapter factor random, as training leaves them."""
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(p in name for p in PEFT_PARTS):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            if "lora_magnitude_vector" in name:
                param.copy_(param.abs() + 0.5)
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {k.removeprefix("base_model.model."): v.detach().clone() for k, v in state.items()}


def _merged(model: nn.Module) -> dict[str, torch.Tensor]:
    merged = copy.deepcopy(model).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def _changed(base: nn.Module, merged: dict[str, torch.Tensor]) -> set[str]:
    state = base.state_dict()
    return {k for k, v in merged.items() if not torch.equal(state[k], v)}


def _lora(base, dora=False):
    from peft import LoraConfig

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=_targets(), use_dora=dora)
    return _adapted(base, config)


def _comfy_apply(base: nn.Module, tensors: dict[str, torch.Tensor]):
    """The file applied by the kit's ComfyUI reader to ComfyUI's model of the base."""
    family = get_family("zimage")
    comps = type("C", (), {"denoiser": base})()
    model, aliases = family.client_models(comps)["ComfyUI"]
    assert comfyui.detect_layout(model) == "lumina2"
    return comfyui.apply(tensors, {}, model, aliases=aliases)


def test_the_lora_file_keeps_diffusers_names_under_diffusion_model(base):
    model = _lora(base)
    tensors = get_family("zimage").kohya_state_dict(_weights(model), ALPHA)
    assert LORA_PREFIX == "diffusion_model."
    assert "diffusion_model.layers.0.attention.to_q.lora_down.weight" in tensors
    assert "diffusion_model.context_refiner.0.feed_forward.w2.lora_up.weight" in tensors
    assert float(tensors["diffusion_model.noise_refiner.0.adaLN_modulation.0.alpha"]) == ALPHA


def test_diffusers_reads_the_lora_file_to_the_merged_weights(base, tiny_zimage):
    """`ZImagePipeline.load_lora_weights` on the file goes through diffusers' own
    `_convert_non_diffusers_z_image_lora_to_diffusers`; fused, it gives peft's merge."""
    from diffusers import ZImagePipeline

    model = _lora(base)
    merged = _merged(model)
    tensors = get_family("zimage").kohya_state_dict(_weights(model), ALPHA)
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.transformer.load_state_dict(base.state_dict())
    pipe.load_lora_weights({k: v.clone() for k, v in tensors.items()})
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    got = pipe.transformer.state_dict()
    changed = _changed(base, merged)
    assert changed and changed == _changed(base, got)
    for key in changed:
        assert torch.allclose(got[key], merged[key], atol=1e-6), key


@pytest.mark.slow
def test_diffusers_reads_the_lokr_file_to_the_merged_weights(base, tiny_zimage):
    """A LoKr file in the same naming goes through diffusers' `_convert_non_diffusers_lokr_to_
    diffusers` (ai-toolkit's Z-Image LoKr layout), which bakes the alpha as LyCORIS does."""
    from diffusers import ZImagePipeline
    from peft import LoKrConfig

    model = _adapted(base, LoKrConfig(r=RANK, alpha=ALPHA, target_modules=_targets()))
    merged = _merged(model)
    family = get_family("zimage")
    prefix, rename = family.lycoris_naming()
    tensors = adapter_keys.lycoris_keys(_weights(model), ALPHA, RANK, prefix, rename)
    assert "diffusion_model.layers.1.attention.to_v.lokr_w1" in tensors
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.transformer.load_state_dict(base.state_dict())
    pipe.load_lora_weights({k: v.clone() for k, v in tensors.items()})
    pipe.fuse_lora(lora_scale=1.0)
    got = {k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items()}
    changed = _changed(base, merged)
    assert changed
    for key in changed:
        assert torch.allclose(got[key], merged[key], atol=1e-5), key


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_comfyui_applies_every_key_to_the_merged_weights(kind, base):
    """Every key of the file maps to a weight (or q / k / v rows of `qkv`) of ComfyUI's model,
    and the result is peft's merge in ComfyUI's naming. DoRA only loads in full: ComfyUI divides
    by the unmerged weight's row norms (a known gap the export names), so its weights differ."""
    from peft import LoHaConfig, LoKrConfig

    family = get_family("zimage")
    if kind in ("lora", "dora"):
        model = _lora(base, dora=kind == "dora")
        tensors = family.kohya_state_dict(_weights(model), ALPHA)
    else:
        cls = LoHaConfig if kind == "loha" else LoKrConfig
        model = _adapted(base, cls(r=RANK, alpha=ALPHA, target_modules=_targets()))
        prefix, rename = family.lycoris_naming()
        tensors = adapter_keys.lycoris_keys(_weights(model), ALPHA, RANK, prefix, rename)
    applied = _comfy_apply(base, tensors)
    assert not applied.unconsumed, applied.unconsumed[:5]
    config = dict(base.config)
    want = adapter_keys.prefixed("diffusion_model.", to_original(_merged(model), config))
    before = adapter_keys.prefixed("diffusion_model.", to_original(base.state_dict(), config))
    changed = {k for k, v in want.items() if not torch.equal(before[k], v)}
    assert changed and changed <= set(applied.merged)
    if kind == "dora":
        q = tensors["diffusion_model.layers.0.attention.to_q.dora_scale"]
        assert q.shape == (config["dim"], 1)  # per output row of the q slice
        return
    for key in changed:
        assert torch.allclose(applied.merged[key], want[key], atol=1e-5), key


def test_the_other_spellings(base):
    """Why the file names diffusers' modules under `diffusion_model.`: ComfyUI has no name for
    `lora_unet_<diffusers path>`; the fused original `lora_unet_..._attention_qkv` loads in both
    readers (diffusers splits it into q, k, v sharing the down), but only as one fused adapter."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_z_image_lora_to_diffusers as convert,
    )

    down, up = torch.randn(RANK, 32), torch.randn(96, RANK)
    kohya_diffusers = {
        "lora_unet_layers_0_attention_to_q.lora_down.weight": down,
        "lora_unet_layers_0_attention_to_q.lora_up.weight": up[:32],
    }
    assert _comfy_apply(base, kohya_diffusers).unconsumed == sorted(kohya_diffusers)
    fused = {
        "lora_unet_layers_0_attention_qkv.lora_down.weight": down,
        "lora_unet_layers_0_attention_qkv.lora_up.weight": up,
    }
    assert not _comfy_apply(base, fused).unconsumed  # ComfyUI reads the original name
    read = convert(dict(fused))
    for i, part in enumerate("qkv"):
        key = f"transformer.layers.0.attention.to_{part}"
        assert torch.equal(read[f"{key}.lora_B.weight"], up[32 * i : 32 * (i + 1)])
        assert torch.equal(read[f"{key}.lora_A.weight"], down)
