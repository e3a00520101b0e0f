"""Where a sample's bytes are when it is no local file, and how they are read: lazily, one sample
at a time, so a scan of a million images holds their names and sizes, never their pixels.

A `Blob` is small and plain (strings and numbers, picklable), so a sample can be sent to another
process; whatever it opens (a Hugging Face dataset, a filesystem for a URL) is opened again there.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
from dataclasses import dataclass
from typing import Any

from kit.config.sources import URL, check_pattern
from kit.data.network import REMOTE as _REMOTE
from kit.data.network import dataset_options, hub_settings
from kit.data.network import no_answer as no_answer
from kit.data.network import remote as remote
from kit.data.network import timed_out as timed_out
from kit.data.network import timeouts as _timeouts
from kit.data.streamed import read_row
from kit.errors import ConfigError, DataError, KitError


def is_url(value: str) -> bool:
    """Whether a dataset location is an fsspec URL (`s3://`, `gs://`, `hf://`...), not a path."""
    return bool(URL.match(value or "")) and not value.startswith("file://")


def local_path(value: str) -> str:
    """A `file://` URL as the plain path it names; anything else unchanged."""
    return value[len("file://") :] if value.startswith("file://") else value


def use_remote(timeout: float, retries: int) -> None:
    """Take the config's `remote_timeout` and `remote_retries` for every read from a URL, and
    for the Hugging Face libraries' reads (`hub_settings`)."""
    hub_settings(timeout, retries)
    if (_REMOTE["timeout"], _REMOTE["retries"]) != (timeout, retries):
        _REMOTE.update(timeout=float(timeout), retries=int(retries))
        filesystem.cache_clear()  # the filesystems opened with the old settings


