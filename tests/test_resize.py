"""`kit resize`: a smaller LoRA by truncated SVD, and a plain LoRA extracted from DoRA and LoHa.

The reduced update is checked against the best approximation of that rank computed here from the
explicit ΔW (Eckart–Young), and an extraction at full rank against the trained adapter's update
computed without peft: DoRA by its formula, LoHa by the kit's own LyCORIS reader.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.export.resize import RESIZE_RECORD, reduce_lora, resize, truncate, truncate_factors
from kit.families import get_family
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.train.loop import train
from tests.conftest import write_run_config
from tests.lycoris_reference import delta_weights

DOWN, UP = ".lora_A.weight", ".lora_B.weight"


def _train(tmp_path_factory, base, data, name: str, **fields) -> RunDir:
    tmp = tmp_path_factory.mktemp(name)
    path = write_run_config(
        tmp / "config.json",
        base=base,
        data=data,
        trigger_words=["zorbstar"],
        lora_alpha=2,
        learning_rate=2e-2,
        train_batch_size=1,
        max_train_steps=3,
        checkpointing_steps=3,
        **fields,
    )
    train(load_config(path))
    return RunDir(tmp / "run")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_sd15, family_dataset) -> RunDir:
    """Rank 4, alpha 2, with validation images at its last step (which resize redraws)."""
    return _train(
        tmp_path_factory,
        tiny_sd15,
        family_dataset("sd15"),
        "lora",
        validation_steps=3,
        validation_seeds=[0, 7],
    )


def _best_rank_k(delta: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k], float((s[:k] ** 2).sum() / (s**2).sum())


def _lora_delta(weights: dict[str, torch.Tensor], name: str, scale: float) -> torch.Tensor:
    a, b = weights[name + DOWN].double(), weights[name + UP].double()
    return scale * b.flatten(1) @ a.flatten(1)


# ------------------------------------------------------------------ the arithmetic


def test_truncation_is_the_best_approximation_of_that_rank():
    gen = torch.Generator().manual_seed(0)
    up, down = torch.randn(24, 6, generator=gen), torch.randn(6, 40, generator=gen)
    delta = 0.5 * up.double() @ down.double()
    best, energy = _best_rank_k(delta, 3)
    for t in (truncate_factors(up, down, 0.5, 3), truncate(delta.float(), 3)):
        assert t.up.shape == (24, 3) and t.down.shape == (3, 40)
        assert torch.allclose(t.up.double() @ t.down.double(), best, atol=1e-5)
        assert t.energy == pytest.approx(energy, abs=1e-6) and 0 < t.energy < 1


def test_a_rank_deficient_update_keeps_all_its_energy():
    gen = torch.Generator().manual_seed(1)
    up, down = torch.randn(16, 4, generator=gen), torch.randn(4, 16, generator=gen)
    down[2:] = 0  # the update has rank 2
    t = truncate_factors(up, down, 1.0, 2)
    assert t.energy == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(t.up @ t.down, up @ down, atol=1e-5)
    # Asking for more than the matrix has pads with zeros and loses nothing.
    wide = truncate(torch.ones(3, 5), 4)
    assert wide.up.shape == (3, 4) and wide.energy == pytest.approx(1.0)
    assert torch.allclose(wide.up @ wide.down, torch.ones(3, 5), atol=1e-5)


def test_a_zero_update_counts_as_fully_kept():
    assert truncate(torch.zeros(4, 4), 2).energy == 1.0


# ------------------------------------------------------------------ a trained LoRA


@pytest.fixture(scope="module")
def resized(lora_run, tmp_path_factory):
    return resize(lora_run.root, 2, out_dir=tmp_path_factory.mktemp("resized") / "rank2")


def test_resize_keeps_the_best_rank_2_update(lora_run, resized):
    source = ckpt.exported_weights(ckpt.resolve_resume(lora_run.root, "latest"))
    new_run = RunDir(resized.run_dir)
    reduced = ckpt.exported_weights(ckpt.resolve_resume(new_run.root, "latest"))
    modules = sorted(k[: -len(DOWN)] for k in source if k.endswith(DOWN))
    assert sorted(resized.energy) == modules and set(reduced) == set(source)
    for name in modules:
        best, energy = _best_rank_k(_lora_delta(source, name, 2 / 4), 2)
        assert reduced[name + DOWN].shape[0] == 2 and reduced[name + UP].shape[1] == 2
        # alpha = rank: the reduced factors apply at scale 1.
        assert torch.allclose(_lora_delta(reduced, name, 1.0), best, atol=1e-6)
        assert resized.energy[name] == pytest.approx(energy, abs=1e-6)
    assert 0 < resized.min_energy <= resized.mean_energy <= 1
    cfg = load_config(new_run.config)
    assert (cfg.network.lora_rank, cfg.network.lora_alpha) == (2, 2.0)
    record = json.loads((new_run.root / RESIZE_RECORD).read_text())
    assert record["trained_rank"] == 4 and record["rank"] == 2 and record["step"] == 3


def test_a_trained_update_of_rank_2_comes_back_whole(lora_run):
    """Where the trained ΔW has rank 2 (two rows of each A zeroed), rank 2 keeps all of it."""
    weights = dict(ckpt.exported_weights(ckpt.resolve_resume(lora_run.root, "latest")))
    for k in [k for k in weights if k.endswith(DOWN)]:
        weights[k] = weights[k].clone()
        weights[k][2:] = 0
    reduced, energy = reduce_lora(weights, 2 / 4, 2)
    assert min(energy.values()) == pytest.approx(1.0, abs=1e-6)
    for name in energy:
        expected = _lora_delta(weights, name, 2 / 4)
        assert torch.allclose(_lora_delta(reduced, name, 1.0), expected, atol=1e-6)


def test_resized_files_have_rank_2_and_alpha_2_and_verify(resized):
    by_format = {r.format: r for r in resized.exports}
    assert set(by_format) == {"diffusers", "kohya"}
    for r in resized.exports:
        # Verified against the resized run's own validation images, redrawn with the reduced LoRA.
        assert r.verification.passed and r.verification.images == 2
    kohya = load_file(str(by_format["kohya"].path))
    downs = [k for k in kohya if k.endswith(".lora_down.weight")]
    assert downs and all(kohya[k].shape[0] == 2 for k in downs)
    assert all(kohya[k].shape[1] == 2 for k in kohya if k.endswith(".lora_up.weight"))
    assert all(float(kohya[k]) == 2.0 for k in kohya if k.endswith(".alpha"))
    with safe_open(str(by_format["kohya"].path), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "2" and float(meta["ss_network_alpha"]) == 2.0
    diffusers = load_file(str(by_format["diffusers"].path))
    assert all(v.shape[0] == 2 for k, v in diffusers.items() if "lora_A" in k)


def test_resize_refuses_what_it_cannot_do(lora_run, tmp_path):
    with pytest.raises(KitError, match="at least 1"):
        resize(lora_run.root, 0)
    for rank in (4, 6):
        with pytest.raises(KitError, match="not below the trained rank 4"):
            resize(lora_run.root, rank)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(KitError, match="not a resized run"):
        resize(lora_run.root, 2, out_dir=foreign)
    assert (foreign / "notes.txt").is_file()
    for kind in ("full", "textual_inversion"):
        fake = RunDir(tmp_path / kind)
        fake.root.mkdir()
        extra = {"placeholder_tokens": ["<zorb>"], "initializer_token": "star"}
        load_config(lora_run.config).replace(
            network_type=kind, **(extra if kind == "textual_inversion" else {})
        ).save(fake.config)
        with pytest.raises(KitError, match="no low-rank update to shrink"):
            resize(fake.root, 2)


def test_kit_resize_command(lora_run, capsys):
    assert main(["resize", str(lora_run.root), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 4 → LoRA rank 1" in out and "kept energy mean" in out
    default = lora_run.root.parent / "run-rank1"  # beside the run by default
    assert f"run folder: {default}" in out and (default / RESIZE_RECORD).is_file()
    assert main(["resize", str(lora_run.root), "--rank", "0"]) == 2
    assert "kit: error: resize: --rank must be at least 1" in capsys.readouterr().err


def test_kit_merge_command(lora_run, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(lora_run.root), "--out", str(out), "--scale", "0.5"]) == 0
    assert f"single_file: {out} (step 3, verified" in capsys.readouterr().out and out.is_file()


# ------------------------------------------------------------------ DoRA and LoHa become LoRA


def _dora_updates(cfg, weights) -> dict[str, torch.Tensor]:
    """W' − W for every module, from DoRA's formula: m · (W + sBA) / ‖W + sBA‖ per row."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(cfg.model.pretrained_model, subfolder="unet")
    modules = dict(unet.named_modules())
    scale = cfg.network.lora_alpha / cfg.network.lora_rank
    out = {}
    for key in weights:
        if key.endswith(DOWN):
            name = key[: -len(DOWN)]
            w = modules[name].weight.detach().double()
            merged = w + _lora_delta(weights, name, scale).reshape(w.shape)
            m = weights[name + ".lora_magnitude_vector"].double()
            out[name] = m[:, None] * merged / merged.norm(dim=1, keepdim=True) - w
    return out


