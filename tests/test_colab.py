"""Colab helpers: detection, the Drive folder and where runs go, checked with a fake Drive."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kit.errors import KitError
from kit.run import colab


@pytest.fixture()
def drive(tmp_path, monkeypatch) -> Path:
    """A folder standing in for a mounted Google Drive."""
    root = tmp_path / "MyDrive"
    root.mkdir()
    monkeypatch.setenv(colab.DRIVE_ENV, str(root))
    return root


def test_not_in_colab_here():
    assert colab.in_colab() is False


def test_in_colab_when_google_colab_imports(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "google" / "colab"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from kit.run import colab; print(colab.in_colab())"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "site")], capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr


def test_drive_root_when_mounted(drive):
    assert colab.drive_root() == drive


def test_drive_root_when_not_mounted(tmp_path, monkeypatch):
    monkeypatch.setenv(colab.DRIVE_ENV, str(tmp_path / "not-mounted"))
    assert colab.drive_root() is None


def test_output_dir_on_drive(drive):
    out = colab.default_output_dir("mycat")
    assert Path(out) == drive / colab.RUNS_FOLDER / "mycat"


def test_output_dir_without_drive(tmp_path, monkeypatch):
    monkeypatch.setenv(colab.DRIVE_ENV, str(tmp_path / "not-mounted"))
    assert colab.default_output_dir("mycat") == "runs/mycat"


@pytest.mark.parametrize("name", ["", "a/b", "..", "  "])
def test_output_dir_refuses_bad_names(name, drive):
    with pytest.raises(KitError, match="run name"):
        colab.default_output_dir(name)
