"""Qwen-Image 2.1 specifics the contract suite does not see: the transformer inputs the kit builds
equal QwenImage21Pipeline's tensor for tensor (unpatched latents, the image-pad mask with the
target's slots, the VL prompt), the σ shift on the unpatched token count, the RGB image filled
with the alpha the pipeline gives it, the base and Turbo read from the configs, and the
diffusers LoRA round trip through the pipeline's own loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kit.config import Config
from kit.families import get_family
from kit.families.qwen_image21.family import pack, transformer_inputs, unpack
from tests.conftest import assert_same_inputs as _assert_same
from tests.conftest import lora_loads_exactly
from tests.conftest import transformer_calls as _recorded_call

CAPTIONS = ["a red zorbstar", "a small blue circle on the left of a big green tree"]
LENGTH = 48


@pytest.fixture(scope="module")
def tiny21(tiny_base):
    return tiny_base("qwen_image21")


@pytest.fixture(scope="module")
def tiny_turbo(tiny21, tmp_path_factory):
    """The same tiny model with the few-step grid the Turbo checkpoint ships."""
    path = tmp_path_factory.mktemp("qwen_image21") / "turbo"
    shutil.copytree(tiny21, path)
    index = json.loads((path / "model_index.json").read_text())
    grid = {**index, "sample_sigmas": [1.0, 0.75, 0.5, 0.25]}
    (path / "model_index.json").write_text(json.dumps(grid))
    return path


def _family(base, **changes):
    cfg = Config().replace(model_family="qwen_image21", pretrained_model=str(base), **changes)
    return get_family("qwen_image21", cfg)


@pytest.fixture(scope="module")
def loaded(tiny21):
    family = _family(tiny21, max_sequence_length=LENGTH)
    return family, family.load(str(tiny21))


def test_packing_is_the_pipelines(loaded):
    family, comps = loaded
    pipe = family.pipeline(comps)
    x = torch.randn(2, 64, 4, 6)
    packed = pipe._pack_latents(x, 2, 64, 4, 6)
    assert torch.equal(pack(x), packed)
    assert torch.equal(unpack(packed, 4, 6), x)
    assert torch.equal(pipe._unpack_latents(packed, 64, 96, 16).squeeze(2), x)


def test_transformer_inputs_equal_the_pipelines(loaded):
    """THE test: every tensor the kit feeds the transformer for a text-to-image sample (the
    flattened latents, the VL prompt, its mask, the image-pad mask with the target's slots, the
    shapes and timestep) is, dtype included, what QwenImage21Pipeline builds at inference."""
    family, comps = loaded
    pipe = family.pipeline(comps)
    latents = torch.randn(2, 64, 4, 6, generator=torch.Generator().manual_seed(1))
    calls = _recorded_call(
        pipe,
        prompt=list(CAPTIONS),
        latents=pack(latents),
        height=64,
        width=96,
        num_inference_steps=2,
        use_kv_cache=False,
        output_type="latent",
    )
    assert len(calls) == 2
    text = family.encode_text(comps, CAPTIONS)
    assert text["prompt_embeds"].shape[1] == LENGTH
    timesteps = pipe.scheduler.timesteps
    kit = transformer_inputs(
        latents,
        timesteps[:1].expand(2),
        text["prompt_embeds"],
        text["prompt_embeds_mask"],
        text["image_pad_mask"],
    )
    recorded = {k: v for k, v in calls[0].items() if k in kit}
    _assert_same(kit, recorded)
    noisy = unpack(calls[1]["hidden_states"], 4, 6)
    again = transformer_inputs(
        noisy,
        timesteps[1:2].expand(2),
        text["prompt_embeds"],
        text["prompt_embeds_mask"],
        text["image_pad_mask"],
    )
    _assert_same(again, calls[1])
    # `predict` feeds the transformer exactly these.
    seen = []
    hook = comps.denoiser.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw), with_kwargs=True
    )
    with torch.no_grad():
        family.predict(comps, latents, timesteps[:1].expand(2), text)
    hook.remove()
    _assert_same(kit, seen[0])


def test_predict_is_the_velocity_the_scheduler_steps_with(loaded):
    family, comps = loaded
    pipe = family.pipeline(comps)
    latents = torch.randn(1, 64, 4, 4, generator=torch.Generator().manual_seed(2))
    seen = {}

    def keep(p, i, t, kwargs):
        seen.setdefault(i, kwargs["latents"].clone())
        return kwargs

    pipe(prompt=CAPTIONS[:1], latents=pack(latents), height=64, width=64, num_inference_steps=2,
         use_kv_cache=False, output_type="latent", callback_on_step_end=keep)  # fmt: skip
    sched = pipe.scheduler
    sigma, sigma_next = sched.sigmas[0], sched.sigmas[1]
    cond = family.encode_text(comps, CAPTIONS[:1])
    with torch.no_grad():
        v = family.predict(comps, latents, sched.timesteps[:1], cond)
    assert torch.allclose(unpack(seen[0], 4, 4), latents + (sigma_next - sigma) * v, atol=1e-5)


def test_training_draws_at_the_shift_the_pipeline_samples_with(loaded):
    """The pipeline's mu counts the unpatched latent tokens (h · w), not 2×2 patches."""
    family, comps = loaded
    for side in (64, 128):
        shift = family.flow_shift(comps.noise_scheduler.config, side // 16, side // 16)
        pipe = family.pipeline(comps)
        n = 4
        pipe(prompt=CAPTIONS[:1], height=side, width=side, num_inference_steps=n,
             output_type="latent")  # fmt: skip
        u = torch.from_numpy(np.linspace(1.0, 1 / n, n)).float()
        expected = shift * u / (1 + (shift - 1) * u)
        assert torch.allclose(pipe.scheduler.sigmas[:n], expected, atol=1e-5), (side, shift)
    assert _family(comps.source, flow_shift=2.0).flow_shift(comps.noise_scheduler.config, 4, 4) == 2


def test_an_rgb_image_is_encoded_opaque_as_the_pipeline_fills_it(loaded):
    """The VAE reads RGBA; the pipeline converts an RGB image to RGBA (alpha 255 → 1 after
    normalising) before it encodes it, and the kit's encoding of the RGB pixels is the same."""
    from PIL import Image

    family, comps = loaded
    pipe = family.pipeline(comps)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8), "RGB")
    theirs = pipe.image_processor.preprocess(image.convert("RGBA"), 64, 96)
    assert theirs.shape[1] == 4 and torch.all(theirs[:, 3] == 1)
    rgb = pipe.image_processor.preprocess(image, 64, 96)
    assert rgb.shape[1] == 3
    seen = []
    encode = comps.vae.encode
    comps.vae.encode = lambda x, *a, **k: (seen.append(x.clone()), encode(x, *a, **k))[1]
    try:
        with torch.no_grad():
            ours = family.encode_images(comps, rgb, torch.Generator().manual_seed(0))
    finally:
        comps.vae.encode = encode
    assert ours.shape == (1, 64, 4, 6)
    # What the VAE reads is the pipeline's RGBA tensor, in its one-frame layout.
    assert torch.equal(seen[0], theirs.unsqueeze(2))


