"""The config: strict loading, flat and sectioned files, clear errors, path resolution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kit.config import (
    SECTIONS,
    Config,
    field_docs,
    from_dict,
    load_config,
    parse_override,
)
from kit.data.scan import load_samples
from kit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

# Which section each key of the guide's flat config belongs to.
GUIDE_SECTIONS = {
    "model_family": "model",
    "pretrained_model": "model",
    "output_dir": "train",
    "data_backend": "data",
    "image_dir": "data",
    "caption_dir": "data",
    "resolution": "data",
    "resolution_type": "data",
    "caption_strategy": "data",
    "lora_rank": "network",
    "learning_rate": "train",
    "lr_scheduler": "train",
    "lr_warmup_steps": "train",
    "train_batch_size": "train",
    "gradient_accumulation_steps": "train",
    "max_train_steps": "train",
    "mixed_precision": "train",
    "gradient_checkpointing": "train",
    "checkpointing_steps": "train",
    "validation_steps": "validation",
    "validation_prompt": "validation",
}


def guide_config(model: Path, output: Path, data: Path) -> dict:
    """The flat config that users copy from the guide, with its paths filled in."""
    return {
        "model_family": "sd15",
        "pretrained_model": str(model),
        "output_dir": str(output),
        "data_backend": "local",
        "image_dir": str(data),
        "caption_dir": str(data),
        "resolution": 768,
        "resolution_type": "area",
        "caption_strategy": "textfile",
        "lora_rank": 16,
        "learning_rate": 1e-4,
        "lr_scheduler": "cosine",
        "lr_warmup_steps": 100,
        "train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "max_train_steps": 4000,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "checkpointing_steps": 500,
        "validation_steps": 250,
        "validation_prompt": "a photo",
    }


def sectioned(flat: dict) -> dict:
    """The same values grouped by section."""
    out: dict[str, dict] = {}
    for key, value in flat.items():
        out.setdefault(GUIDE_SECTIONS[key], {})[key] = value
    return out


@pytest.fixture()
def guide(tmp_path, dataset) -> dict:
    # A stand-in model folder: loading a config checks names and types, not weights.
    model = tmp_path / "model"
    model.mkdir()
    return guide_config(model, tmp_path / "run", dataset)


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def config_error(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    return str(e.value)


# ---------------------------------------------------------------- the guide's config


def test_guide_config_loads_into_the_right_sections(tmp_path, guide):
    cfg = load_config(write(tmp_path / "config.json", guide))
    assert set(GUIDE_SECTIONS) == set(guide)
    for key, value in guide.items():
        got = getattr(getattr(cfg, GUIDE_SECTIONS[key]), key)
        if key == "validation_prompt":
            assert got == ["a photo"]  # a single prompt stands for a list of one
        else:
            assert got == value, key
    assert isinstance(cfg.train.learning_rate, float)
    assert cfg.train.mixed_precision == "bf16"
    assert cfg.train.gradient_checkpointing is True


def test_flat_and_sectioned_files_give_equal_configs(tmp_path, guide):
    flat = load_config(write(tmp_path / "flat.json", guide))
    sect = load_config(write(tmp_path / "sectioned.json", sectioned(guide)))
    assert set(sectioned(guide)) == {"model", "data", "network", "train", "validation"}
    assert flat == sect
    assert flat != Config()


def test_to_dict_round_trips(tmp_path, guide):
    cfg = load_config(write(tmp_path / "config.json", {**guide, "lora_alpha": 8}))
    flat = cfg.to_dict(flat=True)
    assert "lora_rank" in flat and "network" not in flat
    assert from_dict(flat) == cfg
    assert from_dict(cfg.to_dict()) == cfg
    cfg.save(tmp_path / "saved.json")
    assert load_config(tmp_path / "saved.json") == cfg


# ---------------------------------------------------------------- errors name the key


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("lora_rnak", "lora_rank"), ("learning_rat", "learning_rate"), ("resolutoin", "resolution")],
)
def test_unknown_key_suggests_the_closest(key, suggestion):
    msg = config_error({key: 1})
    assert f"'{key}'" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_key_in_a_section():
    msg = config_error({"network": {"lora_rnak": 8}})
    assert "'lora_rnak'" in msg and "'network'" in msg
    assert "did you mean 'lora_rank'" in msg


def test_key_in_the_wrong_section_names_the_right_one():
    msg = config_error({"network": {"learning_rate": 1e-4}})
    assert "'learning_rate'" in msg
    assert "'train'" in msg


@pytest.mark.parametrize(
    ("raw", "key", "detail"),
    [
        ({"lora_rank": "16"}, "lora_rank", "integer"),
        ({"train_batch_size": True}, "train_batch_size", "integer"),
        ({"gradient_checkpointing": 1}, "gradient_checkpointing", "true or false"),
        ({"validation_seeds": [0, "one"]}, "validation_seeds[1]", "integer"),
        ({"learning_rate": "fast"}, "learning_rate", "number"),
        ({"lora_alpha": "x"}, "lora_alpha", "'x'"),
        ({"trigger_words": {"a": 1}}, "trigger_words", "list"),
    ],
)
def test_wrong_type_names_the_key(raw, key, detail):
    msg = config_error(raw)
    assert msg.startswith(f"{key}:")
    assert detail in msg


def test_bad_choice_lists_the_choices_and_suggests():
    msg = config_error({"lr_scheduler": "cosin"})
    assert msg.startswith("lr_scheduler:")
    for choice in ("'constant'", "'linear'", "'cosine'", "'polynomial'"):
        assert choice in msg
    assert "did you mean 'cosine'" in msg


@pytest.mark.parametrize(
    "raw",
    [
        {"lora_rank": 8, "network": {"lora_rank": 16}},
        {"network": {"lora_rank": 16}, "lora_rank": 8},
    ],
)
def test_key_given_twice_is_refused(raw):
    msg = config_error(raw)
    assert "'lora_rank'" in msg and "twice" in msg


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "lora_rank": 8,\n  "resolution": 64,\n}\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "line 4" in str(e.value)


def test_missing_config_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError, match="not found") as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_errors_from_a_file_name_the_file(tmp_path):
    path = write(tmp_path / "config.json", {"lora_rnak": 8})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "did you mean 'lora_rank'" in str(e.value)


def test_section_that_is_not_an_object_is_named_as_a_section():
    msg = config_error({"model": "sd15"})
    assert "did you mean 'model'" not in msg
    assert "section" in msg


def test_negative_bucket_step_is_refused():
    msg = config_error({"bucket_step": -32})
    assert "bucket_step" in msg


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"resolution": 16}, "resolution"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_train_steps": 0}, "max_train_steps"),
        ({"max_aspect_ratio": 0.5}, "max_aspect_ratio"),
    ],
)
def test_out_of_range_values_name_the_key(raw, key):
    assert config_error(raw).startswith(f"{key}:")


# ---------------------------------------------------------------- the schema


def test_every_field_has_a_docstring():
    docs = field_docs()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{section}.{f.name} has no docstring"


def test_field_names_are_unique_across_sections():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))
    assert not set(names) & set(SECTIONS)
    assert set(SECTIONS) == {"model", "data", "network", "objective", "train", "validation"}


# ---------------------------------------------------------------- paths and overrides


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project" / "configs"
    (folder / "models" / "tiny").mkdir(parents=True)
    (folder / "local-model").mkdir()
    path = write(
        folder / "config.json",
        {
            "pretrained_model": "./models/tiny",
            "image_dir": "data/images",
            "caption_dir": "../captions",
            "output_dir": "../runs/one",
            "cache_dir": "",
        },
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert Path(cfg.model.pretrained_model) == (folder / "models" / "tiny").resolve()
    assert Path(cfg.data.image_dir) == (folder / "data" / "images").resolve()
    assert Path(cfg.data.caption_dir) == (tmp_path / "project" / "captions").resolve()
    assert Path(cfg.train.output_dir) == (tmp_path / "project" / "runs" / "one").resolve()
    assert cfg.data.cache_dir == ""  # empty stays empty: it means the default cache

    # A bare name is a local folder only when one exists beside the config.
    local = load_config(write(folder / "local.json", {"pretrained_model": "local-model"}))
    assert Path(local.model.pretrained_model) == (folder / "local-model").resolve()


def test_hub_id_stays_as_is(tmp_path):
    path = write(
        tmp_path / "config.json",
        {"pretrained_model": "stable-diffusion-v1-5/stable-diffusion-v1-5"},
    )
    assert load_config(path).model.pretrained_model == "stable-diffusion-v1-5/stable-diffusion-v1-5"


def test_parse_override():
    assert parse_override("lora_rank=8") == ("lora_rank", 8)
    assert isinstance(parse_override("lora_rank=8")[1], int)
    assert parse_override("lr_scheduler=cosine") == ("lr_scheduler", "cosine")
    assert parse_override("validation_prompt=a red cat") == ("validation_prompt", "a red cat")
    assert parse_override("lora_alpha=null") == ("lora_alpha", None)
    with pytest.raises(ConfigError, match="did you mean 'lora_rank'"):
        parse_override("lora_rnak=8")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("lora_rank")


def test_overrides_replace_file_values(tmp_path):
    path = write(tmp_path / "config.json", {"network": {"lora_rank": 4}})
    cfg = load_config(path, dict([parse_override("lora_rank=8")]))
    assert cfg.network.lora_rank == 8
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(path, {"lora_rank": "eight"})
    with pytest.raises(ConfigError, match="did you mean 'lora_rank'"):
        load_config(path, {"lora_rnak": 8})


# ---------------------------------------------------------------- normalisation and formats


def test_fp32_means_no_mixed_precision():
    assert from_dict({"mixed_precision": "fp32"}).train.mixed_precision == "no"
    assert from_dict({"mixed_precision": "fp32"}) == from_dict({"mixed_precision": "no"})
    assert from_dict({"mixed_precision": "bf16"}).train.mixed_precision == "bf16"


def test_yaml_loads_the_same_as_json(tmp_path, guide):
    yaml = pytest.importorskip("yaml")
    values = {**guide, "learning_rate": 0.0001, "validation_prompt": ["a photo", "a cat"]}
    as_json = load_config(write(tmp_path / "config.json", sectioned(values)))
    for name in ("config.yaml", "config.yml"):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(sectioned(values)))
        assert load_config(path) == as_json
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump(values))
    assert load_config(flat) == as_json


def test_yaml_reads_exponent_numbers_as_numbers(tmp_path, guide):
    lines = [f"{k}: {json.dumps(v)}" for k, v in guide.items() if k != "learning_rate"]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join([*lines, "learning_rate: 1e-4"]) + "\n")
    assert load_config(path) == load_config(write(tmp_path / "config.json", guide))


def test_invalid_yaml_names_the_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text("lora_rank: [8\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "YAML" in str(e.value)


# ---------------------------------------------------------------- the shipped demo


def test_demo_config_loads_and_validates():
    path = ROOT / "datasets_example" / "config.json"
    cfg = load_config(path)
    assert cfg.model.model_family == "sd15"
    assert Path(cfg.model.pretrained_model) == (ROOT / "models" / "toy-sd15").resolve()
    assert Path(cfg.data.image_dir) == (ROOT / "datasets_example" / "images").resolve()
    assert cfg.data.trigger_words == ["zorbic"] and cfg.data.prior_images == ["prior_*"]
    assert len(cfg.validation.validation_prompt) == 2
    assert len(load_samples(cfg.data)) == 32
    assert from_dict(cfg.to_dict(flat=True)) == cfg
