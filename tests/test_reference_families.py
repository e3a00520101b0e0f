"""Where the reference trainers and pipelines set the behaviour: EMA warm-up, SDXL's pooled text
at EOS, schedule milestones on several processes, flow-matching σ sampling with a loss weighting,
each family's own sampling and training guidance, VAE posterior samples, and the empty negative
prompt that the sidecar records and the pipeline receives."""

from __future__ import annotations

import inspect
import json
import shutil
from types import SimpleNamespace

import diffusers
import pytest
import torch
from PIL import Image

from kit.config import Config, TrainConfig, load_config
from kit.families import family_names, get_family
from kit.families.base import ImageSpec
from kit.families.noise import flow_noise_and_target
from kit.families.shipped import ARCHITECTURES
from kit.optim import make_scheduler
from kit.sample.validate import image_specs, run_validation
from kit.train.objective import EMA


def _config(family: str, **changes) -> Config:
    return Config().replace(model_family=family, **changes)


# ------------------------------------------------------------------ EMA


def _ema_over(decay: float, steps: int, start: int = 0, ema: EMA | None = None) -> EMA:
    """An EMA of one weight that a steady run moves by 1 per step, after `start` steps."""
    p = torch.nn.Parameter(torch.zeros(3))
    ema = ema if ema is not None else EMA([p], decay, on_cpu=False)
    for step in range(start + 1, start + steps + 1):
        with torch.no_grad():
            p.fill_(float(step))
        ema.step([p])
    return ema


def test_ema_warms_up_and_holds_most_of_a_short_run():
    ema = _ema_over(0.999, 20)
    averaged = ema.state_dict()["shadow_params"][0]
    # The raw weight moved 20 from its start; a decay fixed at 0.999 from the first step keeps
    # the average near step 1 (about 6% of that), the diffusers ramp keeps most of it.
    assert (averaged / 20 > 0.5).all()
    # The ramp is diffusers' default: (1 + n) / (10 + n) after n updates, capped at the decay.
    assert ema.model.cur_decay_value == pytest.approx(20 / 29)
    assert _ema_over(0.5, 20).model.cur_decay_value == 0.5


def test_ema_resumes_its_ramp_exactly():
    straight = _ema_over(0.999, 12)
    first = _ema_over(0.999, 5)
    resumed = EMA([torch.nn.Parameter(torch.zeros(3))], 0.999, on_cpu=False)
    resumed.load_state_dict(first.state_dict())
    resumed = _ema_over(0.999, 7, start=5, ema=resumed)
    assert resumed.state_dict()["optimization_step"] == 12
    assert torch.equal(
        resumed.state_dict()["shadow_params"][0], straight.state_dict()["shadow_params"][0]
    )


# ------------------------------------------------------------------ SDXL pooled text


def test_sdxl_pools_the_second_encoder_at_the_first_eos(tiny_base, tmp_path):
    """As the released SDXL: `eos_token_id: 2` in the second encoder's config, for which
    transformers pools at the highest token id, which a new placeholder token becomes."""
    from transformers import CLIPTextModelWithProjection

    base = tmp_path / "sdxl"
    shutil.copytree(tiny_base("sdxl"), base)
    config = base / "text_encoder_2" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": 2}))

    family = get_family("sdxl")
    comps = family.load(str(base))
    plain = CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder_2")
    for tok, enc in zip(comps.tokenizers, [*comps.text_encoders[:1], plain], strict=True):
        tok.add_tokens(["<zorb>"])
        enc.resize_token_embeddings(len(tok))
    comps.text_encoders[1].resize_token_embeddings(len(comps.tokenizers[1]))
    with torch.no_grad():
        comps.text_encoders[1].get_input_embeddings().weight[-1] = (
            plain.get_input_embeddings().weight[-1]
        )

    tok, enc = comps.tokenizers[1], comps.text_encoders[1]
    captions = ["a <zorb> circle", "a red square"]
    ids = tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    ids = ids.input_ids
    placeholder = tok.convert_tokens_to_ids("<zorb>")
    assert placeholder > tok.eos_token_id and (ids[0] == placeholder).any()

    with torch.no_grad():
        ours = family.encode_text(comps, captions)["pooled_prompt_embeds"]
        eos = [int((row == tok.eos_token_id).nonzero()[0]) for row in ids]
        hidden = enc(ids).last_hidden_state
        expected = enc.text_projection(hidden[torch.arange(2), torch.tensor(eos)])
        assert torch.allclose(ours, expected, atol=1e-6)
        # transformers' own pooling under that config reads the placeholder instead ...
        assert not torch.allclose(plain(ids).text_embeds[0], expected[0], atol=1e-4)
        # ... but not without one, where the highest id is the EOS token.
        assert torch.allclose(plain(ids).text_embeds[1], expected[1], atol=1e-6)
        # Validation samples with what training trains: the pipeline pools at EOS too.
        pipe = family.pipeline(comps)
        _, _, pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
        assert torch.allclose(pooled, ours, atol=1e-6)


