"""The estimator per GPU under DDP, ZeRO-2 and FSDP: what each layout divides by the process
count and what it adds; the advice and the planner proposing several GPUs for a run no single
card holds (a full fine-tune of Flux.1 dev on 24 GB cards); and, on two CPU processes over
gloo, FSDP's optimizer state per process against the estimate."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kit.cli import main
from kit.config import Config, load_config
from kit.errors import ConfigError, KitError
from kit.preflight.advice import advise
from kit.preflight.estimate import GIB, GPUS, estimate
from kit.preflight.plan import plan

CARD = "RTX 4090 24GB"
FLUX_FULL = {
    "model_family": "flux",
    "pretrained_model": "black-forest-labs/FLUX.1-dev",
    "resolution": 512,
    "network_type": "full",
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
}


# Offline, and each Flux shape traced once for the module.
pytestmark = pytest.mark.usefixtures("module_trace_cache")


def _tiny(path, **changes) -> Config:
    base = {"model_family": "sd15", "pretrained_model": str(path), "resolution": 64}
    return Config().replace(**{**base, "mixed_precision": "bf16", **changes})


@pytest.mark.slow
def test_zero2_and_fsdp_divide_what_they_shard(tiny_sd15):
    cfg = _tiny(tiny_sd15, network_type="full")
    one = estimate(cfg).components
    for layout in ("zero2", "fsdp"):
        by_n = {n: estimate(cfg, processes=n, layout=layout) for n in (1, 2, 4)}
        state = {n: e.components["optimizer_state"] for n, e in by_n.items()}
        assert state[1] == one["optimizer_state"]
        assert abs(state[4] * 4 - state[1]) <= 4, layout  # a quarter, within rounding up
        assert by_n[2].peak_bytes > by_n[4].peak_bytes, layout
        assert (by_n[4].layout, by_n[4].processes) == (layout, 4)
        assert any("divided by 4" in note for note in by_n[4].notes)
    # FSDP shards the trained weights themselves; ZeRO-2 keeps a half-precision copy whole.
    fsdp, zero2 = (estimate(cfg, processes=4, layout=k).components for k in ("fsdp", "zero2"))
    assert abs(fsdp["trainable_weights"] * 4 - one["trainable_weights"]) <= 4
    assert zero2["trainable_weights"] > one["trainable_weights"] // 2
    # On a tiny model DeepSpeed's reduce bucket (5e8 elements) outweighs all that is divided.
    assert zero2["gradient_buckets"] == 500_000_000 * 2
    assert estimate(cfg, processes=2, layout="fsdp").peak_bytes < estimate(cfg).peak_bytes
    # The frozen encoders are on every GPU whole under ZeRO; under FSDP they leave it once the
    # cache is filled, as no images are drawn there.
    assert zero2["vae_weights"] == one["vae_weights"] > 0
    assert fsdp["vae_weights"] == 0


def test_ddp_adds_the_gradient_buckets_and_divides_nothing(tiny_sd15):
    cfg = _tiny(tiny_sd15, network_type="full")
    one, two = estimate(cfg), estimate(cfg, processes=2, layout="ddp")
    assert "gradient_buckets" not in one.components
    assert two.components["gradient_buckets"] == one.components["trainable_weights"]
    assert two.components["optimizer_state"] == one.components["optimizer_state"]
    assert two.peak_bytes > one.peak_bytes and two.floor_bytes > one.floor_bytes


@pytest.mark.slow
def test_lora_base_is_whole_under_zero2_and_sharded_under_fsdp(tiny_sd15):
    cfg = _tiny(tiny_sd15)
    one = estimate(cfg).components
    zero2 = estimate(cfg, processes=4, layout="zero2").components
    fsdp = estimate(cfg, processes=4, layout="fsdp").components
    assert zero2["denoiser_weights"] == one["denoiser_weights"]
    assert abs(fsdp["denoiser_weights"] * 4 - one["denoiser_weights"]) <= 4
    assert fsdp["gathered_weights"] > 0  # the units gathered whole while they compute


def test_what_the_launches_refuse_is_refused(tiny_sd15):
    cfg = _tiny(tiny_sd15)
    with pytest.raises(KitError, match="zero3 is not supported.*fsdp"):
        estimate(cfg, processes=2, layout="zero3")
    with pytest.raises(KitError, match="--layout"):
        estimate(cfg, processes=2, layout="pipeline")
    with pytest.raises(ConfigError, match="ema_decay"):
        estimate(cfg.replace(ema_decay=0.999), processes=2, layout="fsdp")


def test_cli_estimate_per_gpu(tmp_path, tiny_sd15, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_tiny(tiny_sd15, network_type="full").to_dict()))
    assert main(["estimate", str(path), "--json", "--processes", "2", "--layout", "fsdp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["layout"], out["processes"]) == ("fsdp", 2)
    assert out["total_bytes"] == sum(out["components"].values())
    one = estimate(load_config(path))
    assert out["components"]["optimizer_state"] * 2 >= one.components["optimizer_state"]


@pytest.mark.slow
def test_advice_puts_a_full_flux_fine_tune_on_several_24gb_cards(tmp_path, capsys):
    cfg = Config().replace(**FLUX_FULL)
    assert not estimate(cfg).fits(GPUS[CARD])
    fsdp8 = estimate(cfg, processes=8, layout="fsdp")
    assert (
        fsdp8.components["trainable_weights"] * 8 >= estimate(cfg).components["trainable_weights"]
    )
    rows = advise(cfg, GPUS[CARD], top=2)
    assert rows and all("launch" in r for r in rows)
    launch = rows[0]["launch"]
    assert (
        launch["layout"] == "fsdp"
        and f"--processes {launch['processes']} --fsdp" in (launch["command"])
    )
    # The row is real: its keys and its launch, estimated again, fit the card.
    again = estimate(cfg.replace(**rows[0]["set"]), processes=launch["processes"], layout="fsdp")
    assert again.fits(GPUS[CARD]) and launch["per_gpu_gib"] == round(again.peak_bytes / GIB, 2)
    # Fewer GPUs of the same kind do not hold it.
    fewer = launch["processes"] // 2
    assert not estimate(cfg.replace(**rows[0]["set"]), processes=fewer, layout="fsdp").fits(
        GPUS[CARD]
    )
    path = tmp_path / "flux.json"
    path.write_text(json.dumps(FLUX_FULL))
    assert main(["estimate", str(path), "--gpu", CARD]) == 0
    assert "FSDP on" in capsys.readouterr().out


@pytest.mark.slow
def test_planner_picks_a_multi_gpu_layout_for_a_full_flux_fine_tune(dataset, tmp_path):
    base = Config().replace(**FLUX_FULL)
    p = plan(dataset, "character", base=base, gpu=CARD, output_dir=str(tmp_path / "run"))
    assert p.config.network.network_type == "full"
    assert p.launch["layout"] == "fsdp" and p.launch["processes"] >= 2
    reason = next(x.reason for x in p.proposals if "train_batch_size" in x.fields)
    assert "FSDP on" in reason and "per GPU" in reason and "--fsdp" in reason, reason
    saved = json.loads(p.save(tmp_path / "planned.json").read_text())
    assert saved["_launch"]["processes"] == p.launch["processes"]
    cfg = load_config(tmp_path / "planned.json")
    assert estimate(cfg, processes=p.launch["processes"], layout="fsdp").fits(GPUS[CARD])


def _fsdp_process(rank: int, world: int, port: int, unet_dir: str, out: dict) -> None:
    """One process: the tiny UNet sharded as the kit's FSDP launch shards it, one AdamW step;
    the bytes of this process's optimizer state."""
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        unet = UNet2DConditionModel.from_pretrained(unet_dir)
        names = set(unet._no_split_modules)

        def wrap(module, root):
            for child in module.children():
                wrap(child, False)
            if not root and type(module).__name__ in names:
                fully_shard(module, mesh=mesh)

        wrap(unet, True)
        fully_shard(unet, mesh=mesh)
        optimizer = torch.optim.AdamW(unet.parameters(), foreach=False)
        for p in unet.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        held = sum(
            v.to_local().numel() * v.element_size()
            for state in optimizer.state.values()
            for k, v in state.items()
            if k != "step"
        )
        out[rank] = held
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_optimizer_state_per_process_is_the_estimate(tiny_sd15):
    """Measured: two CPU processes over gloo, each holding its shard of AdamW's state."""
    import torch.multiprocessing as mp

    from kit.train.distributed import free_port

    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        # Spawned, not forked: a fork of a process whose torch thread pools already run (as in
        # a whole test session) can deadlock in the child.
        mp.start_processes(
            _fsdp_process,
            args=(world, free_port(), str(tiny_sd15 / "unet"), out),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        held = dict(out)
    cfg = _tiny(tiny_sd15, network_type="full", mixed_precision="no")
    predicted = estimate(cfg, processes=world, layout="fsdp").components["optimizer_state"]
    whole = estimate(cfg).components["optimizer_state"]
    assert sum(held.values()) == whole  # every value's state, once, across the processes
    assert max(held.values()) == pytest.approx(predicted, rel=0.05)
