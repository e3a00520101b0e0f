"""The failures users still met after the first rounds: each is now one line that names what to
fix, and no file the kit writes for the user is left private or partial."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kit.errors import KitError
from kit.run import checkpoint as ckpt
from tests.test_failures import refused

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _checkpoint(run: Path, step: int) -> Path:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    opt.step()  # an optimizer with state, as after training
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    progress = {"step": step, "epoch": 0, "position": 0}
    return ckpt.save_checkpoint(
        run, step, {"w": torch.zeros(2)}, opt, sched, torch.Generator(), progress
    )


# ------------------------------------------------------------------ the hub


@pytest.mark.parametrize("command", ["network", "estimate"])
def test_an_unreachable_hub_is_one_line_at_once(
    command, capsys, make_config, monkeypatch, tmp_path
):
    """`kit network` and `kit estimate` refuse a hub id they cannot reach as `kit train` does:
    at once, in one line."""
    from huggingface_hub import constants

    from kit.families import source

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(source, "_hub_reachable", lambda: False)
    config = make_config(pretrained_model="someone/no-such-model")
    start = time.monotonic()
    err = refused(capsys, command, config)
    assert time.monotonic() - start < 8
    assert "'someone/no-such-model'" in err and "cannot be reached" in err


# ------------------------------------------------------------------ full disks


def test_a_failing_tensorboard_writer_thread_prints_no_traceback(monkeypatch):
    """TensorBoard's writer thread keeps its error for the training thread to raise (and the kit
    to report in one line): its own traceback is not printed; other threads' still are."""
    import queue

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from kit.logs import quiet_writer_threads

    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    quiet_writer_threads()

    class FullDisk:
        def write(self, data):
            raise NO_SPACE

        flush = write

    events: queue.Queue = queue.Queue()
    writer = _AsyncWriterThread(events, FullDisk(), flush_secs=120)
    writer.start()
    events.put(b"an event")
    writer.join(10)
    assert writer.exception is NO_SPACE and printed == []
    other = threading.Thread(target=lambda: 1 / 0)
    other.start()
    other.join(10)
    assert len(printed) == 1 and printed[0].exc_type is ZeroDivisionError


