"""The family seam's questions, asked of every registered family on its tiny offline copy.

In the manner of diffusers' ModelTesterMixin: one suite run over `family_names()`, so a new
family file is held to the same contract without touching this file. Nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kit.config import from_dict
from kit.families import family_names, get_family
from kit.families.base import PARTS, ImageSpec
from tests.conftest import short_clips

FAMILIES = family_names()
CAPTIONS = ["a large red circle", "a small blue square on a white background"]
SIDE = 64
"""Image side in pixels: a multiple of every family's latent and patch factors."""

SUBSETS = [c for n in range(len(PARTS) + 1) for c in itertools.combinations(PARTS, n)]


def _family(name: str):
    # A short clip for video families, so that sampling stays quick.
    return get_family(name, from_dict({"model_family": name, **short_clips(name)}))


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tiny_base):
    """Per family: the family, its tiny base and every part loaded."""
    family = _family(request.param)
    base = tiny_base(request.param)
    return family, base, family.load(str(base))


@pytest.fixture(scope="module")
def batch(loaded):
    """Two encoded samples of the family's kind, with the bucketing conditioning."""
    family, _, comps = loaded
    generator = torch.Generator().manual_seed(0)
    frames = (family.frame_count(5),) if family.video else ()
    pixels = torch.rand((2, 3, *frames, SIDE, SIDE), generator=generator) * 2 - 1
    with torch.no_grad():
        text = family.encode_text(comps, CAPTIONS)
        latents = family.encode_images(comps, pixels)
    sizes = {
        "original_size": torch.tensor([[SIDE, SIDE]] * 2),
        "crop_top_left": torch.zeros(2, 2, dtype=torch.long),
        "target_size": torch.tensor([[SIDE, SIDE]] * 2),
    }
    # An edit family's references, as the cache gives them (`control_latents_<r>`).
    with torch.no_grad():
        controls = {
            f"control_latents_{r}": family.encode_images(comps, pixels.flip(-1))
            for r in range(family.control_images)
        }
    # A family that trains on sound (`Family.audio`) gets each clip's, as the cache gives it.
    sound = {}
    if family.audio:
        one = family.encode_sound(comps, None, frames[0], None)
        sound = {k: torch.stack([v, v]) for k, v in one.items()}
    return pixels, latents, {**text, **sizes, **controls, **sound}


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


# ------------------------------------------------------------------ loading


@pytest.mark.parametrize("parts", SUBSETS, ids=lambda p: "+".join(p) or "none")
@pytest.mark.parametrize("name", FAMILIES)
def test_loads_only_the_parts_asked_for(tiny_base, name, parts):
    family = _family(name)
    comps = family.load(str(tiny_base(name)), parts=parts)
    assert comps.missing_parts() == tuple(p for p in PARTS if p not in parts)
    assert comps.tokenizers and comps.noise_scheduler is not None  # these always load
    for module in comps.frozen_modules():
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())


def test_tokenizers_and_token_limits(loaded):
    family, base, comps = loaded
    tokenizers = family.load_tokenizers(str(base))
    assert len(tokenizers) == len(comps.tokenizers) == len(comps.text_encoders) > 0
    assert [type(t) for t in tokenizers.values()] == [type(t) for t in comps.tokenizers]
    for encoder, tokenizer in tokenizers.items():
        limit = family.token_limit(encoder, tokenizer)
        assert isinstance(limit, int) and 2 < limit <= tokenizer.model_max_length, encoder
        assert len(tokenizer(CAPTIONS[1]).input_ids) > 2  # the offline vocabulary works


# ------------------------------------------------------------------ encoding


def test_encode_text_is_batch_first_and_deterministic(loaded):
    family, _, comps = loaded
    with torch.no_grad():
        first = family.encode_text(comps, CAPTIONS)
        again = family.encode_text(comps, CAPTIONS)
    assert first and first.keys() == again.keys()
    for key, value in first.items():
        assert isinstance(value, torch.Tensor) and value.shape[0] == len(CAPTIONS), key
        assert torch.isfinite(value).all() and torch.equal(value, again[key]), key
    assert any(not torch.equal(v[0], v[1]) for v in first.values()), "captions look alike"


