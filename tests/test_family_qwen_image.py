"""Qwen-Image specifics: what the kit feeds the transformer equals, tensor for tensor, what
QwenImagePipeline feeds it at inference (latents, timestep, text and its mask, image shapes, the
σ shift for the size); caption padding changes nothing; the tiny tokenizer drops exactly the
template's system prompt; LoRA files load through the pipeline's own loaders."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.families.qwen_image.family import (
    encode_prompts,
    pack_latents,
    transformer_inputs,
    unpack_latents,
)

CAPTIONS = ["a red circle", "a large blue dog on the left of a small green tree"]


@pytest.fixture(scope="module")
def tiny_qwen(tiny_base):
    return tiny_base("qwen_image")


@pytest.fixture(scope="module")
def pipe(tiny_qwen):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(tiny_qwen))


def _family(**changes):
    return get_family("qwen_image", Config().replace(model_family="qwen_image", **changes))


def test_pack_unpack_round_trips():
    latents = torch.randn(2, 16, 8, 12)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 4 * 6, 64)
    assert torch.equal(tokens[0, 0], latents[0, :, :2, :2].reshape(-1))
    assert torch.equal(pack_latents(latents.unsqueeze(2)), tokens)  # the VAE's one-frame layout
    assert torch.equal(unpack_latents(tokens, 8, 12), latents)


def test_tiny_tokenizer_drops_exactly_the_system_prompt(pipe):
    tok = pipe.tokenizer
    ids = tok(pipe.prompt_template_encode.format("a red circle"))["input_ids"]
    kept = tok.convert_ids_to_tokens(ids[pipe.prompt_template_encode_start_idx :])
    assert kept == ["a", "Ġred", "Ġcircle", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    # The vision token ids of the text encoder's config are the tokenizer's.
    config = pipe.text_encoder.config
    assert tok.convert_ids_to_tokens(config.image_token_id) == "<|image_pad|>"
    assert tok.convert_ids_to_tokens(config.vision_start_token_id) == "<|vision_start|>"


def test_text_is_the_pipelines_padded_with_a_mask(tiny_qwen, pipe):
    family = _family(max_sequence_length=24)
    comps = family.load(str(tiny_qwen))
    ours = family.encode_text(comps, CAPTIONS)
    with torch.no_grad():
        theirs, mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=24)
        alone, none = pipe.encode_prompt(CAPTIONS[:1], device="cpu", max_sequence_length=24)
    n = theirs.shape[1]
    assert ours["prompt_embeds"].shape == (2, 24, 32) and n < 24
    assert torch.equal(ours["prompt_embeds"][:, :n], theirs)
    assert ours["prompt_embeds"][:, n:].abs().sum() == 0
    assert torch.equal(ours["prompt_embeds_mask"][:, :n], mask)
    assert ours["prompt_embeds_mask"][:, n:].sum() == 0
    # One caption alone: no padding, so the pipeline gives no mask; the kit's marks its tokens.
    assert none is None
    single = encode_prompts(pipe, CAPTIONS[:1], 24)
    assert single["prompt_embeds_mask"].sum() == alone.shape[1]
    # Captions longer than the length are cut, as the pipeline cuts them.
    short = encode_prompts(pipe, CAPTIONS, 4)
    assert short["prompt_embeds"].shape == (2, 4, 32) and bool(short["prompt_embeds_mask"].all())


def test_padding_does_not_change_the_transformer_output(pipe):
    t = pipe.transformer
    padded = encode_prompts(pipe, CAPTIONS, 40)
    latents = torch.randn(2, 16, 4, 6)
    steps = torch.tensor([700.0, 300.0])
    cut = transformer_inputs(latents, steps, padded["prompt_embeds"], padded["prompt_embeds_mask"])
    full = {
        **cut,
        "encoder_hidden_states": padded["prompt_embeds"],
        "encoder_hidden_states_mask": padded["prompt_embeds_mask"],
    }
    assert cut["encoder_hidden_states"].shape[1] < 40
    with torch.no_grad():
        a = t(**cut, return_dict=False)[0]
        b = t(**full, return_dict=False)[0]
    assert torch.allclose(a, b, atol=1e-5)


def test_transformer_inputs_equal_the_pipelines(tiny_qwen, pipe, monkeypatch):
    """THE check: one denoising step of the pipeline, its transformer's arguments recorded, and
    the kit's arguments for the same latents, captions, size and timestep."""
    from diffusers import QwenImagePipeline

    family = _family(max_sequence_length=32)
    comps = family.load(str(tiny_qwen))
    pipe = QwenImagePipeline.from_pretrained(str(tiny_qwen))
    height, width = 64, 96  # latents 8 × 12, 24 packed tokens
    latents = torch.randn(
        2, 16, height // 8, width // 8, generator=torch.Generator().manual_seed(0)
    )
    seen, mus = [], []
    forward = pipe.transformer.forward
    set_timesteps = pipe.scheduler.set_timesteps

    @functools.wraps(forward)
    def record(*args, **kwargs):
        seen.append(kwargs)
        return forward(*args, **kwargs)

    @functools.wraps(set_timesteps)  # the pipeline reads its signature
    def record_mu(*args, **kwargs):
        mus.append(kwargs["mu"])
        return set_timesteps(*args, **kwargs)

    monkeypatch.setattr(pipe.transformer, "forward", record)
    monkeypatch.setattr(pipe.scheduler, "set_timesteps", record_mu)
    pipe(
        prompt=CAPTIONS,
        negative_prompt=[" ", " "],
        true_cfg_scale=4.0,
        height=height,
        width=width,
        num_inference_steps=2,
        latents=pack_latents(latents),
        max_sequence_length=32,
        output_type="latent",
    )
    cond, uncond = seen[0], seen[1]  # the first step's two passes
    t = pipe.scheduler.timesteps[0]

    text = family.encode_text(comps, CAPTIONS)
    ours = transformer_inputs(
        latents, t.expand(2), text["prompt_embeds"], text["prompt_embeds_mask"]
    )
    assert set(ours) | {"attention_kwargs", "return_dict"} == set(cond)
    for key, value in ours.items():
        theirs = cond[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == theirs.dtype and torch.equal(value, theirs), key
        else:
            assert value == theirs, key
    # The negative prompt " " alone is unpadded: no mask, as the kit gives for it too.
    neg = family.encode_text(comps, [" ", " "])
    ours_neg = transformer_inputs(
        latents, t.expand(2), neg["prompt_embeds"], neg["prompt_embeds_mask"]
    )
    assert ours_neg["encoder_hidden_states_mask"] is None is uncond["encoder_hidden_states_mask"]
    assert torch.equal(ours_neg["encoder_hidden_states"], uncond["encoder_hidden_states"])

    # The σ shift: the pipeline's μ for this size, and the kit's shift applies the scheduler's
    # exponential time shift to σ.
    config = comps.noise_scheduler.config
    shift = family.flow_shift(config, height // 8, width // 8)
    assert shift == pytest.approx(math.exp(mus[0]), rel=1e-12)
    m = (0.9 - 0.5) / (8192 - 256)
    assert mus[0] == pytest.approx(m * 24 + 0.5 - m * 256)
    sched = type(pipe.scheduler).from_config(config, shift_terminal=None)
    base = [1.0, 0.75, 0.5, 0.25]
    sched.set_timesteps(sigmas=base, mu=mus[0])
    kit = [shift * s / (1 + (shift - 1) * s) for s in base]
    assert torch.allclose(sched.sigmas[:-1].double(), torch.tensor(kit, dtype=torch.double))
    # And the kit draws with it: the same draw unshifted, then shifted.
    draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    plain = _family(flow_shift=1.0).noise_and_target(
        comps, latents, torch.Generator().manual_seed(0)
    )
    sigma, sigma0 = draw.timesteps / 1000, plain.timesteps / 1000
    assert torch.allclose(sigma, shift * sigma0 / (1 + (shift - 1) * sigma0), atol=1e-5)


def test_predict_is_the_transformer_output_unpacked(tiny_qwen):
    family = _family(max_sequence_length=16)
    comps = family.load(str(tiny_qwen))
    cond = family.encode_text(comps, CAPTIONS)
    noisy, steps = torch.randn(2, 16, 4, 6), torch.tensor([100.0, 900.0])
    with torch.no_grad():
        out = family.predict(comps, noisy, steps, cond)
        raw = comps.denoiser(
            **transformer_inputs(noisy, steps, cond["prompt_embeds"], cond["prompt_embeds_mask"]),
            return_dict=False,
        )[0]
    assert out.shape == noisy.shape
    assert torch.equal(pack_latents(out), raw)


def test_latents_are_the_pipelines_normalisation(tiny_qwen):
    family = _family()
    comps = family.load(str(tiny_qwen))
    x = torch.rand(1, 3, 32, 48) * 2 - 1
    latents = family.encode_images(comps, x)
    assert latents.shape == (1, 16, 4, 6)
    vae = comps.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1)
    with torch.no_grad():
        raw = vae.encode(x.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    # What the pipeline does before decoding (latents / (1 / std) + mean) gives the VAE's own.
    assert torch.allclose(latents / (1.0 / std) + mean, raw, atol=1e-5)


def test_sampling_uses_true_cfg_and_the_pipelines_defaults(tiny_qwen):
    import inspect

    from diffusers import QwenImagePipeline

    from kit.families.base import ImageSpec

    family = _family()
    defaults = inspect.signature(QwenImagePipeline.__call__).parameters
    assert family.default_guidance_scale == defaults["true_cfg_scale"].default
    spec = ImageSpec("a red circle", "", 0, 2, family.guidance_scale(), 64, 64, adapter_scale=0.5)
    kwargs = family.call_kwargs(spec)
    assert kwargs["negative_prompt"] == " " and kwargs["true_cfg_scale"] == 4.0
    assert kwargs["attention_kwargs"] == {"scale": 0.5}
    assert set(kwargs) <= set(defaults)
    comps = family.load(str(tiny_qwen))
    (image,) = family.sample(family.pipeline(comps), spec)
    assert image.size == (64, 64)


def test_variants_and_distillation(tiny_qwen):
    family = _family()
    assert family.variants == ("Qwen-Image", "Qwen-Image-2512")
    assert family.variant_of("Qwen/Qwen-Image") == "Qwen-Image"
    assert family.variant_of("Qwen/Qwen-Image-2512") == "Qwen-Image-2512"
    assert family.distillation("Qwen/Qwen-Image") == ""
    assert family.distillation(str(tiny_qwen)) == ""


def test_settings_the_pipeline_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="bucket_step"):
        _family(bucket_step=24)
    with pytest.raises(ConfigError, match="max_sequence_length"):
        _family(max_sequence_length=2048)


def test_textual_inversion_is_refused_by_name():
    from kit.methods import get_method
    from tests.conftest import TEXTUAL_INVERSION

    cfg = Config().replace(model_family="qwen_image", **TEXTUAL_INVERSION)
    with pytest.raises(ConfigError, match="QwenImagePipeline"):
        get_method(cfg, get_family("qwen_image", cfg))


def test_a_comfyui_transformer_file_loads_as_the_folder(tiny_qwen, tmp_path):
    """A single transformer file (ComfyUI's diffusion_models layout) with `model_config` for
    the rest: bit for bit the folder's parts, through diffusers' `from_single_file`."""
    from safetensors.torch import save_file

    family = _family()
    ours = family.load(str(tiny_qwen))
    path = tmp_path / "qwen_image_tiny.safetensors"
    save_file(family.single_file_state_dict(ours), str(path))
    cfg = Config().replace(
        model_family="qwen_image", pretrained_model=str(path), model_config=str(tiny_qwen)
    )
    theirs = get_family("qwen_image", cfg).load(str(path))
    for a, b in (
        (ours.denoiser, theirs.denoiser),
        (ours.vae, theirs.vae),
        (ours.text_encoders[0], theirs.text_encoders[0]),
    ):
        sa, sb = a.state_dict(), b.state_dict()
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert theirs.source == str(tiny_qwen)
