"""WebDataset tar shards as a training dataset: the members of a shard that share a key (the name
up to its first dot: `000123.jpg`, `000123.txt`) are one sample, an image and its caption.

A video family reads a key whose media is a video member (`000123.mp4`, `.webm`, `.mov`, `.mkv`,
`.gif`) as a clip, as it reads a video file in a folder (the member is handed to the same reader
as a temporary file); any other family names it and skips it.

An edit dataset's key also holds its control images, each a member named by `control_column`:
`000123.control.png` (and `000123.control_1.png` for a second control) beside the target
`000123.jpg`. The target is the key's image member with a plain extension (`jpg`, `png`).

Each shard is read once, front to back (a stream: one request for a remote shard), to take each
image's size from its header and digest its bytes; the cache build later reads it again front to
back, or only a few missing members by their byte ranges (`kit.data.shard_reads`). A member
that cannot be used is reported with its shard and key and skipped alone; a shard cut short
keeps the samples before the cut.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from PIL import UnidentifiedImageError

from kit.data import video
from kit.data.blob import (
    Blob,
    expand_braces,
    filesystem,
    is_url,
    local_path,
    no_answer,
    remote,
    sha256,
    timed_out,
)
from kit.data.bounds import check_member, size_text
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_controls, add_sample, caption_text
from kit.data.video import FRAME_EXTS, VIDEO_EXTS
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
            return remote(f"shard {shard}", fs.open, path, "rb", block_size=8 << 20)
        return open(local_path(shard), "rb")
    except FileNotFoundError:
        raise DataError(f"shard {shard} not found") from None
    except (OSError, ValueError) as e:
        raise DataError(f"shard {shard} cannot be opened: {e}") from None
    except DataError:
        raise
    except Exception as e:  # the store's library could not reach its service
        raise DataError(
            f"shard {shard} cannot be reached ({type(e).__name__}: {e}); check the network and "
            "the credentials in the environment"
        ) from None


def split_key(member: str) -> tuple[str, str]:
    """A member's key and extension as WebDataset splits them: at the first dot of its name."""
    folder, _, base = member.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (folder + "/" + stem if folder else stem), ext.lower() if dot else ""


def scan_shards(view: DatasetView, family: Any = None) -> ScanReport:
    """Every sample of every shard the entry's `shards` pattern names; a video family's (or,
    with no family, every) video member as a clip."""
    assert view.entry is not None
    names = shard_names(view.entry.shards)
    folder = index.scan_dir(view.data)
    parts: dict[str, ScanReport] = {}
    cfg, clips = view.data, family is None or family.video
    rule = family.frame_count if family is not None and family.video else None
    # A clip's frames follow the family's rule: a scan that reads clips is kept per family.
    reads = [getattr(family, "name", ""), cfg.num_frames, cfg.frame_stride] if clips else []
    controls = (*view.entry.control_column, *reads)
    for shard in index.rotated(names):  # each process of a launch starts at its own shards
        name = index.key(shard, view.data, settings=controls)
        part = index.load(folder, name)
        if part is None:
            part = ScanReport()
            _read_shard(shard, view, part, (clips, rule))
            index.save(folder, name, part)
        parts[shard] = part
    report = ScanReport()
    for shard in names:  # in the pattern's order, whichever process scanned what
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(parts[shard], f.name))
    return report


def _read_shard(shard: str, view: DatasetView, report: ScanReport, clips: tuple) -> None:
    with _open(shard) as f:
        group: dict[str, tuple[int, int, bytes]] = {}
        key = None
        done = 0
        cut: Exception | None = None
        try:
            for name, start, data in members(f, shard):
                k, ext = split_key(name)
                if k != key:
                    done += _flush(shard, key, group, view, report, clips)
                    key, group = k, {}
                group[ext] = (start, len(data), data)
        except NotATar as e:
            raise DataError(
                f"shard {shard} is not an uncompressed tar file ({e}); write shards as plain "
                ".tar, as WebDataset does"
            ) from None
        except Exception as e:
            if timed_out(e):  # a store that stopped answering: not a shard cut short
                raise no_answer(f"shard {shard} after {done} sample(s)", 1) from None
            if not isinstance(e, TarCut | OSError):
                raise
            # The member being read is lost (it is cut short); the ones before it are kept, and
            # so is the key read whole before a member of another key whose header lies.
            cut = e
            if not getattr(e, "member", "") or split_key(e.member)[0] == key:
                group = {}
        done += _flush(shard, key, group, view, report, clips)
        if cut is not None:
            why = f"shard cut short after {done} sample(s) ({cut}); its rest is skipped"
            report.skipped.append((Path(shard), why))


