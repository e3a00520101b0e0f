"""Chroma specifics the contract suite does not see: the transformer's inputs in training equal
ChromaPipeline's at inference (tokens, σ, text ids, image ids, the joint mask), the σ shift the
pipeline's scheduler uses per size, the cached T5 mask, and the LoRA round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.families.chroma.family import pack_latents, transformer_inputs, unpack_latents
from kit.families.samplers import ImageSpec
from tests.conftest import lora_loads_exactly

SEQ = 16  # a short T5 length keeps the tiny model fast


@pytest.fixture(scope="module")
def tiny_chroma(tiny_base):
    return tiny_base("chroma")


def _family(**changes):
    return get_family("chroma", Config().replace(model_family="chroma", **changes))


@pytest.fixture(scope="module")
def comps(tiny_chroma):
    return _family(max_sequence_length=SEQ).load(str(tiny_chroma))


def _record_calls(transformer, calls):
    """Wrap the transformer's forward so every call's kwargs and output are kept."""
    forward = transformer.forward

    def recording(*args, **kwargs):
        assert not args
        out = forward(**kwargs)
        calls.append(({k: v for k, v in kwargs.items()}, out[0].clone()))
        return out

    transformer.forward = recording
    return forward


def test_pack_unpack_round_trips():
    latents = torch.randn(2, 16, 8, 12)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 4 * 6, 64)
    assert torch.equal(tokens[0, 0], latents[0, :, :2, :2].reshape(-1))
    assert torch.equal(unpack_latents(tokens, 8, 12), latents)


def test_cached_text_is_the_pipelines_with_its_mask(comps):
    family = _family(max_sequence_length=SEQ)
    captions = ["a red zorbstar", "a blue circle and a red zorbstar on a green field"]
    cond = family.encode_text(comps, captions)
    assert set(cond) == {"prompt_embeds", "prompt_attention_mask"}  # the call's keyword names
    pipe = family.pipeline(comps)
    embeds, _, mask, *_ = pipe.encode_prompt(
        captions, device="cpu", do_classifier_free_guidance=False, max_sequence_length=SEQ
    )
    assert torch.equal(cond["prompt_embeds"], embeds)
    assert torch.equal(cond["prompt_attention_mask"], mask)
    # Every real token and the first padding token are kept; a full caption keeps all.
    real = comps.tokenizers[0](captions, max_length=SEQ, truncation=True, padding="max_length")
    lengths = torch.tensor(real["attention_mask"]).sum(1)
    assert cond["prompt_attention_mask"].sum(1).tolist() == [
        min(n + 1, SEQ) for n in lengths.tolist()
    ]
    assert cond["prompt_embeds"].shape == (2, SEQ, 32)


@pytest.mark.parametrize("size", [(64, 96), (256, 512)])
def test_training_inputs_equal_the_pipelines(comps, size):
    """One pipeline step with true CFG, recorded: the kit's predict feeds the transformer the
    same tensors for the same latents, caption and timestep, and gets the same output; the σ
    the scheduler steps with is the kit's shift for that size."""
    family = _family(max_sequence_length=SEQ)
    height, width = size
    latents = torch.randn(
        1, 16, height // 8, width // 8, generator=torch.Generator().manual_seed(0)
    )
    pipe = family.pipeline(comps)
    calls: list = []
    forward = _record_calls(comps.denoiser, calls)
    try:
        with torch.no_grad():
            pipe(
                prompt="a red zorbstar",
                negative_prompt="blurry",
                latents=pack_latents(latents),
                height=height,
                width=width,
                num_inference_steps=2,
                guidance_scale=family.default_guidance_scale,
                max_sequence_length=SEQ,
                output_type="latent",
            )
    finally:
        comps.denoiser.forward = forward
    assert len(calls) == 4  # two steps, each with the prompt and the negative prompt
    (theirs, their_out), (negative, _) = calls[0], calls[1]

    # The scheduler's first σ is 1; its timestep there is 1000 · σ.
    shift = family.flow_shift(comps.noise_scheduler.config, height // 8, width // 8)
    sigmas = np.linspace(1.0, 1 / 2, 2)
    expected = shift * sigmas / (1 + (shift - 1) * sigmas)
    assert torch.allclose(pipe.scheduler.sigmas[:2].double(), torch.tensor(expected), atol=1e-6)
    timestep = pipe.scheduler.timesteps[:1]

    cond = family.encode_text(comps, ["a red zorbstar"])
    ours = transformer_inputs(
        latents, timestep, cond["prompt_embeds"], cond["prompt_attention_mask"]
    )
    assert set(ours) | {"joint_attention_kwargs", "return_dict"} == set(theirs)
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype, key
        assert torch.equal(value, theirs[key]), key
    # The negative prompt's call differs only in its text and mask.
    uncond = family.encode_text(comps, ["blurry"])
    assert torch.equal(negative["encoder_hidden_states"], uncond["prompt_embeds"])
    with torch.no_grad():
        out = family.predict(comps, latents, timestep, cond)
    assert torch.equal(pack_latents(out), their_out)


def test_shift_follows_the_packed_sequence_length(comps):
    from diffusers.pipelines.chroma.pipeline_chroma import calculate_shift

    config = comps.noise_scheduler.config
    assert config.use_dynamic_shifting  # as Chroma1's scheduler config has it
    family = _family()
    small, large = family.flow_shift(config, 32, 32), family.flow_shift(config, 128, 128)
    assert 1 < small < large
    mu = calculate_shift(64 * 64 // 4, 256, 4096, 0.5, 1.15)
    assert family.flow_shift(config, 64, 64) == pytest.approx(float(np.exp(mu)))
    assert _family(flow_shift=2.0).flow_shift(config, 32, 32) == 2.0
    fixed = {**config, "use_dynamic_shifting": False}
    assert family.flow_shift(fixed, 32, 32) == config.shift


def test_checkpointed_single_blocks_keep_the_mask(tiny_chroma):
    """diffusers drops the mask of a checkpointed single block; predict puts it back, so a
    checkpointed step computes what an uncheckpointed one (and inference) does."""
    family = _family(max_sequence_length=SEQ)
    comps = family.load(str(tiny_chroma))
    cond = family.encode_text(comps, ["a red zorbstar"])  # padded: the mask matters
    latents, steps = torch.randn(1, 16, 4, 6), torch.tensor([500.0])
    plain = family.predict(comps, latents, steps, cond)
    comps.denoiser.enable_gradient_checkpointing()
    checkpointed = family.predict(comps, latents, steps, cond)
    assert torch.allclose(checkpointed, plain, atol=1e-6)
    comps.denoiser.disable_gradient_checkpointing()


def test_sampling_call_and_defaults():
    family = _family()
    spec = ImageSpec("a cat", "", 0, 35, 5.0, 512, 768, adapter_scale=0.5)
    kwargs = family.call_kwargs(spec)
    assert kwargs["negative_prompt"] == "" and kwargs["guidance_scale"] == 5.0
    assert kwargs["joint_attention_kwargs"] == {"scale": 0.5}
    assert kwargs["max_sequence_length"] == 512
    assert family.default_guidance_scale == 5.0


def test_variants_and_no_distillation(tiny_chroma):
    family = _family()
    assert family.variant_of("lodestones/Chroma1-HD") == "HD"
    assert family.variant_of("lodestones/Chroma1-Base") == "Base"
    assert family.variant_of(str(tiny_chroma)) == ""
    assert family.distillation("lodestones/Chroma1-HD") == ""


def test_textual_inversion_and_kohya_dora_are_refused():
    from kit.methods import get_method

    cfg = Config().replace(
        model_family="chroma",
        network_type="textual_inversion",
        placeholder_tokens=["<z>"],
        initializer_token="cat",
    )
    with pytest.raises(ConfigError, match="T5"):
        get_method(cfg, get_family("chroma", cfg))
    dora = Config().replace(model_family="chroma", use_dora=True)
    method = get_method(dora, get_family("chroma", dora))
    assert "kohya" not in method.export_formats()


def test_bucket_step_must_allow_packing():
    with pytest.raises(ConfigError, match="bucket_step"):
        _family(bucket_step=24)


def test_lora_round_trips_every_default_target(tiny_chroma, tmp_path):
    from diffusers import ChromaPipeline

    from kit.methods import get_method

    cfg = Config().replace(model_family="chroma", lora_rank=2)
    family = get_family("chroma", cfg)
    comps = family.load(str(tiny_chroma))
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    assert any(m.startswith("single_transformer_blocks") for m in summary.modules)
    lora_loads_exactly(family, comps, ChromaPipeline.from_pretrained(str(tiny_chroma)), tmp_path)
