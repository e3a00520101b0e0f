"""Per-prompt validation: entries with their own negative prompt, guidance, steps, seed, size and
sampler; sidecars that record exactly what was drawn; exports verified against such images."""

from __future__ import annotations

import json

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict, load_config
from kit.errors import ConfigError
from kit.export.writer import export
from kit.families import get_family
from kit.families.samplers import ImageSpec, samplers_for
from kit.run.folder import RunDir
from kit.sample.validate import (
    default_prompts,
    grid_rows,
    image_specs,
    make_grid,
    rows_grid,
    run_validation,
)
from kit.train.loop import train

ENTRIES = [
    {
        "prompt": "a blue zorbstar",
        "negative_prompt": "blurry",
        "guidance_scale": 3.0,
        "seed": 5,
        "width": 32,
        "height": 48,
        "scheduler": "euler_a",
    },
    {
        "prompt": "a green zorbstar",
        "negative_prompt": "",
        "guidance_scale": 9.0,
        "num_inference_steps": 3,
        "width": 48,
        "height": 32,
        "scheduler": "dpm++_2m_karras",
    },
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_sd15, family_dataset) -> RunDir:
    """A two-step run whose final validation draws the simple prompt and both entries."""
    from tests.conftest import write_run_config

    tmp = tmp_path_factory.mktemp("prompts")
    path = write_run_config(
        tmp / "config.json",
        base=tiny_sd15,
        data=family_dataset("sd15"),
        max_train_steps=2,
        checkpointing_steps=2,
        learning_rate=2e-2,
        validation_resolution=32,
        validation_negative_prompt="ugly",
        validation_seeds=[0, 3],
        validation_prompts=ENTRIES,
    )
    train(load_config(path))
    return RunDir(tmp / "run")


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def _sidecar(run: RunDir, stem: str) -> dict:
    """A sidecar, read as strictly as a browser would (no bare Infinity or NaN)."""
    text = (run.validation_step(2) / f"{stem}.json").read_text()
    return json.loads(text, parse_constant=_refuse)


def test_each_entry_is_drawn_as_it_asks_and_the_sidecar_says_so(run):
    folder = run.validation_step(2)
    stems = sorted(p.stem for p in folder.glob("*.json"))
    # The simple prompt's row (a column per seed), the seeded entry's one image, then a column
    # per seed for the entry without one.
    assert stems == ["00_seed0", "00_seed3", "01_seed5", "02_seed0", "02_seed3"]

    simple = _sidecar(run, "00_seed3")
    assert simple["prompt"] == "a red zorbstar" and simple["negative_prompt"] == "ugly"
    assert simple["guidance_scale"] == 7.5 and simple["sampler"] == "default"
    assert simple["scheduler"]["class"] == "DDIMScheduler" and simple["shift"] is None

    seeded = _sidecar(run, "01_seed5")
    assert (seeded["negative_prompt"], seeded["guidance_scale"], seeded["seed"]) == (
        "blurry",
        3.0,
        5,
    )
    assert seeded["call_kwargs"]["negative_prompt"] == "blurry"
    assert seeded["call_kwargs"]["guidance_scale"] == 3.0
    assert (seeded["width"], seeded["height"], seeded["num_inference_steps"]) == (32, 48, 2)
    assert seeded["sampler"] == "euler_a"
    assert seeded["scheduler"]["class"] == "EulerAncestralDiscreteScheduler"
    # Built from the base model's own scheduler config: its beta schedule carries over.
    assert seeded["scheduler"]["config"]["beta_schedule"] == "scaled_linear"
    assert Image.open(folder / "01_seed5.png").size == (32, 48)

    for seed in (0, 3):
        other = _sidecar(run, f"02_seed{seed}")
        assert other["seed"] == seed and other["negative_prompt"] == ""
        assert other["call_kwargs"]["negative_prompt"] == ""  # not the section's "ugly"
        assert other["guidance_scale"] == other["call_kwargs"]["guidance_scale"] == 9.0
        assert other["num_inference_steps"] == other["call_kwargs"]["num_inference_steps"] == 3
        assert other["sampler"] == "dpm++_2m_karras"
        assert other["scheduler"]["class"] == "DPMSolverMultistepScheduler"
        assert other["scheduler"]["config"]["use_karras_sigmas"] is True
        # DPM-Solver's config holds -inf, written as a string so strict readers take it.
        assert other["scheduler"]["config"]["lambda_min_clipped"] == "-inf"
        assert Image.open(folder / f"02_seed{seed}.png").size == (48, 32)

    # One grid of rows of their own sizes: 2 × 32, 1 × 32 and 2 × 48 wide, each under a label.
    grid = Image.open(folder / "grid.png")
    assert grid.size == (96, (14 + 32) + (14 + 48) + (14 + 32))