class NotATar(Exception):
    """The file does not start with a tar header (compressed, or no tar at all)."""


class TarCut(Exception):
    """The tar ends inside a member or a header, or lacks its end marker."""

    def __init__(self, why: str, member: str = "") -> None:
        super().__init__(why)
        self.member = member
        """The member whose header or data is cut or damaged, where its name was read."""


_BLOCK = 512
_FILE_TYPES = (b"0", b"\0", b"7")


def _length(f: IO[bytes]) -> int | None:
    """A shard's length in bytes (a local file's, or a store's object's); None when unknown."""
    size = getattr(f, "size", None)  # an fsspec file knows its object's
    if isinstance(size, int):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return None


def members(f: IO[bytes], shard: str = "") -> Iterator[tuple[str, int, bytes]]:
    """(name, offset of its data, data) of each regular file of a tar read front to back.

    A plain reader of the POSIX (ustar, pax) and GNU formats, read as one stream: a tenth of
    `tarfile`'s cost per member, which on small images is a scan's largest part after the image
    headers. Long names (GNU `L`, pax `path`) are followed; links and folders are passed over.
    """
    pos = 0
    long_name = ""
    total = _length(f)
    while True:
        header = f.read(_BLOCK)
        if len(header) < _BLOCK:
            raise TarCut("no end-of-archive marker" if not header else "a header is cut short")
        if header.count(0) == _BLOCK:
            return  # the end marker
        try:
            stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
            size = _number(header[124:136])
        except ValueError:
            stored = size = -1
        if stored != sum(header) - sum(header[148:156]) + 8 * 32 or size < 0:
            if pos == 0:
                raise NotATar("no tar header at its start")
            raise TarCut(f"a damaged header at byte {pos}")
        kind = header[156:157]
        padded = -(-size // _BLOCK) * _BLOCK
        # The size is the header's word: checked against the shard and the memory before the
        # member is read whole (a damaged header can claim gigabytes).
        name = long_name or _ustar_name(header)
        if total is not None and pos + _BLOCK + padded > total:
            raise TarCut(
                f"the header of {name} at byte {pos} claims {size_text(size)}, more than the "
                f"shard's {total:,} bytes hold",
                name,
            )
        check_member(shard, name, size)
        data = f.read(padded)
        if len(data) < padded:
            raise TarCut(f"a member's data is cut short at byte {pos + _BLOCK + len(data)}")
        data = data[:size]
        start, pos = pos + _BLOCK, pos + _BLOCK + padded
        if kind == b"L":
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == b"x":
            long_name = _pax_path(data) or long_name
        elif kind in _FILE_TYPES:
            name = long_name or _ustar_name(header)
            long_name = ""
            yield name, start, data
        elif kind != b"g":
            long_name = ""


def _number(field: bytes) -> int:
    """A header's number: octal text, or base-256 (GNU) when its first bit is set."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _ustar_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "replace")


def _pax_path(data: bytes) -> str:
    """The `path` record of a pax extended header (`<len> path=<name>\\n` records)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space] or 0)
        if length <= 0:
            break
        record = data[space + 1 : pos + length - 1]
        keyword, _, value = record.partition(b"=")
        if keyword == b"path":
            return value.decode("utf-8", "replace")
        pos += length
    return ""


