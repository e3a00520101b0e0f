"""A Hugging Face dataset as a training dataset: one sample per row of its image column, the
caption from its caption column. The table is memory-mapped; a scan reads each image's header
from it and digests its bytes; the pixels are decoded only when the cache encodes them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kit.data.blob import Blob, open_dataset, read_range, sha256
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_controls, add_sample
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
            data = _cell(chunk, i, struct)
            text = None if captions is None else captions[row - rows[0]]
            blob = Blob(f"{label}[{row}]", sha256(data), start=row, size=len(data), table=cell)
            at = row - rows[0]
            if add_sample(report, cfg, blob, data, None if text is None else str(text).strip()):
                if masks is not None:
                    report.samples[-1].mask = masks[at][0]
                if controls:
                    found = [
                        (f"in column {c!r} of row {row}", *col[at])
                        for c, col in zip(entry.control_column, controls, strict=True)
                    ]
                    add_controls(report, cfg, found)
            row += 1
    return report


def _blobs(
    table: Any, entry: Any, column: str, first: int
) -> list[tuple[Blob, bytes | memoryview]]:
    """Each row's image of another column (a mask, a control) as a Blob read lazily (its digest
    taken now), with its bytes for a header read (empty for a row without one)."""
    out: list[tuple[Blob, bytes | memoryview]] = []
    cell = (entry.hf_dataset, entry.split, column)
    row = first
    for chunk in table.column(column).chunks:
        struct = chunk.type.num_fields > 0
        for i in range(len(chunk)):
            data = _cell(chunk, i, struct)
            name = f"{entry.source_name()}[{row}].{column}"
            blob = Blob(name, sha256(data), start=row, size=len(data), table=cell)
            out.append((blob, data))
            row += 1
    return out


def _cell(chunk: Any, i: int, struct: bool) -> bytes | memoryview:
    """One row's image bytes, without a copy where the table holds them: an Image column's bytes
    (else the file its path names), a binary column's value, or the file a string column names."""
    if struct:
        value = chunk.field("bytes")[i]
        if value.is_valid:
            return memoryview(value.as_buffer())
        path = chunk.field("path")[i].as_py()
    elif str(chunk.type) in ("string", "large_string"):
        path = chunk[i].as_py()
    else:
        value = chunk[i]
        return memoryview(value.as_buffer()) if value.is_valid else b""
    return read_range(path) if path else b""
