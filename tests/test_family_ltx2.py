"""LTX-2: a clip and its sound trained as LTX2Pipeline denoises them, on the tiny random-init copy."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from kit.config import Config
from kit.families import get_family

CAPTION = "a large red zorbic moving right"


@pytest.fixture(scope="module")
def ltx2_base(tiny_base) -> Path:
    return tiny_base("ltx2")


@pytest.fixture(scope="module")
def loaded(ltx2_base):
    family = get_family("ltx2", Config().replace(max_sequence_length=32, num_frames=9))
    return family, family.load(str(ltx2_base))


def tone(seconds: float, rate: int = 16000, hz: float = 440.0) -> torch.Tensor:
    """A stereo sine, (2, samples)."""
    t = torch.arange(int(seconds * rate)) / rate
    wave = 0.3 * torch.sin(2 * torch.pi * hz * t)
    return torch.stack([wave, 0.5 * wave])


def pipeline_step_inputs(pipe, **call) -> dict:
    """The keyword arguments of the transformer's first call inside `pipe(**call)`, and the
    `mu` (dynamic σ shift) its scheduler was set with."""
    seen: dict = {}

    def hook(module, args, kwargs):
        if "timestep" not in seen:
            seen.update(kwargs)

    set_timesteps = pipe.scheduler.set_timesteps

    @functools.wraps(set_timesteps)  # the pipeline reads its signature
    def recording(*args, **kwargs):
        seen.setdefault("mu", kwargs.get("mu"))
        return set_timesteps(*args, **kwargs)

    pipe.scheduler.set_timesteps = recording
    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipe(**call, num_inference_steps=2, output_type="latent", return_dict=False)
    finally:
        handle.remove()
        del pipe.scheduler.set_timesteps
    return seen


def test_frame_rule_is_8k_plus_1():
    family = get_family("ltx2")
    assert [family.frame_count(n) for n in (0, 1, 8, 9, 16, 17, 120, 121)] == [
        0, 1, 1, 9, 9, 17, 113, 121,
    ]  # fmt: skip
    from kit.families import family_info

    assert family_info("ltx2").frame_count(20) == 17 and family_info("ltx2").audio


def test_training_inputs_equal_the_pipelines(loaded, ltx2_base):
    """Video latents, audio latents, their positions, the connectors' embeddings and masks and
    the timestep reach the transformer exactly (dtype included) as LTX2Pipeline feeds them."""
    from diffusers import LTX2Pipeline

    from kit.families.ltx2 import sound

    family, comps = loaded
    pipe = LTX2Pipeline.from_pretrained(str(ltx2_base))
    pixels = torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(comps, pixels)
    entry = family.encode_sound(comps, tone(0.5), frames=9, fps=24.0)
    text = family.encode_text(comps, [CAPTION])
    # What the pipeline is given: the VAEs' raw latents of the same clip and sound.
    audio_vae = family.part(comps, "audio_vae")
    count = entry["audio_latents"].shape[0]
    assert count == round(9 / 24 * 25)  # the pipeline's `audio_num_frames` for 9 frames
    wave = torch.zeros(1, 2, sound.window_samples(count, audio_vae.config))
    wave[0, :, :8000] = tone(0.5)[:, : wave.shape[-1]]
    with torch.no_grad():
        raw_video = comps.vae.encode(pixels).latent_dist.mean
        raw_audio = audio_vae.encode(sound.log_mel(wave, audio_vae.config)).latent_dist.mode()
    theirs = pipeline_step_inputs(
        pipe,
        prompt=CAPTION,
        height=64,
        width=64,
        num_frames=9,
        frame_rate=24.0,
        latents=raw_video,
        audio_latents=raw_audio[:, :, :count],
        noise_scale=0.0,  # the first step's input is then the clean latents themselves
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        modality_scale=1.0,
        stg_scale=0.0,
        max_sequence_length=32,
    )
    cond = {
        **text,
        "audio_latents": entry["audio_latents"][None],
        "frame_rate": entry["frame_rate"][None],
    }
    ours = family.transformer_inputs(comps.denoiser, latents, theirs["timestep"], cond)
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == other, key
    # The training draw's σ shift is the one the pipeline's scheduler set for these tokens.
    shifts = []
    real = family.flow_draw
    family.flow_draw = lambda c, lat, g, shift: shifts.append(shift) or real(c, lat, g, shift)
    try:
        family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    finally:
        del family.flow_draw
    assert shifts == [math.exp(theirs["mu"])]


def test_silent_clip_weighs_nothing(loaded):
    family, comps = loaded
    silent = family.encode_sound(comps, None, frames=9, fps=None)
    heard = family.encode_sound(comps, tone(1.0), frames=9, fps=30.0)
    assert float(silent["audio_latents_weight"]) == 0 and float(heard["audio_latents_weight"]) == 1
    assert float(silent["frame_rate"]) == 24.0 and float(heard["frame_rate"]) == 30.0
    assert heard["audio_latents"].shape == (round(9 / 30 * 25), 16)
    assert not torch.equal(
        silent["audio_latents"], family.encode_sound(comps, tone(1.0), 9, 24.0)["audio_latents"]
    )
