"""The VRAM estimator: shipped configs offline, the traced step, the breakdown and the advice."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kit.cli import main
from kit.config import Config
from kit.families import get_family
from kit.families.shipped import ARCHITECTURES, SHIPPED, config_source
from kit.preflight import estimate as estimating
from kit.preflight import trace as tracing
from kit.preflight.advice import advise
from kit.preflight.estimate import GIB, GPUS, estimate
from kit.preflight.measure import real_step
from kit.preflight.trace import Shape


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, and a fresh on-disk trace cache per test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KIT_VRAM_CACHE", str(tmp_path / "vram"))
    estimating.forget_traces()


def _cfg(pretrained: str, family: str, resolution: int = 512, **train) -> Config:
    cfg = Config()
    cfg.model.model_family = family
    cfg.model.pretrained_model = pretrained
    cfg.data.resolution = resolution
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.mark.parametrize("folder", list(ARCHITECTURES))
def test_shipped_configs_build_the_real_architecture_offline(folder):
    """Each shipped architecture builds offline to its published denoiser size."""
    arch = ARCHITECTURES[folder]
    source = config_source(arch.hub_id)
    assert source.endswith(SHIPPED[arch.hub_id]) and SHIPPED[arch.hub_id] == folder
    parts = get_family(arch.family).empty_parts(source)
    billions = sum(p.numel() for p in parts["denoiser"].parameters()) / 1e9
    low, high = arch.denoiser_billions
    assert low <= billions <= high, (folder, billions)
    assert all(p.device.type == "meta" for m in parts.values() for p in m.parameters())


@pytest.mark.slow
def test_shipped_config_estimate_adds_up_and_prints_json(tmp_path, capsys):
    path = tmp_path / "sd15.json"
    path.write_text(
        json.dumps(
            {"model_family": "sd15", "pretrained_model": "stable-diffusion-v1-5/stable-diffusion-v1-5",
             "resolution": 512, "mixed_precision": "bf16"}
        )
    )  # fmt: skip
    assert main(["estimate", str(path), "--json", "--gpu", "T4 16GB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_bytes"] == sum(out["components"].values())
    assert out["fits_gpu"] is True and out["fits"]["T4 16GB"] is True
    c = out["components"]
    # SD1.5's UNet in bf16 is 0.86 B parameters × 2 bytes.
    assert abs(c["denoiser_weights"] / 1.7191e9 - 1) < 0.01
    assert c["activations"] > 0
    # The text encoder fills the cache (the setup phase), then leaves: the grids draw from
    # the prompts' cached embeddings.
    assert c["text_encoder_weights"] == 0 < out["details"]["setup"]["text_encoder_weights"]
    loads = out["details"]["host_loads"]
    assert out["host_ram"]["loaded_weights"] == max(loads.values()) > 0
    assert sum(out["details"]["activations_by_group"].values()) == c["activations"]


@pytest.mark.slow
def test_the_trace_follows_checkpointing_precision_batch_and_is_cached(tiny_sd15, monkeypatch):
    cfg = _cfg(str(tiny_sd15), "sd15", 256)
    base = estimate(cfg)
    assert base.total_bytes == sum(base.components.values())
    assert estimate(cfg, gradient_checkpointing=True).components["activations"] < (
        base.components["activations"] / 2
    )
    assert (
        estimate(cfg, mixed_precision="bf16").components["activations"]
        < (base.components["activations"])
    )
    four = estimate(cfg, batch_size=4).components["activations"]
    assert 3.5 < four / base.components["activations"] < 4.5
    # Optimizer, accumulation and EMA are arithmetic on the same trace.
    small = estimate(cfg, optimizer="adafactor")
    assert small.components["optimizer_state"] < base.components["optimizer_state"] / 4
    assert estimate(cfg, gradient_accumulation_steps=2).components["gradients"] > 0
    # A repeat never traces again, not even in a new process (the disk cache).
    estimating.forget_traces()
    monkeypatch.setattr(estimating, "trace", lambda *a: pytest.fail("traced again"))
    assert estimate(cfg).total_bytes == base.total_bytes


def test_attention_is_stored_as_flash_kernels_store_it():
    q = torch.empty(1, 8, 16384, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    counter = tracing.LiveBytes()
    with counter, tracing.Autocast(torch.bfloat16, {}):
        out = F.scaled_dot_product_attention(q, q, q)
        out.float().sum().backward()
    matrix = 8 * 16384 * 16384 * 2
    assert counter.peak < matrix / 20


def test_autocast_follows_the_cuda_op_lists():
    x = torch.empty(2, 32, 8, 8, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, 32, device="meta")
    with tracing.Autocast(torch.bfloat16, {}):
        assert F.linear(torch.empty(2, 32, device="meta"), w).dtype == torch.bfloat16
        assert F.group_norm(x, 8).dtype == torch.float32
        assert F.softmax(x, -1).dtype == torch.float32
        assert F.interpolate(x, scale_factor=2.0, mode="nearest").dtype == torch.float32
        assert F.silu(x).dtype == torch.bfloat16


def test_optimizer_state_by_kind():
    shapes = [(320, 16), (16, 320), (320,)]
    n = sum(a * (b if len(s) > 1 else 1) for s in shapes for a, b in [(s[0], s[-1])])
    got = tracing.optimizer_bytes(shapes)
    assert got["adamw"]["state"] == 8 * n
    assert got["prodigy"]["state"] == 16 * n
    assert got["adamw8bit"]["state"] < got["adamw"]["state"] / 3
    assert got["adafactor"]["state"] < got["adamw"]["state"] / 4


def test_config_source_prefers_a_local_folder(tmp_path, monkeypatch):
    assert config_source("someone/some-model") == "someone/some-model"
    assert config_source("sdxl").endswith("sdxl/configs/sdxl")
    (tmp_path / "sdxl").mkdir()
    monkeypatch.chdir(tmp_path)
    assert config_source("sdxl") == "sdxl"


@pytest.mark.slow
def test_advice_fits_the_budget_on_a_tiny_model(tiny_sd15):
    cfg = _cfg(str(tiny_sd15), "sd15", 512, train_batch_size=4)
    est = estimate(cfg)
    budget = (est.total_bytes - est.components["activations"] / 2) / GIB
    rows = advise(cfg, budget, top=2)
    assert rows and all(r["estimate"].fits(budget) for r in rows)
    assert rows[0]["slowdown"] <= rows[-1]["slowdown"]
    assert rows[0]["changes"] != "(as configured)"


@pytest.mark.slow
def test_advice_for_sdxl_1024_on_a_12gb_card_fits_by_the_estimate():
    cfg = _cfg("stabilityai/stable-diffusion-xl-base-1.0", "sdxl", 1024, mixed_precision="bf16")
    card = "RTX 3060 12GB"
    assert not estimate(cfg).fits(GPUS[card])
    rows = advise(cfg, GPUS[card], card=card)
    assert rows
    for r in rows:
        # Each row is config keys: applied to the config, the estimate is the row's.
        again = estimate(cfg.replace(**r["set"]))
        assert again.fits(GPUS[card]) and again.total_bytes == r["estimate"].total_bytes


def test_shape_is_the_trace_key():
    a = Shape(512, 512, 1, False, "bf16", False)
    assert a == Shape(512, 512, 1, False, "bf16", False)
    assert a != Shape(512, 512, 2, False, "bf16", False)


def _attention_block(device: str, estimate_kernels: bool) -> tuple[int, tuple[int, ...], int]:
    """A projection, attention and output projection as diffusers runs them; the bytes kept."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 32, device=device, requires_grad=True)
    proj = torch.nn.Linear(32, 32, device=device)
    counter = tracing.LiveBytes()
    mode = tracing.Autocast(None, {}) if estimate_kernels else contextlib.nullcontext()
    with counter, mode:
        q = proj(x).view(2, 64, 4, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q)
        y = proj(out.transpose(1, 2).reshape(2, 64, 32))
        before_backward = counter.live
        y.sum().backward()
    return before_backward, out.stride(), counter.live


