"""Merging a run into its base: the checkpoint holds base + adapter, loads in plain diffusers,
and what cannot be merged is refused with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kit.config import from_dict, load_config
from kit.errors import KitError
from kit.export.merge import merge, merge_adapters
from kit.families import get_family
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from tests.conftest import TEXTUAL_INVERSION, short_clips, write_run_config

RANK, ALPHA = 4, 2.0


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_sd15, family_dataset) -> RunDir:
    """Two strong steps of LoRA with alpha ≠ rank (so a lost alpha shows)."""
    from kit.train.loop import train

    tmp = tmp_path_factory.mktemp("merge")
    path = write_run_config(
        tmp / "config.json",
        base=tiny_sd15,
        data=family_dataset("sd15"),
        trigger_words=["zorbstar"],
        lora_rank=RANK,
        lora_alpha=ALPHA,
        learning_rate=2e-2,
        train_batch_size=1,
        max_train_steps=2,
        checkpointing_steps=2,
    )
    train(load_config(path))
    return RunDir(tmp / "run")


def expected_unet(base: Path, adapter: dict[str, torch.Tensor], scale: float) -> dict:
    """The base UNet's weights with each LoRA update added: W + scale · alpha/r · B A."""
    from diffusers import UNet2DConditionModel

    state = UNet2DConditionModel.from_pretrained(str(base), subfolder="unet").state_dict()
    for key in adapter:
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            down, up = adapter[key], adapter[f"{module}.lora_B.weight"]
            state[f"{module}.weight"] = state[f"{module}.weight"] + scale * ALPHA / RANK * (
                up @ down
            )
    return state


