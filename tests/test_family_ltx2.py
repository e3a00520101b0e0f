"""LTX-2: a clip and its sound trained as LTX2Pipeline denoises them, on the tiny random-init copy."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
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


# ---------------------------------------------------------------- clips with their sound


def write_clip(path: Path, frames: int = 17, fps: int = 24, seconds: float | None = None) -> Path:
    """An MP4 of `frames` moving-colour frames at `fps`, with a tone of `seconds` (None: as
    long as the frames; 0: no audio track), and its caption beside it."""
    from PIL import Image

    from kit.families.samplers import Clip
    from kit.sample.clips import write_mp4

    images = [Image.new("RGB", (64, 64), (20 * i % 256, 200, 60)) for i in range(frames)]
    length = frames / fps if seconds is None else seconds
    clip = Clip(images, tone(length).numpy(), 16000) if length else images
    write_mp4(clip, path, fps)
    path.with_suffix(".txt").write_text(CAPTION)
    return path


def test_sound_is_read_for_each_window_and_counted(tmp_path, loaded):
    from kit.config import DataConfig
    from kit.data import sound
    from kit.data.report import bucket_report, report_lines
    from kit.data.scan import load_samples

    family, comps = loaded
    data = tmp_path / "data"
    data.mkdir()
    heard = write_clip(data / "heard.mp4")
    write_clip(data / "quiet.mp4", seconds=0)
    assert sound.probe(heard) == (True, 24.0) and sound.probe(data / "quiet.mp4")[0] is False
    wave = sound.read_sound(heard, 8 / 24, 9 / 24, 16000)
    assert wave.shape == (2, 6000) and abs(float(wave.std()) - 0.3 * 0.79 / 2**0.5) < 0.05
    samples = load_samples(DataConfig(image_dir=str(data), num_frames=9), family)
    by_name = {s.image.name: s for s in samples}
    entry = sound.clip_sound(family, comps, by_name["heard.mp4"], tuple(range(8, 17)))
    assert float(entry["audio_latents_weight"]) == 1 and float(entry["frame_rate"]) == 24
    # The window's own stretch: the same sound read directly and encoded gives the same latents.
    direct = family.encode_sound(comps, torch.from_numpy(wave), 9, 24.0)
    assert torch.equal(entry["audio_latents"], direct["audio_latents"])
    silent = sound.clip_sound(family, comps, by_name["quiet.mp4"], tuple(range(9)))
    assert float(silent["audio_latents_weight"]) == 0

    cfg = Config().replace(
        model_family="ltx2", image_dir=str(data), num_frames=9, resolution=64, bucket_step=32
    )
    report = bucket_report(cfg)
    assert (report["clips_with_sound"], report["silent_clips"]) == (1, 1)
    assert "1 clip(s) with sound, 1 silent (silent clips train video only)" in report_lines(report)


def test_bad_sound_and_short_clips_are_named(tmp_path, loaded):
    from kit.config import DataConfig
    from kit.data import sound
    from kit.data.scan import load_samples, scan

    family, comps = loaded
    data = tmp_path / "data"
    data.mkdir()
    # The sound stops after 0.1 s: the window from frame 8 on has none to decode.
    cut = write_clip(data / "cut.mp4", seconds=0.1)
    (s,) = load_samples(DataConfig(image_dir=str(data), num_frames=9), family)
    with pytest.warns(UserWarning, match=rf"{cut}: its sound cannot be decoded.*trains silent"):
        entry = sound.clip_sound(family, comps, s, tuple(range(8, 17)))
    assert float(entry["audio_latents_weight"]) == 0
    # Clips at different frame rates in one bucket: their sound cannot share a batch.
    from kit.data.cache import build_cache
    from kit.errors import DataError

    write_clip(data / "fast.mp4", frames=17, fps=30)
    cfg = Config().replace(
        model_family="ltx2",
        image_dir=str(data),
        num_frames=9,
        resolution=64,
        bucket_step=32,
        train_batch_size=2,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(DataError, match=r"cut.mp4 and .*fast.mp4 share a bucket but play at 24"):
        build_cache(cfg, family, comps)
    (data / "fast.mp4").unlink()
    # A clip shorter than one window (9 frames: 8k+1) is skipped, and named.
    write_clip(data / "short.mp4", frames=5)
    report = scan(DataConfig(image_dir=str(data), num_frames=9), family)
    assert [x.image.name for x in report.samples] == ["cut.mp4"]
    (problem,) = report.problems()
    assert "too short" in problem and str(data / "short.mp4") in problem


def test_validation_clip_plays_with_its_sound(loaded, tmp_path):
    from kit.data import sound
    from kit.families.base import ImageSpec
    from kit.sample.validate import run_validation

    family, comps = loaded
    spec = ImageSpec(CAPTION, "", 0, 2, 3.0, 64, 64)
    run_validation(
        family, family.pipeline(comps), [spec], tmp_path, cols=1, meta={"base_model": "x"}
    )
    mp4 = tmp_path / "00_seed0.mp4"
    assert sound.probe(mp4) == (True, 24.0)
    wave = sound.read_sound(mp4, 0.0, 9 / 24, 24000)
    assert wave.shape[0] == 2 and wave.shape[1] > 0.3 * 24000


@pytest.mark.slow
def test_two_steps_on_a_clip_with_sound_train_and_export(tmp_path, ltx2_base):
    from diffusers import LTX2Pipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from kit.config import load_config
    from kit.data import sound
    from kit.data.cache import build_cache
    from kit.export.writer import export
    from kit.run import checkpoint as ckpt
    from kit.train.loop import train
    from tests.conftest import write_run_config

    data = tmp_path / "data"
    data.mkdir()
    write_clip(data / "heard.mp4")
    path = write_run_config(
        tmp_path / "run.json",
        base=ltx2_base,
        data=data,
        family="ltx2",
        num_frames=9,
        max_sequence_length=32,
        train_batch_size=1,
        max_train_steps=2,
        validation_prompt=[CAPTION],
    )
    cfg = load_config(path)
    family = get_family("ltx2", cfg)
    cached = build_cache(cfg, family, family.load(str(ltx2_base)))
    batch = cached.load_batch([0])
    assert batch["audio_latents"].shape == (1, 9, 16) and float(batch["audio_latents_weight"]) == 1
    state = train(cfg)
    assert state.step == 2
    trained = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 2) / ckpt.ADAPTER_FILE))
    assert any(
        "audio_attn" in k and "lora_B" in k and w.abs().sum() > 0 for k, w in trained.items()
    )
    result = export(tmp_path / "run", "diffusers")
    assert result.verification.passed, result.verification
    pipe = LTX2Pipeline.from_pretrained(str(ltx2_base))
    pipe.load_lora_weights(str(tmp_path / "run/exports/diffusers"))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    # The run's own validation clip plays with its sound.
    (mp4,) = sorted((tmp_path / "run/validation").rglob("*.mp4"))
    assert sound.probe(mp4)[0]


def test_lora_round_trips_through_the_pipeline(loaded, ltx2_base, tmp_path):
    from diffusers import LTX2Pipeline

    from kit.methods import get_method
    from tests.conftest import lora_loads_exactly

    family, _ = loaded
    cfg = Config().replace(model_family="ltx2", lora_rank=2)
    comps = get_family("ltx2", cfg).load(str(ltx2_base))
    summary = get_method(cfg, family).attach(comps)
    assert any("audio_to_video_attn" in m for m in summary.modules)
    lora_loads_exactly(family, comps, LTX2Pipeline.from_pretrained(str(ltx2_base)), tmp_path)


@pytest.mark.slow
def test_estimate_answers_for_the_hub_id_without_a_download(tmp_path, capsys, monkeypatch):
    import json

    from kit.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KIT_VRAM_CACHE", str(tmp_path / "vram"))
    path = tmp_path / "ltx2.json"
    base = get_family("ltx2").hub_id  # the family's maintained base: Lightricks/LTX-2
    fields = {"model_family": "ltx2", "pretrained_model": base, "resolution": 256, "num_frames": 9}
    path.write_text(json.dumps({**fields, "mixed_precision": "bf16"}))
    assert main(["estimate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The shipped configs build the 19 B transformer (bf16: 2 bytes a parameter).
    assert 18.5e9 < out["components"]["denoiser_weights"] / 2 < 19.5e9
    assert out["details"]["setup"]["connectors_weights"] > 0
    assert out["components"]["activations"] > 0


def test_original_layout_is_the_one_diffusers_reads_back(loaded):
    """The ComfyUI (original) names given to every transformer weight are the ones diffusers'
    own converter of original-layout LTX-2 LoRA files maps back onto the diffusers model."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers,
    )

    from kit.families.ltx2 import layout

    _, comps = loaded
    state = comps.denoiser.state_dict()
    original = {f"diffusion_model.{k}": v for k, v in layout.to_original(state).items()}
    back = _convert_non_diffusers_ltx2_lora_to_diffusers(original)
    assert sorted(back) == sorted(f"transformer.{k}" for k in state)
    assert "diffusion_model.audio_patchify_proj.weight" in original
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_out.0.weight" in original