def test_attention_keeps_what_the_cpu_flash_kernel_keeps():
    """Same layout and same saved bytes as the real kernel: the reshape after it is no copy."""
    kept, stride, after = _attention_block("meta", estimate_kernels=True)
    assert (kept, stride, after) == _attention_block("cpu", estimate_kernels=False)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True])
def test_traced_step_matches_a_real_cpu_step_tensor_for_tensor(tiny_sd15, ckpt):
    """The trace's live tensors equal those of a real fp32 CPU step counted the same way."""
    cfg = _cfg(str(tiny_sd15), "sd15", 128, train_batch_size=2, gradient_checkpointing=ckpt)
    est = estimate(cfg)
    c = est.components
    # The real count starts once the model is loaded: weights and inputs are not in it.
    weights = sum(v for k, v in c.items() if k.endswith("_weights"))
    traced = est.allocated_bytes - weights - c["batch"]
    counter = tracing.LiveBytes()
    with contextlib.ExitStack() as stack:
        real_step(cfg, "cpu", steps=2, on_ready=lambda: stack.enter_context(counter))
    assert abs(traced / counter.peak - 1) < 0.01, (traced, counter.peak)


REMOVED_HUB_IDS = ("runwayml/stable-diffusion-v1-5",)
"""Repositories that were taken down: the kit may read old configs naming them, never suggest them."""


def test_every_hub_id_the_kit_names_is_shipped_and_none_is_removed():
    from kit.config import Config
    from kit.families import family_names, get_family

    named = {get_family(f).hub_id for f in family_names()} | {Config().model.pretrained_model}
    assert named <= set(SHIPPED), named - set(SHIPPED)
    root = Path(__file__).resolve().parent.parent
    texts = [*root.glob("kit/**/*.py"), *root.glob("notebooks/*.ipynb"), root / "README.md"]
    # The family pages are left out: generated from the shipped configs, they list every name
    # that selects one, the old alias too.
    texts += [p for p in root.glob("docs/**/*.md") if p.parent.name != "families"]
    texts += [*root.glob("datasets_example/*.json"), *root.glob("benchmarks/*.py")]
    for path in texts:
        if path.name == "shipped.py":
            continue  # the alias that maps an old config to its architecture
        for old in REMOVED_HUB_IDS:
            assert old not in path.read_text(), f"{path} names the removed {old}"
