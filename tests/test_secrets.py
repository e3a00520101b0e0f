"""Access tokens stay in the environment: never in saved configs, run folders, logs or reports."""

from __future__ import annotations

import json
import warnings

import pytest

from kit.cli import main
from kit.config import from_dict, load_config
from kit.errors import ConfigError

FAKE = "hf_KitFakeSecret0123456789abcdefXYZ"


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


@pytest.fixture()
def token(monkeypatch) -> str:
    """A recognisable fake token in every variable the Hugging Face libraries read."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(name, FAKE)
    return FAKE


def kit(capsys, *argv) -> str:
    """Run `kit ARGV`, expecting success; return stdout and stderr together."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out + err


@pytest.mark.slow
def test_token_reaches_no_file_or_output(capsys, token, make_config, dataset, tmp_path):
    for png in sorted(dataset.glob("*.png"))[4:]:
        png.unlink()
        png.with_suffix(".txt").unlink()
    cfg = make_config(max_train_steps=2, checkpointing_steps=1, validation_steps=2)
    shown = kit(capsys, "train", cfg)
    shown += kit(capsys, "export", tmp_path / "run", "--no-verify")
    shown += kit(capsys, "doctor", tmp_path / "run")
    shown += kit(capsys, "env")
    shown += kit(capsys, "env", "--json")
    assert token not in shown

    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in files)
    assert any(p.suffix == ".safetensors" for p in files)
    leaked = [p for p in files if token.encode() in p.read_bytes()]
    assert not leaked, f"token found in {leaked}"
    assert token not in (tmp_path / "run" / "config.json").read_text()


@pytest.mark.parametrize("key", ["hf_token", "token", "HF_TOKEN", "hub_token"])
def test_token_key_in_a_config_is_refused(capsys, key, make_config):
    cfg = make_config(**{key: FAKE})
    rc = main(["buckets", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"'{key}'" in err and "HF_TOKEN environment variable" in err
    assert FAKE not in err


def test_token_key_refused_in_a_section_and_as_an_override(make_config):
    with pytest.raises(ConfigError, match="HF_TOKEN environment variable") as err:
        from_dict({"model": {"hf_token": FAKE}})
    assert FAKE not in str(err.value)
    with pytest.raises(ConfigError, match="HF_TOKEN environment variable") as err:
        load_config(make_config(), {"token": FAKE})
    assert FAKE not in str(err.value)


def test_saved_config_holds_no_environment(token, make_config, tmp_path):
    cfg = load_config(make_config())
    cfg.save(tmp_path / "saved.json")
    text = (tmp_path / "saved.json").read_text()
    assert token not in text and json.loads(text)
