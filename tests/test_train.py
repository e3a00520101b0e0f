"""Training end to end on the tiny model: the guide's flat config, checkpoints, exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.run import checkpoint as ckpt
from kit.train.loop import train

GUIDE = {
    "model_family": "sd15",
    "data_backend": "local",
    "resolution": 768,
    "resolution_type": "area",
    "caption_strategy": "textfile",
    "lora_rank": 16,
    "learning_rate": 1e-4,
    "lr_scheduler": "cosine",
    "lr_warmup_steps": 100,
    "train_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_train_steps": 4000,
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
    "checkpointing_steps": 500,
    "validation_steps": 250,
    "validation_prompt": "a small red zorbstar",
}


@pytest.mark.slow
def test_guide_flat_config_trains(tmp_path, tiny_sd15, dataset, monkeypatch):
    """The config users copy from the guide trains once its paths point at real folders."""
    # Its bf16 falls back to fp32 on a CPU without bf16 instructions (tests/test_cpu_bf16.py
    # covers one that has them).
    monkeypatch.setattr("kit.train.accel.cpu_bf16", lambda: False)
    fields = {
        **GUIDE,
        "pretrained_model": str(tiny_sd15),
        "output_dir": str(tmp_path / "run"),
        "image_dir": str(dataset),
        "caption_dir": str(dataset),
    }
    (tmp_path / "guide.json").write_text(json.dumps(fields))
    assert load_config(tmp_path / "guide.json").data.resolution == 768
    # A CPU test trains shorter and smaller (768² attention on a CPU takes minutes a step);
    # every other value is the guide's.
    cfg = load_config(
        tmp_path / "guide.json",
        {
            "max_train_steps": 2,
            "resolution": 128,
            "validation_num_inference_steps": 2,
            "cache_dir": str(tmp_path / "c"),
        },
    )
    with pytest.warns(UserWarning, match="mixed_precision='bf16'"):
        result = train(cfg)
    assert result.step == 2
    rows = [
        json.loads(line) for line in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] > 0 and r["grad_norm"] is not None and r["lr"] > 0 for r in rows)
    assert (tmp_path / "run/loss.png").is_file()
    assert (tmp_path / "run/validation/step-000002/grid.png").is_file()  # the final validation
    assert any((tmp_path / "run/logs").rglob("events.out.tfevents*"))  # TensorBoard


def _adapter(run_dir, step):
    return load_file(str(ckpt.checkpoint_dir(run_dir, step) / ckpt.ADAPTER_FILE))


@pytest.mark.slow
def test_resume_mid_run_matches_straight_run(tmp_path, make_config):
    """Stop after 10 of 20 steps (mid-epoch), resume, finish: bitwise equal adapter weights."""
    common = {
        "max_train_steps": 20,
        "checkpointing_steps": 10,
        "gradient_accumulation_steps": 2,
        "lr_scheduler": "cosine",
        "lr_warmup_steps": 3,
        "lora_dropout": 0.1,
    }
    a = tmp_path / "a"
    train(load_config(make_config("a.json", output_dir=str(a), **common)))

    b = tmp_path / "b"
    cfg_b = load_config(make_config("b.json", output_dir=str(b), **common))

    def stop_at_10(event):
        if event["kind"] == "checkpoint" and event["step"] == 10:
            raise KeyboardInterrupt

    first = train(
        cfg_b, callbacks=[stop_at_10]
    )  # the interrupt's own save is skipped: step 10 is saved
    assert first.interrupted and first.step == 10
    progress = json.loads((ckpt.checkpoint_dir(b, 10) / "progress.json").read_text())
    assert progress["position"] not in (0,), "the checkpoint should fall mid-epoch"
    second = train(cfg_b, resume="latest")
    assert second.step == 20

    wa, wb = _adapter(a, 20), _adapter(b, 20)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # The log holds each step once, in order, across the resume.
    steps = [json.loads(x)["step"] for x in (b / "logs/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


@pytest.mark.slow
def test_cli_resume_with_longer_run_matches_straight_run(tmp_path, make_config):
    """`kit train -s max_train_steps=10`, then `kit train --resume latest` to 20 = 20 straight."""
    from kit.cli import main

    common = {"max_train_steps": 20, "checkpointing_steps": 5, "lr_scheduler": "constant"}
    assert (
        main(["train", str(make_config("a.json", output_dir=str(tmp_path / "a"), **common))]) == 0
    )
    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    assert main(["train", str(b), "-s", "max_train_steps=10"]) == 0
    assert main(["train", str(b), "--resume", "latest"]) == 0
    wa, wb = _adapter(tmp_path / "a", 20), _adapter(tmp_path / "b", 20)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_only_the_adapter_trains(tmp_path, make_config):
    """The optimizer holds exactly the LoRA tensors; their B matrices move off zero."""
    cfg = load_config(make_config(max_train_steps=3))
    train(cfg)
    folder = ckpt.checkpoint_dir(tmp_path / "run", 3)
    w = load_file(str(folder / ckpt.ADAPTER_FILE))
    assert w and all("lora_A" in k or "lora_B" in k for k in w)
    assert any("lora_B" in k and w[k].abs().sum() > 0 for k in w)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(w)


def test_incomplete_checkpoint_is_skipped(tmp_path, make_config):
    """A newest checkpoint without its marker is passed over for the previous good one."""
    cfg = load_config(make_config(max_train_steps=4, checkpointing_steps=2))
    train(cfg)
    run = tmp_path / "run"
    (ckpt.checkpoint_dir(run, 4) / ckpt.MARKER).unlink()
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert ckpt.resolve_resume(run, "latest") == ckpt.checkpoint_dir(run, 2)


def test_resume_refuses_changed_batch_size(tmp_path, make_config):
    """A resume that could not be exact names what changed, unless forced."""
    from kit.errors import KitError

    path = make_config(max_train_steps=2, checkpointing_steps=2)
    train(load_config(path))
    changed = load_config(path, {"train_batch_size": 3, "max_train_steps": 3})
    with pytest.raises(KitError, match="train_batch_size: 2 → 3"):
        train(changed, resume="latest")
    with pytest.warns(UserWarning, match="resuming despite changes"):
        assert train(changed, resume="latest", force=True).step == 3


def test_checkpoint_limit_keeps_newest(tmp_path, make_config):
    cfg = load_config(
        make_config(max_train_steps=6, checkpointing_steps=1, checkpoints_total_limit=2)
    )
    train(cfg)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert names == ["step-000005", "step-000006"]
