"""Google Colab: whether we run there, where Drive is mounted, and where runs should be written.

A Colab machine forgets its disk when the session ends, so runs belong on Google Drive once it is
mounted (`from google.colab import drive; drive.mount("/content/drive")`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kit.errors import KitError

DRIVE_ROOT = Path("/content/drive/MyDrive")
DRIVE_ENV = "KIT_DRIVE_ROOT"
"""Environment variable naming another folder to treat as the mounted Drive (tests, other hosts)."""
RUNS_FOLDER = "kit-runs"
"""Folder on Drive that holds the kit's runs."""


def in_colab() -> bool:
    """True when `google.colab` can be imported, i.e. inside a Colab runtime."""
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):
        # find_spec imports the parent package `google`, which may be missing or half-installed.
        return False


def drive_root() -> Path | None:
    """The mounted Drive folder (`$KIT_DRIVE_ROOT`, else /content/drive/MyDrive), or None."""
    root = Path(os.environ.get(DRIVE_ENV) or DRIVE_ROOT)
    return root if root.is_dir() else None


def default_output_dir(run_name: str) -> str:
    """Where a run named `run_name` is written: on Drive when mounted, else `runs/RUN_NAME`."""
    name = run_name.strip()
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise KitError(f"run name {run_name!r} must be a plain folder name (no slashes)")
    root = drive_root()
    return str(root / RUNS_FOLDER / name) if root is not None else f"runs/{name}"
