"""The estimator on real cards: a quantized base, block swap and host RAM, and advice made of
config keys the trainer takes; Flux.1 dev LoRA at 512 px against 16 and 24 GB cards."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from kit.cli import main
from kit.config import Config, load_config, parse_override
from kit.errors import ConfigError, KitError
from kit.families import get_family
from kit.families import quantize as quant
from kit.families.shipped import config_source
from kit.methods import get_method
from kit.preflight.advice import advise, fit_table, markdown_table, options
from kit.preflight.estimate import GIB, GPUS, bucket_size, cached_trace, estimate
from kit.preflight.trace import Shape
from kit.train.offload import BlockSwap, check_block_swap

ROOT = Path(__file__).resolve().parent.parent
FLUX_DEV = {
    "model_family": "flux",
    "pretrained_model": "black-forest-labs/FLUX.1-dev",
    "resolution": 512,
    "network_type": "lora",
    "lora_rank": 16,
    "lora_alpha": 16.0,
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
}
SIXTEEN, TWENTY_FOUR = "RTX 4080 16GB", "RTX 4090 24GB"
README_VARIANTS = [
    {},
    {"blocks_to_swap": 57},
    {"base_quantization": "int8"},
    {"base_quantization": "nf4"},
    {"base_quantization": "nf4", "gradient_checkpointing": False},
]
"""The rows of the Flux.1 dev table in docs/guides/memory.md, applied to `FLUX_DEV`."""


# Offline, and each Flux shape traced once for the module.
pytestmark = pytest.mark.usefixtures("module_trace_cache")


def _write(path: Path, **fields) -> Path:
    path.write_text(json.dumps(fields))
    return path


def _flux(**changes) -> Config:
    return Config().replace(**{**FLUX_DEV, **changes})


# ---------------------------------------------------------------- the storage rules


def test_quantized_sizes_are_the_trainers(tiny_base):
    """The estimate shrinks exactly the bytes kit.families.quantize stores quantized."""
    path = tiny_base("flux")
    cfg = Config().replace(model_family="flux", pretrained_model=str(path), resolution=64)
    family = get_family("flux", cfg)
    plain = estimate(cfg)
    comps = family.load(str(path))
    before = quant.module_bytes(comps.denoiser)
    report = quant.quantize(comps.denoiser, "int8", device="cpu")
    assert report.layers, "the tiny denoiser has layers to quantize"
    saved = before - quant.module_bytes(comps.denoiser)
    q8 = estimate(cfg, base_quantization="int8")
    gone = plain.components["denoiser_weights"] - q8.components["denoiser_weights"]
    assert gone == report.bytes_before - report.bytes_after
    assert abs(gone / saved - 1) < 0.05, (gone, saved)  # quanto's own bookkeeping aside
    assert q8.components["dequant_buffers"] > 0 == plain.components["dequant_buffers"]
    # Refused as training refuses it: a denoiser that trains whole cannot be stored quantized.
    with pytest.raises(ConfigError, match="base_quantization"):
        estimate(cfg.replace(network_type="full"), base_quantization="int8")


def test_the_swap_is_the_one_the_trainer_installs(tiny_base):
    """The estimate moves exactly the bytes kit.train.offload keeps in CPU memory."""
    path = tiny_base("flux")
    cfg = Config().replace(model_family="flux", pretrained_model=str(path), resolution=64)
    family = get_family("flux", cfg)
    comps = family.load(str(path))
    get_method(cfg, family).attach(comps)
    blocks = family.swap_blocks(comps.denoiser)
    plain = estimate(cfg)
    for n in range(1, len(blocks) + 1):
        est = estimate(cfg, blocks_to_swap=n)
        swap = BlockSwap(blocks, n, "cpu")
        try:
            assert est.details["swap"]["host"] == swap.stored_bytes
            gone = plain.components["denoiser_weights"] - est.components["denoiser_weights"]
            assert gone == swap.stored_bytes
            largest_two = sorted(swap.block_bytes.values())[-2:]
            assert est.components["swap_buffers"] == sum(largest_two)
        finally:
            swap.remove()
    with pytest.raises(ConfigError, match="at most"):
        estimate(cfg, blocks_to_swap=len(blocks) + 1)
    full = cfg.replace(network_type="full")
    with pytest.raises(ConfigError, match="trains every weight"):
        estimate(full, blocks_to_swap=1)
    with pytest.raises(ConfigError, match="quantized weights are not swapped"):
        estimate(cfg, blocks_to_swap=1, base_quantization="int8")


@pytest.mark.slow
def test_quantization_for_every_family_and_swap_only_for_transformer_stacks():
    cfg = Config().replace(model_family="sd15", pretrained_model="sd15", mixed_precision="bf16")
    plain, q8 = estimate(cfg), estimate(cfg, base_quantization="int8")
    # The UNet's convolutions stay: int8 saves less than half of its weights.
    ratio = q8.components["denoiser_weights"] / plain.components["denoiser_weights"]
    assert 0.6 < ratio < 0.95
    assert q8.components["text_encoder_weights"] == plain.components["text_encoder_weights"]
    assert q8.components["dequant_buffers"] > 0 and plain.components["dequant_buffers"] == 0
    with pytest.raises(ConfigError, match="no stack of transformer blocks"):
        estimate(cfg, blocks_to_swap=2)
    inv = cached_trace(cfg, _shape(cfg))["storage"]
    opts = options(cfg, None, inv)
    assert [o.value for o in opts["base_quantization"]] == ["none", "int8", "nf4"]
    assert [o.value for o in opts["blocks_to_swap"]] == [0]


def _shape(cfg: Config) -> Shape:
    t = cfg.train
    h, w = bucket_size(cfg, cfg.data.resolution)
    return Shape(h, w, t.train_batch_size, t.gradient_checkpointing, t.mixed_precision, False)


# ---------------------------------------------------------------- Flux.1 dev on real cards


@pytest.mark.slow
def test_flux_dev_lora_on_16_and_24_gb_cards():
    """bf16 fits neither card; int8, nf4 or swapping blocks fit both: the cache fills before
    the denoiser is loaded, so the setup holds the encoders (T5 still in bf16) and the VAE
    only, and the encoders leave before the denoiser arrives."""
    bf16 = estimate(_flux())
    assert not bf16.fits(GPUS[SIXTEEN]) and not bf16.fits(GPUS[TWENTY_FOUR])
    int8 = estimate(_flux(base_quantization="int8"))
    assert int8.fits(GPUS[TWENTY_FOUR]) and int8.fits(GPUS[SIXTEEN])
    nf4 = estimate(_flux(base_quantization="nf4"))
    assert nf4.total_bytes < 16 * GIB and nf4.fits(GPUS[SIXTEEN])
    assert "denoiser_weights" not in nf4.details["setup"]
    assert (
        nf4.details["setup"]["text_encoder_2_weights"]
        == bf16.details["setup"]["text_encoder_2_weights"]
        > 8.5 * GIB  # T5-XXL in bf16
    )
    # Once the cache is filled the encoders are gone (the grids draw from cached embeddings);
    # the VAE stays, not quantized.
    c8, c = int8.components, bf16.components
    assert c8["text_encoder_2_weights"] == c["text_encoder_2_weights"] == 0
    assert c8["text_encoder_weights"] == c["text_encoder_weights"] == 0
    assert c8["vae_weights"] == c["vae_weights"] > 0
    assert 0.5 < c8["denoiser_weights"] / c["denoiser_weights"] < 0.52
    # The T5 stored quantized from the start: the setup holds about half of it.
    t8 = estimate(_flux(text_encoder_quantization="int8"))
    s8, s = t8.details["setup"], bf16.details["setup"]
    assert s8["text_encoder_2_weights"] < 0.7 * s["text_encoder_2_weights"]  # T5 keeps `wo`
    assert t8.setup_bytes < bf16.setup_bytes and t8.total_bytes == bf16.total_bytes
    assert any(n.startswith("text_encoder_quantization int8") for n in t8.notes)
    # Swapping every block makes the step small; the setup is the encoders' whatever swaps.
    every = estimate(_flux(blocks_to_swap=57))
    assert every.total_bytes < 14 * GIB and every.setup_bytes == bf16.setup_bytes
    assert every.fits(GPUS[SIXTEEN])
    assert any("blocks_to_swap 57" in n for n in every.notes)
    # Host RAM: the base is read in bf16, not fp32, in two loads: the encoders and VAE for the
    # cache (4.8 B + 0.1 B parameters × 2 bytes, the VAE in fp32), then the 12 B denoiser; the
    # swapped blocks stay there, pinned, once training runs.
    loaded = bf16.host["loaded_weights"]
    loads = bf16.details["host_loads"]
    assert 9 * GIB < loads["cache"] < 10.5 * GIB and 22 * GIB < loads["denoiser"] < 22.5 * GIB
    assert loaded == loads["denoiser"] and bf16.host_bytes == loaded + bf16.host["process"]
    assert every.details["host_phase"] == "load"
    assert 20 * GIB < every.details["host_by_phase"]["training"] < 23 * GIB


@pytest.mark.slow
def test_every_advice_row_is_config_keys_the_trainer_takes(tmp_path):
    """Each row, applied with `kit train -s key=value`, loads, is accepted by the method, the
    quantization and the block swap, and the estimate of the loaded config is the row's."""
    config = _write(tmp_path / "flux.json", **FLUX_DEV)
    parts = get_family("flux").empty_parts(config_source(FLUX_DEV["pretrained_model"]))
    keys = set()
    for card in (SIXTEEN, TWENTY_FOUR, "A100 40GB"):
        rows = advise(load_config(config), GPUS[card], top=4)
        assert len(rows) >= 2
        keys |= {k for r in rows for k in r["set"]}
        kept = [r for r in rows if not r["changes_learning"]]
        assert [r["slowdown"] for r in kept] == sorted(r["slowdown"] for r in kept)
        for r in rows:
            items = r["changes"].split(", ") if r["set"] else []
            assert items or r["changes"] == "(as configured)"
            overrides = dict(parse_override(item) for item in items)
            assert overrides == r["set"]
            cfg = load_config(config, overrides)
            family = get_family(cfg.model.model_family, cfg)
            method = get_method(cfg, family)
            check_block_swap(cfg, family, method, parts["denoiser"])
            with contextlib.suppress(KitError):  # a library or GPU this machine lacks
                quant.check_quantization(cfg.model.base_quantization, "cuda", method=method)
            again = estimate(cfg)
            assert again.peak_bytes == r["estimate"].peak_bytes <= GPUS[card] * GIB
            assert r["peak_gib"] == round(again.peak_bytes / GIB, 2)
    assert {"base_quantization", "blocks_to_swap"} <= keys, keys


