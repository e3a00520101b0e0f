"""FSDP in two CPU processes (gloo), launched with the accelerate config file that
`kit accelerate-config --fsdp` writes: a full fine-tune of the tiny SD1.5 whose checkpoints hold
every process's shard and resume exactly, whose saved weights are the whole model and equal one
process's with doubled accumulation; LoRA on the sharded denoiser likewise; and what FSDP cannot
train refused before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.train.distributed import accelerate_config, free_port
from kit.train.loop import train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _launch(accelerate_yaml: Path, config: Path, *args: str) -> None:
    """`accelerate launch --config_file ... -m kit train CONFIG ARGS` on this machine's CPUs."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(accelerate_yaml), "--main_process_port", str(free_port())]
    command += ["-m", "kit", "train", str(config), *args]
    out = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def _one_process(config: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kit", "train", str(config)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.checkpoint_dir(run, step) / ckpt.ADAPTER_FILE))


def _fsdp_yaml(tmp_path: Path, config: Path) -> Path:
    out = tmp_path / "fsdp.yaml"
    assert (
        main(["accelerate-config", str(config), "--processes", "2", "--fsdp", "--out", str(out)])
        == 0
    )
    return out


def _finals(run: Path) -> list[dict]:
    return [
        json.loads((run / f"logs/process-{rank}.jsonl").read_text().splitlines()[-1])
        for rank in (0, 1)
    ]


@pytest.mark.slow
def test_fsdp_full_finetune_resumes_exactly_and_matches_one_process(
    tmp_path, make_config, tiny_sd15
):
    common = {
        "network_type": "full",
        "learning_rate": 1e-4,
        "max_train_steps": 4,
        "checkpointing_steps": 0,
        "lr_scheduler": "constant_with_warmup",
        "lr_warmup_steps": 2,
        "caption_dropout": 0.2,
    }
    a = make_config("a.json", output_dir=str(tmp_path / "a"), **common)
    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    one = make_config(
        "one.json", output_dir=str(tmp_path / "one"), gradient_accumulation_steps=2, **common
    )
    fsdp = _fsdp_yaml(tmp_path, a)

    _launch(fsdp, a)  # 4 steps straight
    _launch(fsdp, b, "-s", "max_train_steps=2")  # 2 steps, then resumed to 4
    mid = ckpt.checkpoint_dir(tmp_path / "b", 2)
    _launch(fsdp, b, "--resume", "latest")
    _one_process(one)

    # The mid-run checkpoint: each process's shard in torch's distributed format, no
    # optimizer.pt, and the whole denoiser gathered beside it.
    assert not (mid / ckpt.OPTIMIZER_FILE).exists()
    shards = sorted(p.name for p in (mid / ckpt.FSDP_DIR).glob("*.distcp"))
    assert len(shards) == 2, shards
    assert ckpt.sharded_by(mid) == ckpt.FSDP_DIR

    wa, wb, w1 = (
        _weights(tmp_path / "a", 4),
        _weights(tmp_path / "b", 4),
        _weights(tmp_path / "one", 4),
    )
    assert wa.keys() == wb.keys() == w1.keys()
    assert all(k.startswith("denoiser.") for k in wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"resumed run differs at {k}"
    # Compared as updates: a bias ahead of a GroupNorm gets no real gradient, and Adam turns
    # that rounding noise into steps of full size, on one process as on two.
    base = load_file(str(next((tiny_sd15 / "unet").glob("*.safetensors"))))
    moved = {k: w1[k] - base[k.removeprefix("denoiser.")] for k in w1}
    gap = torch.stack([(wa[k] - w1[k]).norm() for k in wa]).norm()
    assert gap < 1e-2 * torch.stack([m.norm() for m in moved.values()]).norm()
    close = [k for k in wa if (wa[k] - w1[k]).norm() <= 1e-3 * moved[k].norm() + 1e-8]
    assert len(close) > 0.9 * len(wa), "most tensors should match one process's to 0.1%"
    start = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 2) / ckpt.ADAPTER_FILE))
    assert any(not torch.equal(start[k], wa[k]) for k in wa), "the weights never moved"
    for run in ("a", "b"):
        finals = _finals(tmp_path / run)
        assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], run

    rows = [json.loads(x) for x in (tmp_path / "b/logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    # The sharded state cannot be read back by one process: said, not ignored.
    with pytest.raises(KitError, match="saved under FSDP"):
        train(load_config(b), resume=str(mid), force=True)


@pytest.mark.slow
def test_fsdp_lora_matches_one_process(tmp_path, make_config):
    common = {"max_train_steps": 3, "checkpointing_steps": 0, "lora_dropout": 0.1}
    sharded = make_config("fsdp.json", output_dir=str(tmp_path / "fsdp"), **common)
    one = make_config(
        "one.json", output_dir=str(tmp_path / "one"), gradient_accumulation_steps=2, **common
    )
    _launch(_fsdp_yaml(tmp_path, sharded), sharded)
    _one_process(one)
    a, b = _weights(tmp_path / "fsdp", 3), _weights(tmp_path / "one", 3)
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)
    finals = _finals(tmp_path / "fsdp")
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"]


def test_accelerate_config_writes_fsdp(tmp_path, make_config):
    config = make_config(gradient_accumulation_steps=4, max_grad_norm=0.5)
    out = tmp_path / "f.yaml"
    assert main(["accelerate-config", str(config), "--processes", "4", "--fsdp", "--fsdp-offload",
                 "--machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.2",
                 "--out", str(out)]) == 0  # fmt: skip
    written = yaml.safe_load(out.read_text())
    assert written["distributed_type"] == "FSDP"
    assert written["fsdp_config"]["fsdp_version"] == 2
    assert written["fsdp_config"]["fsdp_offload_params"] is True
    assert written["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert (written["num_processes"], written["num_machines"], written["machine_rank"]) == (4, 2, 1)
    assert written["main_process_ip"] == "10.0.0.2"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"deepspeed_stage": 3}, "use --fsdp"),
        ({"fsdp": True, "fsdp_version": 1}, "--fsdp-version: 1"),
        ({"fsdp": True, "deepspeed_stage": 2}, "exclude each other"),
        ({"fsdp_offload": True}, "--fsdp-offload needs FSDP"),
        ({"machines": 2}, "--main-process-ip"),
        ({"machines": 2, "processes": 3, "main_process_ip": "h"}, "multiple of"),
    ],
)
def test_accelerate_config_refusals(options, message):
    with pytest.raises(KitError, match=message):
        accelerate_config(None, **options)


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"network_type": "full", "blocks_to_swap": 1}, "blocks_to_swap"),
        ({"base_quantization": "int8"}, "base_quantization"),
        ({"ema_decay": 0.99}, "ema_decay"),
        ({"compile": True}, "compile"),
        ({"train_text_encoder": True}, "network_type lora"),
    ],
)
def test_fsdp_refuses_what_it_cannot_train(monkeypatch, make_config, fields, key):
    # Refused before the accelerator, the data or the base: no launch is needed to see it.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(KitError, match=f"cannot train under FSDP: {key}"):
        train(load_config(make_config(**fields)))
