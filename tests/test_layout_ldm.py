"""The original single-file layout (A1111 / ComfyUI / Forge) of SD1, SD2 and SDXL, proven by
reading it back with diffusers' own converters: every weight must come back exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kit.config import Config
from kit.errors import KitError
from kit.families import get_family, ldm, tiny
from kit.families.shipped import shipped_dir

# The UNet of SD 2.x (stabilityai/stable-diffusion-2-1), as its diffusers config states it.
SD2_UNET = {
    "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 96,
    "up_block_types": [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ],
    "use_linear_projection": True,
}


def _pipeline_parts(pipe) -> dict[str, nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, nn.Module)}


def assert_same_weights(ours: dict[str, nn.Module], theirs: dict[str, nn.Module]) -> None:
    """Every model of `ours` comes back in `theirs` with exactly the same weights."""
    assert set(ours) == set(theirs)
    for name, module in ours.items():
        a, b = module.state_dict(), theirs[name].state_dict()
        assert set(a) == set(b), (name, sorted(set(a) ^ set(b))[:5])
        for key in a:
            assert torch.equal(a[key].float(), b[key].float()), f"{name}.{key}"


def _write(state: dict[str, torch.Tensor], path) -> str:
    save_file(state, str(path))
    return str(path)


# ------------------------------------------------------------------ the family's tiny models


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_single_file_round_trips_through_diffusers(tmp_path, tiny_base, name):
    """The family's own single file, read by the family's diffusers `from_single_file`,
    holds every weight of the UNet, the VAE and the text encoders exactly."""
    family = get_family(name)
    base = tiny_base(name)
    comps = family.load(str(base))
    path = _write(family.single_file_state_dict(comps), tmp_path / "model.safetensors")
    pipe = family.single_file_pipeline(path, base)
    assert_same_weights(_pipeline_parts(family.pipeline(comps)), _pipeline_parts(pipe))


def test_sd1_keys_are_where_clients_look(tiny_base):
    family = get_family("sd15")
    state = family.single_file_state_dict(family.load(str(tiny_base("sd15"))))
    for key in (
        "model.diffusion_model.input_blocks.0.0.weight",
        "model.diffusion_model.out.2.weight",
        "model.diffusion_model.middle_block.1.proj_in.weight",
        "first_stage_model.decoder.up.0.block.0.conv1.weight",
        "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
        "cond_stage_model.transformer.text_model.final_layer_norm.weight",
    ):
        assert key in state, key
    # The VAE's attention projections are 1×1 convolutions in the original.
    assert state["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert ldm.layout_of(state) == "sd1" and "v_pred" not in state


# ------------------------------------------------------------------ SDXL, as it ships


def _tiny_sdxl(out_dir, v_prediction: bool = False):
    """A tiny SDXL with the released model's structure: three levels (no attention on the first,
    transformer depth 1 then 2), two resnets per level, and encoders of different widths."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    tok, tok2 = tiny.clip_tokenizer(), tiny.clip_tokenizer()
    te = CLIPTextModel(tiny.clip_text_config(tok, hidden=32))
    te2_cfg = tiny.clip_text_config(tok2, hidden=48, projection=16)
    te2_cfg.hidden_act = "gelu"
    te2 = CLIPTextModelWithProjection(te2_cfg)
    unet = UNet2DConditionModel(
        sample_size=16,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 64),
        layers_per_block=2,
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        cross_attention_dim=32 + 48,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 16,
        norm_num_groups=32,
    )
    vae = tiny.autoencoder_kl(block_out_channels=(16, 32, 32, 32), latent_channels=4)
    scheduler = EulerDiscreteScheduler(
        beta_schedule="scaled_linear",
        prediction_type="v_prediction" if v_prediction else "epsilon",
        rescale_betas_zero_snr=v_prediction,
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=te,
        text_encoder_2=te2,
        tokenizer=tok,
        tokenizer_2=tok2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    return tiny.save_pipeline(pipe, out_dir)


def test_sdxl_structure_round_trips_through_plain_from_single_file(tmp_path):
    """With encoders of different widths (as released), diffusers' plain loader reads it all."""
    from diffusers import StableDiffusionXLPipeline

    base = _tiny_sdxl(tmp_path / "base", v_prediction=True)
    family = get_family("sdxl")
    comps = family.load(str(base))
    state = family.single_file_state_dict(comps)
    # What A1111 and ComfyUI test for to recognise SDXL, and the v-prediction markers.
    assert "conditioner.embedders.1.model.ln_final.weight" in state
    assert "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight" in state
    assert "model.diffusion_model.label_emb.0.0.weight" in state
    assert "model.diffusion_model.output_blocks.2.2.conv.weight" in state  # the upsampler
    assert "v_pred" in state and "ztsnr" in state
    assert ldm.layout_of(state) == "sdxl"
    path = _write(state, tmp_path / "xl.safetensors")
    pipe = StableDiffusionXLPipeline.from_single_file(path, config=str(base), add_watermarker=False)
    assert_same_weights(_pipeline_parts(family.pipeline(comps)), _pipeline_parts(pipe))


def test_open_clip_fuses_qkv_and_transposes_the_projection(tmp_path):
    from transformers import CLIPTextModelWithProjection

    cfg = tiny.clip_text_config(tiny.clip_tokenizer(), hidden=32, projection=16)
    enc = CLIPTextModelWithProjection(cfg)
    sd = enc.state_dict()
    out = ldm.open_clip_to_ldm(sd, "p.")
    attn = "text_model.encoder.layers.1.self_attn"
    fused = out["p.transformer.resblocks.1.attn.in_proj_weight"]
    assert torch.equal(fused, torch.cat([sd[f"{attn}.{x}_proj.weight"] for x in "qkv"], dim=0))
    assert torch.equal(out["p.text_projection"], sd["text_projection.weight"].t())
    assert out["p.positional_embedding"].shape == (cfg.max_position_embeddings, 32)
    # Every weight has exactly one place: no key is dropped, none is invented.
    assert len(out) == len(sd) - 2 * 2 * cfg.num_hidden_layers


# ------------------------------------------------------------------ SD2 in the SD1.5 family


def _tiny_sd2(out_dir):
    """A tiny SD2: OpenCLIP-style text encoder (exact GELU), linear transformer projections,
    v-prediction."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    torch.manual_seed(0)
    tok = tiny.clip_tokenizer()
    cfg = tiny.clip_text_config(tok, hidden=32)
    cfg.hidden_act = "gelu"
    unet = UNet2DConditionModel(
        sample_size=16,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64, 64),
        layers_per_block=2,
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        cross_attention_dim=32,
        norm_num_groups=32,
    )
    pipe = StableDiffusionPipeline(
        vae=tiny.autoencoder_kl(block_out_channels=(16, 32, 32, 32), latent_channels=4),
        text_encoder=CLIPTextModel(cfg),
        tokenizer=tok,
        unet=unet,
        scheduler=DDIMScheduler(prediction_type="v_prediction"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return tiny.save_pipeline(pipe, out_dir)


def test_sd2_uses_the_open_clip_layout_and_round_trips(tmp_path):
    base = _tiny_sd2(tmp_path / "sd2")
    family = get_family("sd15")
    comps = family.load(str(base))
    state = family.single_file_state_dict(comps)
    assert ldm.layout_of(state) == "sd2" and "v_pred" in state
    assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in state
    assert not any(k.startswith("cond_stage_model.transformer.") for k in state)
    family = get_family("sd15", Config().replace(pretrained_model=str(base)))
    assert family.version_metadata()["modelspec.architecture"] == "stable-diffusion-v2-768-v"
    path = _write(state, tmp_path / "sd2.safetensors")
    pipe = family.single_file_pipeline(path, base)
    assert_same_weights(_pipeline_parts(family.pipeline(comps)), _pipeline_parts(pipe))


# ------------------------------------------------------------------ the UNet names


def _configs(tiny_base) -> dict[str, dict]:
    out = {
        f"shipped-{n}": json.loads((shipped_dir(n) / "unet" / "config.json").read_text())
        for n in ("sd15", "sdxl")
    }
    out["sd2"] = SD2_UNET
    for n in ("sd15", "sdxl"):
        out[f"tiny-{n}"] = json.loads((tiny_base(n) / "unet" / "config.json").read_text())
    return out


@pytest.mark.slow
def test_unet_module_names_cover_every_layer_and_agree_with_diffusers(tiny_base):
    """Every weight-holding module of each UNet has one original name, and diffusers' own
    converter takes each name back to the module it came from (real sizes, on meta)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    for label, cfg in _configs(tiny_base).items():
        names = ldm.unet_module_names(cfg)
        with init_empty_weights():
            unet = UNet2DConditionModel.from_config(cfg)
        layers = [
            n
            for n, m in unet.named_modules()
            if isinstance(m, nn.Linear | nn.Conv2d | nn.GroupNorm | nn.LayerNorm)
        ]
        assert set(layers) <= set(names), (label, sorted(set(layers) - set(names))[:3])
        assert len(set(names.values())) == len(names), label  # one module, one name
        # Tag every weight with its own number; diffusers' converter must bring each back.
        keys = list(unet.state_dict())
        tags = {k: torch.tensor(float(i)) for i, k in enumerate(keys)}
        back = convert_ldm_unet_checkpoint(ldm.unet_to_ldm(tags, cfg, ldm.UNET_PREFIX), cfg)
        assert set(back) == set(keys), label
        assert all(back[k].item() == tags[k].item() for k in keys), label


def test_sdxl_names_follow_the_released_numbering():
    """What kohya's SDXL LoRA names spell (`lora_unet_input_blocks_4_1_...`), fixed here."""
    cfg = json.loads((shipped_dir("sdxl") / "unet" / "config.json").read_text())
    names = ldm.unet_module_names(cfg)
    expected = {
        "conv_in": "input_blocks.0.0",
        "down_blocks.0.resnets.1.conv1": "input_blocks.2.0.in_layers.2",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": (
            "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
        ),
        "down_blocks.1.resnets.0.conv_shortcut": "input_blocks.4.0.skip_connection",
        "down_blocks.1.downsamplers.0.conv": "input_blocks.6.0.op",
        "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2": (
            "input_blocks.8.1.transformer_blocks.9.ff.net.2"
        ),
        "mid_block.resnets.1.time_emb_proj": "middle_block.2.emb_layers.1",
        "mid_block.attentions.0.proj_out": "middle_block.1.proj_out",
        "up_blocks.0.resnets.2.norm2": "output_blocks.2.0.out_layers.0",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_k": (
            "output_blocks.5.1.transformer_blocks.1.attn2.to_k"
        ),
        "up_blocks.1.upsamplers.0.conv": "output_blocks.5.2.conv",
        "up_blocks.2.resnets.0.conv2": "output_blocks.6.0.out_layers.3",
        "add_embedding.linear_2": "label_emb.0.2",
        "time_embedding.linear_1": "time_embed.0",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
    }
    assert {k: names[k] for k in expected} == expected
    # SD1.5: attention at the top level, none at the bottom, so its upsamplers differ.
    sd15 = ldm.unet_module_names(
        json.loads((shipped_dir("sd15") / "unet" / "config.json").read_text())
    )
    assert sd15["up_blocks.0.upsamplers.0.conv"] == "output_blocks.2.1.conv"
    assert sd15["up_blocks.1.upsamplers.0.conv"] == "output_blocks.5.2.conv"
    assert sd15["up_blocks.3.attentions.2.proj_out"] == "output_blocks.11.1.proj_out"


# ------------------------------------------------------------------ refusals


def test_what_the_layout_cannot_hold_is_refused():
    with pytest.raises(KitError, match="single-file layout 'sd9'"):
        ldm.single_file_state_dict({}, {}, [], unet_config={}, vae_config={}, layout="sd9")
    with pytest.raises(KitError, match="holds 2 text encoder"):
        ldm.single_file_state_dict({}, {}, [{}], unet_config={}, vae_config={}, layout="sdxl")
    odd = {**SD2_UNET, "down_block_types": ["SimpleCrossAttnDownBlock2D"] * 4}
    with pytest.raises(KitError, match="down_block_types 'SimpleCrossAttnDownBlock2D'"):
        ldm.unet_module_names(odd)
    with pytest.raises(KitError, match="unet weight 'down_blocks.0.resnets.0.lora_A.weight'"):
        ldm.unet_to_ldm({"down_blocks.0.resnets.0.lora_A.weight": torch.zeros(1)}, SD2_UNET)
    with pytest.raises(KitError, match="vae weight 'encoder.nope.weight'"):
        ldm.vae_to_ldm({"encoder.nope.weight": torch.zeros(1)}, {"up_block_types": [1, 2]})
