"""fp16 with a gradient scaler, run on the CPU (KIT_ALLOW_CPU_FP16=1): the scaler built from the
config, the scale logged and checkpointed, overflow steps skipped, and a NaN loss stopped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.train.accel import CPU_FP16_ENV, make_accelerator, resolve_precision
from kit.train.loop import train


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "logs/metrics.jsonl").read_text().splitlines()]


def _adapter(run_dir, step):
    return load_file(str(ckpt.checkpoint_dir(run_dir, step) / ckpt.ADAPTER_FILE))


def test_cpu_fp16_needs_the_switch(monkeypatch):
    """Without the switch a CPU falls back to fp32 with a warning; with it, fp16 is kept."""
    if torch.cuda.is_available():
        pytest.skip("CPU fallback only")
    monkeypatch.delenv(CPU_FP16_ENV, raising=False)
    with pytest.warns(UserWarning, match="needs a CUDA GPU"):
        assert resolve_precision("fp16") == "no"
    monkeypatch.setenv(CPU_FP16_ENV, "1")
    assert resolve_precision("fp16") == "fp16"
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: False)
    with pytest.warns(UserWarning, match="needs a CUDA GPU or a CPU with bf16"):
        assert resolve_precision("bf16") == "no"  # the switch is for fp16 only


def test_scaler_is_built_from_the_config(tmp_path, make_config, cpu_fp16):
    cfg = load_config(
        make_config(
            mixed_precision="fp16",
            grad_scaler_init_scale=512.0,
            grad_scaler_growth_factor=3.0,
            grad_scaler_backoff_factor=0.25,
            grad_scaler_growth_interval=7,
        )
    )
    accelerator, precision = make_accelerator(cfg, RunDir(tmp_path / "run"))
    scaler = accelerator.scaler
    assert precision == "fp16" and scaler is not None and scaler.is_enabled()
    assert scaler.get_scale() == 512.0
    assert scaler.get_growth_factor() == 3.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7
    with accelerator.autocast():
        y = torch.nn.Linear(4, 4)(torch.ones(1, 4))
    assert y.dtype == torch.float16  # autocast is on too, not only the scaler

    # A later fp32 run in the same process gets an fp32 accelerator, without a scaler.
    fp32, _ = make_accelerator(load_config(make_config("b.json")), RunDir(tmp_path / "b"))
    assert fp32.mixed_precision == "no" and fp32.scaler is None


@pytest.mark.slow
def test_fp16_trains_logs_the_scale_and_resumes_exactly(tmp_path, make_config, cpu_fp16):
    """The scale grows every good step here; a resume restores it and matches a straight run."""
    from kit.families.sd15.family import SD15

    common = {
        "mixed_precision": "fp16",
        "max_train_steps": 4,
        "checkpointing_steps": 2,
        "grad_scaler_init_scale": 256.0,
        "grad_scaler_growth_factor": 2.0,
        "grad_scaler_growth_interval": 1,
    }
    seen: list[torch.dtype] = []
    real = SD15.predict

    def spy(self, comps, noisy, timesteps, cond):
        out = real(self, comps, noisy, timesteps, cond)
        seen.append(comps.denoiser.conv_in.weight.dtype)
        return out

    a = tmp_path / "a"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(SD15, "predict", spy)
        train(load_config(make_config("a.json", output_dir=str(a), **common)))
    assert seen and set(seen) == {torch.float16}  # the frozen base really is half precision
    rows = _rows(a)
    assert [r["loss_scale"] for r in rows] == [512.0, 1024.0, 2048.0, 4096.0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)

    b = tmp_path / "b"
    cfg_b = make_config("b.json", output_dir=str(b), **common)
    train(load_config(cfg_b, {"max_train_steps": 2}))
    saved = ckpt.load_checkpoint(ckpt.checkpoint_dir(b, 2))
    assert saved["extras"]["scaler"]["scale"] == 1024.0
    assert saved["extras"]["scaler"]["growth_interval"] == 1
    train(load_config(cfg_b), resume="latest")
    assert [r["loss_scale"] for r in _rows(b)] == [512.0, 1024.0, 2048.0, 4096.0]
    assert [r["loss"] for r in _rows(b)] == [r["loss"] for r in rows]
    wa, wb = _adapter(a, 4), _adapter(b, 4)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
def test_overflowing_steps_are_skipped_and_the_scale_backs_off(tmp_path, make_config, cpu_fp16):
    """A huge initial scale overflows fp16 gradients: no update, scale × backoff, no stop."""
    big = 2.0**40
    cfg = load_config(
        make_config(
            mixed_precision="fp16",
            max_train_steps=3,
            checkpointing_steps=1,
            grad_scaler_init_scale=big,
            grad_scaler_backoff_factor=0.125,
        )
    )
    result = train(cfg)
    assert result.step == 3
    rows = _rows(tmp_path / "run")
    assert rows[0]["loss_scale"] == big * 0.125
    assert rows[1]["loss_scale"] == big * 0.125**2
    assert not torch.isfinite(torch.tensor(rows[0]["grad_norm"]))  # inf, reported not raised
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    # The skipped step left the adapter as initialised: LoRA's B matrices are still zero.
    first = _adapter(tmp_path / "run", 1)
    b_keys = [k for k in first if "lora_B" in k or "lora_up" in k]
    assert b_keys and all(torch.count_nonzero(first[k]) == 0 for k in b_keys)


def test_nan_loss_stops_with_step_scale_and_last_good_checkpoint(
    tmp_path, make_config, cpu_fp16, nan_at_call
):
    cfg = load_config(
        make_config(
            mixed_precision="fp16",
            max_train_steps=6,
            checkpointing_steps=2,
            grad_scaler_init_scale=1024.0,
            grad_scaler_backoff_factor=0.5,
        )
    )
    nan_at_call(3)
    # The NaN gradients also made the scaler skip the step and back off: 1024 → 512.
    with pytest.raises(
        KitError,
        match=r"loss became nan at step 3 \(mixed_precision=fp16, loss scale 512\).*step-000002",
    ):
        train(cfg)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-000002"]
    kept = ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path / "run", 2))
    assert kept["extras"]["scaler"]["scale"] == 1024.0
    assert all(torch.isfinite(v).all() for v in kept["adapter"].values())
