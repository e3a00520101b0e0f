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
from kit.data.sources.common import add_sample
from kit.errors import DataError

BLOCK = 10_000
"""Rows scanned (and their scan saved) together: the unit the processes of a launch share."""


def scan_hf(view: DatasetView) -> ScanReport:
    """Every row of the entry's `hf_dataset` split, as samples (or reported problems)."""
    entry, cfg = view.entry, view.data
    assert entry is not None
    name, split = entry.hf_dataset, entry.split
    ds = open_dataset(name, split)
    for key in ("image_column", "caption_column", "mask_column"):
        column = getattr(entry, key)
        needed = key == "image_column" or (
            cfg.caption_strategy == "textfile" if key == "caption_column" else bool(column)
        )
        if needed and column not in ds.column_names:
            raise DataError(
                f"hf_dataset {name} ({split}) has no column {column!r} "
                f"(its columns: {', '.join(ds.column_names)}); set {key}"
            )
    ident = _identity(ds)
    folder = index.scan_dir(cfg)
    blocks = [(a, min(a + BLOCK, len(ds))) for a in range(0, len(ds), BLOCK)]
    parts: dict[tuple[int, int], ScanReport] = {}
    for rows in index.rotated(blocks):  # each process of a launch starts at its own rows
        columns = f"{entry.image_column} {entry.caption_column} {entry.mask_column}"
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
    masks = _masks(table, entry, rows[0]) if entry.mask_column else None
    row = rows[0]
    for chunk in images.chunks:
        struct = chunk.type.num_fields > 0
        for i in range(len(chunk)):
            data = _cell(chunk, i, struct)
            text = None if captions is None else captions[row - rows[0]]
            blob = Blob(f"{label}[{row}]", sha256(data), start=row, size=len(data), table=cell)
            add_sample(report, cfg, blob, data, None if text is None else str(text).strip())
            if masks is not None and report.samples and report.samples[-1].blob is blob:
                report.samples[-1].mask = masks[row - rows[0]]
            row += 1
    return report


def _masks(table: Any, entry: Any, first: int) -> list[Blob]:
    """Each row's mask, as a Blob read lazily (its digest taken now)."""
    out = []
    cell = (entry.hf_dataset, entry.split, entry.mask_column)
    row = first
    for chunk in table.column(entry.mask_column).chunks:
        struct = chunk.type.num_fields > 0
        for i in range(len(chunk)):
            data = _cell(chunk, i, struct)
            name = f"{entry.source_name()}[{row}].{entry.mask_column}"
            out.append(Blob(name, sha256(data), start=row, size=len(data), table=cell))
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
