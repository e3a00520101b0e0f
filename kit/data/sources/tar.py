"""WebDataset tar shards as a training dataset: the members of a shard that share a key (the name
up to its first dot: `000123.jpg`, `000123.txt`) are one sample, an image and its caption.

Each shard is read once, front to back (a stream: one request for a remote shard), to take each
image's size from its header and digest its bytes; the cache later reads one member by its byte
range. A member that cannot be used is reported with its shard and key and skipped alone; a shard
cut short keeps the samples before the cut.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from pathlib import Path
from typing import IO

from kit.data.blob import Blob, expand_braces, filesystem, is_url, local_path, sha256
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_sample, caption_text
from kit.data.video import FRAME_EXTS
from kit.errors import DataError

CAPTION_EXTS = ("txt", "caption", "json")
"""Caption members, in the order one is taken when a key has several."""


def shard_names(pattern: str) -> list[str]:
    """The shards a pattern names (brace ranges and lists expanded), in order."""
    return expand_braces(pattern)


def _open(shard: str) -> IO[bytes]:
    """The shard as a file read front to back; a DataError naming it when it cannot be opened."""
    try:
        if is_url(shard):
            fs, path = filesystem(shard)
            return fs.open(path, "rb", block_size=8 << 20)
        return open(local_path(shard), "rb")
    except FileNotFoundError:
        raise DataError(f"shard {shard} not found") from None
    except (OSError, ValueError) as e:
        raise DataError(f"shard {shard} cannot be opened: {e}") from None


def _size(f: IO[bytes]) -> int | None:
    """A shard's size in bytes, where its file object knows it."""
    size = getattr(f, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return None


def split_key(member: str) -> tuple[str, str]:
    """A member's key and extension as WebDataset splits them: at the first dot of its name."""
    folder, _, base = member.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (folder + "/" + stem if folder else stem), ext.lower() if dot else ""


def scan_shards(view: DatasetView) -> ScanReport:
    """Every sample of every shard the entry's `shards` pattern names."""
    assert view.entry is not None
    names = shard_names(view.entry.shards)
    folder = index.scan_dir(view.data)
    parts: dict[str, ScanReport] = {}
    for shard in index.rotated(names):  # each process of a launch starts at its own shards
        name = index.key(shard, view.data)
        part = index.load(folder, name)
        if part is None:
            part = ScanReport()
            _read_shard(shard, view, part)
            index.save(folder, name, part)
        parts[shard] = part
    report = ScanReport()
    for shard in names:  # in the pattern's order, whichever process scanned what
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(parts[shard], f.name))
    return report


def _read_shard(shard: str, view: DatasetView, report: ScanReport) -> None:
    with _open(shard) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|")
        except tarfile.TarError as e:
            raise DataError(
                f"shard {shard} is not an uncompressed tar file ({e}); write shards as plain "
                ".tar, as WebDataset does"
            ) from None
        group: dict[str, tuple[int, int, bytes]] = {}
        key = None
        done = 0
        try:
            for m in tar:
                if not m.isfile():
                    continue
                k, ext = split_key(m.name)
                if k != key:
                    done += _flush(shard, key, group, view, report)
                    key, group = k, {}
                handle = tar.extractfile(m)
                data = handle.read() if handle else b""
                if len(data) != m.size:
                    raise EOFError(f"{m.name} has {len(data)} of its {m.size} bytes")
                group[ext] = (m.offset_data, m.size, data)
            if _size(f) is not None and tar.offset + 1024 > _size(f):
                # tarfile takes a header cut short for the end: the end marker is missing
                raise EOFError("no end-of-archive marker")
        except (tarfile.TarError, EOFError, OSError) as e:
            # The member being read is lost (it is cut short); the ones before it are kept.
            report.skipped.append(
                (Path(shard), f"shard cut short after {done} sample(s) ({e}); its rest is skipped")
            )
            group = {}
        done += _flush(shard, key, group, view, report)


def _flush(
    shard: str,
    key: str | None,
    group: dict[str, tuple[int, int, bytes]],
    view: DatasetView,
    report: ScanReport,
) -> int:
    """Record the sample of one key (1), or why it is left out (0)."""
    if key is None or not group:
        return 0
    image = next((e for e in group if "." + e.rsplit(".", 1)[-1] in FRAME_EXTS), None)
    where = f" (shard {shard}, key {key})"
    if image is None:
        caption = next((e for e in CAPTION_EXTS if e in group), None)
        if caption is not None:
            report.orphan_captions.append(Path(f"{shard}/{key}.{caption}"))
        return 0
    start, size, data = group[image]
    name = f"{shard}/{key}.{image}"
    cap_ext = next((e for e in CAPTION_EXTS if e in group), None)
    caption = None
    if cap_ext is not None:
        try:
            caption = caption_text(group[cap_ext][2], cap_ext, name, report)
        except DataError as e:
            report.unreadable.append((Path(name), f"{e}{where}"))
            return 0
    blob = Blob(name, sha256(data), shard, start, size)
    before = len(report.samples)
    add_sample(report, view.data, blob, data, caption, where)
    return len(report.samples) - before
