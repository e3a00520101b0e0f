"""Exported LoRA files load in plain diffusers and redraw the kit's own validation images."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kit.config import load_config
from kit.errors import KitError
from kit.export.writer import export, verify_export
from kit.run.folder import RunDir
from kit.train.loop import train

# Plain diffusers, no kit: what a user of the exported file would write.
REPRODUCE = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from PIL import Image
    from diffusers import StableDiffusionPipeline

    sidecar, lora = sys.argv[1], sys.argv[2]
    spec = json.load(open(sidecar))
    pipe = StableDiffusionPipeline.from_pretrained(
        spec["base_model"], safety_checker=None, requires_safety_checker=False
    )
    pipe.load_lora_weights(lora)
    image = pipe(
        spec["prompt"],
        negative_prompt=spec["negative_prompt"] or None,
        num_inference_steps=spec["num_inference_steps"],
        guidance_scale=spec["guidance_scale"],
        width=spec["width"],
        height=spec["height"],
        generator=torch.Generator(spec["generator_device"]).manual_seed(spec["seed"]),
    ).images[0]
    ours = np.asarray(image, dtype=int)
    kits = np.asarray(Image.open(sidecar[: -len(".json")] + ".png").convert("RGB"), dtype=int)
    print(int(np.abs(ours - kits).max()))
    """
)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_sd15):
    """A short run with alpha ≠ rank (so a lost alpha shows) and a strong learning rate."""
    import shutil

    from tests.conftest import EXAMPLE, write_run_config

    tmp = tmp_path_factory.mktemp("export")
    shutil.copytree(EXAMPLE / "images", tmp / "data")
    path = write_run_config(
        tmp / "config.json",
        base=tiny_sd15,
        data=tmp / "data",
        trigger_words=["zorbstar"],
        lora_alpha=2,
        learning_rate=2e-2,
        train_batch_size=1,
        max_train_steps=6,
        checkpointing_steps=3,
        validation_steps=3,
        validation_prompt=["a large red zorbstar", "a small blue zorbstar"],
        validation_seeds=[0, 7],
        validation_num_inference_steps=4,
    )
    train(load_config(path))
    return RunDir(tmp / "run")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_export_verifies_against_validation_images(trained_run, fmt):
    result = export(trained_run.root, fmt)
    v = result.verification
    assert result.step == 6 and result.path.is_file()
    assert v.passed and v.images == 4 and v.max_abs_diff <= 2
    assert json.loads(result.path.with_suffix(".verify.json").read_text())["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_plain_diffusers_reproduces_a_validation_image(trained_run, fmt):
    """An independent process with plain diffusers and the sidecar JSON draws the same image."""
    lora = export(trained_run.root, fmt, verify=False).path
    sidecar = trained_run.validation_step(6) / "01_seed7.json"
    out = subprocess.run(
        [sys.executable, "-c", REPRODUCE, str(sidecar), str(lora)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout.strip().splitlines()[-1]) <= 2


@pytest.mark.slow
def test_the_adapter_changes_the_image(trained_run):
    """The comparison above means something: without the adapter the image differs."""
    from kit.sample.validate import draw_checkpoint

    grid = draw_checkpoint(trained_run.root, scales=(0.0, 1.0))
    base = np.asarray(Image.open(grid.parent / "00_seed0.png"), dtype=int)
    tuned = np.asarray(Image.open(trained_run.validation_step(6) / "00_seed0.png"), dtype=int)
    assert np.abs(base - tuned).max() > 10


def test_kohya_keys_alpha_and_metadata(trained_run):
    path = export(trained_run.root, "kohya", verify=False).path
    tensors = load_file(str(path))
    downs = [k for k in tensors if k.endswith(".lora_down.weight")]
    assert downs and all(k.startswith("lora_unet_") for k in tensors)
    for k in downs:
        stem = k[: -len(".lora_down.weight")]
        assert f"{stem}.lora_up.weight" in tensors
        assert float(tensors[f"{stem}.alpha"]) == 2.0
        assert tensors[k].shape[0] == 4  # rank
    assert any("attn2_to_k" in k for k in tensors)  # cross-attention is adapted
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2.0"
    assert meta["ss_base_model_version"] == "sd_v1"
    assert json.loads(meta["kit.trigger_words"]) == ["zorbstar"]
    assert meta["modelspec.trigger_phrase"] == "zorbstar"
    assert meta["ss_steps"] == "6"
    # The base is named, never located: a shared file shows no local folder.
    base = load_config(trained_run.config).model.pretrained_model
    assert meta["kit.base_model"] == meta["ss_sd_model_name"] == base.rsplit("/", 1)[-1]
    assert not any(base in v for v in meta.values())
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert meta["modelspec.prediction_type"] == "epsilon" and meta["ss_v2"] == "False"
    assert meta["modelspec.resolution"] == "64x64" and meta["modelspec.date"]
    assert int(meta["ss_num_train_images"]) > 0
    (tags,) = json.loads(meta["ss_tag_frequency"]).values()
    assert tags and all(isinstance(n, int) and n > 0 for n in tags.values())


def test_diffusers_file_carries_its_scale_in_the_weights(trained_run):
    """alpha / rank (2 / 4) is folded into lora_B and the file says alpha = rank, so a reader
    that ignores the metadata (ComfyUI, Forge: scale 1) applies the same update as diffusers."""
    from kit.run import checkpoint as ckpt

    path = export(trained_run.root, "diffusers", verify=False).path
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    adapter = json.loads(meta["lora_adapter_metadata"])
    assert adapter["unet.r"] == 4 and adapter["unet.lora_alpha"] == 4
    trained = ckpt.exported_weights(ckpt.resolve_resume(trained_run.root, "latest"))
    for key, value in trained.items():
        written = tensors[f"unet.{key}"]
        expected = value * 0.5 if ".lora_B." in key else value
        assert torch.allclose(written, expected), key


@pytest.mark.slow
def test_a_wrong_file_fails_verification(trained_run, tmp_path):
    """A file whose scale is off (alpha lost, as naive converters do) does not pass."""
    path = export(trained_run.root, "kohya", verify=False).path
    tensors = load_file(str(path))
    broken = {k: (torch.tensor(4.0) if k.endswith(".alpha") else v) for k, v in tensors.items()}
    bad = tmp_path / "bad.safetensors"
    save_file(broken, str(bad))
    v = verify_export(trained_run, bad, 6)
    assert not v.passed and v.max_abs_diff > 2


def test_export_dtype_and_errors(trained_run, tmp_path):
    half = export(trained_run.root, "kohya", dtype="fp16", verify=False, out_dir=tmp_path)
    assert all(
        t.dtype == torch.float16
        for k, t in load_file(str(half.path)).items()
        if k.endswith(".weight")
    )
    with pytest.raises(KitError, match="unknown export format"):
        export(trained_run.root, "ckpt")


def test_tiny_model_loads_in_plain_diffusers(tmp_path):
    from diffusers import StableDiffusionPipeline

    from kit.cli import main

    assert main(["tiny", "sd15", str(tmp_path / "tiny")]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "tiny")
    assert pipe.tokenizer("a red circle").input_ids[1:3] != [pipe.tokenizer.unk_token_id] * 2
    image = pipe("a red circle", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)