# ---------------------------------------------------------------- image-to-video


def test_image_to_video_inputs_equal_the_pipelines(ltx2_base):
    """The conditioning frame re-compressed, encoded and put in the first latent frame, and the
    per-token timesteps (0 there), as LTX2ImageToVideoPipeline feeds its transformer."""
    pytest.importorskip("av")  # the pipeline's H.264 re-compression of the image
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    cfg = Config().replace(max_sequence_length=32, num_frames=9, condition_frame=0)
    family = get_family("ltx2", cfg)
    assert family.pipeline_class == "LTX2ImageToVideoPipeline" and family.control_images == 1
    comps = family.load(str(ltx2_base))
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    clip = np.stack([first, *rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)])
    pixels = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    cond = family.pixel_conditioning(comps, pixels)
    assert cond["loss_mask"].shape == (1, 2, 2, 2) and cond["loss_mask"][:, 0].sum() == 0
    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(ltx2_base))
    theirs = pipeline_step_inputs(
        pipe,
        image=Image.fromarray(first),
        prompt=CAPTION,
        height=64,
        width=64,
        num_frames=9,
        frame_rate=24.0,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        modality_scale=1.0,
        stg_scale=0.0,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
    )
    from diffusers import LTX2Pipeline

    noisy = LTX2Pipeline._unpack_latents(theirs["hidden_states"].clone(), 2, 2, 2)
    noisy[:, :, 0] = 7.0  # whatever the draw put there, the image's latents replace it
    text = family.encode_text(comps, [CAPTION])
    sound = {"audio_latents": theirs["audio_hidden_states"], "frame_rate": torch.tensor([24.0])}
    batch = {**text, **sound, "condition_latents": cond["condition_latents"][None]}
    ours = family.transformer_inputs(comps.denoiser, noisy, theirs["audio_timestep"], batch)
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == other, key
    assert ours["timestep"].shape == (1, 8) and (ours["timestep"][0, :4] == 0).all()


@pytest.mark.slow
def test_image_to_video_trains_on_a_clip_with_sound_and_draws_from_an_image(tmp_path, ltx2_base):
    pytest.importorskip("av")
    from PIL import Image

    from kit.config import load_config
    from kit.data import sound
    from kit.train.loop import train
    from tests.conftest import write_run_config

    data = tmp_path / "data"
    data.mkdir()
    write_clip(data / "heard.mp4")
    first = tmp_path / "first.png"
    Image.new("RGB", (64, 64), (20, 200, 60)).save(first)
    path = write_run_config(
        tmp_path / "run.json",
        base=ltx2_base,
        data=data,
        family="ltx2",
        num_frames=9,
        condition_frame=0,
        max_sequence_length=32,
        train_batch_size=1,
        max_train_steps=2,
        validation_prompt=[],
        validation_prompts=[{"prompt": CAPTION, "control": [str(first)]}],
    )
    state = train(load_config(path))
    assert state.step == 2
    (mp4,) = sorted((tmp_path / "run/validation").rglob("*.mp4"))
    assert sound.probe(mp4)[0]