# ------------------------------------------------------------------ schedules


def _learning_rates(num_processes: int, steps: int, **train) -> list[float]:
    """The learning rate at each optimizer step, the scheduler stepped as accelerate steps it:
    once per process per optimizer step (accelerate/scheduler.py, without split_batches)."""
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=1.0)
    scheduler = make_scheduler(
        optimizer, TrainConfig(max_train_steps=steps, **train), num_processes
    )
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for _ in range(num_processes):
            scheduler.step()
    return rates


def test_piecewise_milestones_count_optimizer_steps_on_any_number_of_processes():
    rules = {"lr_scheduler": "piecewise_constant", "lr_step_rules": "1:3,0.5:5,0.1"}
    one = _learning_rates(1, 7, **rules)
    assert one == [1.0, 1.0, 1.0, 0.5, 0.5, 0.1, 0.1]
    assert _learning_rates(2, 7, **rules) == one
    assert _learning_rates(4, 7, **rules) == one
    # Warm-up was already counted this way; milestones now agree with it.
    warm = {"lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 3}
    assert _learning_rates(2, 5, **warm) == _learning_rates(1, 5, **warm)


# ------------------------------------------------------------------ flow-matching σ


def _flow_draw(**objective):
    family = get_family("sd3", _config("sd3", **objective))
    comps = SimpleNamespace(
        noise_scheduler=SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000))
    )
    latents = torch.zeros(64, 4, 2, 2)
    return family.flow_draw(comps, latents, torch.Generator().manual_seed(0), 1.0), latents


def _sigmas(sampling: str, latents: torch.Tensor) -> torch.Tensor:
    draw = flow_noise_and_target(latents, torch.Generator().manual_seed(0), sampling=sampling)
    return draw.timesteps


@pytest.mark.parametrize("weighting", ["cosmap", "sigma_sqrt"])
def test_a_loss_weighting_draws_uniform_sigma_by_default(weighting):
    """diffusers pairs these weightings with uniform σ; logit-normal draws too would favour the
    middle σ twice."""
    assert Config().objective.timestep_sampling == "auto"
    draw, latents = _flow_draw(loss_weighting=weighting)
    assert draw.weight is not None
    assert torch.equal(draw.timesteps, _sigmas("uniform", latents))
    # Without a weighting the default stays logit-normal; a sampling asked for is kept.
    plain, _ = _flow_draw()
    assert plain.weight is None and torch.equal(plain.timesteps, _sigmas("logit_normal", latents))
    both, _ = _flow_draw(loss_weighting=weighting, timestep_sampling="logit_normal")
    assert torch.equal(both.timesteps, _sigmas("logit_normal", latents))


# ------------------------------------------------------------------ guidance


