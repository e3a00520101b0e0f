"""FLUX.1 Kontext: the training input of a pair equals FluxKontextPipeline's, tensor for tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict
from kit.data.cache import fill_cache, plan_cache
from kit.families import get_family
from kit.families.flux_kontext.family import control_size
from tests.conftest import lora_loads_exactly


@pytest.fixture(scope="module")
def tiny_kontext(tiny_base):
    return tiny_base("flux_kontext")


def _pair(root, target_size=(64, 64), control_size_=(48, 32)):
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    (root / "controls").mkdir()
    target = rng.integers(0, 255, (*target_size[::-1], 3), dtype=np.uint8)
    control = rng.integers(0, 255, (*control_size_[::-1], 3), dtype=np.uint8)
    Image.fromarray(target).save(root / "data" / "a.png")
    Image.fromarray(control).save(root / "controls" / "a.png")
    (root / "data" / "a.txt").write_text("make it red")
    return root / "controls" / "a.png"


def test_control_size_is_the_pipelines_rule():
    assert control_size(1024, 1024) == (1024, 1024)
    assert control_size(48, 32) == (1248, 832)  # aspect 1.5: the closest preferred size
    assert control_size(72, 40, auto_resize=False) == (64, 32)


def test_tiny_base_is_a_kontext_pipeline(tiny_kontext):
    index = json.loads((tiny_kontext / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"


@pytest.mark.slow
def test_training_inputs_equal_the_pipelines(tiny_kontext, tmp_path):
    """One cached training pair through `predict`, and FluxKontextPipeline's first step for the
    same control image, prompt, size and noise: every transformer input is equal."""
    control = _pair(tmp_path)
    cfg = from_dict(
        {
            "model_family": "flux_kontext",
            "pretrained_model": str(tiny_kontext),
            "image_dir": str(tmp_path / "data"),
            "control_dir": str(tmp_path / "controls"),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "output_dir": str(tmp_path / "run"),
        }
    )
    family = get_family("flux_kontext", cfg)
    comps = family.load(str(tiny_kontext))

    seen: list[dict] = []
    transformer = comps.denoiser
    real = transformer.forward

    def record(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    transformer.forward = record
    pipe = family.pipeline(comps)
    spec_kwargs = {
        "prompt": "make it red",
        "image": Image.open(control).convert("RGB"),
        "width": 64,
        "height": 64,
        "max_area": 64 * 64,
        "num_inference_steps": 2,
        "max_sequence_length": family.max_sequence_length(),
        "output_type": "latent",
    }
    pipe(**spec_kwargs, generator=torch.Generator().manual_seed(0))
    ref = seen[0]
    seen.clear()
    # The cache is built after the pipeline ran: on CPU, the tiny VAE's encoding of a megapixel
    # control moves by ~1e-4 once other models have run in the process (kernel state, not data).
    data = plan_cache(cfg, comps.identity, torch.float32, family=family)
    fill_cache(data, cfg, family, comps, progress=False)
    assert data.samples[0].controls == [control]
    batch = data.load_batch([0])
    assert batch["control_latents_0"].shape == (1, 16, 832 // 8, 1248 // 8)
    n = 16  # a 64 × 64 target: 8 × 8 latents, 4 × 4 tokens
    from kit.families.flux.family import unpack_latents

    noisy = unpack_latents(ref["hidden_states"][:, :n], 8, 8)
    timesteps = ref["timestep"] * 1000
    cond = {k: v for k, v in batch.items() if k != "latents"}
    family.predict(comps, noisy, timesteps, cond)
    mine = seen.pop()
    transformer.forward = real
    # The target's tokens are equal; the control's tokens agree to ~2e-4: the same pixels
    # (checked exactly below) through the same VAE, whose CPU kernels differ in the last bits
    # between the pipeline's call and the kit's cache pass on this megapixel input.
    assert torch.equal(mine["hidden_states"][:, :n], ref["hidden_states"][:, :n])
    assert torch.allclose(mine["hidden_states"], ref["hidden_states"], atol=1e-3, rtol=0)
    pixels = family.control_pixels(Image.open(control).convert("RGB"))
    processor = pipe.image_processor
    theirs = processor.preprocess(processor.resize(Image.open(control).convert("RGB"), 832, 1248))
    assert torch.equal(pixels, theirs[0])
    for key in ("timestep", "guidance", "pooled_projections"):
        assert torch.equal(mine[key], ref[key]), key
    for key in ("encoder_hidden_states", "txt_ids", "img_ids"):
        assert torch.equal(mine[key], ref[key]), key
    # The control's tokens follow the target's, its ids' first coordinate is 1.
    assert mine["hidden_states"].shape[1] == n + (832 // 16) * (1248 // 16)
    assert (mine["img_ids"][:n, 0] == 0).all() and (mine["img_ids"][n:, 0] == 1).all()
    # And the σ shift the kit draws with is the pipeline's for this size (target tokens only).
    shift = family.flow_shift(comps.noise_scheduler.config, 8, 8)
    assert float(pipe.scheduler.sigmas[1]) == pytest.approx(shift * 0.5 / (1 + (shift - 1) * 0.5))


def _config(root, family="flux_kontext", **extra):
    return from_dict(
        {
            "model_family": family,
            "image_dir": str(root / "data"),
            "control_dir": str(root / "controls"),
            "resolution": 64,
            **extra,
        }
    )


def test_validation_controls_are_checked_against_the_family(tmp_path):
    from kit.errors import ConfigError

    control = _pair(tmp_path)
    entry = {"prompt": "make it red", "control": [str(control)]}
    with pytest.raises(ConfigError, match=r"validation_prompts\[0\]\.control: .* flux takes none"):
        get_family("flux", from_dict({"model_family": "flux", "validation_prompts": [entry]}))
    two = {**entry, "control": [str(control)] * 2}
    with pytest.raises(ConfigError, match="flux_kontext takes at most 1"):
        get_family("flux_kontext", _config(tmp_path, validation_prompts=[two]))
    gone = {**entry, "control": [str(tmp_path / "gone.png")]}
    with pytest.raises(ConfigError, match="gone.png is not an image file"):
        get_family("flux_kontext", _config(tmp_path, validation_prompts=[gone]))


def test_an_edit_models_default_grid_draws_its_training_pairs(tmp_path):
    from kit.data.scan import scan
    from kit.sample.validate import pair_prompts

    control = _pair(tmp_path)
    cfg = _config(tmp_path)
    family = get_family("flux_kontext", cfg)
    entries = pair_prompts(cfg, family, scan(cfg.data, family).samples)
    assert [(e.prompt, e.control) for e in entries] == [("make it red", [str(control)])]
    # A configured prompt is kept as it is; a family without controls has no pairs.
    assert not pair_prompts(_config(tmp_path, validation_prompt=["x"]), family, [])
    flux = from_dict({"model_family": "flux", "image_dir": str(tmp_path / "data")})
    assert not pair_prompts(flux, get_family("flux", flux), scan(flux.data).samples)


def test_validation_grid_shows_control_then_result(tiny_kontext, tmp_path):
    from kit.sample.validate import image_specs, run_validation

    control = _pair(tmp_path)
    entry = {"prompt": "make it red", "control": [str(control)], "num_inference_steps": 1}
    cfg = _config(tmp_path, validation_prompts=[entry], validation_seeds=[1])
    family = get_family("flux_kontext", cfg)
    family.auto_resize = False  # the control at its own size: a small test
    comps = family.load(str(tiny_kontext))
    pipe = family.pipeline(comps)
    seen = []
    real = comps.denoiser.forward

    def record(*args, **kwargs):
        seen.append(kwargs["hidden_states"].shape[1])
        return real(*args, **kwargs)

    comps.denoiser.forward = record
    specs = image_specs(cfg, family, [])
    grid = run_validation(family, pipe, specs, tmp_path / "grid", cols=1, meta={})
    assert seen == [16 + 2 * 3]  # the 64 × 64 target's tokens, then the 48 × 32 control's
    image = Image.open(grid)
    assert image.width == 2 * 64  # control, then result
    cell = np.asarray(image.convert("RGB"))[14:, :64]
    shown = np.asarray(Image.open(control).convert("RGB").resize((64, 43)))
    assert np.abs(cell[10:53].astype(int) - shown.astype(int)).mean() < 40
    sidecar = json.loads(next((tmp_path / "grid").glob("*.json")).read_text())
    assert sidecar["call_kwargs"]["image"] == str(control)
    assert sidecar["control"] == [str(control)]
    assert sidecar["call_kwargs"]["max_area"] == 64 * 64


def test_exports_load_through_the_kontext_pipeline(tiny_kontext, tmp_path):
    """The diffusers file loads through FluxKontextPipeline's `load_lora_weights` to the trained
    weights; the ComfyUI-layout file, through diffusers' own converter for such files, merges to
    the trained adapter's weights on every changed weight."""
    from diffusers import FluxKontextPipeline
    from safetensors.torch import save_file

    from kit.config import Config
    from kit.methods import get_method

    cfg = Config().replace(model_family="flux_kontext", lora_rank=2, lora_alpha=4)
    family = get_family("flux_kontext", cfg)
    comps = family.load(str(tiny_kontext))
    get_method(cfg, family).attach(comps)
    pipe = FluxKontextPipeline.from_pretrained(str(tiny_kontext))
    state = lora_loads_exactly(family, comps, pipe, tmp_path / "d")

    # The trained adapter's merged weights (W + alpha / rank · B A), and the ComfyUI-layout
    # file's, loaded by diffusers' own converter for such files and fused.
    # diffusers' converter hard-codes the real model's single-block widths (3 × 3072 + 12288),
    # which a tiny model cannot have: the double-stream blocks (fused qkv too) are checked here,
    # the single-stream layout by flux's own layout tests.
    state = {k: v for k, v in state.items() if not k.startswith("single_transformer_blocks")}
    save_file(family.kohya_state_dict(state, 4.0), str(tmp_path / "comfy.safetensors"))
    other = FluxKontextPipeline.from_pretrained(str(tiny_kontext))
    base = {k: v.clone() for k, v in other.transformer.state_dict().items()}
    other.load_lora_weights(str(tmp_path / "comfy.safetensors"))
    other.fuse_lora()
    other.unload_lora_weights()
    got = other.transformer.state_dict()
    modules = {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    assert len(modules) == 8  # every default target of the double-stream block
    for m in modules:
        update = 2.0 * state[f"{m}.lora_B.weight"] @ state[f"{m}.lora_A.weight"]
        assert torch.allclose(got[f"{m}.weight"], base[f"{m}.weight"] + update, atol=1e-5), m
    rest = set(base) - {f"{m}.weight" for m in modules}
    assert all(torch.equal(got[k], base[k]) for k in rest)
