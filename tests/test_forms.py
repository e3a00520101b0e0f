"""Config forms without a front end: widgets move the config, bad values are refused, save reloads."""

from __future__ import annotations

import ipywidgets as W
import pytest

from kit.config import Config, load_config
from kit.errors import ConfigError
from kit.ui.forms import LORA_FIELDS, config_form
from tests.conftest import write_config


@pytest.fixture()
def cfg(tmp_path) -> Config:
    path = write_config(
        tmp_path / "base.json",
        pretrained_model="stable-diffusion-v1-5/stable-diffusion-v1-5",
        image_dir="images",
        output_dir="runs/a",
        lora_rank=8,
        validation_prompt=["a red zorbstar, large", "a blue one"],
    )
    return load_config(path)


def test_widget_kinds_follow_the_field_types(cfg):
    form = config_form(cfg)
    w = {n: f.widget for n, f in form.fields.items()}
    assert isinstance(w["lr_scheduler"], W.Dropdown)
    assert "cosine" in w["lr_scheduler"].options
    assert isinstance(w["gradient_checkpointing"], W.Checkbox)
    assert isinstance(w["lora_rank"], W.IntText) and w["lora_rank"].value == 8
    assert isinstance(w["learning_rate"], W.FloatText)
    assert isinstance(w["image_dir"], W.Text) and w["image_dir"].value == cfg.data.image_dir
    assert w["validation_seeds"].value == "0, 1"
    assert w["validation_prompt"].value == "a red zorbstar, large\na blue one"
    assert "Rank of each adapter" in w["lora_rank"].tooltip
    # Every field of every section has a widget, grouped in one accordion pane per section.
    assert set(form.fields) == set(cfg.to_dict(flat=True))
    assert len(form.sections.children) == 6


def test_widget_changes_update_the_config(cfg):
    form = config_form(cfg, fields=LORA_FIELDS)
    f = form.fields
    f["lora_rank"].widget.value = 32
    f["lr_scheduler"].widget.value = "cosine"
    f["lora_alpha"].widget.value = "16"
    f["validation_prompt"].widget.value = "one, with a comma\n\ntwo"
    assert form.config.network.lora_rank == 32
    assert form.config.train.lr_scheduler == "cosine"
    assert form.config.network.lora_alpha == 16.0
    assert form.config.validation.validation_prompt == ["one, with a comma", "two"]
    f["lora_alpha"].widget.value = ""
    assert form.config.network.lora_alpha is None
    assert not form.errors


def test_invalid_value_shows_the_error_and_keeps_the_config(cfg):
    form = config_form(cfg, sections=["network", "validation"])
    before = form.config
    rank = form.fields["lora_rank"]
    rank.widget.value = 0
    assert form.config is before
    assert "lora_rank: 0 must be at least 1" in rank.error.value
    assert "color:#c00" in rank.error.value
    form.fields["validation_seeds"].widget.value = "1, x"
    assert "expected an integer" in form.errors["validation_seeds"]
    assert form.config.validation.validation_seeds == [0, 1]
    rank.widget.value = 4  # fixing the value applies it and clears the message
    assert form.config.network.lora_rank == 4 and rank.error.value == ""
    assert set(form.errors) == {"validation_seeds"}


def test_a_refused_field_is_applied_once_another_change_allows_it(cfg):
    form = config_form(cfg, sections=["network"])
    f = form.fields
    f["network_type"].widget.value = "textual_inversion"  # needs tokens first
    assert form.config.network.network_type == "lora" and "network_type" in form.errors
    f["placeholder_tokens"].widget.value = "<zorb>"
    f["initializer_token"].widget.value = "star"
    assert form.config.network.network_type == "textual_inversion"
    assert not form.errors and f["network_type"].error.value == ""


def test_set_and_assign_move_the_widgets(cfg):
    form = config_form(cfg, fields=LORA_FIELDS)
    form.set("learning_rate", 3e-4)
    assert form.fields["learning_rate"].widget.value == pytest.approx(3e-4)
    with pytest.raises(ConfigError, match="lora_rank"):
        form.set("lora_rank", -1)
    assert form.fields["lora_rank"].widget.value == 8
    form.config = cfg.replace(lora_rank=64, validation_prompt=["x"])
    assert form.fields["lora_rank"].widget.value == 64
    assert form.fields["validation_prompt"].widget.value == "x"
    assert form.config.network.lora_rank == 64
    # Without a widget front end (papermill) the form reads as its settings.
    assert "lora_rank = 64" in form._repr_mimebundle_()["text/plain"]


def test_save_writes_what_the_cli_loads(cfg, tmp_path):
    form = config_form(cfg, path=tmp_path / "out" / "edited.json")
    form.fields["max_train_steps"].widget.value = 250
    form.fields["cache_dir"].widget.value = str(tmp_path / "cache")
    form.fields["trigger_words"].widget.value = "zorbstar, zorb"
    form.save_button.click()
    assert "saved" in form.status.value
    loaded = load_config(tmp_path / "out" / "edited.json")
    assert loaded == form.config
    assert loaded.train.max_train_steps == 250
    assert loaded.data.trigger_words == ["zorbstar", "zorb"]


def test_unknown_names_are_refused(cfg):
    with pytest.raises(ConfigError, match="did you mean 'lora_rank'"):
        config_form(cfg, fields=["lora_rnak"])
    with pytest.raises(ConfigError, match="unknown config section 'netwrk'"):
        config_form(cfg, sections=["netwrk"])
