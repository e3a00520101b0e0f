"""Qwen-Image-Edit (and 2509/2511): the training input of a pair equals the edit pipeline's,
tensor for tensor, the vision-language prompt with its control images included."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict
from kit.data.cache import fill_cache, plan_cache
from kit.families import get_family
from kit.families.qwen_image_edit.family import (
    IMAGE_ONLY_MODULE,
    control_sizes,
    has_torchvision,
    load_processor,
)
from tests.conftest import lora_loads_exactly

NAME = "qwen_image_edit"
CAPTION = "make it red"


@pytest.fixture(scope="module")
def tiny_edit(tiny_base):
    return tiny_base(NAME)


@pytest.fixture(scope="module")
def tiny_plus(tmp_path_factory):
    """A tiny 2511 (QwenImageEditPlusPipeline, `zero_cond_t`): 2509's inputs and more."""
    out = tmp_path_factory.mktemp("models") / "tiny-qwen-edit-2511"
    return get_family(NAME).make_tiny(out, seed=0, plus=True, zero_cond_t=True)


def _pairs(root, controls=((48, 32),)):
    """One 64 × 64 target with a control per size given, each in its own folder."""
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    target = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(target).save(root / "data" / "a.png")
    (root / "data" / "a.txt").write_text(CAPTION)
    files = []
    for r, (w, h) in enumerate(controls):
        (root / f"controls{r}").mkdir()
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"controls{r}" / "a.png")
        files.append(root / f"controls{r}" / "a.png")
    return files


def _config(root, base, n, **extra):
    return from_dict(
        {
            "model_family": NAME,
            "pretrained_model": str(base),
            "image_dir": str(root / "data"),
            "control_dir": [str(root / f"controls{r}") for r in range(n)],
            "cache_dir": str(root / "cache"),
            "resolution": 64,
            "output_dir": str(root / "run"),
            **extra,
        }
    )


def test_control_sizes_are_the_pipelines_rule():
    # Edit: one ~1 MP size for the VAE and the prompt; Plus: ~1 MP and ~384² (multiples of 32).
    assert control_sizes(48, 32, plus=False) == ((1248, 832), (1248, 832))
    assert control_sizes(48, 32, plus=True) == ((1248, 832), (480, 320))
    assert control_sizes(1024, 1024, plus=True) == ((1024, 1024), (384, 384))


