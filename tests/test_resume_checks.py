"""Resume and merge check what they continue: the adapter's shape, the base model, and a
damaged newest checkpoint (the one before it is used, and said so)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from kit.cli import main
from kit.run.folder import RunDir


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


@pytest.mark.slow
def test_resume_and_merge_refuse_another_adapter_or_base(capsys, make_config, tmp_path, tiny_sd15):
    base_a, base_b = tmp_path / "base-a", tmp_path / "base-b"
    shutil.copytree(tiny_sd15, base_a)
    shutil.copytree(tiny_sd15, base_b)
    cfg = make_config(pretrained_model=str(base_a))
    assert main(["train", str(cfg)]) == 0
    run = RunDir(tmp_path / "run")
    progress = json.loads((run.checkpoint(4) / "progress.json").read_text())
    assert progress["adapter"]["lora_rank"] == 4 and progress["base"]["name"] == "base-a"
    assert str(tmp_path) not in json.dumps(progress)  # no local path in a checkpoint
    capsys.readouterr()

    # Another rank or target set: refused by name, --force or not.
    for changed, words in (
        ({"lora_rank": 8}, "lora_rank: 4 → 8"),
        ({"lora_target_modules": ["to_q"]}, "lora_target_modules"),
    ):
        other = make_config("other.json", pretrained_model=str(base_a), **changed)
        assert main(["train", str(other), "--resume", "latest", "--force"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and words in err and "another adapter" in err

    # Another base: refused by name; --force resumes with a warning.
    moved = make_config("moved.json", pretrained_model=str(base_b), max_train_steps=5)
    assert main(["train", str(moved), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert "base model: base-a → base-b" in err and "--force" in err
    assert main(["train", str(moved), "--resume", "latest", "--force"]) == 0
    assert (
        "warning: resuming despite changes: base model: base-a → base-b" in capsys.readouterr().err
    )

    # Merge: the run's base now holds other configs than it trained on.
    vae = base_b / "vae" / "config.json"
    vae.write_text(json.dumps({**json.loads(vae.read_text()), "force_upcast": False}))
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(run.root), "--out", str(out), "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "holds other weights or configs" in err and "--force" in err and not out.exists()


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    import torch

    from kit.run import checkpoint as ckpt

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (2, 4):
        progress = {"step": step, "epoch": 0, "position": 0}
        ckpt.save_checkpoint(
            tmp_path, step, {"w": torch.ones(4)}, opt, sched, torch.Generator(), progress
        )
    assert ckpt.resolve_resume(tmp_path, "latest").name == "step-000004"
    for name, cut in (("optimizer.pt", 100), ("adapter.safetensors", 60)):
        f = RunDir(tmp_path).checkpoint(4) / name
        whole = f.read_bytes()
        f.write_bytes(whole[:cut])
        with pytest.warns(UserWarning) as w:
            assert ckpt.resolve_resume(tmp_path, "latest").name == "step-000002"
        said = " ".join(str(x.message) for x in w)
        assert f"step-000004 is damaged ({name}" in said and "falling back" in said
        assert "step-000002, the newest checkpoint that reads back whole" in said
        f.write_bytes(whole)
    with pytest.raises(Exception, match="does not read back"):
        (RunDir(tmp_path).checkpoint(2) / "rng.pt").write_bytes(b"garbage")
        ckpt.load_checkpoint(RunDir(tmp_path).checkpoint(2))
