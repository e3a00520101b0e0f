"""Which entries of a run folder the kit created: the run's own record, read by `--overwrite`.

A run may be pointed at a project folder that already holds the user's files, even folders of
the same names as the run's (`validation/`, `checkpoints/`). Before the first write, the run
records in `run_files.json` each of its top-level outputs that did not exist yet; `--overwrite`
removes those whole. Into a folder that was there before (the user's), a run writes only
entries it names itself (`step-NNNNNN`, `*-scales`), and only those are removed from it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from kit.errors import KitError
from kit.io import write_text
from kit.run.folder import RunDir

RECORD = "run_files.json"
"""The record of what the kit created in a run folder, beside the run's config."""

_KIT_NAMED = re.compile(r"step-\d+|\.step-\d+.*\.tmp|.+-scales")
"""What a run writes into a folder that was the user's before it: checkpoints, grids."""


def record_path(run: RunDir) -> Path:
    return run.root / RECORD


def outputs(run: RunDir) -> list[Path]:
    """The top-level entries a training run writes into its folder."""
    return [
        run.checkpoints,
        run.validation,
        run.logs,
        run.exports,
        run.loss_plot,
        run.data_report,
        run.archive,
    ]


def created(run: RunDir) -> list[str]:
    """The top-level entries (names relative to the run folder) the kit created, as recorded."""
    try:
        data = json.loads(record_path(run).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = data.get("created", []) if isinstance(data, dict) else []
    # Only plain names of the run folder's own entries: a record edited by hand to name
    # anything else (`..`, an absolute path) removes nothing.
    own = {p.name for p in outputs(run)}
    return [n for n in names if isinstance(n, str) and n in own]


def note_outputs(run: RunDir) -> None:
    """Record each top-level output that does not exist yet, before the run writes it (kept
    across runs: what the kit created once stays the kit's)."""
    names = created(run)
    fresh = [p.name for p in outputs(run) if not p.exists() and p.name not in names]
    if fresh or not record_path(run).is_file():
        payload = {"created": sorted({*names, *fresh})}
        write_text(record_path(run), json.dumps(payload, indent=2) + "\n")


def kit_entries(folder: Path) -> list[Path]:
    """The entries of `folder` that a run wrote by the names it gives them."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _KIT_NAMED.fullmatch(p.name))


def old_run_files(run: RunDir) -> list[Path]:
    """What an earlier run left in `run`: its checkpoints, metrics and validation grids."""
    found = kit_entries(run.checkpoints) + kit_entries(run.validation)
    return found + [p for p in (run.metrics,) if p.is_file()]


def clear_run(run: RunDir) -> list[Path]:
    """Remove an earlier run's outputs: each entry the record says the kit created, whole, and
    from the folders that were there before it only the entries the kit names itself (and the
    metrics file). Nothing else is touched; returns what was removed."""
    mine = {run.root / n for n in created(run)}
    gone = sorted(p for p in mine if p.exists() or p.is_symlink())
    for folder in (run.checkpoints, run.validation):
        if folder not in mine:
            gone += kit_entries(folder)
    if run.logs not in mine and run.metrics.is_file():
        gone.append(run.metrics)
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for folder in (run.checkpoints, run.validation):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return gone


def refuse_mixed_runs(run: RunDir, resume: str | None, overwrite: bool) -> None:
    """A new run may not write into an old one's folder unless asked to replace it."""
    if not resume and not overwrite and old_run_files(run):
        raise KitError(
            f"{run.root} already holds a run; resume it (--resume latest), "
            "choose another output_dir, or pass --overwrite to replace it (only what the run "
            f"wrote is removed: see {RECORD})"
        )