def _flush(
    shard: str,
    key: str | None,
    group: dict[str, tuple[int, int, bytes]],
    view: DatasetView,
    report: ScanReport,
    clips: tuple[bool, Any] = (False, None),
) -> int:
    """Record the sample of one key (1), or why it is left out (0). `clips`: whether video
    members are read as clips, and the family's frame rule."""
    if key is None or not group:
        return 0
    where = f" (shard {shard}, key {key})"
    wanted = [c.lower() for c in view.entry.control_column] if view.entry is not None else []
    controls = {
        c: [e for e in group if _is_image(e) and c in (e, e.rsplit(".", 1)[0])] for c in wanted
    }
    taken = {e for found in controls.values() for e in found}
    images = [e for e in group if _is_image(e) and e not in taken]
    # The target: a plain extension (`jpg`) before a named member (`seg.png`) that is none.
    image = next((e for e in images if "." not in e), images[0] if images else None)
    cap_ext = next((e for e in CAPTION_EXTS if e in group), None)
    clip = next((e for e in group if "." + e.rsplit(".", 1)[-1] in VIDEO_EXTS), None)
    if image is None and clip is not None and not clips[0]:
        why = f"a video member{where}: read as a clip by a video family only"
        report.skipped.append((Path(f"{shard}/{key}.{clip}"), why))
        return 0
    if image is None and clip is None:
        if cap_ext is not None:
            report.orphan_captions.append(Path(f"{shard}/{key}.{cap_ext}"))
        return 0
    # A video family trains a key's clip, not a still beside it (a video dataset's thumbnail).
    media = clip if clip is not None and clips[0] else image
    assert media is not None
    start, size, data = group[media]
    name = f"{shard}/{key}.{media}"
    caption = None
    if cap_ext is not None:
        try:
            caption = caption_text(group[cap_ext][2], cap_ext, name, report)
        except DataError as e:
            report.unreadable.append((Path(name), f"{e}{where}"))
            return 0
    blob = Blob(name, sha256(data), shard, start, size)
    if media == clip:
        return _add_clip(report, view, blob, data, caption, where, clips[1])
    if not add_sample(report, view.data, blob, data, caption, where):
        return 0
    if wanted:
        found: list[tuple[str, Blob | None, bytes]] = []
        for c, members in controls.items():
            if len(members) > 1:
                why = f"ambiguous control: {', '.join(f'{key}.{e}' for e in members)}{where}"
                report.samples.pop()
                report.skipped.append((Path(name), why))
                return 0
            if not members:
                found.append((f"{key}.{c}.*", None, b""))
                continue
            start, size, data = group[members[0]]
            member = f"{shard}/{key}.{members[0]}"
            found.append((member, Blob(member, sha256(data), shard, start, size), data))
        add_controls(report, view.data, found, where)
    return 1 if report.samples and report.samples[-1].blob is blob else 0


def _add_clip(
    report: ScanReport,
    view: DatasetView,
    blob: Blob,
    data: bytes,
    caption: str | None,
    where: str,
    rule: Any,
) -> int:
    """Record a video member as a clip (1), read as a folder's video file is; or why not (0)."""
    cfg, name = view.data, Path(blob.name)
    try:
        with video.as_file(data, blob.name) as tmp:
            try:
                w, h, total = video.clip_info(tmp)
            except (DataError, UnidentifiedImageError, OSError) as e:
                why = str(e).replace(str(tmp), blob.name).split("\n", 1)[0] or type(e).__name__
                report.unreadable.append((name, f"{why}{where}"))
                return 0
    except OSError as e:  # no room for the temporary file
        raise DataError(f"cannot read clip {blob.name}: {e}") from None
    frames, short = video.clip_frames(total, cfg.num_frames, cfg.frame_stride, rule)
    if short:
        report.short_clips.append((name, f"{short}{where}"))
        return 0
    if not add_sample(report, cfg, blob, b"", caption, where, size=(w, h)):
        return 0
    sample = report.samples[-1]
    sample.frames, sample.total_frames, sample.clip = frames, total, True
    return 1


def _is_image(ext: str) -> bool:
    """Whether a member's extension (`jpg`, `control.png`) ends in a still-image format."""
    return "." + ext.rsplit(".", 1)[-1] in FRAME_EXTS
