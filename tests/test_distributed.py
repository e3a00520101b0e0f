"""Two processes (gloo on the CPU) through accelerate: sharded data, identical weights, and the
same result as one process with the same effective batch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.run import checkpoint as ckpt


@pytest.mark.slow
def test_two_processes_match_one_with_accumulation(tmp_path, two_processes_and_one):
    two_processes_and_one(
        max_train_steps=3, checkpointing_steps=0, lora_dropout=0.1, caption_dropout=0.2
    )

    records = {
        rank: [
            json.loads(x)
            for x in (tmp_path / f"ddp/logs/process-{rank}.jsonl").read_text().splitlines()
        ]
        for rank in (0, 1)
    }
    seen = {
        rank: [s for r in rows if "samples" in r for s in r["samples"]]
        for rank, rows in records.items()
    }
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1]), "ranks saw overlapping samples"
    finals = [rows[-1] for rows in records.values()]
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], (
        "ranks ended with different weights"
    )

    a = load_file(str(ckpt.checkpoint_dir(tmp_path / "ddp", 3) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "one", 3) / ckpt.ADAPTER_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)