def _loha_updates(cfg, weights) -> dict[str, torch.Tensor]:
    """ΔW for every module, read by the kit's own LyCORIS reader from the exported layout."""
    from diffusers import UNet2DConditionModel

    family = get_family(cfg.model.model_family, cfg)
    tensors = get_method(cfg, family).kohya_tensors(weights)
    unet = UNet2DConditionModel.from_pretrained(cfg.model.pretrained_model, subfolder="unet")
    return {k: v.double() for k, v in delta_weights(tensors, unet, family.kohya_prefix).items()}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "reference"), [("dora", _dora_updates), ("loha", _loha_updates)])
def test_extracted_lora_at_full_rank_reproduces_the_adapter(
    kind, reference, tmp_path_factory, tiny_sd15, family_dataset
):
    run = _train(tmp_path_factory, tiny_sd15, family_dataset("sd15"), kind, network_type=kind)
    cfg = load_config(run.config)
    weights = ckpt.exported_weights(ckpt.resolve_resume(run.root, "latest"))
    expected = reference(cfg, weights)
    full = max(min(d.flatten(1).shape) for d in expected.values())
    with pytest.raises(KitError, match=f"above the largest rank .* \\({full}\\)"):
        resize(run.root, full + 1, verify=False)
    # The full rank of every adapted weight of the tiny model: nothing is cut.
    result = resize(run.root, full, fmt="diffusers", verify=False)
    extracted = ckpt.exported_weights(ckpt.resolve_resume(result.run_dir, "latest"))
    assert sorted(expected) == sorted(result.energy)
    for name, delta in expected.items():
        ours = _lora_delta(extracted, name, 1.0)
        assert delta.abs().max() > 1e-4  # the adapter did change this weight
        assert torch.allclose(ours, delta.flatten(1), atol=2e-6), name
    assert result.min_energy == pytest.approx(1.0, abs=1e-6)
    assert load_config(RunDir(result.run_dir).config).network.network_type == "lora"
    # A smaller extraction keeps less, and says so.
    small = resize(run.root, 2, fmt="diffusers", verify=False)
    assert 0 < small.min_energy < 1
