"""Z-Image specifics the contract suite does not see: the transformer inputs the kit builds equal
ZImagePipeline's tensor for tensor, the sign and time conventions, the padded captions, the σ
shift, the two variants, and the diffusers LoRA round trip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kit.config import Config
from kit.families import get_family
from kit.families.shipped import config_source
from kit.families.zimage.family import model_velocity, pad_embeds, transformer_inputs, unpad_embeds
from tests.conftest import lora_loads_exactly

CAPTIONS = ["a red zorbstar", "a small blue circle on the left of a big green tree"]


@pytest.fixture(scope="module")
def tiny_zimage(tiny_base):
    return tiny_base("zimage")


def _family(base, **changes):
    return get_family(
        "zimage", Config().replace(model_family="zimage", pretrained_model=str(base), **changes)
    )


@pytest.fixture(scope="module")
def loaded(tiny_zimage):
    family = _family(tiny_zimage, max_sequence_length=48)
    return family, family.load(str(tiny_zimage))


def _recorded_call(pipe, **call):
    """The positional inputs of every transformer call during `pipe(**call)`."""
    calls = []
    forward = pipe.transformer.forward

    def record(x, t, cap_feats, **kwargs):
        calls.append(([v.clone() for v in x], t.clone(), [c.clone() for c in cap_feats]))
        return forward(x, t, cap_feats, **kwargs)

    pipe.transformer.forward = record
    try:
        pipe(**call)
    finally:
        pipe.transformer.forward = forward
    return calls


def test_transformer_inputs_equal_the_pipelines(loaded):
    """THE test: latents, timestep and captions the kit feeds the transformer for a training
    sample are, tensor for tensor, those ZImagePipeline builds at inference."""
    family, comps = loaded
    pipe = family.pipeline(comps)
    latents = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(1))
    calls = _recorded_call(
        pipe,
        prompt=list(CAPTIONS),
        latents=latents.clone(),
        height=64,
        width=48,
        num_inference_steps=3,
        guidance_scale=0.0,  # Turbo: no CFG, one pass per step
        max_sequence_length=family.max_sequence_length(),
        output_type="latent",
    )
    assert len(calls) == 3
    x, t, caps = calls[0]
    # The first step's timestep is the scheduler's; the kit gets it as σ · 1000.
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    sched = type(comps.noise_scheduler).from_config(comps.noise_scheduler.config)
    sched.set_timesteps(sigmas=get_default_z_image_sigmas(3), mu=0.0)  # static shift: mu unused
    kit = transformer_inputs(
        latents,
        sched.timesteps[:1].expand(2),
        unpad_embeds(**_renamed(family.encode_text(comps, CAPTIONS))),
        comps.denoiser.dtype,
    )
    assert len(kit["x"]) == len(x) == 2
    assert all(torch.equal(a, b) for a, b in zip(kit["x"], x, strict=True))
    assert torch.equal(kit["t"], t)
    assert [c.shape[0] for c in caps] == [c.shape[0] for c in kit["cap_feats"]]
    assert caps[0].shape[0] < caps[1].shape[0] < family.max_sequence_length()  # unequal lengths
    assert all(torch.equal(a, b) for a, b in zip(kit["cap_feats"], caps, strict=True))
    # A later step: the noisy latents the pipeline reached, at its own timestep.
    x2, t2, _ = calls[1]
    noisy = torch.stack([v.squeeze(1) for v in x2])
    again = transformer_inputs(noisy, sched.timesteps[1:2].expand(2), caps, None)
    assert torch.equal(again["t"], t2)
    assert all(torch.equal(a, b) for a, b in zip(again["x"], x2, strict=True))


def _renamed(cond):
    return {"embeds": cond["prompt_embeds"], "mask": cond["prompt_embeds_mask"]}


def test_predict_is_the_velocity_the_scheduler_steps_with(loaded):
    """ZImagePipeline negates the output before its Euler step: x_next = x + (σ_next − σ) · v.
    The kit's prediction is that v (noise − x0, the kit's flow target)."""
    family, comps = loaded
    pipe = family.pipeline(comps)
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    seen = {}

    def keep(p, i, t, kwargs):
        seen.setdefault(i, kwargs["latents"].clone())
        return kwargs

    pipe(
        prompt=CAPTIONS[:1],
        latents=latents.clone(),
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=0.0,
        max_sequence_length=family.max_sequence_length(),
        output_type="latent",
        callback_on_step_end=keep,
    )
    sched = pipe.scheduler
    sigma, sigma_next = sched.sigmas[0], sched.sigmas[1]
    cond = family.encode_text(comps, CAPTIONS[:1])
    with torch.no_grad():
        v = family.predict(comps, latents, sched.timesteps[:1], cond)
    assert torch.allclose(seen[0], latents + (sigma_next - sigma) * v, atol=1e-6)
    # The training target has that sign: noisy = (1 − σ) x0 + σ ε moves along ε − x0.
    draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    s = (draw.timesteps / 1000).view(-1, 1, 1, 1)
    assert torch.allclose(draw.noisy, (1 - s) * latents + s * (draw.target + latents), atol=1e-6)


def test_padding_changes_nothing(loaded):
    """The cache's fixed-length caption + mask gives the transformer exactly the pipeline's
    list, whatever the padded length: inputs and output equal the unpadded caption's."""
    family, comps = loaded
    pipe = family._text_pipeline(comps)
    embeds, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False,
                                   max_sequence_length=family.max_sequence_length())  # fmt: skip
    for length in (family.max_sequence_length(), 200):
        padded, mask = pad_embeds(embeds, length)
        assert padded.shape == (2, length, 32) and mask.sum(1).tolist() == [len(e) for e in embeds]
        back = unpad_embeds(padded, mask)
        assert all(torch.equal(a, b) for a, b in zip(back, embeds, strict=True))
    cond = family.encode_text(comps, CAPTIONS)
    assert cond["prompt_embeds"].shape[1] == family.max_sequence_length()
    assert not cond["prompt_embeds"][~cond["prompt_embeds_mask"]].any()  # zeros after the text
    noisy, steps = torch.randn(2, 16, 8, 8), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        ours = family.predict(comps, noisy, steps, cond)
        # The pipeline's own form: one unpadded caption per sample.
        out = comps.denoiser(
            list(noisy.unsqueeze(2).unbind(0)), (1000 - steps) / 1000, embeds, return_dict=False
        )[0]
        # One sample alone (no batch padding inside the transformer) gives the same row.
        alone = family.predict(comps, noisy[:1], steps[:1], {k: v[:1] for k, v in cond.items()})
    assert torch.equal(ours, model_velocity(out))
    assert torch.allclose(ours[:1], alone, atol=1e-6)