@functools.lru_cache(maxsize=32)
def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of a URL and the path within it; opened once per process, its
    requests bounded by `remote_timeout` (S3, HTTP).

    Credentials are whatever the filesystem's own library reads from the environment (for S3:
    `AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, `AWS_ENDPOINT_URL`...), never the kit's config.
    """
    import fsspec

    scheme = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **_timeouts(scheme))
        if scheme in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own loop, which would wait its timeouts over five times
    except ImportError as e:  # the scheme's own package (gcsfs, s3fs, adlfs...) is missing
        raise DataError(f"{url}: {e} (pip install it beside the kit to read {scheme}://)") from None
    except ValueError as e:  # a scheme fsspec does not know
        raise DataError(f"{url}: {e}; give a local path or a URL fsspec reads") from None
    except Exception as e:  # the library could not reach its service
        raise DataError(
            f"{url} cannot be reached ({type(e).__name__}: {e}); check the network and the "
            f"{scheme} credentials in the environment"
        ) from None
    return fs, path


def read_range(location: str, start: int = 0, size: int = -1) -> bytes:
    """`size` bytes of a file at `start` (all of it for -1): a local path or a URL."""
    if is_url(location):
        fs, path = filesystem(_base(location))
        inner = path + location[len(_base(location)) :]
        end = None if size < 0 else start + size
        try:
            return remote(location, fs.cat_file, inner, start=start, end=end)
        except (OSError, KitError):
            raise
        except Exception as e:  # the store's own error (an endpoint refused): a read lost
            raise OSError(f"{location} cannot be read ({type(e).__name__}: {e})") from None
    with open(local_path(location), "rb") as f:
        f.seek(start)
        return f.read(size)


def _base(url: str) -> str:
    """The scheme and bucket of a URL (`s3://bucket`): one filesystem serves all its paths."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def sha256(data: bytes | memoryview) -> str:
    """SHA-256 of bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Blob:
    """A sample's bytes: a byte range of a file (a shard's member, a whole object) or a cell of a
    dataset's table. `digest` is the content's key (the cache keys latents by it)."""

    name: str
    """How reports name it: `train-000003.tar/000123.jpg`, `s3://bucket/cats/1.png`, `data[12]`."""
    digest: str
    """A digest of the bytes (SHA-256, or the object store's ETag with the size)."""
    location: str = ""
    """The file or URL the bytes lie in (a shard, an object); empty for a table cell."""
    start: int = 0
    size: int = -1
    """Byte range within `location` (-1: to its end)."""
    table: tuple[str, ...] | None = None
    """A dataset cell: (dataset, split, column) as `kit.data.sources.hf` opens it; `start` is
    the row. A streamed row (`streaming`) adds its block of the stream: `start` is its row in
    that block."""

    @property
    def stream_block(self) -> int | None:
        """A streamed row's block of its stream; None for any other sample."""
        return int(self.table[3]) if self.table is not None and len(self.table) > 3 else None

    def read(self) -> bytes:
        """The bytes, read now (one range request for a remote file; a streamed row from its
        block's pass, see `kit.data.streamed.read_row`)."""
        if self.stream_block is not None:
            assert self.table is not None
            data = read_row(self.table, self.start, self.name)
            if sha256(data) != self.digest:  # the stream gave other rows than its scan saw
                raise DataError(
                    f"{self.name}: this row of the stream changed since it was scanned; run "
                    "again (its data files' new identity starts a new scan)"
                )
            return data
        if self.table is not None:
            return cell_bytes(self.table, self.start)
        return read_range(self.location, self.start, self.size)

    def open(self) -> io.BytesIO:
        """The bytes as a file object Pillow opens."""
        return io.BytesIO(self.read())


def reach(what: str, url: str) -> None:
    """Ask a URL's store about the file it names (not a pattern), bounded by `remote_timeout`
    and tried `remote_retries` times more: a store that never answers is named here, where a
    library behind it (`datasets`) would say only that it found nothing. Any other error is left
    to the library's own read, which says what is wrong."""
    if not is_url(url) or any(c in url for c in "*?[{"):
        return
    try:
        fs, path = filesystem(url)
        remote(what, fs.info, path)
    except DataError:
        raise
    except Exception:  # noqa: BLE001, S110 — not the store's silence: the read reports it
        pass


@functools.lru_cache(maxsize=8)
def open_dataset(name: str, split: str) -> Any:
    """A Hugging Face dataset's split, opened once per process (memory-mapped: nothing is read).

    `name` is a folder written by `save_to_disk`, parquet file(s) (a path or glob), a folder
    `load_dataset` reads (parquet, an image folder), or a hub id (downloaded once into the
    `datasets` cache; credentials from `HF_TOKEN` or `huggingface-cli login`).
    """
    try:
        import datasets
    except ImportError:
        raise DataError(
            "hf_dataset needs the `datasets` package: pip install 'kit[data]'"
        ) from None
    where = f"hf_dataset {name}"
    reach(where, name)
    try:
        saved = os.path.isdir(name) and any(
            os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")
        )
        if saved:
            d = datasets.load_from_disk(name)
            if isinstance(d, datasets.DatasetDict):
                if split not in d:
                    raise DataError(
                        f"{where} has no split {split!r} (it has {sorted(d)}): set split"
                    )
                d = d[split]
            return d
        bounded = dataset_options(name)  # `remote_timeout` and `remote_retries`
        if name.endswith(".parquet"):
            files = {split: name}
            return datasets.load_dataset("parquet", data_files=files, split=split, **bounded)
        return datasets.load_dataset(name, split=split, **bounded)
    except DataError:
        raise
    except (ValueError, KeyError) as e:  # an unknown split, a dataset without one
        if "corresponds to no data" in str(e):
            raise DataError(f"{where} has no rows (split {split!r})") from None
        raise DataError(f"{where}: {str(e).splitlines()[0]} (split {split!r})") from None
    except (OSError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{where} cannot be opened: {str(e).splitlines()[0]}") from None


def cell_bytes(table: tuple[str, ...], row: int) -> bytes:
    """The image bytes in one row of a dataset's column (an Image column's bytes, or the file its
    path names; a binary column's value)."""
    name, split, column = table[:3]
    value = open_dataset(name, split).data.column(column)[row].as_py()
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, str) and value:
        return read_range(value)
    if isinstance(value, bytes):
        return value
    raise DataError(f"{name}[{row}] column {column}: no image bytes in this row")


_BRACES = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """Every name a shard pattern spells: `a-{000..012}.tar` (zero-padded as written), `{a,b}`;
    a DataError when it spells more than a run could hold (`MAX_SHARDS`)."""
    try:
        check_pattern(pattern)
    except ConfigError as e:
        raise DataError(str(e)) from None
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") else 0
        parts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    elif "," in body:
        parts = body.split(",")
    else:
        parts = ["{" + body + "}"]  # a brace that spells no list is part of the name
    return [head + p + rest for p in parts for rest in expand_braces(tail)]