def test_variants_and_their_defaults_come_from_the_configs(tiny21, tiny_turbo):
    base, turbo = _family(tiny21), _family(tiny_turbo)
    assert base.variants == ("Qwen-Image-2.1", "Qwen-Image-2.1-Turbo")
    assert base.variant_of(str(tiny21)) == "Qwen-Image-2.1" and base.distillation(str(tiny21)) == ""
    assert turbo.variant_of(str(tiny_turbo)) == "Qwen-Image-2.1-Turbo"
    assert "step-distilled" in turbo.distillation(str(tiny_turbo))
    assert (base.guidance_scale(), base.inference_steps()) == (1.0, 40)
    assert turbo.inference_steps() == 8
    assert _family("").variant_of("Qwen/Qwen-Image-2.1") == "Qwen-Image-2.1"


def test_the_diffusers_lora_loads_exactly_through_the_pipeline(loaded, tmp_path):
    from diffusers import QwenImage21Pipeline

    from kit.methods import get_method

    family, comps = loaded
    source = comps.source
    cfg = Config().replace(model_family="qwen_image21", pretrained_model=source, lora_rank=2)
    comps = _family(source).load(source)
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    pipe = QwenImage21Pipeline.from_pretrained(source, **family.pipeline_kwargs)
    lora_loads_exactly(family, comps, pipe, tmp_path)


def test_estimate_answers_for_the_hub_id_at_1024_without_a_download():
    """The shipped configs build the released 7B transformer on the meta device, and one
    traced training step at 1024 px (64 × 64 latent tokens, the target's slots in the CPU
    image-pad mask) gives the activations."""
    from kit.preflight.estimate import estimate

    cfg = Config().replace(model_family="qwen_image21", resolution=1024, mixed_precision="bf16")
    est = estimate(cfg)
    weights = est.components["denoiser_weights"] / 2**30
    assert 7.0e9 * 2 / 2**30 < weights < 7.2e9 * 2 / 2**30
    assert est.components["activations"] > 0


def _references(n):
    """`n` references of different sizes; the second carries transparency."""
    from PIL import Image

    rng = np.random.default_rng(3)
    images = []
    for i, (w, h) in enumerate([(96, 64), (64, 64), (64, 96)][:n]):
        pixels = rng.integers(0, 255, (h, w, 4 if i == 1 else 3), dtype=np.uint8)
        images.append(Image.fromarray(pixels, "RGBA" if i == 1 else "RGB"))
    return images


