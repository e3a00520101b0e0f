"""What the kit says about a run and its files: the base a config means, the metadata, the
clients and versions each file is for, and the model card's usage text (issue 47)."""

from __future__ import annotations

import json

import pytest

from kit.cli import main
from kit.config import Config, load_config
from kit.errors import ConfigError
from kit.families import family_info, get_family

SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"


def test_an_unset_base_is_the_familys_own(tmp_path, capsys):
    path = tmp_path / "zimage.json"
    path.write_text(json.dumps({"model_family": "zimage", "image_dir": str(tmp_path)}))
    assert load_config(path).model.pretrained_model == family_info("zimage").hub_id
    assert Config().model.pretrained_model == SD15
    # A base left at its family's own follows the family; one that was set stays.
    assert Config().replace(model_family="wan").model.pretrained_model == family_info("wan").hub_id
    mine = Config().replace(pretrained_model="me/my-sd15")
    assert mine.replace(lora_rank=2).model.pretrained_model == "me/my-sd15"
    assert main(["estimate", str(path)]) == 0
    assert "denoiser_weights" in capsys.readouterr().out


def test_a_base_of_another_family_is_one_line(tmp_path, capsys):
    path = tmp_path / "mixed.json"
    path.write_text(
        json.dumps({"model_family": "zimage", "pretrained_model": SD15, "image_dir": "x"})
    )
    with pytest.raises(ConfigError, match="pretrained_model: .* is a sd15 model"):
        get_family("zimage", load_config(path))
    assert main(["estimate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "OSError" not in err
    assert "model_family is zimage" in err and "Tongyi-MAI/Z-Image-Turbo" in err
