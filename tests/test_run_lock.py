"""One run per folder: a second process is refused by name, a crashed one's lock is stale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kit.cli import main
from kit.errors import KitError
from kit.run import lock
from kit.run.folder import RunDir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


@pytest.fixture()
def holder():
    """`holder(folder)`: another process that takes the folder's lock and keeps it."""
    procs: list[subprocess.Popen] = []

    def start(root: Path, command: str = "train") -> subprocess.Popen:
        code = (
            "import time; from kit.run.lock import acquire; "
            f"acquire({str(root)!r}, {command!r}); print('held', flush=True); time.sleep(120)"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        procs.append(p)
        assert p.stdout.readline().strip() == b"held"
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_second_process_is_refused_with_the_first_ones_pid(tmp_path, holder):
    p = holder(tmp_path / "run")
    with pytest.raises(KitError) as e:
        lock.acquire(tmp_path / "run", "export")
    msg = str(e.value)
    assert f"pid {p.pid}" in msg and "`kit train`" in msg and "started 20" in msg
    assert lock.holder(tmp_path / "run")["pid"] == p.pid


def test_a_killed_holders_lock_is_stale_and_taken_over(tmp_path, holder):
    root = tmp_path / "run"
    p = holder(root)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert RunDir(root).lock.is_file()  # left behind by the crash...
    assert lock.holder(root) is None  # ...but held by nobody
    with pytest.warns(UserWarning, match=f"pid {p.pid}.*stale"):
        with lock.hold_run(root, "train"):
            assert json.loads(RunDir(root).lock.read_text())["pid"] == os.getpid()
    assert not RunDir(root).lock.exists()  # released on exit


def test_lock_is_released_on_an_error_and_reentrant_in_one_process(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(RuntimeError), lock.hold_run(root, "train"):
        with lock.hold_run(root, "export"):  # the same process: no refusal
            pass
        assert RunDir(root).lock.is_file()
        raise RuntimeError("boom")
    assert not RunDir(root).lock.exists()
    assert not root.exists()  # the lock made the folder, nothing was written: gone again


def test_pid_record_decides_where_no_kernel_lock(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert lock._stale_pid({"pid": dead.pid, "boot_id": lock.boot_id()})
    assert lock._stale_pid({"pid": os.getpid(), "boot_id": "another-boot"})
    assert not lock._stale_pid({"pid": os.getpid(), "boot_id": lock.boot_id()})


def test_kit_train_and_export_refused_while_a_run_trains(capsys, make_config, holder, tmp_path):
    cfg = make_config()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "dataset_manifest.json").write_text("[]")
    before = sorted(p.name for p in run.iterdir())
    p = holder(run)
    for argv in (
        ["train", cfg],
        ["train", cfg, "--resume", "latest"],
        ["export", run, "--format", "kohya"],
    ):
        rc = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err
        assert f"in use by `kit train` (pid {p.pid}" in err
    assert sorted(p.name for p in run.iterdir() if p.name != ".kit.lock") == before