@pytest.mark.parametrize("n", [1, 3], ids=["one-reference", "three-references"])
def test_edit_inputs_equal_the_pipelines(loaded, n, monkeypatch):
    """With references: the prompt as the pipeline encodes it with them (the VL encoder reading
    each, resized, over white), their VAE latents (RGBA, the mode) before the target's, their
    shapes in `img_shapes` and their slots in `img_mask`, tensor for tensor."""
    from kit.families.qwen_image21 import family as module

    family, comps = loaded
    # A small reference area keeps the tiny run quick; the pipeline's is output_resolution².
    monkeypatch.setattr(module, "REFERENCE_AREA", 64 * 64)
    pipe = family.pipeline(comps)
    refs = _references(n)
    latents = torch.randn(1, 64, 4, 6, generator=torch.Generator().manual_seed(4))
    calls = _recorded_call(
        pipe,
        prompt=CAPTIONS[1],
        image=refs,
        latents=pack(latents),
        height=64,
        width=96,
        num_inference_steps=1,
        output_resolution=64,
        use_kv_cache=False,
        output_type="latent",
    )
    text = family.encode_text(comps, [CAPTIONS[1]], controls=[refs])
    with torch.no_grad():
        controls = [
            family.encode_images(comps, family.control_pixels(r).unsqueeze(0)) for r in refs
        ]
    kit = transformer_inputs(
        latents,
        pipe.scheduler.timesteps[:1],
        text["prompt_embeds"],
        text["prompt_embeds_mask"],
        text["image_pad_mask"],
        controls,
    )
    assert int(kit["img_mask"].sum()) * 4 == kit["hidden_states"].shape[1]
    _assert_same(kit, calls[0])
    seen = []
    hook = comps.denoiser.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw), with_kwargs=True
    )
    cond = {**text, **{f"control_latents_{r}": c for r, c in enumerate(controls)}}
    with torch.no_grad():
        family.predict(comps, latents, pipe.scheduler.timesteps[:1], cond)
    hook.remove()
    _assert_same(kit, seen[0])


def test_an_image_with_transparency_trains_with_its_alpha_as_the_pipeline_encodes_it(tmp_path):
    """The family declares an RGBA VAE (`image_alpha`): the cache keeps a transparent image's
    alpha as a fourth channel, the pixels the pipeline's preprocess gives that image; an opaque
    image stays RGB (the family fills its alpha, above); the bucket report names the images
    that carry alpha."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    from kit.data.buckets import Placement
    from kit.data.pixels import load_pixels
    from kit.data.report import bucket_report

    rng = np.random.default_rng(5)
    folder = tmp_path / "images"
    folder.mkdir()
    rgba = Image.fromarray(rng.integers(0, 255, (128, 128, 4), dtype=np.uint8), "RGBA")
    rgba.save(folder / "cutout.png")
    Image.fromarray(rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(folder / "flat.png")
    for name in ("cutout", "flat"):
        (folder / f"{name}.txt").write_text("a zorbstar")
    place = Placement(bucket=(128, 128), resized=(128, 128), crop=(0, 0), original=(128, 128))
    ours = load_pixels(folder / "cutout.png", place, alpha=True)
    theirs = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=64).preprocess(
        Image.open(folder / "cutout.png"), 128, 128
    )[0]
    assert ours.shape == (4, 128, 128) and torch.allclose(ours, theirs, atol=1e-6)
    assert load_pixels(folder / "flat.png", place, alpha=True).shape == (3, 128, 128)
    # A family without an RGBA VAE lays the alpha on the background, as before.
    assert load_pixels(folder / "cutout.png", place).shape == (3, 128, 128)
    cfg = Config().replace(
        model_family="qwen_image21", image_dir=str(folder), resolution=128, train_batch_size=1
    )
    rows = bucket_report(cfg)["buckets"]
    assert [Path(f).name for r in rows for f in r["alpha"]] == ["cutout.png"]


@pytest.mark.slow
def test_edit_pairs_with_transparency_train_and_draw_their_validation_image(
    tiny21, family_dataset, tmp_path, monkeypatch
):
    """A 2-step LoRA run on pairs (each target with a reference), one target with transparency
    (kept as its alpha channel): the cache encodes them, it trains and draws its validation
    image with a reference."""
    from PIL import Image

    from kit.config import load_config
    from kit.families.qwen_image21 import family as module
    from kit.train.loop import train
    from tests.conftest import paired_controls, write_run_config

    monkeypatch.setattr(module, "REFERENCE_AREA", 64 * 64)  # the tiny run's references stay small

    data = tmp_path / "data"
    shutil.copytree(family_dataset("qwen_image21"), data)
    first = sorted(data.glob("*.png"))[0]
    image = Image.open(first).convert("RGBA")
    alpha = np.full((image.height, image.width), 255, dtype=np.uint8)
    alpha[: image.height // 2] = 0
    image.putalpha(Image.fromarray(alpha))
    image.save(first)
    controls = paired_controls(data)
    reference = sorted(controls.glob("*.png"))[0]
    config = write_run_config(
        tmp_path / "config.json",
        base=tiny21,
        data=data,
        family="qwen_image21",
        control_dir=str(controls),
        train_batch_size=1,
        max_train_steps=2,
        checkpointing_steps=2,
        validation_prompt=[],
        validation_prompts=[{"prompt": "a red zorbstar", "control": [str(reference)]}],
    )
    train(load_config(config))
    drawn = list((tmp_path / "run").rglob("*.png"))
    assert drawn, "no validation image"
