"""`report_to: wandb`: a short run tracked by Weights & Biases offline, read back from wandb's own
run file; nothing local (paths, machine) in what would be uploaded; refused when not installed."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from kit.config import load_config
from kit.errors import KitError
from kit.run.folder import RunDir
from kit.train.log import log_row, shareable_config, start_trackers

pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def fresh_wandb():
    """wandb reads its environment once per process: each test starts it afresh."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture()
def offline(monkeypatch, tmp_path) -> Path:
    """wandb offline, its files in a folder of their own; the folder is returned."""
    folder = tmp_path / "wandb-dir"
    folder.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return folder


def records(path: Path) -> list[Any]:
    """The records of a `.wandb` run file: a 7-byte header, then 32 KiB blocks of chunks (CRC,
    length, kind: whole, first, middle, last), each record one protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # the block's padding
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def read_run(folder: Path) -> dict[str, Any]:
    """The one offline run under `folder`: its run record, history rows and last summary."""
    import wandb

    # `finish` (accelerate's `end_training`) can return before wandb's service has written all
    # of the run file; shutting the service down waits for it.
    wandb.teardown()
    (run_dir,) = (folder / "wandb").glob("offline-run-*")
    (wandb_file,) = run_dir.glob("run-*.wandb")
    run, history, summary = None, [], {}
    for r in records(wandb_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            history.append(
                {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            )
        elif kind == "summary":
            for u in r.summary.update:
                summary["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    return {"dir": run_dir, "run": run, "config": config, "history": history, "summary": summary}


def test_wandb_run_offline(offline, tmp_path, make_config, tiny_sd15, dataset, capfd):
    """Two steps of the tiny SD1.5 with `report_to: wandb`: wandb's run holds every logged loss,
    the validation grid and the config, named after the run folder, without one local path."""
    from kit.train.loop import train

    cfg = load_config(
        make_config(report_to="wandb", max_train_steps=2, checkpointing_steps=0),
    )
    capfd.readouterr()
    result = train(cfg)
    out, err = capfd.readouterr()
    assert result.step == 2
    # wandb says nothing (kit.logs.quiet_libraries); the kit says where the run went.
    assert "wandb" not in err.lower(), err
    assert "W&B run saved offline in" in out

    got = read_run(offline)
    run_folder = Path(cfg.train.output_dir)
    assert got["run"].project == run_folder.name == got["run"].display_name
    rows = RunDir(run_folder).read_metrics()
    logged = {h["_step"]: h["loss"] for h in got["history"] if "loss" in h}
    assert logged == {r["step"]: pytest.approx(r["loss"]) for r in rows}
    assert got["summary"]["loss"] == pytest.approx(rows[-1]["loss"])
    assert any(k.startswith("validation/") for h in got["history"] for k in h)  # the grid...
    assert list((got["dir"] / "files" / "media").rglob("validation_2_*.png"))  # ...its file
    # The config's paths arrive as their last part only.
    assert got["config"]["image_dir"] == dataset.name
    assert got["config"]["pretrained_model"] == tiny_sd15.name
    assert got["config"]["output_dir"] == run_folder.name
    assert got["config"]["report_to"] == "wandb"

    # Not a byte of any local path the run knows of, nor of this machine's Python or checkout.
    local = {
        str(dataset),
        str(tiny_sd15),
        str(run_folder),
        cfg.data.cache_dir,
        sys.executable,
        str(Path(__file__).resolve().parent.parent),  # the checkout
        str(Path.cwd()),
    }
    for f in got["dir"].rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            for p in local:
                assert p.encode() not in data, f"{p} in {f}"


def test_wandb_names_and_default_folder(monkeypatch, tmp_path, make_config):
    """`WANDB_PROJECT` names the project; without `WANDB_DIR` wandb's files go in the run's
    `logs/`."""
    from kit.train.accel import make_accelerator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "zorb-tests")
    cfg = load_config(make_config(report_to="wandb", output_dir=str(tmp_path / "my:run")))
    run = RunDir(Path(cfg.train.output_dir))
    acc, _ = make_accelerator(cfg, run)
    start_trackers(acc, cfg)
    log_row(acc, run, {"step": 1, "loss": 0.25, "lr": 1e-3, "grad_norm": None})
    acc.end_training()
    got = read_run(run.logs)
    assert got["run"].project == "zorb-tests"
    assert got["run"].display_name == "my:run"
    assert [h["loss"] for h in got["history"] if "loss" in h] == [0.25]


def test_shareable_config_has_no_paths(make_config, tmp_path, tiny_sd15, dataset):
    """Every local path is cut to its name, lists of them too; other values are kept."""
    cfg = load_config(
        make_config(
            caption_dir=str(dataset),
            vae_model=str(tiny_sd15 / "vae"),
            validation_prompt=["a red zorbstar", str(tmp_path / "x.txt")],
        )
    )
    flat = shareable_config(cfg)
    assert flat["caption_dir"] == dataset.name
    assert flat["vae_model"] == "vae"
    assert json.loads(flat["validation_prompt"]) == ["a red zorbstar", "x.txt"]
    assert flat["learning_rate"] == cfg.get("learning_rate")
    blob = json.dumps(flat)
    assert str(tmp_path) not in blob and str(tiny_sd15.parent) not in blob


def test_refused_without_wandb(monkeypatch, make_config):
    """Without wandb installed, `report_to: wandb` stops before anything loads, saying how to
    install it."""
    from kit.train.loop import train

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "wandb" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg = load_config(make_config(report_to="wandb"))
    with pytest.raises(KitError, match=r"pip install wandb"):
        train(cfg)


def test_online_without_key_is_refused(monkeypatch, tmp_path, make_config):
    """An online run with no W&B key anywhere stops with a KitError saying where keys come
    from (the environment, `wandb login`), not wandb's own exception."""
    from kit.train.accel import make_accelerator

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings file
    cfg = load_config(make_config(report_to="wandb"))
    acc, _ = make_accelerator(cfg, RunDir(Path(cfg.train.output_dir)))
    with pytest.raises(KitError, match=r"WANDB_API_KEY.*wandb login.*WANDB_MODE=offline"):
        start_trackers(acc, cfg)
