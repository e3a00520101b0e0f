"""Text-encoder LoRA and wide targets: trained, saved, resumed and exported in every format.

The exported files are checked by redrawing the kit's validation images with plain diffusers
(`kit.export.writer.verify_export`), which applies both the denoiser's and the encoders' LoRA.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kit.config import Config, load_config
from kit.errors import ConfigError
from kit.export.writer import export
from kit.families import get_family
from kit.methods import get_method
from kit.run.folder import RunDir
from kit.train.loop import train
from tests.conftest import write_run_config

WIDE = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "proj_in",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
    "conv1",
    "conv2",
    "time_emb_proj",
]


def _run(tmp_path, base, data, family="sd15", **fields):
    path = write_run_config(
        tmp_path / "config.json",
        base=base,
        data=data,
        family=family,
        trigger_words=["zorbstar"],
        lora_alpha=2,
        learning_rate=2e-2,
        train_batch_size=1,
        max_train_steps=4,
        checkpointing_steps=4,
        validation_steps=4,
        validation_prompt=["a zorbstar"],
        validation_seeds=[0],
        validation_num_inference_steps=3,
        **fields,
    )
    train(load_config(path))
    return RunDir(tmp_path / "run")


@pytest.fixture(scope="module")
def te_run(tmp_path_factory, tiny_sd15, family_dataset):
    tmp = tmp_path_factory.mktemp("te")
    return _run(
        tmp,
        tiny_sd15,
        family_dataset("sd15"),
        train_text_encoder=True,
        text_encoder_lr=1e-2,
        lora_target_modules=WIDE,
    )


def test_text_encoder_adapters_train_and_are_saved(te_run):
    from kit.run import checkpoint as ckpt

    weights = ckpt.exported_weights(ckpt.resolve_resume(te_run.root, "latest"))
    text = [k for k in weights if k.startswith("text_encoder.")]
    assert text and all(".lora_" in k for k in text)
    # The encoder's LoRA up-weights start at zero: non-zero means they received gradients.
    ups = [weights[k] for k in text if "lora_B" in k]
    assert any(u.abs().max() > 0 for u in ups)
    assert any(k.startswith("down_blocks") and ".conv1." in k for k in weights)


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_exports_reproduce_text_encoder_and_wide_lora(te_run, fmt):
    result = export(te_run.root, fmt)
    assert result.verification.passed, result.verification
    tensors = load_file(str(result.path))
    if fmt == "kohya":
        assert any(k.startswith("lora_te_text_model_encoder_layers_") for k in tensors)
        assert any("_resnets_0_conv1." in k for k in tensors)
    else:
        assert any(k.startswith("text_encoder.") for k in tensors)
        # peft's own key style for every target: nothing half-renamed.
        assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    with safe_open(str(result.path), "pt") as f:
        meta = f.metadata()
    assert "/" not in meta["kit.base_model"] and meta["ss_sd_model_name"] == meta["kit.base_model"]


def test_text_encoder_lr_is_its_own_group(te_run, tiny_sd15):
    cfg = load_config(te_run.config)
    family = get_family("sd15", cfg)
    comps = family.load(str(tiny_sd15))
    method = get_method(cfg, family)
    method.attach(comps)
    groups = method.param_groups(comps)
    assert len(groups) == 2 and groups[1]["lr"] == 1e-2 and "lr" not in groups[0]


def _method(family, **fields):
    cfg = Config().replace(model_family=family, **fields)
    return get_method(cfg, get_family(family, cfg))


def test_unsupported_text_encoder_pairs_are_refused():
    with pytest.raises(ConfigError, match="only as LoRA"):
        _method("sd15", network_type="loha", train_text_encoder=True)
    with pytest.raises(ConfigError, match="no client loads a LoRA into wan"):
        _method("wan", train_text_encoder=True)
    with pytest.raises(ConfigError, match="text_encoders: \\[2\\] on sdxl"):
        _method("sdxl", train_text_encoder=True, text_encoders=[2])
    with pytest.raises(ConfigError, match="train_text_encoder is false"):
        _method("sdxl", text_encoders=[0])
    assert _method("sdxl", train_text_encoder=True).trained_text_encoders() == (0, 1)
    assert _method("sdxl", train_text_encoder=True, text_encoders=[1]).trained_text_encoders() == (
        1,
    )
    assert _method("sd3", train_text_encoder=True).trained_text_encoders() == (0, 1)


def test_sdxl_text_encoder_lora_exports(tmp_path, tiny_base, family_dataset):
    run = _run(
        tmp_path, tiny_base("sdxl"), family_dataset("sdxl"), family="sdxl", train_text_encoder=True
    )
    tensors = load_file(str(export(run.root, "diffusers").path))
    assert any(k.startswith("text_encoder.") for k in tensors)
    assert any(k.startswith("text_encoder_2.") for k in tensors)
    kohya = export(run.root, "kohya")
    keys = load_file(str(kohya.path))
    assert any(k.startswith("lora_te1_") for k in keys) and any(
        k.startswith("lora_te2_") for k in keys
    )
    assert kohya.verification.passed
    meta = json.loads(json.dumps(describe_meta(kohya.path)))
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"


def describe_meta(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_without_text_encoder_nothing_changes(tiny_sd15):
    m = _method("sd15")
    assert m.trained_text_encoders() == () and not m.live_text and not m.leaves_unused
    assert torch.is_tensor(torch.zeros(1))


def test_the_text_encoder_lora_matters(te_run, tmp_path):
    """The checks above see the encoders' LoRA: a file without it does not verify."""
    from safetensors.torch import save_file

    from kit.export.writer import verify_export

    path = export(te_run.root, "kohya", verify=False).path
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith("lora_te_")}
    bad = tmp_path / "no_text.safetensors"
    save_file(tensors, str(bad))
    assert not verify_export(te_run, bad, 4).passed


def test_text_encoder_lora_resumes_bit_for_bit(tmp_path, tiny_sd15, family_dataset):
    from safetensors.torch import load_file

    from kit.run import checkpoint as ckpt

    def config(name, steps):
        return write_run_config(
            tmp_path / f"{name}.json",
            base=tiny_sd15,
            data=family_dataset("sd15"),
            output_dir=str(tmp_path / name),
            train_text_encoder=True,
            text_encoder_lr=5e-3,
            max_train_steps=steps,
            checkpointing_steps=1,
        )

    train(load_config(config("straight", 2)))
    split = config("split", 2)
    train(load_config(split, {"max_train_steps": 1}))
    train(load_config(split), resume="latest")
    a = load_file(str(ckpt.checkpoint_dir(tmp_path / "straight", 2) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "split", 2) / ckpt.ADAPTER_FILE))
    assert a.keys() == b.keys() and any(k.startswith("text_encoder.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_estimate_counts_the_text_encoder_adapters():
    from kit.preflight.estimate import estimate

    plain = estimate(Config().replace(model_family="sdxl", pretrained_model="sdxl"))
    with_text = estimate(
        Config().replace(model_family="sdxl", pretrained_model="sdxl", train_text_encoder=True)
    )
    assert with_text.settings["trainable_params"] > plain.settings["trainable_params"]
