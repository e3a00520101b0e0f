"""benchmarks/bench_step.py's `sdxl` job (the kit against the SDXL LoRA script, for a GPU) on the
CPU: both sides train the tiny SDXL, each in a process of its own; the model FLOPs are counted,
and the MFU is left out where no card's peak is known. Never a timing assert."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being made
        spec.loader.exec_module(module)
    return sys.modules[name]


bs = _load("bench_step")


@pytest.mark.slow
def test_sdxl_job_runs_both_sides_on_the_tiny_model_on_the_cpu(tmp_path, tiny_base, monkeypatch):
    # One thread per child: the two cores are shared, and a step's threads then do not wait on
    # the kit's background batch reader.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = bs.compare_sdxl(
        tiny=True, device="cpu", steps=3, warmup=1, base=tiny_base("sdxl"), work=tmp_path
    )
    assert (r["resolution"], r["steps"], r["precision"]) == (bs.TINY_SDXL_PX, 3, "bf16")
    for side in ("kit", "script"):
        assert r[f"{side}_steps_per_s"] > 0
        assert r[f"{side}_seconds"] > 0 and r[f"{side}_peak_rss_mib"] > 0
        assert r[f"{side}_mfu"] is None  # no card: no peak to divide by
        assert r[f"{side}_train_peak_gib"] is None  # no CUDA memory to read
        assert math.isfinite(r[f"{side}_last_loss"])
    assert r["device_name"] == "cpu" and "MFU left out" in r["mfu_note"]
    assert r["flops_per_step"] > 0
    assert r["steps_per_s_ratio"] > 0
    # Each side did its own work: the kit trained from its cache, the script saved its LoRA
    # and drew its sample.
    config = json.loads((tmp_path / "kit-0" / "config.json").read_text())
    assert (config["model_family"], config["resolution"], config["lora_rank"]) == ("sdxl", 64, 4)
    assert config["lora_target_modules"] == bs.LORA_TARGETS
    assert (tmp_path / "kit-0" / "run" / "logs" / "metrics.jsonl").is_file()
    assert (tmp_path / "script-0" / "pytorch_lora_weights.safetensors").is_file()
    assert (tmp_path / "script-0" / "sample.png").is_file()
    table = bs.sdxl_table(r)
    assert "| steps/s (steady) |" in table and "| MFU | – | – | – |" in table


@pytest.mark.slow
def test_model_flops_grow_with_the_pixels_and_count_the_backward(tiny_base):
    base = tiny_base("sdxl")
    small = bs.unet_step_flops(base, bs.sdxl_spec(tiny=True))
    big = bs.unet_step_flops(base, {**bs.sdxl_spec(tiny=True), "resolution": 128})
    assert 0 < small < big
    # Real SDXL at 1024 px, on the meta device from the shipped configs: about 6.8 TFLOP forward,
    # a little over twice that with the LoRA backward.
    from kit.families.shipped import shipped_dir

    real = bs.unet_step_flops(shipped_dir("sdxl"), bs.sdxl_spec())
    assert 12e12 < real < 17e12


def test_peak_flops_by_card_name_and_mfu_left_out_for_an_unknown_card():
    assert bs.peak_bf16_flops("NVIDIA H200") == pytest.approx(989.5e12)
    assert bs.peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.5e12)
    assert bs.peak_bf16_flops("NVIDIA H100 PCIe") == pytest.approx(756.5e12)
    assert bs.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert bs.peak_bf16_flops("NVIDIA A10") == pytest.approx(125e12)
    assert bs.peak_bf16_flops("NVIDIA L40S") == pytest.approx(362.05e12)
    assert bs.peak_bf16_flops("NVIDIA L4") == pytest.approx(121e12)
    assert bs.peak_bf16_flops("NVIDIA GeForce RTX 4090") == pytest.approx(165.2e12)
    assert bs.peak_bf16_flops("cpu") is None
    assert bs.peak_bf16_flops("NVIDIA Imaginary X1") is None
    runs = {
        side: [
            {
                "times": [0.0, 0.5, 1.0, 1.5],  # 2 steps/s after the first
                "losses": [0.1],
                "seconds": 10.0,
                "peak_rss_mib": 100.0,
                "device_name": "NVIDIA H200",
                "setup_peak": 9 * 2**30,
                "train_peak": (10 if side == "kit" else 12) * 2**30,
                "peak": 12 * 2**30,
            }
        ]
        for side in ("kit", "script")
    }
    r = bs.sdxl_summary({**bs.sdxl_spec(), "warmup": 1}, 1, int(989.5e12), runs)
    assert r["kit_steps_per_s"] == pytest.approx(2.0)
    assert r["kit_mfu"] == pytest.approx(2.0)  # 989.5 TFLOP per step at 2 steps/s on 989.5
    assert r["train_peak_ratio"] == pytest.approx(10 / 12, abs=1e-3)
    table = bs.sdxl_table(r)
    assert "| MFU | 200.0% | 200.0% | – |" in table
    assert "| peak VRAM, training steps (GiB) | 10.00 | 12.00 | 0.83 |" in table
    assert "not met (1.00×, VRAM 0.83×)" in table