def test_the_shift_is_the_schedulers(loaded):
    """Both releases use a fixed σ shift; the kit draws with it, as the scheduler shifts the
    pipeline's σ at that resolution (Turbo 3.0 here)."""
    family, comps = loaded
    config = comps.noise_scheduler.config
    assert not config.use_dynamic_shifting
    shift = family.flow_shift(config, 128, 128)
    assert shift == family.flow_shift(config, 16, 16) == 3.0
    sched = type(comps.noise_scheduler).from_config(config)
    u = torch.tensor([0.9, 0.5, 0.2])
    sched.set_timesteps(sigmas=u.tolist(), mu=1.0)  # the pipeline always passes a mu
    assert torch.allclose(sched.sigmas[:3], shift * u / (1 + (shift - 1) * u))
    assert _family(comps.source, flow_shift=2.0).flow_shift(config, 64, 64) == 2.0


def test_variants_are_read_from_the_scheduler(tiny_zimage, tmp_path):
    family = _family(tiny_zimage)
    assert family.variants == ("Turbo", "base")
    assert family.variant_of(str(tiny_zimage)) == "Turbo"
    assert "step-distilled" in family.distillation(str(tiny_zimage))
    assert family.default_guidance_scale == 0.0
    base = tmp_path / "base"
    shutil.copytree(tiny_zimage, base)
    path = base / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "shift": 6.0}))
    assert family.variant_of(str(base)) == "base" and family.distillation(str(base)) == ""
    assert _family(base).default_guidance_scale == 5.0
    assert family.variant_of("Tongyi-MAI/Z-Image-Turbo") == "Turbo"
    assert family.variant_of("Tongyi-MAI/Z-Image") == "base"
    assert config_source("Tongyi-MAI/Z-Image").endswith("zimage")


def test_validation_calls_the_pipeline_with_its_own_guidance(tiny_zimage):
    from kit.families.samplers import ImageSpec

    family = _family(tiny_zimage)
    spec = ImageSpec(prompt="a star", negative_prompt="", seed=0, num_inference_steps=8,
                     guidance_scale=family.guidance_scale(), width=64, height=64,
                     adapter_scale=0.5)  # fmt: skip
    kwargs = family.call_kwargs(spec)
    assert kwargs["guidance_scale"] == 0.0 and "negative_prompt" not in kwargs
    assert kwargs["joint_attention_kwargs"] == {"scale": 0.5}
    assert kwargs["max_sequence_length"] == 512