@pytest.mark.slow
def test_advice_on_a_tiny_model_names_real_keys(tmp_path, tiny_sd15):
    config = _write(
        tmp_path / "sd15.json",
        model_family="sd15",
        pretrained_model=str(tiny_sd15),
        resolution=512,
        train_batch_size=4,
    )
    cfg = load_config(config)
    est = estimate(cfg)
    budget = (est.total_bytes - est.components["activations"] / 2) / GIB
    rows = advise(cfg, budget, top=3)
    assert rows
    for r in rows:
        assert "batch_size=" not in r["changes"].replace("train_batch_size=", "")
        assert "unload_encoders" not in r["changes"]
        again = load_config(config, r["set"])
        assert estimate(again).total_bytes == r["estimate"].total_bytes


def test_memory_guide_shows_the_estimators_flux_table():
    """The memory guide's table is what `fit_table` prints for the same settings."""
    table = markdown_table(fit_table(_flux(), README_VARIANTS, [SIXTEEN, TWENTY_FOUR]))
    guide = (ROOT / "docs" / "guides" / "memory.md").read_text()
    assert table in guide, (
        "docs/guides/memory.md's Flux.1 dev table is stale; it should read:\n" + table
    )
    assert "| `(as configured)` |" in table and "| no | no |" in table


def test_cli_estimate_shows_host_ram_and_advice_as_keys(tmp_path, capsys):
    config = _write(tmp_path / "flux.json", **FLUX_DEV)
    assert main(["estimate", str(config), "--json", "--gpu", SIXTEEN]) == 0
    out = json.loads(capsys.readouterr().out)
    # The larger of the two loads: the 12 B denoiser in bf16, after the encoders have gone.
    assert out["host_ram_bytes"] == sum(out["host_ram"].values()) > 24 * GIB
    assert out["fits_gpu"] is False and out["setup_bytes"] == out["details"]["setup_bytes"]
    assert main(["estimate", str(config), "--json", "--gpu", TWENTY_FOUR]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["advice"]
    assert all(set(r["set"]) <= set(Config().to_dict(flat=True)) for r in out["advice"])
    assert main(["estimate", str(config), "--gpu", SIXTEEN]) == 0
    printed = capsys.readouterr().out
    assert "host RAM total" in printed and "setup (cache filling)" in printed
    assert "base_quantization=nf4" in printed  # the 16 GB card's way to fit
