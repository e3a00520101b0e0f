"""Precision and processes where the reference trainers are right (issue 16, items 1, 2, 4, 11,
12): a VAE that overflows fp16 still caches finite latents, textual inversion trains under fp16,
its gradients are averaged across processes and measured on the new rows only, and DDP is told
when a method may leave parameters without a gradient."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.errors import DataError, KitError
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.train.accel import make_accelerator
from kit.train.loop import train
from kit.train.step import guard_finite
from tests.conftest import TEXTUAL_INVERSION, write_run_config


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "logs/metrics.jsonl").read_text().splitlines()]


def _placeholder_captions(dataset):
    """Captions that call the concept by the placeholder, as textual inversion needs."""
    for p in dataset.glob("*.txt"):
        p.write_text(p.read_text().replace("zorbic", "<zorb>"))


# ------------------------------------------------------------ 1: the VAE encodes in fp32


@pytest.fixture()
def overflowing_sdxl(tmp_path, tiny_base):
    """The tiny SDXL with a VAE whose encoder activations leave fp16's range though its weights
    fit it (as SDXL's VAE does on real images), saved with `force_upcast: true`."""
    from diffusers import AutoencoderKL

    base = tmp_path / "overflow-sdxl"
    shutil.copytree(tiny_base("sdxl"), base)
    vae = AutoencoderKL.from_pretrained(base / "vae")
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(1e3)
        vae.encoder.conv_in.bias.mul_(1e3)
        for block in vae.encoder.down_blocks:
            for down in block.downsamplers or []:
                down.conv.weight.mul_(1e3)
    assert max(p.abs().max() for p in vae.parameters()) < torch.finfo(torch.float16).max
    vae.register_to_config(force_upcast=True)
    vae.save_pretrained(base / "vae")
    # The premise: in fp16 this VAE's latents are not finite, in fp32 they are.
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        assert torch.isfinite(vae.encode(pixels).latent_dist.mean).all()
        assert not torch.isfinite(vae.half().encode(pixels.half()).latent_dist.mean).all()
    return base


def test_fp16_run_caches_finite_latents_from_an_overflowing_vae(
    tmp_path, overflowing_sdxl, family_dataset, cpu_fp16
):
    cfg = write_run_config(
        tmp_path / "c.json",
        base=overflowing_sdxl,
        data=family_dataset("sdxl"),
        family="sdxl",
        mixed_precision="fp16",
        max_train_steps=2,
        checkpointing_steps=0,
        validation_steps=2,
    )
    result = train(load_config(cfg))  # stopped at step 1 by a NaN loss before the fix
    assert result.step == 2
    latents = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert latents and all(torch.isfinite(load_file(f)["latents"]).all() for f in latents)
    assert all(math.isfinite(r["loss"]) for r in _rows(tmp_path / "run"))
    # Validation decodes with the half VAE, which the pipeline upcasts (`force_upcast`).
    assert result.validation_grids and result.validation_grids[0].is_file()


def test_non_finite_latents_are_refused_naming_the_image(make_config, monkeypatch):
    from kit.families.sd15.family import SD15

    real = SD15.encode_images

    def broken(self, comps, pixels, **kw):
        return real(self, comps, pixels, **kw) * float("nan")

    monkeypatch.setattr(SD15, "encode_images", broken)
    with pytest.raises(DataError, match=r"zorbic_\d+\.png.*non-finite latents"):
        train(load_config(make_config()))


def test_nan_message_advises_bf16_only_where_the_gpu_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for has_bf16, advice in ((False, "fp32 (mixed_precision no)"), (True, "bf16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda v=has_bf16, **_: v)
        with pytest.raises(KitError) as e:
            guard_finite(float("nan"), None, 3, "fp16", 512.0, None)
        assert f"{advice} instead of fp16" in str(e.value)
        if not has_bf16:
            assert "bf16" not in str(e.value)


# ------------------------------------------------------------ 2: textual inversion under fp16


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_textual_inversion_trains_under_fp16(tmp_path, tiny_base, dataset, family, cpu_fp16):
    _placeholder_captions(dataset)
    cfg = write_run_config(
        tmp_path / "c.json",
        base=tiny_base(family),
        data=dataset,
        family=family,
        **{**TEXTUAL_INVERSION, "validation_prompt": ["a red <zorb>"]},
        mixed_precision="fp16",
        max_train_steps=2,
        checkpointing_steps=0,
    )
    result = train(load_config(cfg))  # "mixed dtype (CPU)" at step 1 before the fix
    assert result.step == 2
    rows = _rows(tmp_path / "run")
    assert all(math.isfinite(r["loss"]) for r in rows)
    saved = load_file(str(ckpt.checkpoint_dir(tmp_path / "run", 2) / ckpt.ADAPTER_FILE))
    assert saved and all(
        v.dtype == torch.float32 and torch.isfinite(v).all() for v in saved.values()
    )


# ------------------------------------------------------------ 12: clipping sees the new rows


def test_textual_inversion_grad_norm_is_the_new_rows_norm(make_config, dataset, monkeypatch):
    from kit.methods.textual_inversion import TextualInversion

    _placeholder_captions(dataset)
    real, grads = TextualInversion.attach, []

    def attach(self, comps):
        summary = real(self, comps)
        for ids, enc in zip(self.ids, comps.text_encoders, strict=True):
            weight = enc.get_input_embeddings().weight
            # The gradient as backward left it, before any upkeep of the method.
            weight.register_post_accumulate_grad_hook(
                lambda p, ids=ids: grads.append(p.grad[ids].detach().clone())
            )
        return summary

    monkeypatch.setattr(TextualInversion, "attach", attach)
    cfg = make_config(
        **{**TEXTUAL_INVERSION, "validation_prompt": ["a red <zorb>"]},
        max_train_steps=1,
        checkpointing_steps=0,
        validation_steps=0,
        max_grad_norm=1e9,
    )
    train(load_config(cfg))
    (row,) = _rows(cfg.parent / "run")
    assert len(grads) == 1 and grads[0].abs().sum() > 0
    assert row["grad_norm"] == pytest.approx(float(grads[0].norm()), rel=1e-5)


# ------------------------------------------------------------ 11: DDP told of unused parameters


def test_module_dropout_tells_ddp_to_find_unused_parameters(tmp_path, make_config):
    from kit.families import get_family
    from kit.methods import get_method

    def method(**fields):
        cfg = load_config(make_config(**fields))
        return get_method(cfg, get_family(cfg.model.model_family, cfg))

    assert method(network_type="loha", module_dropout=0.2).leaves_unused
    assert method(network_type="lokr", module_dropout=0.2).leaves_unused
    assert not method(network_type="loha").leaves_unused
    assert not method(network_type="lora", lora_dropout=0.2).leaves_unused

    cfg = load_config(make_config())
    told, _ = make_accelerator(cfg, RunDir(tmp_path / "a"), unused_parameters=True)
    assert told.ddp_handler is not None and told.ddp_handler.find_unused_parameters
    plain, _ = make_accelerator(cfg, RunDir(tmp_path / "b"))
    assert plain.ddp_handler is None


# ------------------------------------------------------------ 4: two processes


@pytest.mark.slow
def test_textual_inversion_on_two_processes_matches_one_with_accumulation(
    tmp_path, dataset, two_processes_and_one
):
    _placeholder_captions(dataset)
    two_processes_and_one(
        **TEXTUAL_INVERSION,
        validation_prompt=["a red <zorb>"],
        max_train_steps=2,
        checkpointing_steps=0,
        validation_steps=0,
    )

    finals = [
        json.loads((tmp_path / f"ddp/logs/process-{rank}.jsonl").read_text().splitlines()[-1])
        for rank in (0, 1)
    ]
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], "ranks differ"
    a = load_file(str(ckpt.checkpoint_dir(tmp_path / "ddp", 2) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "one", 2) / ckpt.ADAPTER_FILE))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_loha_module_dropout_on_two_processes_matches_one_with_accumulation(
    tmp_path, two_processes_and_one
):
    # Without find_unused_parameters DDP stops at step 2, on the modules step 1 dropped.
    two_processes_and_one(
        network_type="loha",
        module_dropout=0.5,
        max_train_steps=3,
        checkpointing_steps=0,
        validation_steps=0,
    )
    a = load_file(str(ckpt.checkpoint_dir(tmp_path / "ddp", 3) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "one", 3) / ckpt.ADAPTER_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_nan_message_on_a_cpu_advises_bf16_only_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for has_bf16, advice in ((False, "fp32 (mixed_precision no)"), (True, "bf16")):
        monkeypatch.setattr("kit.train.step.cpu_bf16", lambda v=has_bf16: v)
        with pytest.raises(KitError) as e:
            guard_finite(float("nan"), None, 3, "fp16", 512.0, None)
        assert f"{advice} instead of fp16" in str(e.value)
