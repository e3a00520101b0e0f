"""Chroma's original layout: every name ComfyUI's Chroma model has, the full transformer that
diffusers' single-file converter reads back exactly, and LoRA / LyCORIS files whose updates are
the trained ones, checked through diffusers' own converters (single file and sd-scripts LoRA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kit.errors import KitError
from kit.families import get_family
from kit.families.adapter_keys import lycoris_keys
from kit.families.chroma.layout import (
    KOHYA_PREFIX,
    comfy_aliases,
    comfy_keys,
    kohya_deltas,
    kohya_lora,
    lycoris_module,
    module_map,
    to_original,
)
from tests.lycoris_reference import delta_weights

RANK, ALPHA = 4, 8.0  # alpha ≠ rank, so a lost or doubled scale shows


@pytest.fixture(scope="module")
def tiny_chroma(tiny_base):
    return tiny_base("chroma")


@pytest.fixture(scope="module")
def base(tiny_chroma):
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel.from_pretrained(tiny_chroma, subfolder="transformer").eval()


@pytest.fixture()
def any_width(monkeypatch):
    """diffusers' converter splits `linear1` at the released widths (hidden 3072, MLP 12288)
    whatever the model; give it the tiny model's instead (hidden = rows / 7)."""
    split = torch.split

    def tiny_split(tensor, sizes, dim=0):
        if isinstance(sizes, list | tuple) and list(sizes) == [3072] * 3 + [12288]:
            hidden = tensor.shape[dim] // 7
            sizes = [hidden] * 3 + [4 * hidden]
        return split(tensor, sizes, dim)

    monkeypatch.setattr(torch, "split", tiny_split)


def _back_to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own converter, checking that it used every original key."""
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers,
    )

    checkpoint = dict(original)
    out = convert_chroma_transformer_checkpoint_to_diffusers(checkpoint)
    assert not checkpoint, f"keys diffusers' converter left unread: {sorted(checkpoint)[:5]}"
    return out


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


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


# ------------------------------------------------------------------ names


def test_module_map_covers_every_linear(base):
    mapping = module_map(base.config)
    linears = _linears(base)
    assert set(mapping) == set(linears)
    heights: dict[str, list[tuple[int, int]]] = {}
    for name, (bfl, offset, count) in mapping.items():
        assert count == linears[name].out_features, name
        heights.setdefault(bfl, []).append((offset, count))
    for parts in heights.values():
        parts.sort()
        assert [o for o, _ in parts] == [sum(c for _, c in parts[:i]) for i in range(len(parts))]
    inner = base.config.num_attention_heads * base.config.attention_head_dim
    assert mapping["single_transformer_blocks.0.proj_mlp"] == (
        "single_blocks.0.linear1",
        3 * inner,
        4 * inner,
    )
    assert mapping["distilled_guidance_layer.layers.1.linear_2"][0] == (
        "distilled_guidance_layer.layers.1.out_layer"
    )


def test_original_names_are_comfyuis_and_read_back_exactly(base, tiny_chroma, tmp_path, any_width):
    from diffusers import ChromaTransformer2DModel
    from safetensors.torch import save_file

    state = base.state_dict()
    original = to_original(state, base.config)
    assert set(original) == comfy_keys(base.config)
    back = _back_to_diffusers(original)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    path = tmp_path / "chroma-tiny.safetensors"
    save_file(original, str(path))
    loaded = ChromaTransformer2DModel.from_single_file(
        str(path), config=str(tiny_chroma), subfolder="transformer", local_files_only=True
    )
    loaded_state = loaded.state_dict()
    assert set(loaded_state) == set(state)
    assert all(torch.equal(loaded_state[k], v) for k, v in state.items())


def test_comfy_names_of_the_released_model():
    """The released config's ComfyUI names: 19 double, 38 single blocks, a 5-layer approximator."""
    import json

    from kit.families.shipped import shipped_dir

    config = json.loads((shipped_dir("chroma1-hd") / "transformer/config.json").read_text())
    keys = comfy_keys(config)
    assert "double_blocks.18.txt_attn.norm.key_norm.scale" in keys
    assert "single_blocks.37.linear1.weight" in keys
    assert "distilled_guidance_layer.norms.4.scale" in keys
    assert not any("mod" in k.split(".")[-2] for k in keys)  # no modulation weights
    mapping = module_map(config)
    assert len({bfl for bfl, _, _ in mapping.values()}) * 2 + 4 * 19 + 2 * 38 + 5 == len(keys)