@pytest.mark.parametrize("name", family_names())
def test_each_family_samples_with_its_pipelines_default_guidance(name):
    family = get_family(name, _config(name))
    if family.distillation(family.cfg.model.pretrained_model):
        # A family whose own base is step-distilled (Z-Image Turbo) draws without CFG; its
        # non-distilled release takes the pipeline's default, as checked here.
        base = next(
            a.hub_id
            for a in ARCHITECTURES.values()
            if a.family == name and not family.distillation(a.hub_id)
        )
        family = get_family(name, _config(name, pretrained_model=base))
    pipeline = getattr(diffusers, family.pipeline_class)
    # The keyword the family passes its guidance as: `guidance_scale`, or the true-CFG scale of
    # a pipeline whose `guidance_scale` is a distilled model's input (Qwen-Image).
    probe = family.call_kwargs(ImageSpec("a cat", "", 0, 1, 1.0, 64, 64))
    kwarg = "true_cfg_scale" if "true_cfg_scale" in probe else "guidance_scale"
    parameters = inspect.signature(pipeline.__call__).parameters
    if kwarg not in parameters:
        pytest.skip(
            f"{family.pipeline_class} takes its defaults from its blocks (see its family's tests)"
        )
    default = parameters[kwarg].default
    assert family.default_guidance_scale == default
    spec = image_specs(family.cfg, family, ["a cat"])[0]
    assert spec.guidance_scale == default
    configured = get_family(name, _config(name, validation_guidance_scale=2.0))
    assert image_specs(configured.cfg, configured, ["a cat"])[0].guidance_scale == 2.0


def test_flux_trains_and_samples_with_its_distilled_guidance(tiny_base, tmp_path):
    """FluxPipeline samples with guidance 3.5, and diffusers' and kohya's Flux trainers feed 3.5
    to the guidance embedding; the generic CFG 7.5 is no value for it."""
    from kit.families.flux.family import _transformer_inputs

    cfg = _config(
        "flux",
        validation_seeds=[0],
        validation_num_inference_steps=1,
        validation_resolution=32,
    )
    family = get_family("flux", cfg)
    comps = family.load(str(tiny_base("flux")))
    inputs = _transformer_inputs(
        comps.denoiser.config,
        torch.zeros(1, 16, 4, 4),
        torch.zeros(1),
        torch.zeros(1, 8, 32),
        torch.zeros(1, 32),
        family.train_guidance_scale(),
    )
    assert inputs["guidance"].tolist() == [3.5]
    assert (
        get_family("flux", _config("flux", train_guidance_scale=1.0)).train_guidance_scale() == 1.0
    )

    run_validation(
        family, family.pipeline(comps), image_specs(cfg, family, ["a cat"]), tmp_path, 1, {}
    )
    sidecar = json.loads((tmp_path / "00_seed0.json").read_text())
    assert sidecar["guidance_scale"] == sidecar["call_kwargs"]["guidance_scale"] == 3.5


# ------------------------------------------------------------------ empty negative prompt


def test_the_sidecar_records_the_negative_prompt_the_pipeline_receives(tiny_base, tmp_path):
    """ComfyUI and A1111 encode an empty negative prompt; SDXL's pipeline would draw with zeros
    for None instead (`force_zeros_for_empty_prompt`), another image than the sidecar's ""."""
    family = get_family(
        "sdxl", _config("sdxl", validation_seeds=[0], validation_num_inference_steps=2)
    )
    comps = family.load(str(tiny_base("sdxl")))
    pipe = family.pipeline(comps)
    assert pipe.config.force_zeros_for_empty_prompt
    spec = ImageSpec("a red circle", "", 0, 2, 5.0, 64, 64)
    assert family.call_kwargs(spec)["negative_prompt"] == ""
    run_validation(family, pipe, [spec], tmp_path, 1, {})
    sidecar = json.loads((tmp_path / "00_seed0.json").read_text())
    assert sidecar["negative_prompt"] == sidecar["call_kwargs"]["negative_prompt"] == ""

    # Plain diffusers, given the sidecar's fields, draws the same image.
    plain = diffusers.StableDiffusionXLPipeline.from_pretrained(
        str(tiny_base("sdxl")), **family.pipeline_kwargs
    )
    plain.set_progress_bar_config(disable=True)
    fields = {
        k: sidecar[k]
        for k in (
            "prompt",
            "negative_prompt",
            "num_inference_steps",
            "guidance_scale",
            "width",
            "height",
        )
    }
    redrawn = plain(**fields, generator=torch.Generator().manual_seed(sidecar["seed"])).images[0]
    ours = Image.open(tmp_path / "00_seed0.png").convert("RGB")
    assert list(redrawn.getdata()) == list(ours.getdata())
    zeros = plain(**{**fields, "negative_prompt": None}, generator=torch.Generator().manual_seed(0))
    assert list(zeros.images[0].getdata()) != list(ours.getdata())


