"""A Hugging Face dataset as a training dataset: one sample per row of its image column, the
caption from its caption column. The table is memory-mapped; a scan reads each image's header
from it and digests its bytes; the pixels are decoded only when the cache encodes them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from kit.data.blob import Blob, open_dataset, read_range, sha256
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_controls, add_sample
from kit.data.streamed import first_line
from kit.errors import DataError

BLOCK = 10_000
"""Rows scanned (and their scan saved) together: the unit the processes of a launch share."""


def scan_hf(view: DatasetView) -> ScanReport:
    """Every row of the entry's `hf_dataset` split, as samples (or reported problems)."""
    entry, cfg = view.entry, view.data
    assert entry is not None
    name, split = entry.hf_dataset, entry.split
    ds = open_dataset(name, split)
    wanted = [("image_column", entry.image_column), ("caption_column", entry.caption_column)]
    wanted += [("mask_column", entry.mask_column)] + [
        ("control_column", c) for c in entry.control_column
    ]
    for key, column in wanted:
        needed = key == "image_column" or (
            cfg.caption_strategy == "textfile" if key == "caption_column" else bool(column)
        )
        if needed and column not in ds.column_names:
            raise DataError(
                f"hf_dataset {name} ({split}) has no column {column!r} "
                f"(its columns: {', '.join(ds.column_names)}); set {key}"
            )
    for key, column in wanted:
        if column in ds.column_names:
            _check_kind(ds, name, split, key, column)
    kind = type(ds.features.get(entry.image_column)).__name__
    if kind == "Video":  # decoded by `datasets` as a video: the kit reads clips from folders
        raise DataError(
            f"hf_dataset {name} ({split}): image_column {entry.image_column!r} holds videos; "
            "clips train from a folder of video files or frame folders (image_dir), not from "
            "an hf_dataset"
        )
    ident = _identity(ds)
    folder = index.scan_dir(cfg)
    blocks = [(a, min(a + BLOCK, len(ds))) for a in range(0, len(ds), BLOCK)]
    parts: dict[tuple[int, int], ScanReport] = {}
    for rows in index.rotated(blocks):  # each process of a launch starts at its own rows
        columns = f"{entry.image_column} {entry.caption_column} {entry.mask_column}"
        columns += "".join(f" control {c}" for c in entry.control_column)
        unit = f"{name} ({split}) {columns} rows {rows}"
        key = index.key(unit, cfg, ident)
        part = index.load(folder, key)
        if part is None:
            part = _scan_rows(ds, view, rows)
            index.save(folder, key, part)
        parts[rows] = part
    report = ScanReport()
    for rows in blocks:
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(parts[rows], f.name))
    return report


def _check_kind(ds: Any, name: str, split: str, key: str, column: str) -> None:
    """Refuse an image, mask or control column that holds neither images, bytes nor paths (a
    column of numbers, lists...), naming it; a caption column may hold anything."""
    if key == "caption_column":
        return
    kind = ds.data.schema.field(column).type
    if kind.num_fields > 0:
        if {"bytes", "path"} <= {kind.field(i).name for i in range(kind.num_fields)}:
            return
    elif pa_kind(kind) in ("binary", "string"):
        return
    raise DataError(
        f"hf_dataset {name} ({split}): {key} {column!r} holds {kind} values, not images, image "
        f"bytes or paths; set {key} to a column of images (its columns: "
        f"{', '.join(ds.column_names)})"
    )


def pa_kind(kind: Any) -> str:
    """An Arrow type as binary, string or other (large and view types alike)."""
    text = str(kind).removeprefix("large_").removesuffix("_view")
    return text if text in ("binary", "string") else "other"


def _identity(ds: Any) -> list[Any] | None:
    """What changes when the dataset does: its Arrow files' names, sizes and times (None for a
    dataset in memory, whose scan is not kept)."""
    try:
        files = [f["filename"] for f in ds.cache_files]
        return [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files] or None
    except (OSError, KeyError, TypeError):
        return None


def _scan_rows(ds: Any, view: DatasetView, rows: tuple[int, int]) -> ScanReport:
    """The samples of a block of rows, read from the memory-mapped table."""
    entry, cfg = view.entry, view.data
    assert entry is not None
    table = ds.data.slice(rows[0], rows[1] - rows[0])
    images = table.column(entry.image_column)
    captions = (
        table.column(entry.caption_column).to_pylist()
        if cfg.caption_strategy == "textfile"
        else None
    )
    label = entry.source_name()
    report = ScanReport()
    cell = (entry.hf_dataset, entry.split, entry.image_column)
    masks = _blobs(table, entry, entry.mask_column, rows[0]) if entry.mask_column else None
    controls = [_blobs(table, entry, c, rows[0]) for c in entry.control_column]
    row = rows[0]
    for chunk in images.chunks:
        struct = chunk.type.num_fields > 0
        for i in range(len(chunk)):
            at, here = row - rows[0], f"{label}[{row}]"
            try:
                data = _cell(chunk, i, struct, here, entry.image_column)
            except DataError as e:
                report.unreadable.append((Path(here), str(e)))
                row += 1
                continue
            text = None if captions is None else captions[at]
            blob = Blob(here, sha256(data), start=row, size=len(data), table=cell)
            if add_sample(report, cfg, blob, data, None if text is None else str(text).strip()):
                mask = masks[at] if masks is not None else (None, b"")
                if isinstance(mask[1], str):  # its mask's file cannot be read
                    report.samples.pop()
                    report.unreadable.append((Path(here), f"mask {mask[1]}"))
                elif masks is not None:
                    report.samples[-1].mask = mask[0]
                if controls and not isinstance(mask[1], str):
                    found = [
                        (f"in column {c!r} of row {row}", *col[at])
                        for c, col in zip(entry.control_column, controls, strict=True)
                    ]
                    add_controls(report, cfg, found)
            row += 1
    return report


def _blobs(
    table: Any, entry: Any, column: str, first: int
) -> list[tuple[Blob | None, bytes | memoryview | str]]:
    """Each row's image of another column (a mask, a control) as a Blob read lazily (its digest
    taken now), with its bytes for a header read (empty for a row without one); a row whose
    file cannot be read gives None and why."""
    out: list[tuple[Blob | None, bytes | memoryview | str]] = []
    cell = (entry.hf_dataset, entry.split, column)
    row = first
    for chunk in table.column(column).chunks:
        struct = chunk.type.num_fields > 0
        for i in range(len(chunk)):
            name = f"{entry.source_name()}[{row}].{column}"
            try:
                data = _cell(chunk, i, struct, name, column)
            except DataError as e:
                out.append((None, str(e)))
            else:
                out.append((Blob(name, sha256(data), start=row, size=len(data), table=cell), data))
            row += 1
    return out


def _cell(chunk: Any, i: int, struct: bool, name: str, column: str) -> bytes | memoryview:
    """One row's image bytes, without a copy where the table holds them: an Image column's bytes
    (else the file its path names), a binary column's value, or the file a string column names;
    a DataError naming the row and the file when that file cannot be read."""
    if struct:
        value = chunk.field("bytes")[i]
        if value.is_valid:
            return memoryview(value.as_buffer())
        path = chunk.field("path")[i].as_py()
    elif pa_kind(chunk.type) == "string":
        path = chunk[i].as_py()
    else:
        value = chunk[i]
        return memoryview(value.as_buffer()) if value.is_valid else b""
    try:
        return read_range(path) if path else b""
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        raise DataError(
            f"{name} column {column}: {path!r} cannot be read as a file: {why}"
        ) from None