def _single_file(path: Path, base: Path):
    """The file as a diffusers user reads it: plain `from_single_file`, no kit."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_single_file(
        str(path), config=str(base), safety_checker=None, requires_safety_checker=False
    )


def _latest_adapter(run: RunDir) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.resolve_resume(run.root, "latest") / ckpt.ADAPTER_FILE))


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_single_file_holds_base_plus_adapter(tmp_path, lora_run, tiny_sd15, scale):
    result = merge(lora_run.root, out=tmp_path / "m.safetensors", scale=scale, dtype="fp32")
    assert result.path == tmp_path / "m.safetensors" and result.step == 2
    assert result.format == "single_file" and result.max_abs_diff == 0.0
    adapter = _latest_adapter(lora_run)
    assert len(result.modules) == len(adapter) // 2
    pipe = _single_file(result.path, tiny_sd15)
    want = expected_unet(tiny_sd15, adapter, scale)
    got = pipe.unet.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)
    # The update is real: the adapted weights moved, and nothing else did.
    base = _base_pipeline(tiny_sd15)
    changed = {k for k in got if not torch.equal(got[k], base.unet.state_dict()[k])}
    assert changed == {f"{k[: -len('.lora_A.weight')]}.weight" for k in adapter if "lora_A" in k}
    for part in ("vae", "text_encoder"):
        ours, theirs = getattr(pipe, part).state_dict(), getattr(base, part).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), part


def _base_pipeline(base: Path):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(
        str(base), safety_checker=None, requires_safety_checker=False
    )


def test_fp16_checkpoint_in_a_folder_with_public_metadata(tmp_path, lora_run, tiny_sd15):
    result = merge(lora_run.root, out=tmp_path)
    assert result.path.parent == tmp_path and result.path.suffix == ".safetensors"
    assert result.max_abs_diff == 0.0 and 0 < result.rounding < 1e-2
    with safe_open(str(result.path), "pt") as f:
        meta = f.metadata()
        assert f.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16
    assert meta["modelspec.architecture"] == "stable-diffusion-v1"
    assert meta["kit.base_model"] == tiny_sd15.name and meta["kit.steps"] == "2"
    assert meta["modelspec.trigger_phrase"] == "zorbstar"
    assert not any(str(tmp_path) in v or str(tiny_sd15) in v for v in meta.values())


def test_diffusers_folder_holds_the_same_merge(tmp_path, lora_run, tiny_sd15):
    from diffusers import StableDiffusionPipeline

    result = merge(lora_run.root, out=tmp_path / "pipe", fmt="diffusers", dtype="fp32")
    assert result.format == "diffusers" and result.max_abs_diff == 0.0
    record = json.loads((result.path / "kit_merge.json").read_text())
    assert record["kit.base_model"] == tiny_sd15.name and record["kit.network_type"] == "lora"
    pipe = StableDiffusionPipeline.from_pretrained(str(result.path), safety_checker=None)
    want = expected_unet(tiny_sd15, _latest_adapter(lora_run), 1.0)
    got = pipe.unet.state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_another_copy_of_the_architecture_is_a_valid_base(tmp_path, lora_run):
    other = get_family("sd15").make_tiny(tmp_path / "other", seed=1)
    result = merge(lora_run.root, out=tmp_path / "m.safetensors", dtype="fp32", base=other)
    got = _single_file(result.path, other).unet.state_dict()
    want = expected_unet(other, _latest_adapter(lora_run), 1.0)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_a_base_of_another_architecture_is_refused(tmp_path, lora_run, tiny_sd15, tiny_base):
    sdxl = tiny_base("sdxl")
    with pytest.raises(KitError, match="not the architecture") as err:
        merge(lora_run.root, out=tmp_path / "m.safetensors", base=sdxl)
    assert str(sdxl) in str(err.value) and str(tiny_sd15) in str(err.value)
    assert not (tmp_path / "m.safetensors").exists()


def test_a_checkpoint_that_does_not_read_back_is_refused_and_removed(
    tmp_path, lora_run, monkeypatch
):
    from kit.families.sd15.family import SD15

    real = SD15.single_file_state_dict

    def swapped(self, comps):  # a converter that puts two weights in each other's place
        state = real(self, comps)
        a, b = "model.diffusion_model.out.0.weight", "model.diffusion_model.out.0.bias"
        state[a], state[b] = state[b], state[a]
        return state

    monkeypatch.setattr(SD15, "single_file_state_dict", swapped)
    with pytest.raises(KitError, match="does not hold the merged model"):
        merge(lora_run.root, out=tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_unknown_format_and_dtype_are_refused(tmp_path, lora_run):
    with pytest.raises(KitError, match="unknown merge format 'ckpt'"):
        merge(lora_run.root, out=tmp_path, fmt="ckpt")
    with pytest.raises(KitError, match="unknown merge dtype 'fp8'"):
        merge(lora_run.root, out=tmp_path, dtype="fp8")


# ------------------------------------------------------------------ every adapter kind


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_merging_an_adapter_keeps_what_the_model_computes(tiny_sd15, kind):
    """Merged into the weights, every peft adapter kind gives the adapted model's output, and
    the model is left the plain base architecture."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg = from_dict({"network_type": kind, "lora_rank": RANK, "lora_alpha": ALPHA})
    family = get_family("sd15", cfg)
    comps = family.load(str(tiny_sd15))
    plain = set(comps.denoiser.state_dict())
    get_method(cfg, family).attach(comps)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in comps.denoiser.parameters():
            if p.requires_grad:  # the adapter's factors: away from their neutral start
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))
    x = torch.randn(1, 4, 8, 8, generator=gen)
    text = torch.randn(1, 7, 32, generator=gen)
    t = torch.tensor([500])
    with torch.no_grad():
        before = comps.denoiser(x, t, encoder_hidden_states=text).sample
        merged = merge_adapters(comps)
        after = comps.denoiser(x, t, encoder_hidden_states=text).sample
    assert merged and all(m.startswith("denoiser.") for m in merged)
    assert not any(isinstance(m, BaseTunerLayer) for m in comps.denoiser.modules())
    assert set(comps.denoiser.state_dict()) == plain
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_text_encoder_adapters_merge_too(tiny_sd15):
    cfg = from_dict({"network_type": "lora", "lora_rank": RANK, "train_text_encoder": True})
    family = get_family("sd15", cfg)
    comps = family.load(str(tiny_sd15))
    get_method(cfg, family).attach(comps)
    encoder = comps.text_encoders[0]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in encoder.parameters():
            if p.requires_grad:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))
    ids = comps.tokenizers[0](["a red star"], return_tensors="pt").input_ids
    with torch.no_grad():
        before = encoder(ids)[0]
        merged = merge_adapters(comps, text_names=family.text_subfolders)
        after = encoder(ids)[0]
    assert any(m.startswith("text_encoder.encoder.layers.0.self_attn.") for m in merged)
    assert not hasattr(encoder, "peft_config")
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ full fine-tuning