@pytest.mark.slow
def test_the_export_reproduces_images_drawn_with_other_samplers(run, tiny_sd15):
    result = export(run.root, "diffusers")
    v = result.verification
    assert v.passed and v.images == 5 and v.max_abs_diff <= 2

    # Plain diffusers, with the scheduler the sidecar names built the way its users build one,
    # draws the same image; with the base model's scheduler it would not.
    sidecar = _sidecar(run, "01_seed5")
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        str(tiny_sd15), safety_checker=None, requires_safety_checker=False
    )
    pipe.load_lora_weights(str(result.path))
    pipe.set_progress_bar_config(disable=True)
    kits = np.asarray(Image.open(run.validation_step(2) / "01_seed5.png"), dtype=int)

    def plain() -> np.ndarray:
        image = pipe(
            **sidecar["call_kwargs"],
            generator=torch.Generator("cpu").manual_seed(sidecar["seed"]),
        ).images[0]
        return np.asarray(image, dtype=int)

    assert np.abs(plain() - kits).max() > 2
    pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    assert np.abs(plain() - kits).max() <= 2


def test_flux_entries_take_its_distilled_guidance_and_record_the_shift(tiny_base, tmp_path):
    cfg = from_dict(
        {
            "model_family": "flux",
            "pretrained_model": str(tiny_base("flux")),
            "validation_prompt": [],
            "validation_num_inference_steps": 1,
            "validation_resolution": 32,
            "validation_prompts": [
                {"prompt": "a cat", "seed": 1, "scheduler": "flow_euler", "width": 48},
                {"prompt": "a dog", "seed": 2, "guidance_scale": 2.0},
            ],
        }
    )
    family = get_family("flux", cfg)
    assert default_prompts(cfg, ["a caption"]) == []  # the entries stand for the prompts
    specs = image_specs(cfg, family, [])
    assert [(s.guidance_scale, s.width, s.height) for s in specs] == [(3.5, 48, 32), (2.0, 32, 32)]

    comps = family.load(str(tiny_base("flux")))
    run_validation(family, family.pipeline(comps), specs, tmp_path, 1, {})
    cat = json.loads((tmp_path / "00_seed1.json").read_text())
    assert cat["guidance_scale"] == cat["call_kwargs"]["guidance_scale"] == 3.5
    assert cat["sampler"] == "flow_euler"
    assert cat["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    # Flux dev shifts σ by the image size (the pipeline's `mu`): the sidecar has the shift used.
    assert cat["scheduler"]["config"]["use_dynamic_shifting"] and cat["shift"] > 1.0
    dog = json.loads((tmp_path / "01_seed2.json").read_text())
    assert dog["guidance_scale"] == 2.0 and dog["sampler"] == "default"
    assert dog["shift"] != cat["shift"]  # another size, another shift


def test_a_static_flow_shift_comes_from_the_scheduler_config(tiny_base, tmp_path):
    """SD3 samples with its scheduler's shift (3.0 in the tiny model, as in the released one),
    carried into a multistep sampler's `flow_shift`."""
    cfg = from_dict(
        {
            "model_family": "sd3",
            "pretrained_model": str(tiny_base("sd3")),
            "validation_num_inference_steps": 1,
            "validation_resolution": 32,
            "validation_prompts": [{"prompt": "a cat", "seed": 0, "scheduler": "flow_unipc"}],
        }
    )
    family = get_family("sd3", cfg)
    comps = family.load(str(tiny_base("sd3")))
    run_validation(family, family.pipeline(comps), image_specs(cfg, family, []), tmp_path, 1, {})
    sidecar = json.loads((tmp_path / "00_seed0.json").read_text())
    assert sidecar["guidance_scale"] == 7.0  # StableDiffusion3Pipeline's default
    assert sidecar["scheduler"]["class"] == "UniPCMultistepScheduler"
    assert sidecar["scheduler"]["config"]["use_flow_sigmas"] is True
    assert sidecar["scheduler"]["config"]["flow_shift"] == sidecar["shift"] == 3.0


# ------------------------------------------------------------------ refused at config time


def _cfg(family: str, **entry) -> object:
    return from_dict({"model_family": family, "validation_prompts": [{"prompt": "a cat", **entry}]})


def test_a_sampler_the_family_cannot_use_is_refused_naming_it_and_the_choices():
    with pytest.raises(ConfigError, match=r"validation_prompts\[0\]\.scheduler: 'flow_euler'"):
        get_family("sd15", _cfg("sd15", scheduler="flow_euler"))
    with pytest.raises(ConfigError, match="euler_a") as e:
        get_family("sd15", _cfg("sd15", scheduler="eulr_a"))
    assert "did you mean 'euler_a'" in str(e.value)
    with pytest.raises(ConfigError, match="'flow_heun'.*flux"):
        get_family("flux", _cfg("flux", scheduler="flow_heun"))
    # What each family offers draws (the tiny runs above); `default` is everyone's.
    assert all("default" in samplers_for(f) for f in ("sd15", "sdxl", "sd3", "flux", "wan"))
    get_family("wan", _cfg("wan", scheduler="flow_unipc"))


def test_a_size_off_the_familys_multiple_is_refused_with_the_value_and_the_multiple():
    with pytest.raises(ConfigError, match=r"validation_prompts\[0\]\.width: 100 .* multiple of 8"):
        get_family("sd15", _cfg("sd15", width=100))
    with pytest.raises(ConfigError, match=r"height: 72 is not a multiple of 16"):
        get_family("flux", _cfg("flux", height=72))
    get_family("sd15", _cfg("sd15", width=520, height=776))
    with pytest.raises(ConfigError, match=r"validation_prompts\[0\]: width: -8"):
        _cfg("sd15", width=-8)
    with pytest.raises(ConfigError, match="non-empty prompt"):
        from_dict({"validation_prompts": [{"prompt": " "}]})


# ------------------------------------------------------------------ rows and grids


def test_the_simple_form_keeps_its_rows_and_a_grid_takes_mixed_sizes():
    specs = [ImageSpec(p, "", s, 2, 7.5, 64, 64) for p in ("a", "a", "b") for s in (0, 1)]
    # A repeated prompt still makes a row of its own, as `i // cols` numbered them.
    assert [len(r) for r in grid_rows(specs, 2)] == [2, 2, 2]
    wide = ImageSpec("c", "", 4, 2, 7.5, 96, 32, sampler="euler")
    rows = grid_rows([*specs[:2], wide], 2)
    assert [[s.seed for s in r] for r in rows] == [[0, 1], [4]]

    images = [Image.new("RGB", (64, 64)), Image.new("RGB", (64, 64)), Image.new("RGB", (96, 32))]
    assert rows_grid([images[:2], images[2:]], ["a", "c"]).size == (128, 14 + 64 + 14 + 32)
    assert make_grid(images[:2], 2).size == (128, 64)