def test_lora_round_trips_every_default_target(loaded, tmp_path):
    from diffusers import ZImagePipeline

    from kit.methods import get_method

    family, comps = loaded
    cfg = Config().replace(model_family="zimage", pretrained_model=comps.source, lora_rank=2)
    comps = _family(comps.source).load(comps.source)
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    for stack in ("layers", "noise_refiner", "context_refiner"):
        assert any(m.startswith(stack) for m in summary.modules), stack
    lora_loads_exactly(family, comps, ZImagePipeline.from_pretrained(comps.source), tmp_path)


def test_the_methods_it_trains(tiny_zimage):
    from kit.methods import supported

    family = _family(tiny_zimage)
    # The adapters ComfyUI reads in full, and full fine-tuning; not textual inversion, as
    # ZImagePipeline loads no embeddings (and its text encoder is an LLM).
    assert {"lora", "dora", "loha", "lokr", "full"} <= set(supported(family))
    assert "textual_inversion" not in supported(family)
    assert family.kohya_text_prefixes == ()  # no client loads Qwen3 LoRA for Z-Image


def test_a_single_transformer_file_loads_as_the_folder_does(loaded, tiny_zimage, tmp_path):
    """The original-layout transformer file (ComfyUI's diffusion_models) is a base too: read by
    diffusers' own converter, the rest of the model from `model_config`."""
    from safetensors.torch import save_file

    family, comps = loaded
    path = tmp_path / "z_image_turbo.safetensors"
    save_file(family.single_file_state_dict(comps), str(path))
    other = _family(path, model_config=str(tiny_zimage))
    read = other.load(str(path), parts=("denoiser",))
    ours, theirs = comps.denoiser.state_dict(), read.denoiser.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_swap_blocks_are_in_the_order_the_forward_runs_them(loaded):
    family, comps = loaded
    blocks = family.swap_blocks(comps.denoiser)
    order: list[int] = []
    hooks = [
        b.register_forward_pre_hook(lambda _m, _a, i=i: order.append(i))
        for i, b in enumerate(blocks)
    ]
    cond = family.encode_text(comps, CAPTIONS[:1])
    with torch.no_grad():
        family.predict(comps, torch.randn(1, 16, 8, 8), torch.tensor([500.0]), cond)
    for h in hooks:
        h.remove()
    assert order == list(range(len(blocks)))


def test_the_token_limit_leaves_room_for_the_chat_template(loaded):
    """`token_limit` is what the chat template leaves of the pipeline's sequence: a caption of
    n tokens keeps n + the template's tokens, up to the cut."""
    from kit.families import tiny

    family, comps = loaded
    tok = comps.tokenizers[0]
    limit, length = family.token_limit("text_encoder", tok), family.max_sequence_length()
    assert 0 < limit < length
    captions = [" ".join(tiny.WORDS[:n]) for n in (3, limit - 1, limit, limit + 1, 2 * limit)]
    counts = [len(tok(c).input_ids) for c in captions]
    assert counts[1:4] == [limit - 1, limit, limit + 1]  # one token per word
    kept = family.encode_text(comps, captions)["prompt_embeds_mask"].sum(1).tolist()
    assert kept == [min(n + length - limit, length) for n in counts]


def test_the_base_variant_samples_with_cfg_and_a_negative_prompt(tiny_zimage, tmp_path):
    from kit.families.samplers import ImageSpec

    base = tmp_path / "base"
    shutil.copytree(tiny_zimage, base)
    path = base / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "shift": 6.0}))
    family = _family(base, max_sequence_length=32)
    comps = family.load(str(base))
    assert family.flow_shift(comps.noise_scheduler.config, 8, 8) == 6.0
    spec = ImageSpec(prompt="a red star", negative_prompt="blurry", seed=0, num_inference_steps=2,
                     guidance_scale=family.guidance_scale(), width=64, height=64)  # fmt: skip
    kwargs = family.call_kwargs(spec)
    assert kwargs["guidance_scale"] == 5.0 and kwargs["negative_prompt"] == "blurry"
    calls = _recorded_call(family.pipeline(comps), **kwargs, output_type="latent")
    assert len(calls) == 2 and len(calls[0][0]) == 2  # CFG: the prompt and the negative
