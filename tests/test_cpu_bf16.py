"""bf16 on a CPU with bf16 instructions: autocast in bf16, an exact resume, and exports checked
against an fp32 redraw of the checkpoint (a bf16 image differs from the fp32 one by more than
the check's tolerance)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.export.writer import export
from kit.run import checkpoint as ckpt
from kit.train import train
from kit.train.accel import resolve_precision
from kit.train.loop import fit
from kit.train.prepare import prepare

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
        assert any("training drew its images in bf16" in n for n in v.notes), v.notes
        # Its references are the fp32 redraw, not the bf16 images training drew.
        assert all("-scales/" in f for f in v.files), v.files