def test_encode_images_gives_scaled_latents(loaded, batch):
    family, _, comps = loaded
    pixels, latents, _ = batch
    config = comps.vae.config
    channels = getattr(config, "latent_channels", None) or config.z_dim
    assert latents.ndim == pixels.ndim and latents.shape[:2] == (2, channels)
    factor = SIDE // latents.shape[-1]
    assert latents.shape[-2:] == (SIDE // factor,) * 2 and factor > 1
    assert factor & (factor - 1) == 0, "the spatial factor is a power of two"
    if family.video:
        assert 1 <= latents.shape[2] <= pixels.shape[2]
    with torch.no_grad():
        assert torch.equal(family.encode_images(comps, pixels), latents), "a sample, not the mean"


# ------------------------------------------------------------------ training


def test_noise_draw_is_reproducible_and_shaped_like_the_prediction(loaded, batch):
    family, _, comps = loaded
    _, latents, cond = batch
    kept = latents.clone()
    draws = [
        family.noise_and_target(comps, latents, torch.Generator().manual_seed(s)) for s in (0, 0, 1)
    ]
    assert torch.equal(latents, kept), "the draw changed the latents in place"
    a, b, other = draws
    assert torch.equal(a.noisy, b.noisy) and torch.equal(a.target, b.target)
    assert torch.equal(a.timesteps, b.timesteps)
    assert (a.weight is None) == (b.weight is None)
    if a.weight is not None:
        assert a.weight.shape == (2,) and torch.equal(a.weight, b.weight)
    assert not torch.equal(a.noisy, other.noisy)
    assert a.noisy.shape == latents.shape and a.timesteps.shape[0] == 2

    # Latents predicted beside the main ones (`Family.joint_latents`) are noised with them.
    joint = {k: cond[k] for k in family.joint_latents}
    drawn = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0), **joint)
    assert drawn.joint.keys() == joint.keys() and torch.equal(drawn.timesteps, a.timesteps)
    cond = {**cond, **{k: d.noisy for k, d in drawn.joint.items()}}
    with torch.no_grad():
        pred = family.predict(comps, drawn.noisy, drawn.timesteps, cond)
    if joint:
        pred, beside = pred
        assert all(beside[k].shape == d.target.shape for k, d in drawn.joint.items())
    assert pred.shape == a.target.shape
    assert torch.isfinite(pred).all()


# ------------------------------------------------------------------ memory estimate


def test_empty_parts_have_the_loaded_shapes(loaded):
    family, base, comps = loaded
    parts = family.empty_parts(str(base))
    for module in parts.values():
        assert all(p.device.type == "meta" for p in module.parameters())
    assert _shapes(parts["denoiser"]) == _shapes(comps.denoiser)
    assert _shapes(parts["vae"]) == _shapes(comps.vae)


def test_empty_text_encoders_have_the_loaded_shapes(loaded):
    """The estimator counts these parameters: a tie that loading makes (an encoder's input
    embedding shared with another matrix) must hold on the meta device too."""
    family, base, comps = loaded
    parts = family.empty_parts(str(base))
    loaded_encoders = [_shapes(m) for m in comps.text_encoders]
    # Parts a family holds itself beside `Components` (LTX-2's text connectors).
    held = getattr(family, "held_parts", ())
    for name in sorted(set(parts) - {"denoiser", "vae"} - set(held)):
        assert _shapes(parts[name]) in loaded_encoders, name
    for name in held:
        assert _shapes(parts[name]) == _shapes(family.part(comps, name)), name


# ------------------------------------------------------------------ cache keys


def test_identity_is_stable_and_follows_the_weights(loaded, tmp_path):
    family, base, comps = loaded
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    assert comps.identity == family.identity(str(base))
    before = family.identity(str(copy))
    assert before == family.identity(str(copy)) and {"vae", "text"} <= before.keys()

    def touch_weights(subfolder: str) -> None:
        path = sorted((copy / subfolder).glob("*.safetensors"))[0]
        tensors = load_file(str(path))
        key = sorted(tensors)[0]
        tensors[key] = tensors[key] + 1
        save_file(tensors, str(path))

    touch_weights("vae")
    after_vae = family.identity(str(copy))
    assert after_vae["vae"] != before["vae"] and after_vae["text"] == before["text"]
    touch_weights(family.text_subfolders[0])
    after_text = family.identity(str(copy))
    assert after_text["text"] != after_vae["text"] and after_text["vae"] == after_vae["vae"]


# ------------------------------------------------------------------ sampling


