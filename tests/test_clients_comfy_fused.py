"""ComfyUI's reading of Flux and SD3 adapters named after diffusers' modules.

ComfyUI holds these transformers in their original layout, where q, k and v (and Flux's MLP
input) are one fused weight and some modulations store their halves the other way round; it maps
each diffusers name onto its rows of the fused weight and swaps those halves itself. Here a
random peft adapter on a tiny diffusers transformer is written under ComfyUI's diffusers
spellings, read with the ComfyUI reader on the original-layout weights, and compared with peft's
own merge converted to that layout by the kit's layout maps. DoRA is checked against ComfyUI's
formula on a slice, written out by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kit.export.clients import comfyui
from kit.families import adapter_keys, get_family
from kit.families.flux import layout as flux_layout
from kit.families.sd3 import layout as sd3_layout

PREFIX = "diffusion_model."
RANK, ALPHA = 4, 6.0
EPS = torch.finfo(torch.float32).eps
ADAPTER_TAGS = (".lora_", ".hada_", ".lokr_")

# Beyond the family's default attention targets: the MLP parts that share Flux's `linear1`,
# and the modulations whose halves ComfyUI swaps.
EXTRA_TARGETS = {
    "flux": ("proj_mlp", "norm_out.linear", "norm1_context.linear", "ff.net.2"),
    "sd3": ("norm_out.linear", "norm1_context.linear", "ff.net.0.proj"),
}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def transformers(tmp_path_factory) -> dict:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    out = {}
    for name, cls in (("flux", FluxTransformer2DModel), ("sd3", SD3Transformer2DModel)):
        folder = tmp_path_factory.mktemp(name)
        get_family(name).make_tiny(folder, seed=0)
        out[name] = cls.from_pretrained(folder, subfolder="transformer").eval()
    return out


def original(name: str, state: dict, config) -> dict[str, torch.Tensor]:
    """The weights as ComfyUI holds them: original layout, under `diffusion_model.`."""
    if name == "flux":
        return {PREFIX + k: v.float() for k, v in flux_layout.to_original(state, config).items()}
    return {k: v.float() for k, v in sd3_layout.to_original(state, config, PREFIX).items()}


def aliases(name: str, config) -> dict:
    if name == "flux":
        return adapter_keys.offset_aliases(
            flux_layout.module_map(config), flux_layout.SWAPPED_HALVES
        )
    return adapter_keys.offset_aliases(
        sd3_layout.module_map(config), sd3_layout.swapped_modules(config)
    )


def peft_config(kind: str, targets: list[str]):
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if kind == "lora":
        return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    if kind == "loha":
        return LoHaConfig(r=RANK, alpha=ALPHA, target_modules=targets)
    return LoKrConfig(r=RANK, alpha=ALPHA, target_modules=targets)


def adapted(base, kind: str, targets: list[str], seed: int) -> tuple[dict, dict]:
    """(peft adapter state, the plain state dict after peft merges it) of a random adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(base)
    model.add_adapter(peft_config(kind, targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if any(tag in key for tag in ADAPTER_TAGS):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    merged = {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in model.state_dict().items()
        if not any(tag in k for tag in ADAPTER_TAGS)
    }
    return state, merged


def lora_file(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own LoRA naming: `transformer.<module>.lora_A/B.weight`, scale in lora_B."""
    scale = ALPHA / RANK
    return {f"transformer.{k}": v * scale if ".lora_B." in k else v for k, v in state.items()}


def swap(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[0] // 2
    return torch.cat([t[half:], t[:half]])


# ------------------------------------------------------------------ the names


def test_layouts_and_offset_aliases(transformers):
    flux, sd3 = transformers["flux"], transformers["sd3"]
    hidden = flux.config.num_attention_heads * flux.config.attention_head_dim
    fmodel = original("flux", flux.state_dict(), flux.config)
    smodel = original("sd3", sd3.state_dict(), sd3.config)
    assert comfyui.detect_layout(fmodel) == "bfl"
    assert comfyui.detect_layout(smodel) == "mmdit"
    assert comfyui.detect_layout({f"{PREFIX}input_blocks.0.0.weight": torch.zeros(1)}) == "ldm"
    fa = aliases("flux", flux.config)
    assert fa["transformer_blocks.0.attn.to_k.weight"] == (
        f"{PREFIX}double_blocks.0.img_attn.qkv.weight",
        hidden,
        hidden,
        False,
    )
    assert fa["single_transformer_blocks.0.proj_mlp.weight"] == (
        f"{PREFIX}single_blocks.0.linear1.weight",
        3 * hidden,
        4 * hidden,
        False,
    )
    assert fa["norm_out.linear.weight"] == (
        f"{PREFIX}final_layer.adaLN_modulation.1.weight",
        0,
        2 * hidden,
        True,
    )
    assert fa["transformer_blocks.0.attn.to_out.0.weight"] == (
        f"{PREFIX}double_blocks.0.img_attn.proj.weight"
    )
    sa = aliases("sd3", sd3.config)
    last = sd3.config.num_layers - 1
    assert sa[f"transformer_blocks.{last}.norm1_context.linear.weight"][3] is True
    assert sa["transformer_blocks.0.norm1_context.linear.weight"] == (
        f"{PREFIX}joint_blocks.0.context_block.adaLN_modulation.1.weight"
    )
    every_target = [v if isinstance(v, str) else v[0] for v in (fa | sa).values()]
    assert all(t in fmodel or t in smodel for t in every_target)


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_the_spellings_each_layout_accepts(transformers, name):
    base = transformers[name]
    model = original(name, base.state_dict(), base.config)
    names = comfyui.key_map(model, aliases(name, base.config))
    module = "transformer_blocks.0.attn.to_q"
    under = module.replace(".", "_")
    accepted = {"transformer." + module, "lycoris_" + under, "lora_transformer_" + under}
    accepted.add(module if name == "flux" else "base_model.model." + module)
    refused = {"lora_unet_" + under, "unet." + module}
    refused.add("base_model.model." + module if name == "flux" else module)
    assert accepted <= set(names) and not refused & set(names)
    assert len({names[n] for n in accepted}) == 1
    assert isinstance(names["transformer." + module], comfyui.Slice)
    if name == "flux":
        hidden = base.config.num_attention_heads * base.config.attention_head_dim
        fused = f"{PREFIX}single_blocks.0.linear1_qkv"
        assert names[fused] == comfyui.Slice(
            f"{PREFIX}single_blocks.0.linear1.weight", 0, 3 * hidden
        )


# ------------------------------------------------------------------ peft's merge, exactly


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_diffusers_named_adapters_merge_as_peft_does(transformers, name, kind):
    base = transformers[name]
    targets = [*get_family(name).default_lora_targets, *EXTRA_TARGETS[name]]
    state, merged = adapted(base, kind, targets, seed=len(name) + len(kind))
    if kind == "lora":
        file = lora_file(state)
    else:
        file = adapter_keys.lycoris_keys(state, ALPHA, RANK, "lycoris")
    model = original(name, base.state_dict(), base.config)
    want = original(name, merged, base.config)
    got = comfyui.apply(file, {}, model, aliases=aliases(name, base.config))
    assert got.unconsumed == [] and got.warnings == [], (got.unconsumed, got.warnings[:3])
    changed = {k for k in model if not torch.equal(model[k], want[k])}
    assert set(got.merged) == changed
    fused = [k for k in changed if k.endswith(("qkv.weight", "linear1.weight"))]
    assert fused and any("adaLN_modulation" in k for k in changed)
    for key in changed:
        close(got.merged[key], want[key])


def test_strength_and_patches_that_share_a_fused_weight(transformers):
    """A `lora_unet_` LoRA on the whole fused `qkv` and a diffusers-named one on its k rows
    are two patches on one weight; ComfyUI applies both, each at the strength."""
    base = transformers["flux"]
    model = original("flux", base.state_dict(), base.config)
    qkv = f"{PREFIX}double_blocks.0.img_attn.qkv.weight"
    w = model[qkv]
    hidden = w.shape[1]
    g = torch.Generator().manual_seed(3)
    whole_up, whole_down = (
        torch.randn(3 * hidden, 2, generator=g),
        torch.randn(2, hidden, generator=g),
    )
    k_up, k_down = torch.randn(hidden, 2, generator=g), torch.randn(2, hidden, generator=g)
    file = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": whole_up,
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": whole_down,
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0),
        "transformer_blocks.0.attn.to_k.lora_B.weight": k_up,
        "transformer_blocks.0.attn.to_k.lora_A.weight": k_down,
    }
    got = comfyui.apply(file, {}, model, strength=0.5, aliases=aliases("flux", base.config))
    assert got.clean
    want = w + 0.5 * 0.5 * (whole_up @ whole_down)
    want[hidden : 2 * hidden] += 0.5 * (k_up @ k_down)
    close(got.merged[qkv], want)


# ------------------------------------------------------------------ DoRA and the other parts


def test_dora_on_a_slice_and_on_a_swapped_modulation(transformers):
    """ComfyUI's `weight_decompose` runs on the narrowed rows: per-row norms of the unmerged
    slice, and for a swapped module the update swapped but `dora_scale` taken as it is."""
    base = transformers["sd3"]
    model = original("sd3", base.state_dict(), base.config)
    dim = base.config.num_attention_heads * base.config.attention_head_dim
    last = base.config.num_layers - 1
    g = torch.Generator().manual_seed(5)
    qkv = f"{PREFIX}joint_blocks.0.context_block.attn.qkv.weight"
    mod = f"{PREFIX}joint_blocks.{last}.context_block.adaLN_modulation.1.weight"
    file, parts = {}, {}
    for module, rows in (
        ("transformer_blocks.0.attn.add_v_proj", dim),
        (f"transformer_blocks.{last}.norm1_context.linear", 2 * dim),
    ):
        up, down = torch.randn(rows, 2, generator=g), torch.randn(2, dim, generator=g)
        magnitude = torch.rand(rows, 1, generator=g) + 0.5
        stem = "transformer." + module
        file |= {f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down}
        file |= {f"{stem}.alpha": torch.tensor(4.0), f"{stem}.dora_scale": magnitude}
        parts[module] = (up, down, magnitude)
    got = comfyui.apply(file, {}, model, strength=0.5, aliases=aliases("sd3", base.config))
    assert got.clean, got.warnings

    def comfy_dora(w, delta, m):
        v = w + delta
        norms = torch.stack([w[i].norm() for i in range(w.shape[0])])[:, None]
        return w + 0.5 * (v * m / (norms + EPS) - w)

    up, down, m = parts["transformer_blocks.0.attn.add_v_proj"]
    want = model[qkv].clone()
    want[2 * dim :] = comfy_dora(model[qkv][2 * dim :], 2.0 * up @ down, m)
    close(got.merged[qkv], want)
    up, down, m = parts[f"transformer_blocks.{last}.norm1_context.linear"]
    close(got.merged[mod], comfy_dora(model[mod], swap(2.0 * up @ down), m))
    # What DoRA would be (norms of the merged rows, magnitude in the module's own order):
    w = swap(model[mod])
    v = w + 2.0 * up @ down
    dora = swap(v * m / v.norm(dim=1, keepdim=True))
    assert not torch.allclose(got.merged[mod], model[mod] + 0.5 * (dora - model[mod]), atol=1e-3)


def test_diff_parts_on_slices(transformers):
    base = transformers["flux"]
    model = original("flux", base.state_dict(), base.config)
    hidden = base.config.num_attention_heads * base.config.attention_head_dim
    g = torch.Generator().manual_seed(7)
    mod = f"{PREFIX}final_layer.adaLN_modulation.1.weight"
    linear1 = f"{PREFIX}single_blocks.0.linear1.weight"
    diff = torch.randn(2 * hidden, hidden, generator=g)
    mlp = torch.randn(4 * hidden, hidden, generator=g)
    file = {
        "lycoris_norm_out_linear.diff": diff,
        "lycoris_single_transformer_blocks_0_proj_mlp.diff": mlp,
        "lycoris_single_transformer_blocks_0_proj_mlp.diff_b": torch.randn(4 * hidden, generator=g),
    }
    got = comfyui.apply(file, {}, model, strength=0.5, aliases=aliases("flux", base.config))
    assert got.unconsumed == []
    assert got.warnings == ["ComfyUI: NOT LOADED ().bias (no such weight in the model)"]
    close(got.merged[mod], model[mod] + 0.5 * swap(diff))
    want = model[linear1].clone()
    want[3 * hidden :] += 0.5 * mlp
    close(got.merged[linear1], want)
    wrong = {"lycoris_single_transformer_blocks_0_proj_mlp.diff": diff}  # 2h rows, slice has 4h
    got = comfyui.apply(wrong, {}, model, aliases=aliases("flux", base.config))
    assert got.merged == {} and "SHAPE MISMATCH" in got.warnings[0]
