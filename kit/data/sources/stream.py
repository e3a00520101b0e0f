"""A Hugging Face dataset read as a stream (`streaming: true`), scanned block by block: each row's
size from its image's header, its caption, and the digest of its bytes, as the memory-mapped
reader gives them, with nothing downloaded whole.

The position in the stream is saved as the read goes: every `CHECKPOINT` rows, the scan of those
rows (`<key>.<n>.json`) and then the stream's `state_dict` with the rows done
(`<key>.progress.json`), each written atomically, in the cache folder's `scans/`. A read killed
in the middle (a lost connection, a stopped job) resumes from the last saved position; a block
read to its end is saved whole (`<key>.json`) as every source's scan is, and its progress
dropped. The cache reads the rows a second time, block by block in order (`kit.data.streamed`).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kit.data.blob import Blob, reach, sha256
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_sample
from kit.data.streamed import block, block_count, first_line, open_stream, row_bytes
from kit.errors import DataError
from kit.io import write_json

CHECKPOINT = 1000
"""Rows read between two saved positions in the stream."""


def scan_stream(view: DatasetView) -> ScanReport:
    """Every row of the entry's `hf_dataset` split, read as a stream, as samples (or problems)."""
    entry, cfg = view.entry, view.data
    assert entry is not None
    name, split = entry.hf_dataset, entry.split
    if cfg.masked_loss:
        raise DataError(
            "masked_loss: masks are not read from a stream; set streaming false (the dataset "
            "is then downloaded once) or masked_loss false for this dataset"
        )
    reach(f"hf_dataset {name}", name)  # a server that never answers, named in one line
    ds, ident = open_stream(name, split)
    columns = [entry.image_column]
    if cfg.caption_strategy == "textfile":
        columns.append(entry.caption_column)
    have = list(ds.features) if ds.features is not None else None
    for key, column in zip(("image_column", "caption_column"), columns, strict=False):
        if have is not None and column not in have:
            raise DataError(
                f"hf_dataset {name} ({split}) has no column {column!r} "
                f"(its columns: {', '.join(have)}); set {key}"
            )
    n = block_count(ds)
    folder = index.scan_dir(cfg)
    parts: dict[int, ScanReport] = {}
    for b in index.rotated(list(range(n))):  # each process of a launch starts at its own block
        unit = f"{name} ({split}) stream {' '.join(columns)} block {b} of {n}"
        key = index.key(unit, cfg, ident or None)
        part = index.load(folder, key)
        if part is None:
            part = _scan_block(view, ds, (b, n), columns, folder, key)
            index.save(folder, key, part)
            _forget_progress(folder, key)
        parts[b] = part
    report = ScanReport()
    for b in range(n):
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(parts[b], f.name))
    return report


def _examples(stream: Any) -> Iterator[dict]:
    """The rows of a block, as the stream gives them (the one place rows are pulled)."""
    yield from stream


def _scan_block(
    view: DatasetView,
    ds: Any,
    at: tuple[int, int],
    columns: list[str],
    folder: Path,
    key: str | None,
) -> ScanReport:
    """The samples of one block, resumed from its saved position when a read stopped there."""
    entry = view.entry
    assert entry is not None
    stream = block(ds, at[0], columns)
    report, row, chunks = _resume(folder, key, stream, at[0])
    saved, pending = row, ScanReport()
    try:
        for example in _examples(stream):
            _add_row(pending, view, at, row, example, columns)
            row += 1
            if key is not None and row % CHECKPOINT == 0:
                index.save(folder, f"{key}.{chunks}", pending)
                chunks += 1
                state = stream.state_dict()
                write_json(folder / f"{key}.progress.json", [row, chunks, state])
                _extend(report, pending)
                saved, pending = row, ScanReport()
    except Exception as e:
        if key is not None and row == saved and saved > 0 and not isinstance(e, OSError):
            # The stream failed before one row past the saved position: the position is what
            # is damaged (an edit, a library that reads it otherwise), not the stream. Kept, it
            # would fail every later run too: the block is read again from its start.
            _damaged(folder, key, at[0], f"the stream could not start there: {first_line(e)}")
            return _scan_block(view, ds, at, columns, folder, key)
        if not isinstance(e, (OSError, ValueError)):
            raise
        raise DataError(
            f"hf_dataset {entry.hf_dataset} ({entry.split}): the stream broke at row {row} of "
            f"block {at[0]}: {first_line(e)}; run "
            f"again to resume from row {saved}"
        ) from None
    _extend(report, pending)
    return report


