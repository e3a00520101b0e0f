"""Interruptions: SIGTERM checkpoints and exits; SIGKILL at random moments loses only the steps
since the last checkpoint, and resuming always reaches the uninterrupted run's weights."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.train.loop import train

STEPS = 24


def _start(config, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "kit", "train", str(config), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _steps_logged(run) -> int:
    path = run / "logs/metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _final(run):
    return load_file(str(ckpt.checkpoint_dir(run, STEPS) / ckpt.ADAPTER_FILE))


@pytest.fixture()
def reference(tmp_path, make_config):
    """The uninterrupted run's final weights, and a factory for configs of interrupted runs."""
    common = {
        "max_train_steps": STEPS,
        "checkpointing_steps": 4,
        "lora_dropout": 0.1,
        "gradient_accumulation_steps": 2,
    }
    train(load_config(make_config("ref.json", output_dir=str(tmp_path / "ref"), **common)))
    return _final(tmp_path / "ref"), lambda name: make_config(
        f"{name}.json", output_dir=str(tmp_path / name), **common
    )


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path, reference):
    weights, config = reference
    cfg = config("term")
    proc = _start(cfg)
    while _steps_logged(tmp_path / "term") < 6 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    stopped = ckpt.list_checkpoints(tmp_path / "term")[-1]
    assert int(stopped.name.split("-")[1]) >= 6  # saved where it stopped, not at the last cadence
    done = _start(cfg, "--resume", "latest")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    again = _final(tmp_path / "term")
    assert all(torch.equal(weights[k], again[k]) for k in weights)


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_to_the_same_weights(tmp_path, reference):
    weights, config = reference
    cfg = config("kill")
    rng = random.Random(7)
    for _trial in range(3):
        proc = _start(cfg, "--resume", "latest")
        time.sleep(rng.uniform(4.0, 9.0))  # somewhere in start-up, caching or training
        proc.kill()
        proc.wait()
    done = _start(cfg, "--resume", "latest")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    again = _final(tmp_path / "kill")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    steps = [
        json.loads(x)["step"]
        for x in (tmp_path / "kill/logs/metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, STEPS + 1))  # no step lost or logged twice


@pytest.mark.slow
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, make_config, monkeypatch):
    cfg = load_config(make_config(max_train_steps=4, checkpointing_steps=2))
    real = ckpt.save_file

    def full_disk(tensors, path, *args, **kwargs):
        if "step-000004" in str(path):
            raise OSError(28, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(KitError, match="step-000002 is intact"):
        train(cfg)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert names == ["step-000002"]
    assert not list((tmp_path / "run/checkpoints").glob(".*tmp"))
