"""accelerate config files for DDP and DeepSpeed, and training launched from a notebook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.train.distributed import launch_in_notebook, write_accelerate_config


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


def read(path) -> ClusterConfig:
    """The file as `accelerate launch --config_file` reads it."""
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    return config


def test_deepspeed_zero2_from_a_kit_config(tmp_path, make_config, capsys):
    cfg = make_config(gradient_accumulation_steps=4, max_grad_norm=0.5, mixed_precision="bf16")
    out = tmp_path / "ds.yaml"
    argv = ["accelerate-config", cfg, "--processes", "4", "--deepspeed-stage", "2"]
    rc = main([str(a) for a in [*argv, "--offload-optimizer", "--out", out]])
    assert rc == 0, capsys.readouterr().err
    assert str(out) in capsys.readouterr().out
    got = read(out)
    assert got.distributed_type == DistributedType.DEEPSPEED
    assert got.num_processes == 4 and got.num_machines == 1
    assert got.mixed_precision == "bf16"
    ds = got.deepspeed_config
    assert ds["zero_stage"] == 2
    assert ds["offload_optimizer_device"] == "cpu" and ds["offload_param_device"] == "none"
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5


def test_ddp_without_a_kit_config(tmp_path, capsys):
    out = tmp_path / "ddp.yaml"
    rc = main(
        ["accelerate-config", "--processes", "2", "--mixed-precision", "fp16", "--out", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    got = read(out)
    assert got.distributed_type == DistributedType.MULTI_GPU
    assert got.num_processes == 2 and got.mixed_precision == "fp16"
    assert got.deepspeed_config == {}


def test_one_process_and_no_clipping(tmp_path, make_config):
    cfg = load_config(make_config(max_grad_norm=0.0))
    got = read(write_accelerate_config(tmp_path / "one.yaml", cfg))
    assert got.distributed_type == DistributedType.NO and got.num_processes == 1
    ds = read(
        write_accelerate_config(tmp_path / "ds.yaml", cfg, deepspeed_stage=2)
    ).deepspeed_config
    assert "gradient_clipping" not in ds and ds["offload_optimizer_device"] == "none"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"deepspeed_stage": 3}, "stage 3"),
        ({"offload_optimizer": True}, "needs DeepSpeed"),
        ({"processes": 0}, "--processes"),
        ({"mixed_precision": "fp8"}, "--mixed-precision"),
    ],
)
def test_bad_options_are_refused(tmp_path, options, message):
    with pytest.raises(KitError, match=message):
        write_accelerate_config(tmp_path / "x.yaml", **options)
    assert not (tmp_path / "x.yaml").exists()


def test_refuses_a_non_yaml_file(tmp_path, capsys):
    rc = main(["accelerate-config", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and ".yaml" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_in_notebook_one_process(make_config, tmp_path):
    """One process runs in this one: the plumbing from config file to a trained run."""
    run = launch_in_notebook(make_config(max_train_steps=1), num_processes=1)
    assert run.root == tmp_path / "run"
    assert ckpt.list_checkpoints(run.root)
    assert [r["step"] for r in run.read_metrics() if "loss" in r] == [1]


@pytest.mark.slow
def test_launch_in_notebook_two_cpu_processes(make_config, tmp_path):
    """Two forked gloo processes, as a notebook cell starts them; run in a fresh interpreter,
    since the launcher refuses a process that has already made an Accelerator."""
    cfg = make_config(max_train_steps=2, checkpointing_steps=0)
    code = (
        "import sys; from kit.train.distributed import launch_in_notebook; "
        "launch_in_notebook(sys.argv[1], num_processes=2)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching training on 2" in out.stdout
    seen = {}
    for rank in (0, 1):
        rows = [json.loads(r) for r in (tmp_path / f"run/logs/process-{rank}.jsonl").open()]
        seen[rank] = {s for r in rows if "samples" in r for s in r["samples"]}
    assert seen[0] and seen[1] and not seen[0] & seen[1], "the two ranks did not share the data"
    assert ckpt.list_checkpoints(tmp_path / "run")