def test_foreign_or_missing_weights_are_refused(base):
    state = dict(base.state_dict())
    with pytest.raises(KitError, match="no place in the original layout"):
        to_original({**state, "norm_out.linear.weight": torch.zeros(1)}, base.config)
    del state["distilled_guidance_layer.norms.0.weight"]
    with pytest.raises(KitError, match="is missing"):
        to_original(state, base.config)


# ------------------------------------------------------------------ LoRA


def _apply_kohya(original: dict[str, torch.Tensor], kohya: dict[str, torch.Tensor]):
    """The plain kohya formula, W + alpha / rank · up @ down, on the original weights, as
    ComfyUI applies `lora_unet_<original>` names; every stem must name a weight of the model."""
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
        merged[stems[stem]] += float(kohya[f"{stem}.alpha"]) / down.shape[0] * (up @ down)
    assert len(kohya) == 3 * len(files)
    return merged


@pytest.mark.parametrize("every", [False, True], ids=["default-targets", "every-linear"])
def test_kohya_lora_gives_peft_merge(base, any_width, every):
    from peft import LoraConfig

    default = list(get_family("chroma").default_lora_targets)
    targets = list(module_map(base.config)) if every else default
    model = _adapted(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets), seed=1)
    weights = _peft_weights(model)
    merged = _merged(model)
    kohya = kohya_lora(weights, ALPHA, RANK)
    assert (
        kohya[f"{KOHYA_PREFIX}_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * RANK
    )
    if every:
        assert f"{KOHYA_PREFIX}_distilled_guidance_layer_layers_0_in_layer.alpha" in kohya
    applied = _back_to_diffusers(_apply_kohya(to_original(base.state_dict(), base.config), kohya))
    assert set(applied) == set(merged)
    for key, value in merged.items():
        assert torch.allclose(applied[key], value, atol=1e-5), key
    state = base.state_dict()
    for name, delta in kohya_deltas(kohya, base.config).items():
        key = f"{name}.weight"
        assert torch.allclose(state[key] + delta, merged[key], atol=1e-5), name


def test_chroma_pipeline_loads_the_kohya_file_to_the_trained_weights(tiny_chroma, base, tmp_path):
    """ChromaPipeline's own `load_lora_weights` on the file (diffusers' sd-scripts converter)
    gives the trained weights: the double blocks, whose fused widths it reads from the file.
    (Its names for `img_in`, `txt_in` and `final_layer.linear` lack the `transformer.` prefix,
    so diffusers leaves those three unloaded; ComfyUI loads them.)"""
    from diffusers import ChromaPipeline
    from peft import LoraConfig
    from safetensors.torch import save_file

    targets = [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_k",
        "transformer_blocks.0.attn.to_v",
        "transformer_blocks.0.attn.add_k_proj",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.ff.net.0.proj",
        "transformer_blocks.0.ff_context.net.2",
    ]
    model = _adapted(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets), seed=2)
    path = tmp_path / "lora.safetensors"
    save_file(kohya_lora(_peft_weights(model), ALPHA), str(path))
    merged = _merged(model)
    pipe = ChromaPipeline.from_pretrained(str(tiny_chroma))
    pipe.load_lora_weights(str(tmp_path), weight_name=path.name)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    loaded = pipe.transformer.state_dict()
    changed = [k for k, v in base.state_dict().items() if not torch.equal(merged[k], v)]
    assert len(changed) == len(targets)
    for key, value in merged.items():
        assert torch.allclose(loaded[key], value, atol=1e-5), key


