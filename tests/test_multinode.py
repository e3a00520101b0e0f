"""Two "nodes" on this machine over loopback (`torch.distributed.run --nnodes 2 --node_rank N
--master_addr 127.0.0.1`), one process each, each reading its own config file as separate
machines do: they end on one process's weights with doubled accumulation, and a node whose
config or dataset differs stops both before the first step, naming the difference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.run import checkpoint as ckpt
from kit.train.distributed import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _two_nodes(configs: tuple[Path, Path]) -> list[subprocess.CompletedProcess]:
    """Start node 0 and node 1 at once, each with its config; wait for both."""
    port = str(free_port())
    procs = []
    for rank, config in enumerate(configs):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--nproc_per_node", "1", "--node_rank", str(rank)]
        command += ["--master_addr", "127.0.0.1", "--master_port", port]
        command += ["-m", "kit", "train", str(config)]
        procs.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_two_loopback_nodes_match_one_process(tmp_path, make_config):
    common = {"max_train_steps": 3, "checkpointing_steps": 0, "caption_dropout": 0.2}
    run = tmp_path / "nodes"
    # Each node its own file and its own cache folder, as on two machines.
    node0 = make_config("node0.json", output_dir=str(run), cache_dir=str(tmp_path / "c0"), **common)
    node1 = make_config("node1.json", output_dir=str(run), cache_dir=str(tmp_path / "c1"), **common)
    one = make_config(
        "one.json", output_dir=str(tmp_path / "one"), gradient_accumulation_steps=2, **common
    )
    for done in _two_nodes((node0, node1)):
        assert done.returncode == 0, done.stderr[-3000:]
    single = subprocess.run(
        [sys.executable, "-m", "kit", "train", str(one)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]

    finals = [
        json.loads((run / f"logs/process-{rank}.jsonl").read_text().splitlines()[-1])
        for rank in (0, 1)
    ]
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"]
    assert finals[0]["final_step"] == 3
    a = load_file(str(ckpt.checkpoint_dir(run, 3) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "one", 3) / ckpt.ADAPTER_FILE))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)


@pytest.mark.slow
def test_nodes_that_disagree_stop_before_training(tmp_path, make_config, dataset):
    # Node 1 has its own copy of the images (allowed) with one caption changed (not), and
    # another rank in its config.
    copy = tmp_path / "data-node1"
    shutil.copytree(dataset, copy)
    caption = sorted(copy.glob("*.txt"))[3]
    caption.write_text(caption.read_text() + ", edited")
    run = tmp_path / "nodes"
    node0 = make_config("node0.json", output_dir=str(run))
    node1 = make_config("node1.json", output_dir=str(run), image_dir=str(copy), lora_rank=8)

    results = _two_nodes((node0, node1))
    for rank, done in enumerate(results):
        assert done.returncode != 0, f"node {rank} should have stopped"
        err = done.stderr
        assert "disagree" in err, err[-3000:]
        assert "lora_rank (rank 0: 4; rank 1: 8)" in err, err[-3000:]
        assert f"first difference: {caption.with_suffix('.png').name}" in err, err[-3000:]
        assert "another caption" in err
        assert "image_dir" not in err.split("config keys differ:")[1].split(";")[0]
    # Stopped before the first step: no checkpoint, no metrics.
    assert not (run / "checkpoints").exists()
    assert not (run / "logs" / "metrics.jsonl").exists()
