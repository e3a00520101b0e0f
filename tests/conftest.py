"""Shared fixtures: one tiny SD1.5-architecture model per session, and configs that use it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kit.logs import quiet_libraries

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "datasets_example"

quiet_libraries()


@pytest.fixture(scope="session")
def tiny_sd15(tmp_path_factory) -> Path:
    """A tiny random-init SD1.5-architecture model written by `kit tiny sd15`."""
    from kit.families import get_family

    out = tmp_path_factory.mktemp("models") / "tiny-sd15"
    get_family("sd15").make_tiny(out, seed=0)
    return out


@pytest.fixture()
def dataset(tmp_path, dataset_template) -> Path:
    """24 captioned toy images (`zorbic_000.png` ...) in five aspect ratios, for a test to change."""
    dst = tmp_path / "data"
    shutil.copytree(dataset_template, dst)
    return dst


@pytest.fixture(scope="session")
def dataset_template(tmp_path_factory) -> Path:
    """The images behind `dataset`, drawn once: the example's concept without its prior images."""
    from kit.toy.world import EXAMPLE_SIZES, write_example_dataset

    out = tmp_path_factory.mktemp("dataset") / "data"
    write_example_dataset(out, n=24, priors=0, sizes=EXAMPLE_SIZES)
    return out


def write_config(path: Path, **fields) -> Path:
    """Write a flat JSON config file and return its path."""
    path.write_text(json.dumps(fields, indent=1))
    return path


@pytest.fixture()
def make_config(tmp_path, tiny_sd15, dataset):
    """Factory: a small, fast training config on the tiny model; keyword arguments override."""

    def make(name: str = "config.json", **overrides) -> Path:
        fields = {
            "model_family": "sd15",
            "pretrained_model": str(tiny_sd15),
            "output_dir": str(tmp_path / "run"),
            "image_dir": str(dataset),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "bucket_step": 32,
            "lora_rank": 4,
            "learning_rate": 1e-3,
            "train_batch_size": 2,
            "max_train_steps": 4,
            "checkpointing_steps": 2,
            "validation_steps": 0,
            "validation_prompt": ["a red zorbstar"],
            "validation_seeds": [0],
            "validation_num_inference_steps": 2,
            "report_to": "none",
        }
        fields.update(overrides)
        return write_config(tmp_path / name, **fields)

    return make


@pytest.fixture()
def nan_at_call(monkeypatch):
    """`nan_at_call(n)`: the SD1.5 denoiser's n-th prediction comes out NaN, the others real."""
    from kit.families.sd15 import SD15

    def poison(n: int) -> None:
        real, calls = SD15.predict, {"n": 0}

        def poisoned(self, comps, noisy, timesteps, cond):
            calls["n"] += 1
            out = real(self, comps, noisy, timesteps, cond)
            return out * float("nan") if calls["n"] == n else out

        monkeypatch.setattr(SD15, "predict", poisoned)

    return poison
