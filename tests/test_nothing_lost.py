"""Nothing of the user's is lost, nothing silently wrong is trusted: `--overwrite` removes only
what a run wrote, a run never writes over a user's file, every relative path in a config is
read from the config's folder, and damaged saved state is refused or rebuilt, never trusted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from kit.cli import main
from kit.config import SECTIONS, load_config
from kit.run.folder import RunDir


def hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` (its path relative to it) and the SHA-256 of its bytes."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def refused(capsys, *argv) -> str:
    """Run `kit ARGV`, expecting one line of refusal and no traceback; return it."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("kit: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ the run folder


def test_overwrite_removes_only_the_files_the_run_wrote(capsys, make_config, tmp_path):
    project = tmp_path / "project"
    run = RunDir(project)
    cfg = make_config(output_dir=str(project), max_train_steps=2, checkpointing_steps=0)
    assert main(["train", str(cfg)]) == 0
    assert main(["export", str(project)]) == 0
    capsys.readouterr()
    before = hashes(project)
    capsys.readouterr()
    old_kit_files = set(hashes(project))
    # What the user puts into the folders the run made: notes, favourite grids, a file beside
    # an export and inside a grid's folder.
    grid = next(run.validation_step(2).glob("*.png"))
    mine = {
        "exports/my-notes.txt": b"which export I liked",
        "logs/my-log.txt": b"my own log",
        "validation/my_picks/favourite.png": grid.read_bytes(),
        "validation/step-000002/keep-this.txt": b"a note beside the grid",
        "checkpoints/README.txt": b"mine",
    }
    for rel, data in mine.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(data)
    (project / "validation" / "empty-of-mine").mkdir()
    # Inside an export's own folder: exporting again writes its files beside it.
    fmt = next(p for p in run.exports.iterdir() if p.is_dir() and p.name != "rejected")
    mine[f"exports/{fmt.name}/my-copy.txt"] = b"kept beside the export"
    (fmt / "my-copy.txt").write_bytes(mine[f"exports/{fmt.name}/my-copy.txt"])
    assert main(["export", str(project)]) == 0
    capsys.readouterr()
    before = hashes(project)
    assert main(["train", str(cfg), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "kept 6 of yours" in out  # told, not silent
    after = hashes(project)
    for rel in mine:
        assert after.get(rel) == before[rel], rel  # every file of the user's, byte for byte
    assert (project / "validation" / "empty-of-mine").is_dir()
    # Nothing of the earlier run is left but what the new one wrote again.
    written = {
        json.loads(line) for line in (project / "written.jsonl").read_text().splitlines()[1:]
    }
    assert set(after) - set(mine) <= written | {
        "run_files.json",
        "written.jsonl",
        "config.json",
        "dataset_manifest.json",
    }
    assert not any(p.startswith("exports/") for p in set(after) - set(mine))
    assert len(run.read_metrics()) == len([r for r in run.read_metrics() if r["step"] <= 2])
    assert old_kit_files  # the earlier run wrote files, and they were there to remove


@pytest.mark.slow
def test_overwrite_of_a_run_from_before_the_ledger_keeps_the_users_files(
    capsys, make_config, tmp_path
):
    project = tmp_path / "project"
    cfg = make_config(output_dir=str(project), max_train_steps=2, checkpointing_steps=0)
    assert main(["train", str(cfg)]) == 0
    assert main(["export", str(project)]) == 0
    (project / "written.jsonl").unlink()  # as the kit before it left a run
    mine = {
        "exports/my-notes.txt": b"mine",
        "logs/my-log.txt": b"mine",
        "validation/my_picks/favourite.txt": b"mine",
    }
    for rel, data in mine.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(data)
    old_grid = next(RunDir(project).validation_step(2).glob("*.png"))
    old_grid.write_bytes(b"the earlier run's grid")  # so that its removal shows
    capsys.readouterr()
    assert main(["train", str(cfg), "--overwrite"]) == 0
    after = hashes(project)
    assert all(after.get(rel) == hashlib.sha256(d).hexdigest() for rel, d in mine.items())
    assert (
        after[old_grid.relative_to(project).as_posix()]
        != hashlib.sha256(b"the earlier run's grid").hexdigest()
    )


def test_the_trackers_files_are_listed_as_the_runs(make_config, tmp_path, capsys):
    cfg = make_config(max_train_steps=1, checkpointing_steps=0, report_to="tensorboard")
    assert main(["train", str(cfg)]) == 0
    run = tmp_path / "run"
    events = {
        p.relative_to(run).as_posix() for p in (run / "logs" / "kit").rglob("*") if p.is_file()
    }
    lines = (run / "written.jsonl").read_text().splitlines()[1:]
    assert events and events <= {json.loads(x) for x in lines}  # --overwrite removes them too


def test_a_run_never_writes_over_a_file_it_did_not_write(tmp_path):
    from kit.errors import KitError
    from kit.io import LEDGER, atomic_dir, write_text

    (tmp_path / LEDGER).write_text(json.dumps({"tracks": ["exports", "loss.png"]}) + "\n")
    write_text(tmp_path / "loss.png", "the kit's")
    write_text(tmp_path / "loss.png", "the kit's, again")  # listed as the kit's: replaced
    theirs = tmp_path / "exports" / "x" / "mine.txt"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("mine")
    before = hashes(tmp_path)
    with pytest.raises(KitError, match=r"mine.txt was not written by the kit"):
        with atomic_dir(tmp_path / "exports" / "x") as tmp:
            (tmp / "weights.safetensors").write_text("new")
    with pytest.raises(KitError, match=r"mine.txt was not written by the kit"):
        write_text(theirs, "the kit's")
    assert hashes(tmp_path) == before


def test_a_folder_holding_the_users_files_of_a_runs_names_is_refused(
    capsys, make_config, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("loss.png", "archive.json", "doctor.json"):
        (project / name).write_bytes(b"the user's own " + name.encode())
    cfg = make_config("project/config.json", output_dir=".")  # the config's own folder
    (project / "config.json").rename(project / "my-config.json")  # no config.json of the run's
    cfg = project / "my-config.json"
    monkeypatch.chdir(tmp_path)
    for name in ("loss.png", "archive.json", "doctor.json"):
        before = hashes(project)
        err = refused(capsys, "train", cfg)
        assert f"{project / name}" in err and "output_dir" in err, err
        assert hashes(project) == before  # nothing written, nothing changed
        (project / name).rename(project / f"{name}.kept")


# ------------------------------------------------------------------ config paths


def _path_keys() -> dict[str, tuple[type, str]]:
    """Every config key that names a path (its `path` metadata), nested records included, as
    `Record.key` → (record class, kind)."""
    found: dict[str, tuple[type, str]] = {}
    todo = list(SECTIONS.values())
    while todo:
        cls = todo.pop()
        for f in dataclasses.fields(cls):
            if f.metadata.get("path"):
                found[f"{cls.__name__}.{f.name}"] = (cls, f.metadata["path"])
            for t in typing_args(cls, f.name):
                if dataclasses.is_dataclass(t) and t not in todo:
                    todo.append(t)
    return found


def typing_args(cls: type, name: str) -> list[type]:
    """The classes a field's type names (its list's items, its optional's record)."""
    import typing

    hint = typing.get_type_hints(cls)[name]
    out, stack = [], [hint]
    while stack:
        t = stack.pop()
        out.append(t)
        stack.extend(typing.get_args(t))
    return [t for t in out if isinstance(t, type)]


PATH_KEYS = {
    "ModelConfig.pretrained_model",
    "ModelConfig.model_config",
    "ModelConfig.vae_model",
    "ModelConfig.training_adapter",
    "DataConfig.image_dir",
    "DataConfig.caption_dir",
    "DataConfig.cache_dir",
    "DataConfig.mask_dir",
    "DataConfig.control_dir",
    "TrainConfig.output_dir",
    "ValidationConfig.validation_image_dir",
    "DatasetConfig.hf_dataset",
    "DatasetConfig.shards",
    "DatasetConfig.image_dir",
    "DatasetConfig.caption_dir",
    "DatasetConfig.mask_dir",
    "DatasetConfig.control_dir",
    "ValidationPrompt.control",
}
"""Every key that names a file or folder: each is marked, and read by one rule."""

HUB_OR_PATH = {"pretrained_model", "model_config", "vae_model", "training_adapter", "hf_dataset"}
"""The keys that may name a hub id instead of a local path."""


def test_every_path_key_is_marked():
    assert set(_path_keys()) == PATH_KEYS


def _config_with(key: str, value: str) -> dict:
    """The smallest config that sets `Record.key` to `value` (a list where the key is one)."""
    record, name = key.split(".")
    v = [value] if name in ("control_dir", "control") else value
    if record == "DatasetConfig":
        source = {} if name in ("hf_dataset", "shards", "image_dir") else {"image_dir": "imgs"}
        return {"datasets": [{**source, name: v}]}
    if record == "ValidationPrompt":
        return {"validation_prompts": [{"prompt": "a", name: v}]}
    return {name: v}


def _read_back(cfg, key: str):
    record, name = key.split(".")
    if record == "DatasetConfig":
        return getattr(cfg.data.datasets[0], name)
    if record == "ValidationPrompt":
        return getattr(cfg.validation.validation_prompts[0], name)
    section = next(s for s, c in SECTIONS.items() if c.__name__ == record)
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("key", sorted(PATH_KEYS))
def test_a_relative_path_key_is_read_from_the_config_files_folder(key, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "things" / "here").mkdir(parents=True)
    (folder / "imgs").mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(_config_with(key, "things/here")))
    monkeypatch.chdir(tmp_path)  # the current folder is not the config's
    got = _read_back(load_config(path), key)
    got = got[0] if isinstance(got, list) else got
    assert Path(got) == (folder / "things" / "here").resolve(), key
    if key.split(".")[1] in HUB_OR_PATH:
        # A hub id (no such local path) stays a hub id.
        path.write_text(json.dumps(_config_with(key, "someone/some-model")))
        assert _read_back(load_config(path), key) == "someone/some-model"


@pytest.mark.parametrize("key", ["pretrained_model", "vae_model", "training_adapter"])
def test_a_missing_relative_file_is_looked_for_beside_the_config(key, tmp_path, monkeypatch):
    path = tmp_path / "project" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({key: "models/missing.safetensors"}))
    monkeypatch.chdir(tmp_path)
    got = getattr(load_config(path).model, key)
    assert got == str(tmp_path / "project" / "models" / "missing.safetensors")


# ------------------------------------------------------------------ damaged state on resume


@pytest.fixture()
def finished_run(make_config, tmp_path, capsys):
    """A run of two steps and its one checkpoint (at the end)."""
    cfg = make_config(max_train_steps=2, checkpointing_steps=0)
    assert main(["train", str(cfg)]) == 0
    capsys.readouterr()
    run = RunDir(tmp_path / "run")
    return cfg, run.checkpoint(2)


DAMAGES = [
    ("position", 10**9),  # past the end of any epoch
    ("position", -5),
    ("position", [1, 2]),  # not a position at all
    ("epoch", -5),
    ("epoch", "1"),
    ("epoch", 10**6),  # more epochs than batches trained
    ("epoch", None),  # missing: was `unexpected KeyError: 'epoch'`
    ("step", 7),  # another step than the checkpoint's
]


LOGS = ("logs", "written.jsonl")


def test_a_damaged_saved_position_is_refused_naming_checkpoint_and_key(finished_run, capsys):
    cfg, checkpoint = finished_run
    progress = checkpoint / "progress.json"
    good = json.loads(progress.read_text())
    for key, value in DAMAGES:
        saved = dict(good)
        if value is None:
            del saved[key]
        else:
            saved[key] = value
        progress.write_text(json.dumps(saved))
        before = hashes(checkpoint.parent.parent)
        err = refused(capsys, "train", cfg, "--resume", "latest")
        assert str(checkpoint) in err and f"'{key}'" in err, (key, value, err)
        assert "KeyError" not in err
        # Nothing is written but the error log (and its line in the ledger).
        kept = lambda h: {k: v for k, v in h.items() if k.split("/")[0] not in LOGS}  # noqa: E731
        assert kept(hashes(checkpoint.parent.parent)) == kept(before)


def test_captions_edited_since_the_checkpoint_are_named_and_the_user_chooses(
    finished_run, dataset, capsys
):
    cfg, checkpoint = finished_run
    edited = sorted(dataset.glob("*.txt"))[:2]
    for f in edited:
        f.write_text(f.read_text().strip() + ", edited\n")
    err = refused(capsys, "train", cfg, "--resume", "latest", "-s", "max_train_steps=3")
    assert all(f.stem in err for f in edited), err
    assert "captions" in err and "--force" in err and "--overwrite" in err
    # Resuming on the new captions is the user's choice; they are named again as it does.
    args = ["train", str(cfg), "--resume", "latest", "--force", "-s", "max_train_steps=3"]
    assert main(args) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(warned) == 1 and "captions" in warned[0], warned
    assert all(f.stem in warned[0] for f in edited)