@pytest.mark.slow
def test_diffusers_reads_single_blocks_at_the_released_widths():
    """diffusers' reader of sd-scripts files splits `linear1` at the released widths only:
    LoRA tensors alone at those widths show it reads the fused single-block LoRA as trained."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    hidden, rank = 3072, 2
    shapes = {
        "single_transformer_blocks.0.attn.to_q": (hidden, hidden),
        "single_transformer_blocks.0.attn.to_k": (hidden, hidden),
        "single_transformer_blocks.0.attn.to_v": (hidden, hidden),
        "single_transformer_blocks.0.proj_mlp": (hidden, 4 * hidden),
        "single_transformer_blocks.0.proj_out": (5 * hidden, hidden),
    }
    gen = torch.Generator().manual_seed(4)
    weights = {}
    for name, (fan_in, fan_out) in shapes.items():
        weights[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        weights[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    converted = _convert_kohya_flux_lora_to_diffusers(kohya_lora(weights, ALPHA, rank))
    for name in shapes:
        key = f"transformer.{name}"
        got = converted[f"{key}.lora_B.weight"] @ converted[f"{key}.lora_A.weight"]
        want = weights[f"{name}.lora_B.weight"] @ weights[f"{name}.lora_A.weight"] * (ALPHA / rank)
        assert torch.allclose(got, want, atol=1e-3), name


def test_weights_chroma_has_no_place_for_are_refused():
    up, down = torch.zeros(32, 4), torch.zeros(4, 32)
    with pytest.raises(KitError, match="not a Flux transformer Linear"):
        kohya_lora(
            {
                "transformer_blocks.0.norm1.linear.lora_A.weight": down,
                "transformer_blocks.0.norm1.linear.lora_B.weight": up,
            },
            4.0,
            4,
        )


# ------------------------------------------------------------------ LoHa / LoKr


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_names_map_onto_comfyuis_weights(base, any_width, kind):
    from peft import LoHaConfig, LoKrConfig

    targets = [*get_family("chroma").default_lora_targets, "proj_mlp", "proj_out"]
    cls = LoHaConfig if kind == "loha" else LoKrConfig
    model = _adapted(base, cls(r=RANK, alpha=ALPHA, target_modules=targets), seed=3)
    weights = _peft_weights(model)
    merged = _merged(model)
    tensors = lycoris_keys(weights, ALPHA, RANK, "lycoris", lycoris_module)
    # ComfyUI's aliases (`flux_to_diffusers`) name every module of the file.
    aliases = comfy_aliases(base.config)
    modules = {k.split(".", 1)[0] for k in tensors}
    spelled = {"lycoris_" + k.removesuffix(".weight").replace(".", "_") for k in aliases}
    assert modules <= spelled
    mapping = module_map(base.config)
    original = {k: v.clone() for k, v in to_original(base.state_dict(), base.config).items()}
    for name, delta in delta_weights(tensors, base, "lycoris").items():
        bfl, offset, count = mapping[name]
        original[f"{bfl}.weight"][offset : offset + count] += delta
    applied = _back_to_diffusers(original)
    for key, value in merged.items():
        assert torch.allclose(applied[key], value, atol=1e-5), key


def test_lycoris_refuses_the_approximator():
    with pytest.raises(KitError, match="lycoris_"):
        lycoris_module("distilled_guidance_layer.in_proj")
    assert lycoris_module("transformer_blocks.0.attn.to_q") == "transformer_blocks.0.attn.to_q"


# ------------------------------------------------------------------ ComfyUI's reader


@pytest.mark.parametrize("kind", ["lora", "lokr"])
def test_comfyui_reads_every_key_into_the_trained_weights(tiny_chroma, base, kind):
    """The kit's ComfyUI checker, on the model as the family describes it to ComfyUI
    (`client_models`): every key of the file is read, and the patched original weights are the
    trained ones (LoRA on every Linear, the approximator's included; LoKr on the defaults)."""
    from peft import LoKrConfig, LoraConfig

    from kit.export.clients import comfyui

    family = get_family("chroma")
    comps = family.load(str(tiny_chroma), parts=("denoiser",))
    model, aliases = family.client_models(comps)["ComfyUI"]
    assert set(model) == {f"diffusion_model.{k}" for k in comfy_keys(base.config)}
    if kind == "lora":
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(module_map(base.config)))
    else:
        config = LoKrConfig(r=RANK, alpha=ALPHA, target_modules=list(family.default_lora_targets))
    adapted = _adapted(base, config, seed=5)
    weights = _peft_weights(adapted)
    merged = to_original(_merged(adapted), base.config)
    if kind == "lora":
        file = family.kohya_state_dict(weights, ALPHA)
    else:
        prefix, rename = family.lycoris_naming()
        file = lycoris_keys(weights, ALPHA, RANK, prefix, rename)
    got = comfyui.apply(file, {}, model, aliases=aliases)
    assert got.clean, (got.unconsumed[:3], got.warnings[:3])
    changed = {k for k, v in merged.items() if not torch.equal(v, model[f"diffusion_model.{k}"])}
    assert {k.removeprefix("diffusion_model.") for k in got.merged} == changed
    for key in changed:
        assert torch.allclose(got.merged[f"diffusion_model.{key}"], merged[key], atol=1e-5), key