@pytest.mark.slow
def test_full_fine_tune_merges_as_trained(tmp_path, tiny_sd15, family_dataset):
    from kit.train.loop import train

    path = write_run_config(
        tmp_path / "config.json",
        base=tiny_sd15,
        data=family_dataset("sd15"),
        network_type="full",
        learning_rate=1e-3,
        train_batch_size=1,
        max_train_steps=1,
        checkpointing_steps=1,
    )
    train(load_config(path))
    run = tmp_path / "run"
    result = merge(run, out=tmp_path / "m.safetensors", dtype="fp32")
    assert result.modules == ["denoiser"] and result.max_abs_diff == 0.0
    trained = load_file(str(ckpt.resolve_resume(run, "latest") / ckpt.ADAPTER_FILE))
    got = _single_file(result.path, tiny_sd15).unet.state_dict()
    for key, value in got.items():
        assert torch.equal(value, trained[f"denoiser.{key}"]), key
    with pytest.raises(KitError, match="scale 0.5 applies to adapters"):
        merge(run, out=tmp_path / "n.safetensors", scale=0.5)


# ------------------------------------------------------------------ what cannot be merged


def _bare_run(tmp_path: Path, base: Path, family: str, data: Path, **fields) -> Path:
    """A run folder with its config and one (empty) complete checkpoint: what merge reads
    before it refuses."""
    run = tmp_path / "run"
    run.mkdir()
    write_run_config(
        run / "config.json", base=base, data=data, family=family, output_dir=str(run), **fields
    )
    folder = RunDir(run).checkpoint(1)
    folder.mkdir(parents=True)
    (folder / ckpt.PROGRESS_FILE).write_text(json.dumps({"step": 1}))
    (folder / ckpt.MARKER).write_text("1")
    return run


def test_textual_inversion_is_refused_with_the_way_out(tmp_path, tiny_sd15, family_dataset):
    run = _bare_run(tmp_path, tiny_sd15, "sd15", family_dataset("sd15"), **TEXTUAL_INVERSION)
    with pytest.raises(KitError, match="cannot carry a token.*--format embedding"):
        merge(run, out=tmp_path / "m.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_transformer_families_merge_into_their_original_layout(
    family, tmp_path, tiny_base, family_dataset
):
    """SD3 and Wan files hold the transformer alone, in the original layout ComfyUI loads as a
    diffusion model; diffusers' `from_single_file` reads it back weight for weight."""
    from kit.train.loop import train

    path = write_run_config(
        tmp_path / "c.json",
        base=tiny_base(family),
        data=family_dataset(family),
        family=family,
        lora_alpha=2,
        learning_rate=2e-2,
        max_train_steps=2,
        checkpointing_steps=2,
        validation_steps=0,
        **short_clips(family),
    )
    train(load_config(path))
    result = merge(tmp_path / "run", out=tmp_path / "m.safetensors", dtype="fp32")
    assert result.max_abs_diff == 0 and result.modules
    keys = load_file(str(result.path))
    original = (
        "joint_blocks.0.x_block.attn.qkv.weight"
        if family == "sd3"
        else "blocks.0.self_attn.q.weight"
    )
    assert original in keys and not any(k.startswith("transformer_blocks.") for k in keys)
