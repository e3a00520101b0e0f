"""bf16 on a CPU with bf16 instructions: autocast in bf16, an exact resume, and exports checked
against an fp32 redraw of the checkpoint (a bf16 image differs from the fp32 one by more than
the check's tolerance)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.errors import KitError
from kit.export.writer import export
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.train import train
from kit.train.accel import make_accelerator, resolve_precision
from kit.train.loop import fit
from kit.train.prepare import prepare
from tests.conftest import write_run_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's precision rules")


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU that has bf16 instructions, whatever this one has (torch runs bf16 on any CPU;
    without the instructions only more slowly)."""
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: True)


def test_bf16_is_kept_only_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: True)
    assert resolve_precision("bf16") == "bf16"
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: False)
    with pytest.warns(UserWarning, match=r"AVX512-BF16, AMX\); none found, training in fp32"):
        assert resolve_precision("bf16") == "no"


@pytest.mark.slow
def test_a_bf16_run_on_the_cpu_trains_resumes_and_exports(tmp_path, make_config, bf16_cpu):
    cfg = load_config(make_config("a.json", mixed_precision="bf16", output_dir=str(tmp_path / "a")))
    s = prepare(cfg)
    unet = s.comps.denoiser
    assert s.weight_dtype == torch.bfloat16 and unet.conv_in.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in s.params)  # what trains stays fp32
    seen = []
    unet.conv_in.register_forward_hook(lambda _, args, out: seen.append(out.dtype))
    assert fit(s).step == 4
    assert seen and set(seen) == {torch.bfloat16}  # autocast: the UNet computes in bf16
    split = load_config(
        make_config("b.json", mixed_precision="bf16", output_dir=str(tmp_path / "b"))
    )
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    wa = load_file(str(ckpt.checkpoint_dir(tmp_path / "a", 4) / ckpt.ADAPTER_FILE))
    wb = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 4) / ckpt.ADAPTER_FILE))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    for fmt in ("diffusers", "kohya"):
        result = export(tmp_path / "a", fmt)
        v = result.verification
        assert v.passed and v.max_abs_diff <= 2, (fmt, v)
        assert any("training ran in bf16" in n for n in v.notes), v.notes
        # Its references are the fp32 redraw, not the bf16 images training drew.
        assert all("-scales/" in f for f in v.files), v.files


@pytest.mark.slow
def test_a_bf16_config_that_trained_in_fp32_is_checked_against_its_own_images(
    tmp_path, make_config, monkeypatch
):
    """Where the CPU lacks bf16 the run trains, and draws, in fp32: the check compares with the
    images training drew, and says nothing of bf16."""
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: False)
    cfg = load_config(make_config(mixed_precision="bf16", max_train_steps=2))
    with pytest.warns(UserWarning, match="training in fp32"):
        train(cfg)
    v = export(cfg.train.output_dir, "diffusers").verification
    assert v.passed and v.notes == [], v
    assert v.files and not any("-scales/" in f for f in v.files), v.files


@pytest.mark.parametrize("launch", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_bf16_on_cpus_under_fsdp_or_deepspeed_is_refused(
    tmp_path, make_config, bf16_cpu, monkeypatch, launch
):
    monkeypatch.setenv(launch, "true")
    cfg = load_config(make_config(mixed_precision="bf16"))
    with pytest.raises(KitError, match="mixed_precision: bf16 on CPUs under (FSDP|DeepSpeed)"):
        make_accelerator(cfg, RunDir(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux", "wan"])
def test_every_family_trains_in_bf16_and_its_export_is_checked(
    tmp_path, tiny_base, family_dataset, bf16_cpu, family
):
    """The path a GPU user's bf16 run takes, on each family: training in bf16, its diffusers
    export checked against the fp32 redraw."""
    path = write_run_config(
        tmp_path / "config.json",
        base=tiny_base(family),
        data=family_dataset(family),
        family=family,
        mixed_precision="bf16",
        max_train_steps=2,
    )
    cfg = load_config(path)
    assert train(cfg).step == 2
    v = export(cfg.train.output_dir, "diffusers").verification
    assert v.passed and v.max_abs_diff <= 2, v
    assert any("training ran in bf16" in n for n in v.notes), v.notes
