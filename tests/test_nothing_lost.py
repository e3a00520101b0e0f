"""Nothing of the user's is lost, nothing silently wrong is trusted: `--overwrite` removes only
what a run wrote, a run never writes over a user's file, every relative path in a config is
read from the config's folder, and damaged saved state is refused or rebuilt, never trusted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kit.config import SECTIONS, load_config

# ------------------------------------------------------------------ config paths


def _path_keys() -> dict[str, tuple[type, str]]:
    """Every config key that names a path (its `path` metadata), nested records included, as
    `Record.key` → (record class, kind)."""
    found: dict[str, tuple[type, str]] = {}
    todo = list(SECTIONS.values())
    while todo:
        cls = todo.pop()
        for f in dataclasses.fields(cls):
            if f.metadata.get("path"):
                found[f"{cls.__name__}.{f.name}"] = (cls, f.metadata["path"])
            for t in typing_args(cls, f.name):
                if dataclasses.is_dataclass(t) and t not in todo:
                    todo.append(t)
    return found


def typing_args(cls: type, name: str) -> list[type]:
    """The classes a field's type names (its list's items, its optional's record)."""
    import typing

    hint = typing.get_type_hints(cls)[name]
    out, stack = [], [hint]
    while stack:
        t = stack.pop()
        out.append(t)
        stack.extend(typing.get_args(t))
    return [t for t in out if isinstance(t, type)]


PATH_KEYS = {
    "ModelConfig.pretrained_model",
    "ModelConfig.model_config",
    "ModelConfig.vae_model",
    "ModelConfig.training_adapter",
    "DataConfig.image_dir",
    "DataConfig.caption_dir",
    "DataConfig.cache_dir",
    "DataConfig.mask_dir",
    "DataConfig.control_dir",
    "TrainConfig.output_dir",
    "ValidationConfig.validation_image_dir",
    "DatasetConfig.hf_dataset",
    "DatasetConfig.shards",
    "DatasetConfig.image_dir",
    "DatasetConfig.caption_dir",
    "DatasetConfig.mask_dir",
    "DatasetConfig.control_dir",
    "ValidationPrompt.control",
}
"""Every key that names a file or folder: each is marked, and read by one rule."""

HUB_OR_PATH = {"pretrained_model", "model_config", "vae_model", "training_adapter", "hf_dataset"}
"""The keys that may name a hub id instead of a local path."""


def test_every_path_key_is_marked():
    assert set(_path_keys()) == PATH_KEYS


def _config_with(key: str, value: str) -> dict:
    """The smallest config that sets `Record.key` to `value` (a list where the key is one)."""
    record, name = key.split(".")
    v = [value] if name in ("control_dir", "control") else value
    if record == "DatasetConfig":
        source = {} if name in ("hf_dataset", "shards", "image_dir") else {"image_dir": "imgs"}
        return {"datasets": [{**source, name: v}]}
    if record == "ValidationPrompt":
        return {"validation_prompts": [{"prompt": "a", name: v}]}
    return {name: v}


def _read_back(cfg, key: str):
    record, name = key.split(".")
    if record == "DatasetConfig":
        return getattr(cfg.data.datasets[0], name)
    if record == "ValidationPrompt":
        return getattr(cfg.validation.validation_prompts[0], name)
    section = next(s for s, c in SECTIONS.items() if c.__name__ == record)
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("key", sorted(PATH_KEYS))
def test_a_relative_path_key_is_read_from_the_config_files_folder(key, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "things" / "here").mkdir(parents=True)
    (folder / "imgs").mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(_config_with(key, "things/here")))
    monkeypatch.chdir(tmp_path)  # the current folder is not the config's
    got = _read_back(load_config(path), key)
    got = got[0] if isinstance(got, list) else got
    assert Path(got) == (folder / "things" / "here").resolve(), key
    if key.split(".")[1] in HUB_OR_PATH:
        # A hub id (no such local path) stays a hub id.
        path.write_text(json.dumps(_config_with(key, "someone/some-model")))
        assert _read_back(load_config(path), key) == "someone/some-model"


@pytest.mark.parametrize("key", ["pretrained_model", "vae_model", "training_adapter"])
def test_a_missing_relative_file_is_looked_for_beside_the_config(key, tmp_path, monkeypatch):
    path = tmp_path / "project" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({key: "models/missing.safetensors"}))
    monkeypatch.chdir(tmp_path)
    got = getattr(load_config(path).model, key)
    assert got == str(tmp_path / "project" / "models" / "missing.safetensors")