# ------------------------------------------------------------------ VAE posterior


@pytest.mark.parametrize("name", family_names())
def test_encode_images_draws_a_seeded_posterior_sample_on_request(name, tiny_base):
    family = get_family(name, _config(name))
    comps = family.load(str(tiny_base(name)), parts=("vae",))
    # A clip of the fewest frames past one that the family's VAE takes (Wan 4k+1, LTX-2 8k+1).
    shape = (1, 3, family.frame_count(9), 32, 32) if family.video else (1, 3, 32, 32)
    pixels = torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        mean = family.encode_images(comps, pixels)
        one = family.encode_images(comps, pixels, torch.Generator().manual_seed(7))
        again = family.encode_images(comps, pixels, torch.Generator().manual_seed(7))
        other = family.encode_images(comps, pixels, torch.Generator().manual_seed(8))
        # A 3D (video) VAE encodes images as one-frame clips (Wan's, Qwen-Image's).
        frames = pixels.ndim == 4 and (
            family.video
            or getattr(family, "vae_frames", False)
            or comps.vae.encoder.conv_in.weight.ndim == 5
        )
        # An RGBA VAE (Qwen-Image 2.1) reads an RGB image as opaque, as the family feeds it.
        if comps.vae.config.get("in_channels", 3) == 4 and pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        dist = comps.vae.encode(pixels.unsqueeze(2) if frames else pixels).latent_dist
    assert torch.equal(one, again) and not torch.equal(one, other)
    assert one.shape == mean.shape
    # An image family may drop that one frame from its latents.
    one, mean = one.reshape(dist.mean.shape), mean.reshape(dist.mean.shape)
    # mean + std · ε with ε from the seed, through the family's latent scaling: one factor per
    # channel, or (FLUX.2, normalised over 2×2 patches) per channel and position in a patch.
    noise = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(7))
    ratio = (one - mean) / (dist.std * noise)
    usable = noise.abs() > 0.1
    for c in range(ratio.shape[1]):
        for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
            r = ratio[:, c, ..., i::2, j::2][usable[:, c, ..., i::2, j::2]]
            if not r.numel():  # latents one position wide (LTX-2's 32x VAE at 32 px)
                continue
            assert r.min() > 0 and r.max() - r.min() < 1e-3 * r.max(), (c, i, j)


def test_the_cache_keeps_posterior_samples_under_their_own_seeded_keys(make_config):
    from safetensors.torch import load_file

    from kit.data.cache import build_cache, plan_cache
    from kit.data.pixels import sample_pixels
    from kit.families.loading import load_base

    def cfg_with(**kw):
        return load_config(make_config(f"{len(kw)}-{kw.get('seed', 0)}.json", **kw))

    cfg = cfg_with()
    family, comps = load_base(cfg)
    mean = plan_cache(cfg, comps.identity, torch.float32)
    sampled = plan_cache(cfg_with(latent_sampling="sample"), comps.identity, torch.float32)
    reseeded = plan_cache(cfg_with(latent_sampling="sample", seed=5), comps.identity, torch.float32)
    names = [{f.name for f in d.latent_files} for d in (mean, sampled, reseeded)]
    assert not names[0] & names[1] and not names[1] & names[2]

    scfg = cfg_with(latent_sampling="sample")
    built = build_cache(scfg, family, comps, progress=False)
    f = built.latent_files[0]
    pixels = sample_pixels(built.samples[0], built.plan.placements[0], scfg.data).unsqueeze(0)
    seed = int(f.stem[:15], 16)
    cached = load_file(f)["latents"]
    with torch.no_grad():
        expected = family.encode_images(comps, pixels, torch.Generator().manual_seed(seed))[0]
        assert torch.equal(cached, expected.float())
        assert not torch.equal(cached, family.encode_images(comps, pixels)[0])
