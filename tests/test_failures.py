"""Every failure a user meets is one line that names the file, key or value and the fix; and
nothing outside the run folder changes (nothing of theirs is deleted or overwritten)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folders`: its size and modification time (what a write would change)."""
    out = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                out[str(p)] = (p.stat().st_size, p.stat().st_mtime_ns)
    return out


def refused(capsys, *argv) -> str:
    """Run `kit ARGV`, expecting one line of refusal and no traceback; return it."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("kit: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ the base model


def test_missing_local_folder_is_not_looked_up_on_the_hub(capsys, make_config, tmp_path):
    missing = tmp_path / "models" / "sd15-typo"
    err = refused(capsys, "train", make_config(pretrained_model=str(missing)))
    assert "folder not found" in err and str(missing) in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_hub_id_offline_is_one_line_naming_hf_hub_offline(capsys, make_config, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = refused(capsys, "train", make_config(pretrained_model="someone/no-such-model"))
    assert "'someone/no-such-model'" in err and "HF_HUB_OFFLINE" in err
    assert "local copy" in err


def test_a_cached_hub_model_loads_at_once_when_the_hub_cannot_be_reached(
    tmp_path, monkeypatch, tiny_sd15
):
    from huggingface_hub import constants

    from kit.families import get_family, source

    # A hub cache holding the model, as `huggingface-cli download` leaves it.
    repo = tmp_path / "hub" / "models--someone--tiny-sd15"
    snapshot_dir = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_sd15, snapshot_dir)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test, as the constant
    monkeypatch.setattr(source, "_hub_reachable", lambda: False)
    family = get_family("sd15")
    with pytest.warns(UserWarning, match="loaded from the local hub cache"):
        source.check_base(family, "someone/tiny-sd15")
    # Every later request goes straight to the cache (no retries against an unreachable hub).
    assert constants.is_offline_mode() and os.environ["HF_HUB_OFFLINE"] == "1"
    comps = family.load("someone/tiny-sd15", parts=("denoiser",))
    assert comps.denoiser is not None


def test_gated_and_missing_hub_models_say_what_to_do():
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from kit.families.source import hub_error

    gated = hub_error(GatedRepoError("401", response=_Response()), "org/gated")
    assert "gated" in gated and "licence" in gated and "huggingface-cli login" in gated
    missing = hub_error(RepositoryNotFoundError("404", response=_Response()), "org/typo")
    assert "no such model" in missing and "local folder" in missing


class _Response:
    status_code = 401
    headers: dict[str, str] = {}
    url = "https://huggingface.co/org/x"
    request = None

    def json(self):
        return {}


def test_empty_folder_and_a_folder_of_another_family(capsys, make_config, tmp_path, tiny_base):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    err = refused(capsys, "train", make_config(pretrained_model=str(empty)))
    assert "empty folder" in err and str(empty) in err
    sdxl = tiny_base("sdxl")
    err = refused(capsys, "train", make_config(pretrained_model=str(sdxl)))
    assert "StableDiffusionXLPipeline" in err and "model_family sdxl" in err
    assert "set model_family: sdxl" in err
    assert not (tmp_path / "cache").exists()  # refused before anything was cached


def test_truncated_weights_name_the_file(capsys, make_config, tmp_path, tiny_sd15):
    copy = tmp_path / "base"
    shutil.copytree(tiny_sd15, copy)
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = refused(capsys, "train", make_config(pretrained_model=str(copy)))
    assert "damaged weight file" in err and str(weights) in err and "truncated" in err


def test_damaged_single_file(capsys, make_config, tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    err = refused(capsys, "train", make_config(pretrained_model=str(bad)))
    assert str(bad) in err


# ------------------------------------------------------------------ config edges


def test_non_utf8_and_duplicate_yaml_keys(capsys, tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"lora_rank: 4\n# caf\xe9\n")
    err = refused(capsys, "buckets", latin)
    assert str(latin) in err and "UTF-8" in err and "line 2" in err
    dup = tmp_path / "dup.yaml"
    dup.write_text("lora_rank: 4\nresolution: 64\nlora_rank: 8\n")
    err = refused(capsys, "buckets", dup)
    assert str(dup) in err and "'lora_rank' is given twice" in err


@pytest.mark.parametrize(
    "key", ["checkpointing_steps", "validation_steps", "logging_steps", "stable_loss_steps"]
)
def test_negative_step_intervals_are_refused(capsys, make_config, key):
    err = refused(capsys, "buckets", make_config(**{key: -5}))
    assert f"{key}: -5" in err


# ------------------------------------------------------------------ the run folder


def test_output_dir_empty_current_file_or_inside_the_dataset(
    capsys, make_config, tmp_path, dataset, monkeypatch
):
    before = snapshot(dataset)
    err = refused(capsys, "train", make_config(output_dir=""))
    assert "output_dir: empty" in err
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, "train", make_config(output_dir="."))
    assert "current folder" in err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    err = refused(capsys, "train", make_config(output_dir=str(a_file)))
    assert "is a file" in err and a_file.read_text() == "mine"
    err = refused(capsys, "train", make_config(output_dir=str(dataset / "runs" / "a")))
    assert "inside image_dir" in err
    assert snapshot(dataset) == before and not (dataset / "runs").exists()


def test_a_users_config_json_in_output_dir_and_doctor_on_a_dataset(
    capsys, make_config, tmp_path, dataset
):
    project = tmp_path / "project"
    project.mkdir()
    cfg = make_config("project/config.json", output_dir=str(project))
    before = cfg.read_bytes()
    err = refused(capsys, "train", cfg)
    assert "holds a config.json that no run wrote" in err and cfg.read_bytes() == before
    (dataset / "config.json").write_text("{}")
    snap = snapshot(dataset)
    err = refused(capsys, "doctor", dataset)
    assert "not a run folder" in err and snapshot(dataset) == snap


@pytest.mark.slow
def test_overwrite_removes_only_what_a_run_wrote(capsys, make_config, tmp_path):
    project = tmp_path / "project"
    mine = project / "validation" / "my-photo.png"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"my own picture")
    notes = project / "checkpoints" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("my notes")
    cfg = make_config(output_dir=str(project), max_train_steps=2, checkpointing_steps=0)
    # A project folder with a validation/ of its own is no earlier run: nothing to overwrite.
    assert main(["train", str(cfg)]) == 0
    capsys.readouterr()
    run = RunDir(project)
    assert run.checkpoint(2).is_dir() and run.validation_step(2).is_dir()
    err = refused(capsys, "train", cfg)
    assert "already holds a run" in err and "--overwrite" in err
    assert "already holds a run" in run.error_log.read_text()  # the traceback, in the run's log
    # The run's record: the folders it created, not the user's that it wrote into.
    created = json.loads((project / "run_files.json").read_text())["created"]
    assert "logs" in created and "validation" not in created and "checkpoints" not in created
    users_log = run.logs / "my-log.txt"
    users_log.write_text("the user's, in a folder the kit created")
    assert main(["train", str(cfg), "--overwrite"]) == 0
    assert mine.read_bytes() == b"my own picture" and notes.read_text() == "my notes"
    assert run.checkpoint(2).is_dir()  # the new run's
    assert users_log.is_file()  # removed file by file: a kit-made folder never goes whole
    assert sorted(p.name for p in run.validation.iterdir()) == [
        "index.json",  # the new run's index of its grids and clips
        "my-photo.png",
        "step-000002",
    ]


def _fake_run(tmp_path: Path, make_config) -> Path:
    """A run folder with a config and one complete checkpoint (nothing is loaded before the
    merge's output is checked)."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    load_config(make_config()).save(run.config)
    step = run.checkpoint(2)
    step.mkdir(parents=True)
    (step / ckpt.PROGRESS_FILE).write_text(json.dumps({"step": 2}))
    (step / ckpt.MARKER).write_text("2")
    return run.root


def test_merge_refuses_an_out_that_is_or_holds_the_base(capsys, make_config, tmp_path, tiny_sd15):
    run = _fake_run(tmp_path, make_config)
    before = snapshot(tiny_sd15)
    for out, fmt in (
        (tiny_sd15, "diffusers"),
        (tiny_sd15.parent, "diffusers"),
        (tiny_sd15 / "merged.safetensors", "single_file"),
        (tiny_sd15 / "unet" / "diffusion_pytorch_model.safetensors", "single_file"),
    ):
        err = refused(capsys, "merge", run, "--out", out, "--format", fmt)
        assert "--out" in err and str(tiny_sd15) in err
    users = tmp_path / "my-model.safetensors"
    users.write_bytes(b"not the kit's")
    err = refused(capsys, "merge", run, "--out", users)
    assert "not a checkpoint the kit merged" in err and users.read_bytes() == b"not the kit's"
    assert snapshot(tiny_sd15) == before


# ------------------------------------------------------------------ disks and the console


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (
            RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
            "no space",
        ),
        (OSError(errno.EROFS, "Read-only file system"), "read-only"),
    ],
)
def test_full_or_read_only_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, error, words):
    state = {"w": torch.zeros(2)}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    progress = {"step": 2, "epoch": 0, "position": 0}
    first = ckpt.save_checkpoint(tmp_path, 2, state, opt, sched, torch.Generator(), progress)

    def full(*a, **k):
        raise error

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(KitError) as e:
        ckpt.save_checkpoint(tmp_path, 4, state, opt, sched, torch.Generator(), progress)
    msg = str(e.value)
    assert "step 4" in msg and words in msg and "GiB free" in msg
    if words == "no space":  # how much it needed: the size of the last complete checkpoint
        size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
        assert f"about {max(size / 1024, 1):.0f} KiB needed" in msg
    assert f"{first} is intact" in msg and "partial one was removed" in msg
    assert not list(RunDir(tmp_path).checkpoints.glob(".*tmp"))
    assert (first / ckpt.MARKER).is_file()