@pytest.mark.slow
def test_a_run_whose_tensorboard_file_cannot_be_written_says_so_in_one_line(
    capsys, make_config, monkeypatch
):
    """The event file's first write fails (a full disk): one `kit: error:` line, no thread's
    traceback beside it."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    from kit.cli import main

    def full(self, data):
        raise NO_SPACE

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    # Python's own hook, which prints a thread's traceback (pytest's would keep it to itself).
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    config = make_config(report_to="tensorboard", max_train_steps=2, checkpointing_steps=0)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("kit: error:")]
    assert len(lines) == 1 and "no space left" in lines[0], err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_disk_that_fills_during_the_optimizer_save_is_one_line(tmp_path, monkeypatch):
    """torch.save on a full disk says only `[enforce fail ...] unexpected pos`: the checkpoint's
    line says the disk is full. The optimizer's file is written to /dev/full, which is."""
    first = _checkpoint(tmp_path, 2)
    real = torch.save

    def save(obj, f, *args, **kwargs):
        full = Path(f).name == ckpt.OPTIMIZER_FILE
        return real(obj, "/dev/full" if full else f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(KitError) as e:
        _checkpoint(tmp_path, 4)
    msg = str(e.value)
    assert "step 4" in msg and "no space left" in msg and "\n" not in msg
    assert f"{first} is intact" in msg


def test_disk_full_while_drawing_or_exporting_names_the_file(tmp_path, monkeypatch):
    """A validation image, a sidecar or an export's verify.json on a full disk: one line naming
    the file and its folder; nothing partial left."""
    from PIL import Image

    from kit.io import write_json
    from kit.sample.validate import save_drawn

    samples = tmp_path / "samples"
    samples.mkdir()

    def no_space(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"partial")
        raise NO_SPACE

    with monkeypatch.context() as mp:
        mp.setattr(Image.Image, "save", no_space)
        with pytest.raises(KitError) as e:
            save_drawn([Image.new("RGB", (8, 8))], samples / "step_000002_0")
    msg = str(e.value)
    assert msg.startswith("could not write step_000002_0.png: cannot write ")
    assert str(samples) in msg and "no space left" in msg
    assert list(samples.iterdir()) == []

    def full_text(self, *args, **kwargs):
        raise NO_SPACE

    monkeypatch.setattr(Path, "write_text", full_text)
    with pytest.raises(KitError, match=r"could not write lora\.verify\.json: cannot write .*no "):
        write_json(tmp_path / "exports" / "lora.verify.json", {"passed": True})


def test_a_full_disk_under_the_diffusers_export_names_the_file(make_config, tmp_path, monkeypatch):
    """diffusers writes the export's LoRA file itself; safetensors says only `os error 28`."""
    from kit.config import load_config
    from kit.families import get_family
    from kit.methods import get_method

    cfg = load_config(make_config())
    family = get_family("sd15", cfg)

    def full(*args, **kwargs):
        raise RuntimeError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(type(family), "save_diffusers_lora", full)
    out = tmp_path / "exports"
    out.mkdir()
    with pytest.raises(KitError) as e:
        get_method(cfg, family).write_export("diffusers", {}, {}, 2, out)
    msg = str(e.value)
    assert msg.startswith("could not write pytorch_lora_weights.safetensors in ")
    assert str(out) in msg and "no space left" in msg and list(out.iterdir()) == []


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_config_nested_100000_deep_is_one_line(capsys, tmp_path, suffix):
    path = tmp_path / f"deep{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000)
    err = refused(capsys, "buckets", path)
    assert str(path) in err and "nested too deeply" in err


# ------------------------------------------------------------------ file modes


def test_files_a_user_shares_follow_the_umask(tmp_path, umask_022):
    """safetensors writes through a private (0600) file: exports and checkpoints the kit writes
    get the umask's mode, as its JSON beside them."""
    from kit.io import atomic_dir, save_tensors, write_json

    save_tensors(tmp_path / "lora.safetensors", {"w": torch.zeros(2)})
    write_json(tmp_path / "lora.verify.json", {})
    from safetensors.torch import save_file

    with atomic_dir(tmp_path / "merged") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    saved = _checkpoint(tmp_path / "run", 2)
    files = [
        tmp_path / "lora.safetensors",
        tmp_path / "lora.verify.json",
        tmp_path / "merged" / "model.safetensors",
        *(p for p in saved.iterdir() if p.is_file()),
    ]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: "0o644" for p in files
    }


# ------------------------------------------------------------------ plan and train agree


def test_plan_leaves_out_a_truncated_image_as_training_does(tmp_path, dataset):
    from kit.preflight.plan import plan

    few = tmp_path / "few"
    few.mkdir()
    for f in sorted(dataset.glob("zorbic_00[0-4].*")):
        (few / f.name).write_bytes(f.read_bytes())
    cut = few / "zorbic_001.png"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    p = plan(few, "concept", pretrained_model="/nowhere", trigger="zorbic")
    assert p.dataset["images"] == 4
    assert "halved as 4 images" in next(r.reason for r in p.proposals if "lora_rank" in r.fields)
    (name, why), *_ = p.dataset["unreadable"].items()
    assert name.endswith("zorbic_001.png") and "truncated" in why


# ------------------------------------------------------------------ sizes that cannot fit


def test_sizes_that_cannot_fit_are_refused_before_anything_loads(capsys, make_config, monkeypatch):
    from kit.config import load_config
    from kit.train import sizes

    monkeypatch.setattr(sizes, "_host_bytes", lambda: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, "train", make_config(validation_resolution=100_000))
    assert "validation_resolution: a 100000x100000 image needs at least" in err
    err = refused(capsys, "train", make_config("rank.json", lora_rank=1_000_000))
    assert "lora_rank: 1000000 makes" in err and "4.0 GiB in all" in err
    sizes.refuse_impossible_sizes(load_config(make_config()))  # usual sizes pass


def test_the_network_of_a_large_rank_is_counted_without_its_weights(make_config):
    """`kit network` and the estimator build the adapter on the meta device too: peft makes
    its layers on the CPU otherwise, and a rank of 200,000 (2 GB of weights on the tiny base)
    would take that memory just to be counted."""
    import resource

    from kit.config import load_config
    from kit.methods import preview

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    summary = preview(load_config(make_config(lora_rank=200_000)))
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert summary.trainable > 400_000_000 and grown < 2**30