def test_variant_is_read_from_the_configs(tiny_edit, tiny_plus):
    family = get_family(NAME)
    assert family.variant_of(str(tiny_edit)) == "Qwen-Image-Edit"
    assert family.variant_of(str(tiny_plus)) == "Qwen-Image-Edit-2511"
    # The shipped configs: model_index's class, then 2511's `zero_cond_t`.
    assert family.variant_of("Qwen/Qwen-Image-Edit") == "Qwen-Image-Edit"
    assert family.variant_of("Qwen/Qwen-Image-Edit-2509") == "Qwen-Image-Edit-2509"
    assert family.variant_of("Qwen/Qwen-Image-Edit-2511") == "Qwen-Image-Edit-2511"
    index = json.loads((tiny_edit / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    # The processor the release names, where transformers can build it (torchvision installed);
    # else the same processor's image-only form, as a custom component in its folder.
    named = (
        ["transformers", "Qwen2VLProcessor"]
        if has_torchvision()
        else [IMAGE_ONLY_MODULE, "ImageOnlyQwen2VLProcessor"]
    )
    assert index["processor"] == named
    # The tiny tokenizer drops exactly the system prompt at the pipelines' fixed index.
    tokenizer = load_processor(str(tiny_edit)).tokenizer
    from diffusers import QwenImageEditPipeline

    template = QwenImageEditPipeline.__init__.__code__.co_consts
    prompt = next(c for c in template if isinstance(c, str) and c.startswith("<|im_start|>"))
    ids = tokenizer(prompt.format("X"))["input_ids"]
    # (Edit's template puts the image's vision tokens right after the user turn's start.)
    assert tokenizer.decode(ids[:64]).endswith("appropriate.<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.decode(ids[64:]).startswith("<|vision_start|><|image_pad|>")


def test_edit_refuses_a_second_control(tiny_edit, tmp_path):
    from kit.errors import ConfigError

    _pairs(tmp_path, ((48, 32), (32, 48)))
    with pytest.raises(ConfigError, match="takes one control image per target, 2 are given"):
        get_family(NAME, _config(tmp_path, tiny_edit, 2))
    with pytest.raises(ConfigError, match="caption_dropout"):
        get_family(NAME, _config(tmp_path, tiny_edit, 1, caption_dropout=0.1))


def _record(transformer):
    seen: list[dict] = []
    real = transformer.forward

    def record(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    transformer.forward = record
    return seen, real


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_training_inputs_equal_the_pipelines(variant, tiny_edit, tiny_plus, tmp_path):
    """One cached training pair through `predict`, and the edit pipeline's first step for the
    same control images, prompt, size and noise: every transformer input is equal, the prompt
    embeddings (which the vision-language encoder computes with the controls) included."""
    plus = variant == "plus"
    base = tiny_plus if plus else tiny_edit
    sizes = ((48, 32), (32, 48)) if plus else ((48, 32),)
    controls = _pairs(tmp_path, sizes)
    cfg = _config(tmp_path, base, len(sizes))
    family = get_family(NAME, cfg)
    comps = family.load(str(base))
    assert family.pipeline_class == (
        "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
    )

    seen, real = _record(comps.denoiser)
    pipe = family.pipeline(comps)
    mus = []
    set_timesteps = pipe.scheduler.set_timesteps

    @functools.wraps(set_timesteps)  # the pipeline reads its signature
    def recorded(*args, **kwargs):
        mus.append(kwargs["mu"])
        return set_timesteps(*args, **kwargs)

    pipe.scheduler.set_timesteps = recorded
    images = [Image.open(c).convert("RGB") for c in controls]
    pipe(
        prompt=CAPTION,
        image=images if plus else images[0],
        width=64,
        height=64,
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    ref = seen[0]
    seen.clear()
    data = plan_cache(cfg, comps.identity, torch.float32, family=family)
    fill_cache(data, cfg, family, comps, progress=False)
    assert data.samples[0].controls == controls
    batch = data.load_batch([0])
    vae_sizes = [control_sizes(w, h, plus)[0] for w, h in sizes]
    for r, (w, h) in enumerate(vae_sizes):
        assert batch[f"control_latents_{r}"].shape == (1, 16, h // 8, w // 8)
    from kit.families.qwen_image.family import unpack_latents

    n = 16  # a 64 × 64 target: 8 × 8 latents, 4 × 4 tokens
    noisy = unpack_latents(ref["hidden_states"][:, :n], 8, 8)
    cond = {k: v for k, v in batch.items() if k != "latents"}
    family.predict(comps, noisy, ref["timestep"] * 1000, cond)
    mine = seen.pop()
    comps.denoiser.forward = real

    assert torch.equal(mine["hidden_states"], ref["hidden_states"])
    assert mine["img_shapes"] == ref["img_shapes"]
    assert ref["img_shapes"][0][1:] == [(1, h // 16, w // 16) for w, h in vae_sizes]
    for key in ("timestep", "encoder_hidden_states"):
        assert torch.equal(mine[key], ref[key]), key
    # One caption, no padding left: no mask, as `encode_prompt` gives for a batch of one.
    assert mine["encoder_hidden_states_mask"] is None and ref["encoder_hidden_states_mask"] is None
    assert mine["guidance"] is None and ref["guidance"] is None
    # The prompt holds the controls' vision tokens: a text-only encoding is much shorter.
    text_only = family.encode_text(comps, [CAPTION])["prompt_embeds_mask"].sum()
    assert ref["encoder_hidden_states"].shape[1] > text_only + 20
    # And the σ shift the kit draws with is the pipeline's μ for this size (the target's tokens
    # only), applied as the scheduler's exponential time shift.
    shift = family.flow_shift(comps.noise_scheduler.config, 8, 8)
    assert shift == pytest.approx(math.exp(mus[0]), rel=1e-12)


def test_an_edited_control_re_encodes_its_caption(tiny_edit, tmp_path):
    """The caption's entry is keyed by its pair's controls: a changed control misses it."""
    controls = _pairs(tmp_path)
    cfg = _config(tmp_path, tiny_edit, 1)
    family = get_family(NAME, cfg)
    identity = family.identity(str(tiny_edit))
    first = plan_cache(cfg, identity, torch.float32, family=family)
    Image.new("RGB", (48, 32), (10, 200, 10)).save(controls[0])
    second = plan_cache(cfg, identity, torch.float32, family=family)
    assert first.text_files[0] != second.text_files[0]
    assert first.latent_files == second.latent_files  # the target's own entry stays
    assert set(second.text_controls) == {second.text_files[0]}
    # A family whose encoder does not see the controls keys the caption alone.
    kontext = cfg.replace(model_family="flux_kontext", pretrained_model="")
    other = get_family("flux_kontext", kontext)
    assert not plan_cache(kontext, identity, torch.float32, family=other).text_controls


@pytest.mark.slow
def test_validation_grid_draws_the_edit_with_its_encoder(tiny_edit, tmp_path):
    from kit.sample.embedded import draws_from_embeddings
    from kit.sample.validate import image_specs, run_validation

    controls = _pairs(tmp_path, ((64, 64),))
    entry = {"prompt": CAPTION, "control": [str(controls[0])], "num_inference_steps": 2}
    cfg = _config(tmp_path, tiny_edit, 1, validation_prompts=[entry], validation_seeds=[1])
    family = get_family(NAME, cfg)
    comps = family.load(str(tiny_edit))
    from kit.methods import get_method

    assert not draws_from_embeddings(family, get_method(cfg, family))
    seen, real = _record(comps.denoiser)
    grid = run_validation(
        family, family.pipeline(comps), image_specs(cfg, family, []), tmp_path / "g", 1, {}
    )
    comps.denoiser.forward = real
    # Two steps of two passes (true CFG with the " " negative prompt): the target's 16 tokens,
    # then the control's (resized to 1024 × 1024: 64 × 64 tokens).
    assert [k["hidden_states"].shape[1] for k in seen] == [16 + 64 * 64] * 4
    assert Image.open(grid).width == 2 * 64  # control, then result
    sidecar = json.loads(next((tmp_path / "g").glob("*.json")).read_text())
    assert sidecar["call_kwargs"]["image"] == str(controls[0])


def test_exports_load_through_the_edit_pipeline(tiny_edit, tmp_path):
    """The diffusers file loads through QwenImageEditPipeline's `load_lora_weights` to the
    trained weights; the ComfyUI-layout file, through diffusers' own converter for such files,
    merges to the trained adapter's weights on every changed weight."""
    from diffusers import QwenImageEditPipeline
    from safetensors.torch import save_file

    from kit.config import Config
    from kit.methods import get_method

    cfg = Config().replace(
        model_family=NAME, pretrained_model=str(tiny_edit), lora_rank=2, lora_alpha=4
    )
    family = get_family(NAME, cfg)
    comps = family.load(str(tiny_edit))
    get_method(cfg, family).attach(comps)
    pipe = QwenImageEditPipeline.from_pretrained(str(tiny_edit), **family.pipeline_kwargs)
    state = lora_loads_exactly(family, comps, pipe, tmp_path / "d")

    save_file(family.kohya_state_dict(state, 4.0), str(tmp_path / "comfy.safetensors"))
    other = QwenImageEditPipeline.from_pretrained(str(tiny_edit), **family.pipeline_kwargs)
    base = {k: v.clone() for k, v in other.transformer.state_dict().items()}
    other.load_lora_weights(str(tmp_path / "comfy.safetensors"))
    other.fuse_lora()
    other.unload_lora_weights()
    got = other.transformer.state_dict()
    modules = {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    assert len(modules) == 2 * 8  # two blocks, every default target
    for m in modules:
        update = 2.0 * state[f"{m}.lora_B.weight"] @ state[f"{m}.lora_A.weight"]
        assert torch.allclose(got[f"{m}.weight"], base[f"{m}.weight"] + update, atol=1e-5), m
    rest = set(base) - {f"{m}.weight" for m in modules}
    assert all(torch.equal(got[k], base[k]) for k in rest)


def test_plain_validation_prompts_draw_on_the_first_pair(tiny_edit, tmp_path):
    """The prompt is read with its controls: a configured prompt without any is drawn on the
    first training pair's controls (Kontext draws it as text to image, as its pipeline can)."""
    from kit.data.scan import scan
    from kit.sample.validate import pair_prompts

    controls = _pairs(tmp_path)
    cfg = _config(tmp_path, tiny_edit, 1, validation_prompt=["make it blue"])
    family = get_family(NAME, cfg)
    entries = pair_prompts(cfg, family, scan(cfg.data, family).samples)
    assert [(e.prompt, e.control) for e in entries] == [("make it blue", [str(controls[0])])]
    kontext = cfg.replace(model_family="flux_kontext", pretrained_model="")
    other = get_family("flux_kontext", kontext)
    assert not pair_prompts(kontext, other, scan(kontext.data, other).samples)


def test_a_2511_single_file_carries_comfyuis_marker(tiny_plus, tmp_path):
    """ComfyUI tells 2511 from 2509 by an empty `__index_timestep_zero__` entry: the merged
    transformer file carries it, and diffusers' `from_single_file` reads the file back."""
    from safetensors.torch import save_file

    from kit.families.qwen_image_edit.family import ZERO_MARKER

    family = get_family(NAME, from_dict({"model_family": NAME, "pretrained_model": str(tiny_plus)}))
    comps = family.load(str(tiny_plus))
    state = family.single_file_state_dict(comps)
    assert state[ZERO_MARKER].numel() == 0
    assert f"diffusion_model.{ZERO_MARKER}" in family.client_models(comps)["ComfyUI"][0]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "t.safetensors"))
    pipe = family.single_file_pipeline(tmp_path / "t.safetensors", tiny_plus)
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline"
    assert pipe.transformer.config.zero_cond_t
    got = pipe.transformer.state_dict()
    assert all(torch.equal(got[k], v) for k, v in comps.denoiser.state_dict().items())
