"""A Hugging Face dataset read as a stream (`streaming: true`): `datasets`' IterableDataset, so
nothing is downloaded whole, no Arrow cache is written and no image lands on the local disk.

The stream is cut into blocks (groups of its shards: data files, or a parquet file's row groups),
the unit the processes of a launch share and a saved scan covers. A row is named by its block and
its place in the block; its bytes are read again only by the cache, which asks for the rows of a
block in order, so each process reads its blocks front to back once (`read_row`).
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Iterator
from typing import Any

from kit.data.network import dataset_options
from kit.errors import DataError

MAX_BLOCKS = 1024
"""At most this many blocks per stream: a stream of a million small files is cut into groups."""
RESHARD_BELOW = 16
"""A stream of fewer shards (a single parquet file) is cut by row groups instead, so that the
processes of a launch have blocks of their own to read."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "hf_dataset needs the `datasets` package: pip install 'kit[data]'"
        ) from None
    return datasets


@functools.lru_cache(maxsize=8)
def open_stream(name: str, split: str) -> tuple[Any, list[Any]]:
    """A dataset's split as an IterableDataset cut into its blocks' shards, with what changes
    when its data does (each data file's name, size and time; a hub file's URL holds its commit).

    `name`: parquet file(s) (a path or glob), a folder `load_dataset` reads, or a hub id
    (credentials from `HF_TOKEN` or `huggingface-cli login`).
    """
    datasets = _datasets()
    where = f"hf_dataset {name}"
    saved = os.path.isdir(name) and any(
        os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")
    )
    if saved:
        raise DataError(
            f"{where} is a folder written by save_to_disk, read in place already: "
            "set streaming to false"
        )
    try:
        bounded = dataset_options(name)  # `remote_timeout` and `remote_retries`
        if name.endswith(".parquet"):
            builder = datasets.load_dataset_builder("parquet", data_files={split: name}, **bounded)
        else:
            builder = datasets.load_dataset_builder(name, **bounded)
        files = (builder.config.data_files or {}).get(split)
        if builder.config.data_files and files is None:
            have = sorted(str(k) for k in builder.config.data_files)
            raise DataError(f"{where} has no split {split!r} (it has {have}): set split")
        ds = builder.as_streaming_dataset(split=split)
    except DataError:
        raise
    except (ValueError, KeyError) as e:  # an unknown split, a dataset without one
        raise DataError(f"{where}: {first_line(e)} (split {split!r})") from None
    except (OSError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{where} cannot be opened: {first_line(e)}") from None
    if not hasattr(ds, "shard"):  # `IterableDataset.shard` came with datasets 3.1
        raise DataError(
            f"streaming: {where} is read by blocks, which needs datasets 3.1 or newer "
            f"(this is {datasets.__version__}): pip install -U datasets"
        )
    reshard = getattr(ds, "reshard", None)  # in newer datasets only: else a block per shard
    if ds.num_shards < RESHARD_BELOW and reshard is not None:
        ds = reshard()  # a shard per row group (reads each file's footer only)
    return ds, [_file_identity(str(f)) for f in files or []]


def _file_identity(file: str) -> list[Any]:
    """A data file's name with its size and time (a local file), or its URL alone."""
    try:
        st = os.stat(file)
        return [file, st.st_size, st.st_mtime_ns]
    except OSError:
        return [file]


def block_count(ds: Any) -> int:
    """How many blocks a stream is cut into."""
    return max(min(ds.num_shards, MAX_BLOCKS), 1)


def block(ds: Any, index: int, columns: list[str]) -> Any:
    """One block of a stream: its `columns` only, images as their bytes (never decoded here)."""
    datasets = _datasets()
    part = ds.shard(num_shards=block_count(ds), index=index, contiguous=True)
    part = part.select_columns(columns)
    features = part.features or {}
    for column in columns:
        if isinstance(features.get(column), datasets.Image):
            part = part.cast_column(column, datasets.Image(decode=False))
    return part


def row_bytes(value: Any, name: str, column: str) -> bytes:
    """A row's image bytes: an Image cell's bytes (else the file or URL its path names), a
    binary value, or the file or URL a string names."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value:
        import fsspec  # a path or URL (`hf://`, `zip://...::`), as `datasets` names it

        try:
            with fsspec.open(value, "rb") as f:
                return f.read()
        except OSError as e:
            raise DataError(f"{name} column {column}: {value} cannot be read: {e}") from None
    raise DataError(f"{name} column {column}: no image bytes in this row")


class _Cursor:
    """A block being read front to back: where it is, and the last row it gave."""

    def __init__(self, table: tuple[str, ...], start: int) -> None:
        name, split, column, index = table
        ds, _ = open_stream(name, split)
        self.table = table
        self.stream = block(ds, int(index), [column]).skip(start)
        self.rows: Iterator[dict] = iter(self.stream)
        self.column, self.next = column, start
        self.last: tuple[int, bytes] | None = None

    def read(self, row: int, name: str) -> bytes:
        while self.next <= row:
            try:
                value = _pull(self.rows)[self.column]
            except StopIteration:
                raise DataError(f"{name}: the stream ended before this row") from None
            except (OSError, ValueError) as e:  # the connection lost, after its own retries
                raise DataError(
                    f"{name}: the stream broke while caching ({first_line(e)}); run "
                    "again: what is cached is kept, and the read resumes at the first row not "
                    "cached"
                ) from None
            self.last, self.next = (self.next, row_bytes(value, name, self.column)), self.next + 1
        assert self.last is not None
        return self.last[1]

    def close(self) -> None:
        close = getattr(self.rows, "close", None)
        if close is not None:
            close()


def _pull(rows: Iterator[dict]) -> dict:
    """The next row of a block being cached (the one place the cache pulls rows)."""
    return next(rows)


def first_line(e: BaseException) -> str:
    """An error's first line, or its kind when it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_cursors: dict[tuple[str, ...], _Cursor] = {}


def read_row(table: tuple[str, ...], row: int, name: str) -> bytes:
    """A streamed row's image bytes. Rows asked for in order are read in one pass over their
    block (the row asked for again, a mirrored twin's, is kept); a row behind the pass starts
    it again at that row."""
    cursor = _cursors.get(table[:3])
    held = cursor is not None and cursor.last is not None and cursor.last[0] == row
    if cursor is None or cursor.table != table or (cursor.next > row and not held):
        if cursor is not None:
            cursor.close()
        cursor = _cursors[table[:3]] = _Cursor(table, row)
    return cursor.read(row, name)


@atexit.register
def close_all() -> None:
    """Close the streams still open (before the interpreter takes down what they use)."""
    while _cursors:
        _cursors.popitem()[1].close()
