"""Full fine-tuning and textual inversion on the tiny SD1.5 and SDXL models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.errors import ConfigError
from kit.export.writer import export
from kit.run import checkpoint as ckpt
from tests.conftest import TEXTUAL_INVERSION, write_run_config

FAMILIES = ["sd15", "sdxl"]


@pytest.fixture(scope="module")
def tiny(tiny_base):
    """Tiny base models of both families (the session's shared copies)."""
    return {name: tiny_base(name) for name in FAMILIES}


def _config(tmp_path, tiny, dataset, family, **fields):
    name = fields.pop("name", "config.json")
    # The configuration's defaults for what a short LoRA run sets otherwise.
    defaults = {"lora_rank": 16, "learning_rate": 1e-4, "validation_prompt": ["a red <zorb>"]}
    return write_run_config(
        tmp_path / name, base=tiny[family], data=dataset, family=family, **{**defaults, **fields}
    )


TI = TEXTUAL_INVERSION


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_textual_inversion_trains_resumes_and_exports(tmp_path, tiny, dataset, family):
    from kit.train.loop import train

    for p in dataset.glob("*.txt"):  # the concept is called by the placeholder
        p.write_text(p.read_text().replace("zorbic", "<zorb>"))
    straight = _config(tmp_path, tiny, dataset, family, **TI)
    train(load_config(straight))
    rows = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 4) / ckpt.ADAPTER_FILE))
    encoders = 2 if family == "sdxl" else 1
    assert sorted(rows) == [f"{i}:<zorb>" for i in range(encoders)]

    split = _config(
        tmp_path, tiny, dataset, family, name="b.json", output_dir=str(tmp_path / "b"), **TI
    )
    train(load_config(split, {"max_train_steps": 2}))
    train(load_config(split), resume="latest")
    again = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 4) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(rows[k], again[k]) for k in rows)

    # A fresh pipeline with only the exported embedding redraws the kit's images exactly:
    # so no other row of the embedding matrices moved.
    result = export(tmp_path / "run", "embedding")
    assert result.verification.passed and result.verification.max_abs_diff == 0
    saved = load_file(str(result.path / "zorb.safetensors"))
    assert sorted(saved) == (["clip_g", "clip_l"] if family == "sdxl" else ["<zorb>"])


def test_only_placeholder_rows_change(tiny):
    from kit.config import from_dict
    from kit.families import get_family
    from kit.methods import get_method

    cfg = from_dict({"pretrained_model": str(tiny["sd15"]), **TI})
    family = get_family("sd15", cfg)
    comps = family.load(str(tiny["sd15"]))
    net = get_method(cfg, family)
    net.attach(comps)
    weight = comps.text_encoders[0].get_input_embeddings().weight
    before = weight.detach().clone()
    with torch.no_grad():
        weight.add_(torch.randn_like(weight))  # as if every row had been updated
    net.after_step(comps)
    new = net.ids[0][0]
    others = torch.ones(weight.shape[0], dtype=torch.bool)
    others[new] = False
    assert torch.equal(weight[others], before[others])
    assert not torch.equal(weight[new], before[new])


@pytest.mark.parametrize(
    ("tokens", "init", "match"),
    [(["red"], "star", "already a token"), (["<zorb>"], "zorbstar", "is 4 tokens")],
)
def test_textual_inversion_token_checks(tiny, tokens, init, match):
    from kit.config import from_dict
    from kit.families import get_family
    from kit.methods import get_method

    cfg = from_dict(
        {
            "pretrained_model": str(tiny["sd15"]),
            **TI,
            "placeholder_tokens": tokens,
            "initializer_token": init,
        }
    )
    family = get_family("sd15", cfg)
    with pytest.raises(ConfigError, match=match):
        get_method(cfg, family).attach(family.load(str(tiny["sd15"])))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_full_fine_tune_with_text_encoder(tmp_path, tiny, dataset, family):
    from kit.train.loop import train

    fields = {"network_type": "full", "train_text_encoder": True, "learning_rate": 1e-4}
    train(load_config(_config(tmp_path, tiny, dataset, family, **fields)))
    weights = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 4) / ckpt.ADAPTER_FILE))
    assert any(k.startswith("denoiser.") for k in weights) and any(
        k.startswith("text_encoder.") for k in weights
    )

    split = _config(
        tmp_path, tiny, dataset, family, name="b.json", output_dir=str(tmp_path / "b"), **fields
    )
    train(load_config(split, {"max_train_steps": 2}))
    train(load_config(split), resume="latest")
    again = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 4) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(weights[k], again[k]) for k in weights)

    result = export(tmp_path / "run", "diffusers")
    assert result.path.name == "pipeline" and (result.path / "model_index.json").is_file()
    assert result.verification.passed
    assert json.loads((result.path / "kit_export.json").read_text())["kit.network_type"] == "full"


def test_network_preview_and_estimate_for_full_and_ti(tmp_path, tiny, dataset):
    from kit.preflight.estimate import estimate

    full = estimate(load_config(_config(tmp_path, tiny, dataset, "sd15", network_type="full")))
    ti = estimate(load_config(_config(tmp_path, tiny, dataset, "sd15", name="ti.json", **TI)))
    assert full.settings["trainable_params"] > 100 * ti.settings["trainable_params"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_adapter_kinds_on_sdxl(tmp_path, tiny, dataset, kind):
    """Each adapter kind trains, resumes exactly and exports (verified) on SDXL too."""
    from kit.export.writer import formats_for
    from kit.families import get_family
    from kit.train.loop import train

    fields = {
        "network_type": kind,
        "lora_rank": 4,
        "lora_alpha": 2,
        "max_train_steps": 2,
        "checkpointing_steps": 1,
    }
    cfg = load_config(_config(tmp_path, tiny, dataset, "sdxl", **fields))
    train(cfg)
    weights = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 2) / ckpt.ADAPTER_FILE))
    split = _config(
        tmp_path, tiny, dataset, "sdxl", name="b.json", output_dir=str(tmp_path / "b"), **fields
    )
    train(load_config(split, {"max_train_steps": 1}))
    train(load_config(split), resume="latest")
    again = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 2) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    formats = formats_for(cfg, get_family("sdxl", cfg))
    assert formats
    for fmt in formats:
        assert export(tmp_path / "run", fmt).verification.passed
