"""Which files of a run folder the kit wrote: the run's own record, read by `--overwrite`.

A run may be pointed at a project folder that already holds the user's files, and the user may
add files to the run's folders afterwards (notes in `logs/`, picks in `validation/my_picks/`).
Before its first write a run starts a ledger (`written.jsonl`, see `kit.io.LEDGER`) in which
every file the kit writes into its outputs is listed; `--overwrite` removes those files one by
one and then the folders they leave empty, never a whole folder, so whatever the user put
anywhere in the run folder stays. `run_files.json` records which top-level entries the kit
created; a run from before the ledger is read by it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from kit.errors import KitError
from kit.io import LEDGER, untracked, write_text, written_files
from kit.run.folder import RunDir

RECORD = "run_files.json"
"""The record of what the kit created in a run folder, beside the run's config."""

_KIT_NAMED = re.compile(r"step-\d+|\.step-\d+.*\.tmp|.+-scales")
"""What a run writes into a folder that was the user's before it: checkpoints, grids."""

_KIT_LOGS = re.compile(r"metrics\.jsonl|error\.log|timing\.jsonl|process-\d+\.jsonl|kit|wandb")
"""What a run writes into `logs/`: its logs, and its trackers' folders (TensorBoard's is named
`kit`, see `kit.train.log`)."""

_STAGED = re.compile(r"\.step-\d+.*\.tmp")
"""A checkpoint staged by a run that stopped before it was complete."""


def record_path(run: RunDir) -> Path:
    return run.root / RECORD


def ledger_path(run: RunDir) -> Path:
    return run.root / LEDGER


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
        run.doctor_report,
    ]


def fixed_files(run: RunDir) -> list[Path]:
    """The files a run writes under names of its own: a user's file of the same name is refused
    before the run starts, never replaced."""
    return [
        run.loss_plot,
        run.archive,
        run.doctor_report,
        run.data_report,
        run.metrics,
        run.validation / "index.json",
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


def _files_under(run: RunDir, path: Path) -> set[str]:
    """Every file at or under `path`, relative to the run folder."""
    found = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
    return {p.relative_to(run.root).as_posix() for p in found if p.is_file()}


def _legacy_files(run: RunDir) -> set[str]:
    """A run from before the ledger: the entries it names itself (checkpoints, grids, its
    logs, its export folders, its fixed files), never anything else in the folders it made,
    where the user may have put files since."""
    if not (old_run_files(run) or run.manifest.is_file()):
        return set()  # no run here: every file is the user's
    found = kit_entries(run.checkpoints) + kit_entries(run.validation) + fixed_files(run)
    found += [run.validation_controls]
    if run.logs.is_dir():
        found += [p for p in run.logs.iterdir() if _KIT_LOGS.fullmatch(p.name)]
    if run.exports.name in created(run) and run.exports.is_dir():
        found += [p for p in run.exports.iterdir() if p.is_dir()]  # one folder per format
    mine: set[str] = set()
    for p in found:
        mine |= _files_under(run, p)
    return mine


def own_files(run: RunDir) -> set[str]:
    """The files (relative to the run folder) the kit wrote there, by the ledger."""
    listed = written_files(run.root)
    return _legacy_files(run) if listed is None else listed


def note_outputs(run: RunDir) -> int:
    """Record each top-level output that does not exist yet, before the run writes it (kept
    across runs: what the kit created once stays the kit's), and start the ledger where there
    is none. Returns the ledger's length: the files listed past it are this run's."""
    names = created(run)
    fresh = [p.name for p in outputs(run) if not p.exists() and p.name not in names]
    if fresh or not record_path(run).is_file():
        payload = {"created": sorted({*names, *fresh})}
        write_text(record_path(run), json.dumps(payload, indent=2) + "\n")
    if not ledger_path(run).is_file():
        _write_ledger(run, sorted(_legacy_files(run)))
    return len(ledger_path(run).read_text(encoding="utf-8").splitlines())


def _listed_since(run: RunDir, since: int) -> set[str]:
    """The files the ledger lists past line `since`: the current run's."""
    out = set()
    for line in ledger_path(run).read_text(encoding="utf-8").splitlines()[since:]:
        with contextlib.suppress(ValueError):
            out.add(json.loads(line))
    return {x for x in out if isinstance(x, str)}


def _write_ledger(run: RunDir, files: list[str]) -> None:
    header = json.dumps({"tracks": [p.name for p in outputs(run)]})
    write_text(ledger_path(run), "".join(f"{line}\n" for line in [header, *map(json.dumps, files)]))


def kit_entries(folder: Path) -> list[Path]:
    """The entries of `folder` that a run wrote by the names it gives them."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _KIT_NAMED.fullmatch(p.name))


def old_run_files(run: RunDir) -> list[Path]:
    """What an earlier run left in `run`: its checkpoints, metrics and validation grids."""
    found = kit_entries(run.checkpoints) + kit_entries(run.validation)
    return found + [p for p in (run.metrics,) if p.is_file()]


def foreign_files(run: RunDir) -> list[Path]:
    """Files of the names a run writes that the kit did not write there: the user's own."""
    mine = own_files(run)
    return [
        p
        for p in fixed_files(run)
        if p.is_file() and p.relative_to(run.root).as_posix() not in mine
    ]


def refuse_foreign_files(run: RunDir, key: str = "output_dir") -> None:
    """Before anything is written: a file of the user's where the run writes one of its own
    is named, never replaced."""
    theirs = foreign_files(run)
    if theirs:
        raise KitError(
            f"{key}: {run.root} holds {theirs[0]}, which no run wrote, and the run writes a "
            f"file of that name; give the run a folder of its own (e.g. runs/my-lora), or move "
            f"{theirs[0].name} away"
        )


def clear_run(run: RunDir, since: int | None = None) -> tuple[list[Path], list[Path]]:
    """Remove an earlier run's outputs file by file: each file the ledger lists (above line
    `since`, where this run's own files begin), staged checkpoints, then the folders left empty
    (never a top-level folder the kit did not create). The user's files stay, wherever they
    are. Returns what was removed and the user's files kept among the run's outputs."""
    new = _listed_since(run, since) if since else set()
    old = own_files(run) - new
    tracked = {p.name for p in outputs(run)}
    gone: list[Path] = []
    for rel in sorted(old):
        p = run.root / rel
        # Only plain paths into the run's outputs: an edited ledger removes nothing else.
        safe = ".." not in Path(rel).parts and Path(rel).parts[:1] in [(t,) for t in tracked]
        if safe and (p.is_file() or p.is_symlink()):
            p.unlink()
            gone.append(p)
    for p in run.checkpoints.iterdir() if run.checkpoints.is_dir() else []:
        if _STAGED.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p)  # hidden, and named by the kit: never the user's
            gone.append(p)
    mine = set(created(run))
    emptied = {q for p in gone for q in p.parents if run.root in q.parents}
    for folder in sorted(emptied, key=lambda q: len(q.parts), reverse=True):
        if folder.parent == run.root and folder.name not in mine:
            continue  # the user's own folder, even empty
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    _write_ledger(run, sorted(new))
    kept = [p for out in outputs(run) for p in untracked(out)]
    return gone, kept


def refuse_mixed_runs(run: RunDir, resume: str | None, overwrite: bool) -> None:
    """A new run may not write into an old one's folder unless asked to replace it."""
    if not resume and not overwrite and old_run_files(run):
        raise KitError(
            f"{run.root} already holds a run; resume it (--resume latest), "
            "choose another output_dir, or pass --overwrite to replace it (only the files the "
            f"run wrote are removed, listed in {LEDGER}; yours stay)"
        )