def test_a_full_disk_under_an_export_or_cache_file_says_how_much_it_needed(tmp_path, monkeypatch):
    import safetensors.torch

    from kit.io import save_tensors

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(KitError) as e:
        save_tensors(tmp_path / "lora.safetensors", {"w": torch.zeros(1024, 1024)})
    msg = str(e.value)
    assert msg.startswith("could not write lora.safetensors: cannot write ")
    assert str(tmp_path) in msg and "about 4.0 MiB needed" in msg and "free there" in msg
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    import kit.cli

    def broken(args):
        raise ValueError("something deep\nand a second line")

    monkeypatch.setattr(kit.cli, "cmd_families", broken)
    assert main(["families"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected ValueError: something deep" in err
    assert "--debug" in err and "Traceback" not in err
    with pytest.raises(ValueError):
        main(["families", "--debug"])
    monkeypatch.setenv("KIT_DEBUG", "1")
    with pytest.raises(ValueError):
        main(["families"])


# ------------------------------------------------------------------ odd files in a dataset


def test_fifo_and_unread_formats_are_skipped_by_name_never_opened(capsys, make_config, dataset):
    import signal

    from kit.config import load_config
    from kit.data.scan import scan_folder

    os.mkfifo(dataset / "stuck.png")  # opening it for reading would block forever
    (dataset / "photo.gif").write_bytes(b"GIF89a")
    (dataset / "scan.TIFF").write_bytes(b"II*\x00")
    (dataset / "phone.heic").write_bytes(b"\x00")
    cfg = make_config()
    signal.alarm(120)  # a hang fails the test instead of the suite
    try:
        report = scan_folder(load_config(cfg).data, family=None)
        rc = main(["buckets", str(cfg)])
    finally:
        signal.alarm(0)
    assert rc == 0, capsys.readouterr().err
    why = {p.name: w for p, w in report.skipped}
    assert "not a regular file" in why["stuck.png"]
    assert why["scan.TIFF"].startswith("a .tiff image: a format the kit does not read")
    assert ".heic" in why["phone.heic"]
    assert "photo.gif" not in why  # without a family a GIF may be a clip; an image family:
    from kit.families import get_family

    image_family = get_family("sd15")
    report = scan_folder(load_config(cfg).data, family=image_family)
    assert ".gif image" in {p.name: w for p, w in report.skipped}["photo.gif"]


def test_folders_written_whole_follow_the_umask(tmp_path):
    from kit.io import atomic_dir

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "a.txt").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------ exports


def test_exports_say_their_clients_and_a_failed_one_is_moved_aside(
    capsys, make_config, tmp_path, monkeypatch
):
    from kit.export import writer

    cfg = make_config(max_train_steps=2, checkpointing_steps=0)
    assert main(["train", str(cfg)]) == 0
    run = RunDir(tmp_path / "run")
    capsys.readouterr()
    monkeypatch.setattr(
        writer, "verify_export", lambda *a, **k: writer.Verification(1, 0, 0.0, True)
    )
    assert main(["export", str(run.root), "--format", "diffusers"]) == 0
    out = capsys.readouterr().out
    assert "for: diffusers (pipe.load_lora_weights); other clients: use the kohya file" in out
    record = json.loads(next((run.exports / "diffusers").glob("*.verify.json")).read_text())
    assert record["use_in"][0].startswith("diffusers")
    # A run without a kohya file (Flux or SD3 DoRA) says that none of its files is for ComfyUI.
    alone = writer.use_in("diffusers", writer.Verification(1, 0, 0.0, True), ("diffusers",))
    assert "ComfyUI, A1111 and Forge: no file of this run loads there exactly" in alone[1]

    monkeypatch.setattr(
        writer, "verify_export", lambda *a, **k: writer.Verification(1, 90, 9.0, False)
    )
    assert main(["export", str(run.root), "--format", "diffusers"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffusers: failed: ") and err.count("\n") == 1
    assert "not trustworthy: moved to" in err and "rejected" in err
    assert not list((run.exports / "diffusers").glob("*.safetensors"))  # not where users look
    rejected = run.rejected_exports / "diffusers"
    assert list(rejected.glob("*.safetensors")) and list(rejected.glob("*.verify.json"))