def _resume(folder: Path, key: str | None, stream: Any, b: int) -> tuple[ScanReport, int, int]:
    """What a stopped read of block `b` saved: its scan so far, its next row and the number of
    parts saved; the stream is moved to that row. Nothing saved: the start; a saved position
    that is damaged is dropped, with a warning, and the block read from its start."""
    report = ScanReport()
    if key is None:
        return report, 0, 0
    try:
        saved = json.loads((folder / f"{key}.progress.json").read_text("utf-8"))
    except OSError:
        return report, 0, 0
    except ValueError:
        saved = None
    why = _position_damage(saved)
    if why:
        _damaged(folder, key, b, why)
        return report, 0, 0
    row, chunks, state = saved
    parts = [index.load(folder, f"{key}.{i}") for i in range(chunks)]
    if any(p is None for p in parts):
        return report, 0, 0
    for p in parts:
        assert p is not None
        _extend(report, p)
    stream.load_state_dict(state)
    return report, row, chunks


def _position_damage(saved: Any) -> str:
    """Why a saved position `[row, parts, state]` cannot be where a read stopped ("" if it can)."""
    if not isinstance(saved, list) or len(saved) != 3:
        return "not [row, parts, stream state]"
    row, chunks, state = saved
    if any(type(v) is not int or v < 0 for v in (row, chunks)):
        return f"row {row!r} and parts {chunks!r} are not counts"
    if row != chunks * CHECKPOINT:
        return f"row {row} is not where part {chunks} of {CHECKPOINT} rows each ends"
    if not isinstance(state, dict):
        return "its stream state is not a record"
    return ""


def _damaged(folder: Path, key: str, b: int, why: str) -> None:
    """Drop a damaged saved position, saying so once: the block is then read from its start."""
    _forget_progress(folder, key)
    warnings.warn(
        f"{folder / f'{key}.progress.json'}: the saved position in stream block {b} is damaged "
        f"({why}); reading the block again from its start",
        stacklevel=2,
    )


def _forget_progress(folder: Path, key: str | None) -> None:
    """Drop a finished block's saved positions (its whole scan is saved)."""
    if key is None:
        return
    for f in [folder / f"{key}.progress.json", *folder.glob(f"{key}.*.json")]:
        f.unlink(missing_ok=True)


def _add_row(
    report: ScanReport,
    view: DatasetView,
    at: tuple[int, int],
    row: int,
    example: dict,
    columns: list[str],
) -> None:
    """Record one row: its image's size and digest, its caption; or why it is left out."""
    entry, cfg = view.entry, view.data
    assert entry is not None
    label = entry.source_name()
    name = f"{label}[{row}]" if at[1] == 1 else f"{label}[{at[0]}:{row}]"
    try:
        data = row_bytes(example[columns[0]], name, columns[0])
    except DataError as e:
        report.unreadable.append((Path(name), str(e)))
        return
    cell = (entry.hf_dataset, entry.split, columns[0], str(at[0]))
    blob = Blob(name, sha256(data), start=row, size=len(data), table=cell)
    text = example.get(columns[1]) if len(columns) > 1 else None
    add_sample(report, cfg, blob, data, None if text is None else str(text).strip())


def _extend(report: ScanReport, part: ScanReport) -> None:
    for f in dataclasses.fields(ScanReport):
        getattr(report, f.name).extend(getattr(part, f.name))
