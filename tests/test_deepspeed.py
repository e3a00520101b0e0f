"""DeepSpeed ZeRO-2 in two CPU processes (gloo), launched with the accelerate config file that
`kit accelerate-config` writes: training finishes, checkpoints hold every process's part of the
optimizer state, and a resume from a mid-run checkpoint ends on the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.report import doctor
from kit.run import checkpoint as ckpt
from kit.train.distributed import free_port
from kit.train.loop import train

pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed (pip install deepspeed, or the kit's `deepspeed` extra)",
)

LEARNING_RATE = 1e-3


def _launch(accelerate_config, config, *args: str) -> None:
    """`accelerate launch --config_file ... -m kit train CONFIG ARGS` on this machine's CPUs."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path, also where a GPU is
        "DS_ACCELERATOR": "cpu",
    }
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config),
        "--main_process_port",
        str(free_port()),
        "-m",
        "kit",
        "train",
        str(config),
        *args,
    ]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.slow
def test_zero2_resume_matches_straight_run(tmp_path, make_config, capsys):
    common = {
        "max_train_steps": 5,
        "checkpointing_steps": 0,
        "gradient_accumulation_steps": 2,
        "learning_rate": LEARNING_RATE,
        # A warm-up over two optimizer steps, whatever the number of processes.
        "lr_scheduler": "constant_with_warmup",
        "lr_warmup_steps": 2,
        "lora_dropout": 0.1,
        "caption_dropout": 0.2,
    }
    a = make_config("a.json", output_dir=str(tmp_path / "a"), **common)
    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    zero2 = tmp_path / "zero2.yaml"
    rc = main(
        ["accelerate-config", str(a), "--processes", "2", "--deepspeed-stage", "2"]
        + ["--out", str(zero2)]
    )
    assert rc == 0, capsys.readouterr().err

    _launch(zero2, a)  # 5 steps straight
    _launch(zero2, b, "-s", "max_train_steps=2")  # 2 steps, then resumed to 5
    mid = ckpt.checkpoint_dir(tmp_path / "b", 2)
    progress = json.loads((mid / "progress.json").read_text())
    assert progress["position"] != 0, "the checkpoint should fall mid-epoch"
    _launch(zero2, b, "--resume", "latest")

    # The checkpoint holds the optimizer state of both processes, in DeepSpeed's own files.
    assert not (mid / "optimizer.pt").exists()
    parts = sorted(p.name for p in (mid / ckpt.SHARDED_DIR).rglob("*optim_states.pt"))
    assert len(parts) == 2 and "rank_0" in parts[0] and "rank_1" in parts[1], parts

    for run in ("a", "b"):
        finals = [
            json.loads((tmp_path / run / f"logs/process-{rank}.jsonl").read_text().splitlines()[-1])
            for rank in (0, 1)
        ]
        assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], run
        assert finals[0]["final_step"] == 5

    wa = load_file(str(ckpt.checkpoint_dir(tmp_path / "a", 5) / ckpt.ADAPTER_FILE))
    wb = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 5) / ckpt.ADAPTER_FILE))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)

    # The schedule advances as without DeepSpeed, neither twice nor not at all: the warm-up
    # ends after two optimizer steps, resumed or not.
    rows = [json.loads(x) for x in (tmp_path / "b/logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == pytest.approx(
        [LEARNING_RATE / 2] + [LEARNING_RATE] * 4, rel=1e-6
    )

    # The doctor reads the DeepSpeed checkpoint as complete: no lost optimizer state.
    findings = doctor.diagnose(tmp_path / "b")
    assert not doctor.serious(findings), doctor.format_findings(findings)

    # Without DeepSpeed the split optimizer state cannot be read back: said, not ignored.
    with pytest.raises(KitError, match="saved under DeepSpeed"):
        train(load_config(b), resume="latest")
