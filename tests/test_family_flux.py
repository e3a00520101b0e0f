"""Flux specifics the contract suite does not see: packing, the resolution-dependent shift,
schnell-style models without guidance, and LoRA round-trips of every default target."""

from __future__ import annotations

import pytest
import torch

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.families.flux.family import pack_latents, unpack_latents
from tests.conftest import lora_loads_exactly


@pytest.fixture(scope="module")
def tiny_flux(tiny_base):
    return tiny_base("flux")


def _family(**changes):
    return get_family("flux", Config().replace(model_family="flux", **changes))


def test_pack_unpack_round_trips():
    latents = torch.randn(2, 16, 8, 12)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 4 * 6, 64)
    # Token 0 holds the top-left 2×2 patch, channel by channel.
    assert torch.equal(tokens[0, 0], latents[0, :, :2, :2].reshape(-1))
    assert torch.equal(unpack_latents(tokens, 8, 12), latents)


def test_shift_grows_with_resolution_unless_fixed(tiny_flux):
    comps = _family().load(str(tiny_flux))
    sched = comps.noise_scheduler.config
    assert sched.use_dynamic_shifting
    family = _family()
    small, large = family.flow_shift(sched, 32, 32), family.flow_shift(sched, 128, 128)
    assert 1 < small < large
    # 1024 px (a 64×64 latent, 1024 tokens) as FluxPipeline's calculate_shift gives it.
    m = (1.15 - 0.5) / (4096 - 256)
    assert family.flow_shift(sched, 64, 64) == pytest.approx(
        torch.tensor(m * 1024 + 0.5 - m * 256).exp().item()
    )
    fixed = _family(flow_shift=3.0)
    assert fixed.flow_shift(sched, 32, 32) == fixed.flow_shift(sched, 128, 128) == 3.0


def test_loss_weighting_and_noise_draw(tiny_flux):
    family = _family(loss_weighting="cosmap", timestep_sampling="uniform")
    comps = family.load(str(tiny_flux))
    latents = torch.randn(3, 16, 8, 8)
    draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    sigma = draw.timesteps / 1000
    assert draw.weight is not None and draw.weight.shape == (3,)
    assert torch.allclose(draw.weight, 2 / (torch.pi * (1 - 2 * sigma + 2 * sigma**2)))
    s = sigma.view(3, 1, 1, 1)
    assert torch.allclose(draw.noisy, (1 - s) * latents + s * (draw.target + latents), atol=1e-5)
    assert _family().noise_and_target(comps, latents, torch.Generator()).weight is None


def test_predict_with_and_without_guidance_embeds(tiny_flux):
    from diffusers import FluxTransformer2DModel

    family = _family(max_sequence_length=16)
    comps = family.load(str(tiny_flux))
    cond = family.encode_text(comps, ["a red zorbstar", "a blue circle"])
    assert cond["prompt_embeds"].shape == (2, 16, 32)
    assert cond["pooled_prompt_embeds"].shape == (2, 32)
    noisy, steps = torch.randn(2, 16, 4, 6), torch.tensor([100.0, 900.0])
    with torch.no_grad():
        assert family.predict(comps, noisy, steps, cond).shape == noisy.shape
        config = {**comps.denoiser.config, "guidance_embeds": False}  # schnell-style
        comps.denoiser = FluxTransformer2DModel.from_config(config)
        assert family.predict(comps, noisy, steps, cond).shape == noisy.shape


def test_lora_round_trips_every_default_target(tiny_flux, tmp_path):
    from diffusers import FluxPipeline

    from kit.methods import get_method

    cfg = Config().replace(model_family="flux", lora_rank=2)
    family = get_family("flux", cfg)
    comps = family.load(str(tiny_flux))
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    assert any(m.startswith("single_transformer_blocks") for m in summary.modules)
    lora_loads_exactly(family, comps, FluxPipeline.from_pretrained(str(tiny_flux)), tmp_path)


def test_bucket_step_must_allow_packing():
    with pytest.raises(ConfigError, match="bucket_step"):
        _family(bucket_step=24)