@pytest.mark.slow
def test_chroma_pipeline_loads_single_blocks_at_the_released_width(tiny_chroma, tmp_path):
    """ChromaPipeline's `load_lora_weights` on the file, end to end, for the single blocks its
    reader splits at the released width (hidden 3072): a one-single-block transformer of that
    width (no double blocks, a small approximator) gets exactly the trained weights."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel
    from peft import LoraConfig
    from safetensors.torch import save_file

    torch.manual_seed(0)
    wide = ChromaTransformer2DModel(
        num_layers=0,
        num_single_layers=1,
        joint_attention_dim=32,
        approximator_num_channels=8,
        approximator_hidden_dim=32,
        approximator_layers=1,
    ).eval()
    targets = [*get_family("chroma").default_lora_targets, "proj_mlp", "proj_out"]
    config = LoraConfig(r=2, lora_alpha=ALPHA, target_modules=targets)
    model = _adapted(wide, config, seed=6)
    file = kohya_lora(_peft_weights(model), ALPHA)
    assert {k.split(".")[0] for k in file} == {
        f"{KOHYA_PREFIX}_single_blocks_0_linear1",
        f"{KOHYA_PREFIX}_single_blocks_0_linear2",
        f"{KOHYA_PREFIX}_final_layer_linear",
    }
    save_file(file, str(tmp_path / "lora.safetensors"))
    merged = _merged(model)
    pipe = ChromaPipeline.from_pretrained(str(tiny_chroma), transformer=wide)
    pipe.load_lora_weights(str(tmp_path), weight_name="lora.safetensors")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    loaded = pipe.transformer.state_dict()
    for key in (
        "single_transformer_blocks.0.attn.to_q.weight",
        "single_transformer_blocks.0.attn.to_v.weight",
        "single_transformer_blocks.0.proj_mlp.weight",
        "single_transformer_blocks.0.proj_out.weight",
    ):
        assert torch.allclose(loaded[key], merged[key], atol=1e-5), key


# ------------------------------------------------------------------ single file


def test_the_transformer_file_loads_as_the_base_and_reads_back(
    tiny_chroma, tmp_path, monkeypatch, any_width
):
    """The file `single_file_state_dict` writes is a base the family loads (diffusers'
    `from_single_file` for the transformer, the rest from `model_config`) and the pipeline
    `single_file_pipeline` reads back: the same weights as the folder's; a Flux.1 file is not."""
    from safetensors.torch import save_file

    from kit.config import Config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the file's hash store
    family = get_family("chroma")
    folder = family.load(str(tiny_chroma))
    path = tmp_path / "chroma-tiny.safetensors"
    save_file(family.single_file_state_dict(folder), str(path))
    cfg = Config().replace(model_family="chroma")
    cfg.model.pretrained_model, cfg.model.model_config = str(path), str(tiny_chroma)
    from_file = get_family("chroma", cfg).load(str(path))
    ours, theirs = folder.denoiser.state_dict(), from_file.denoiser.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    pipe = family.single_file_pipeline(path, tiny_chroma)
    read = pipe.transformer.state_dict()
    assert all(torch.equal(ours[k], read[k]) for k in ours)

    flux_file = tmp_path / "flux-like.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, str(flux_file))
    with pytest.raises(KitError, match="does not hold a chroma model"):
        cfg.model.pretrained_model = str(flux_file)
        get_family("chroma", cfg).load(str(flux_file))
