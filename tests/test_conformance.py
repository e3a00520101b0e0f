"""Every kohya / LyCORIS export, loaded by each client's own rules (`kit.export.clients`).

For each family and adapter kind a short run is exported; the export's check applies the file
to the base model as ComfyUI, A1111, sd-scripts and LyCORIS hold it and compares the result
with peft's merge of what was trained. These tests hold what each client must do with each
kind of file, including what a client cannot represent (a DoRA in A1111).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kit.config import load_config
from kit.export.conformance import check_file
from kit.export.writer import export
from kit.families import get_family
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.train.loop import train
from tests.conftest import short_clips, write_run_config

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "conv2", "ff.net.2"]
"""Attention, 1×1 and 3×3 convolutions and a feed-forward layer: every kind of weight."""

EVERYWHERE = {"ComfyUI", "A1111", "sd-scripts", "LyCORIS"}
LYCORIS_FILE = {"ComfyUI", "A1111", "LyCORIS"}  # sd-scripts' networks.lora reads LoRA only

# family, method, extra config, the clients that must reproduce the run exactly
CASES = [
    ("sd15", "lora", {"train_text_encoder": True}, EVERYWHERE),
    ("sd15", "dora", {}, {"LyCORIS"}),
    ("sd15", "loha", {}, LYCORIS_FILE),
    ("sd15", "lokr", {}, LYCORIS_FILE),
    ("sdxl", "lora", {"train_text_encoder": True}, EVERYWHERE),
    ("sdxl", "dora", {}, {"LyCORIS"}),
    ("sdxl", "loha", {}, LYCORIS_FILE),
    ("sdxl", "lokr", {}, LYCORIS_FILE),
    ("flux", "lora", {}, {"ComfyUI"}),
    ("flux", "loha", {}, {"ComfyUI"}),
    ("sd3", "lora", {}, {"ComfyUI"}),
    ("sd3", "lokr", {}, {"ComfyUI"}),
    ("wan", "lora", {}, {"ComfyUI"}),
    ("wan", "loha", {}, {"ComfyUI"}),
    ("wan", "dora", {}, set()),
]


@pytest.fixture(scope="session")
def sd15_two_resnets(tiny_sd15, tmp_path_factory):
    """The tiny SD1.5 with two resnets per UNet block, as the released models have: A1111's
    renaming of diffusers names assumes that structure."""
    from diffusers import UNet2DConditionModel

    out = tmp_path_factory.mktemp("models") / "tiny-sd15-2"
    shutil.copytree(tiny_sd15, out)
    config = dict(UNet2DConditionModel.load_config(out / "unet"), layers_per_block=2)
    torch.manual_seed(0)
    UNet2DConditionModel.from_config(config).save_pretrained(out / "unet")
    return out


def _trained_run(tmp_path, base, data, family, method, extra):
    fields = {
        "network_type": method,
        "lora_alpha": 2,
        "learning_rate": 2e-2,
        "max_train_steps": 2,
        "checkpointing_steps": 2,
        "validation_steps": 2,
        "validation_prompt": ["a zorbic thing"],
        "validation_seeds": [0],
        "validation_num_inference_steps": 2,
        **short_clips(family),
        **extra,
    }
    if family in ("sd15", "sdxl"):
        fields["lora_target_modules"] = UNET_TARGETS
    path = write_run_config(tmp_path / "c.json", base=base, data=data, family=family, **fields)
    train(load_config(path))
    return tmp_path / "run"


@pytest.mark.parametrize(("family", "method", "extra", "exact"), CASES)
def test_clients_load_the_export(
    family, method, extra, exact, tmp_path, tiny_base, family_dataset, sd15_two_resnets
):
    base = sd15_two_resnets if family == "sd15" else tiny_base(family)
    run = _trained_run(tmp_path, base, family_dataset(family), family, method, extra)
    result = export(run, "kohya")
    checks = {c["client"]: c for c in result.verification.clients}
    assert checks and result.verification.passed
    for client, check in checks.items():
        assert not check["skipped"], check
        assert check["weights"] > 0, check  # the adapter changed something the client holds
        if client in exact:
            assert check["exact"], check
            assert not check["unconsumed"] and not check["missed"], check
        else:
            # What the client cannot represent is measured and named, never passed silently.
            assert not check["exact"] and check["known_gap"], check
            assert any(client in n for n in result.verification.notes)
    tensors = load_file(str(result.path))
    with safe_open(str(result.path), "pt") as f:
        meta = f.metadata()
    if family == "sdxl":
        # kohya's SDXL block names, which sd-scripts' SDXL UNet and LyCORIS on it look up.
        unet = [k for k in tensors if k.startswith("lora_unet_")]
        assert unet and not any("down_blocks" in k or "up_blocks" in k for k in unet)
        assert any(k.startswith("lora_unet_input_blocks_") for k in unet)
    if method == "dora":
        assert meta["ss_network_module"] == "lycoris.kohya"
        assert json.loads(meta["ss_network_args"])["dora_wd"] == "True"
        for key, value in tensors.items():
            if key.endswith(".dora_scale"):
                down = tensors[key.replace(".dora_scale", ".lora_down.weight")]
                assert value.ndim == down.ndim and value.shape[1:] == (1,) * (down.ndim - 1)
    if method in ("loha", "lokr"):
        # alpha / rank folded into the factors: every reader scales by 1 however often.
        for key, value in tensors.items():
            if key.endswith(".alpha"):
                stem = key[: -len(".alpha")]
                inner = [
                    tensors[f"{stem}.{p}"]
                    for p in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b")
                    if f"{stem}.{p}" in tensors
                ]
                if inner:
                    assert float(value) == inner[0].shape[0]
    if "train_text_encoder" in extra:
        prefixes = ("lora_te_",) if family == "sd15" else ("lora_te1_", "lora_te2_")
        for prefix in prefixes:
            assert any(k.startswith(prefix + "text_model_encoder_layers_") for k in tensors)


def test_a_wrong_scale_is_caught_by_every_client(tmp_path, tiny_base, family_dataset):
    """The checks can fail: a file whose alpha says a different scale is exact in no client."""
    run = _trained_run(tmp_path, tiny_base("sdxl"), family_dataset("sdxl"), "sdxl", "loha", {})
    path = export(run, "kohya", verify=False).path
    tensors = load_file(str(path))
    tensors = {k: v * 3 if k.endswith(".alpha") else v for k, v in tensors.items()}
    cfg = load_config(run / "config.json")
    family = get_family("sdxl", cfg)
    trained = ckpt.exported_weights(ckpt.resolve_resume(run, "latest"))
    checks = check_file(
        tensors, {}, family, get_method(cfg, family), family.load(str(tiny_base("sdxl"))), trained
    )
    assert checks and not any(c.exact for c in checks)
    assert all(c.max_relative_error > 0.1 for c in checks if c.weights and not c.unconsumed)


def test_a_client_that_reads_nothing_fails_the_export(tmp_path, tiny_base, family_dataset):
    """A family whose file no modelled client reads, and diffusers neither, does not pass."""
    run = _trained_run(tmp_path, tiny_base("wan"), family_dataset("wan"), "wan", "loha", {})
    cfg = load_config(run / "config.json")
    family = get_family("wan", cfg)
    path = export(run, "kohya", verify=False).path
    tensors = {k.replace("lora_unet_", "lora_unet_x_"): v for k, v in load_file(str(path)).items()}
    trained = ckpt.exported_weights(ckpt.resolve_resume(run, "latest"))
    (check,) = check_file(
        tensors, {}, family, get_method(cfg, family), family.load(str(tiny_base("wan"))), trained
    )
    assert not check.passed and check.unconsumed and check.missed


def test_no_local_path_in_any_exported_file(tmp_path, tiny_base, family_dataset):
    run = _trained_run(tmp_path, tiny_base("sd15"), family_dataset("sd15"), "sd15", "lora", {})
    for fmt in ("diffusers", "kohya"):
        export(run, fmt)
    local = [str(tmp_path), str(tiny_base("sd15")), str(family_dataset("sd15"))]
    exported = [p for p in (run / "exports").rglob("*") if p.is_file()]
    assert exported
    for path in exported:
        blob = path.read_bytes()
        for text in local:
            assert text.encode() not in blob, (path, text)


def test_dora_has_no_kohya_file_where_the_layout_fuses_modules():
    from kit.config import Config

    for family in ("flux", "sd3"):
        cfg = Config().replace(model_family=family, network_type="dora")
        assert get_method(cfg, get_family(family, cfg)).export_formats() == ("diffusers",)