class Recorder:
    """Stands in for a pipeline: records each call's keyword arguments, then makes the call."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.pipe(**kwargs)

    def __getattr__(self, name):
        return getattr(self.pipe, name)


def test_pipeline_samples_an_image_spec_as_call_kwargs_says(loaded):
    family, _, comps = loaded
    spec = ImageSpec(
        prompt=CAPTIONS[0],
        negative_prompt="",
        seed=3,
        num_inference_steps=2,
        guidance_scale=3.0,
        width=SIDE,
        height=SIDE,
    )
    pipe = Recorder(family.pipeline(comps))
    images = family.sample(pipe, spec)
    expected = family.frame_count(family.cfg.data.num_frames) if family.video else 1
    assert len(images) == expected
    assert all(im.size == (SIDE, SIDE) for im in images)

    (call,) = pipe.calls
    generator = call.pop("generator")
    assert generator.initial_seed() == spec.seed
    assert call == family.call_kwargs(spec)
    json.dumps(call)  # recorded in each sample's sidecar

    again = family.sample(pipe, spec)
    assert all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(images, again, strict=True)
    )
    scaled = family.call_kwargs(dataclasses.replace(spec, adapter_scale=0.5))
    assert scaled != call and "0.5" in json.dumps(scaled), "the adapter scale is not passed"


def test_validation_draws_the_same_from_cached_embeddings(loaded):
    """Once the cache is filled the encoders go (`kit.sample.embedded`): the grids' prompts,
    cached with the captions, drawn through a pipeline without encoders give the same image."""
    from dataclasses import replace

    from kit.sample.embedded import EmbeddedPrompts, embedded_keys, prompt_texts, takes_embeddings

    family, _, comps = loaded
    spec = ImageSpec(
        prompt=CAPTIONS[0],
        negative_prompt=CAPTIONS[1],
        seed=5,
        num_inference_steps=2,
        guidance_scale=4.0,
        width=SIDE,
        height=SIDE,
    )
    texts = prompt_texts(family, [spec])
    assert CAPTIONS[0] in texts
    # One text at a time, as the pipeline encodes it (a batch may differ in the last bit).
    with torch.no_grad():
        cached = {
            t: {k: v[0].float() for k, v in family.encode_text(comps, [t]).items()} for t in texts
        }
    assert takes_embeddings(type(family.pipeline(comps)), embedded_keys(family, cached[texts[0]]))
    with_encoders = family.sample(family.pipeline(comps), spec)
    bare = replace(comps, text_encoders=[None] * len(comps.tokenizers))
    without = family.sample(
        EmbeddedPrompts(family.pipeline(bare), cached.__getitem__, family), spec
    )
    for a, b in zip(with_encoders, without, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # An adapter scale (a slider's row, `draw_checkpoint`'s scales) reaches the denoiser alone.
    scaled = replace(spec, adapter_scale=0.5)
    assert family.sample(EmbeddedPrompts(family.pipeline(bare), cached.__getitem__, family), scaled)


def test_kit_families_lists_each_with_its_variants_and_shipped_configs(capsys):
    """`kit families --json`: every family, with a shipped config of its maintained base, so
    that `kit estimate` answers for it with no download."""
    from kit.cli import main
    from kit.families.shipped import ARCHITECTURES

    assert main(["families", "--json"]) == 0
    rows = {r["family"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == FAMILIES
    for name, row in rows.items():
        assert row["shipped_configs"], f"{name} ships no config of a real architecture"
        shipped_ids = {n for f in row["shipped_configs"] for n in ARCHITECTURES[f].names}
        assert row["base_model"] in shipped_ids, name
        assert row["variants"] == list(get_family(name).variants)


def test_every_sampler_the_family_offers_draws(loaded):
    """Each name of the family's `samplers` draws through its pipeline (a validation entry may
    ask for any of them), and the base model's own scheduler comes back afterwards."""
    from dataclasses import replace

    from kit.families.samplers import draw

    family, _, comps = loaded
    pipe = family.pipeline(comps)
    own = pipe.scheduler
    spec = ImageSpec(CAPTIONS[0], "", 1, 2, 3.0, SIDE, SIDE)
    for name in family.samplers:
        frames, record = draw(family, pipe, replace(spec, sampler=name))
        assert frames and record["sampler"] == name, name
        assert pipe.scheduler is own
