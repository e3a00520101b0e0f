"""A shard's scan, kept: the samples and problems one tar shard (or one block of a dataset's rows) gave, saved in the cache folder
under a key of the shard's identity (its location, size and modification time or ETag) and of
the settings the scan used. A later run, or another process of the same launch, reads the saved
scan instead of the shard: at a million images a scan reads every byte once, not once per run.

Processes of a launch (`RANK` / `WORLD_SIZE`) start their scans at different shards, so that the
first pass over a dataset is shared between them without any waiting: each saves what it scanned,
and finds the others' scans saved when it reaches their shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kit.config import DataConfig
from kit.data.blob import Blob, filesystem, is_url, local_path, remote
from kit.data.paths import default_cache_dir
from kit.data.samples import Sample, ScanReport
from kit.io import write_text

VERSION = 3
"""Bumped when what a saved scan holds changes: older ones are then scanned again."""
_LISTS = ("missing_captions", "orphan_captions", "empty_captions")
_PAIRS = ("unreadable", "skipped", "warnings", "short_clips")


def scan_dir(cfg: DataConfig) -> Path:
    """Where saved scans are kept: `scans/` in the cache folder."""
    return (Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()) / "scans"


def identity(shard: str) -> list[Any] | None:
    """What changes when a shard does: its size and mtime (a local file) or ETag; None when the
    shard cannot be looked at (the scan then says why)."""
    try:
        if is_url(shard):
            fs, path = filesystem(shard)
            info = remote(f"shard {shard}", fs.info, path)
            tag = next((info[k] for k in ("ETag", "etag", "md5Hash", "mtime") if info.get(k)), "")
            return [info.get("size"), str(tag)]
        st = os.stat(local_path(shard))
        return [st.st_size, st.st_mtime_ns]
    except Exception:  # noqa: BLE001 (a store's own errors, such as an endpoint refused)
        return None


def key(shard: str, cfg: DataConfig, ident: Any = (), settings: Any = ()) -> str | None:
    """The saved scan's name: the shard (or a part of a dataset), its identity (by default the
    shard's own, see `identity`) and the settings the scan applied (`settings`: the entry's own,
    such as its control members)."""
    ident = identity(shard) if ident == () else ident
    if ident is None:
        return None
    used = [
        cfg.caption_strategy,
        cfg.instance_prompt,
        cfg.min_image_size,
        cfg.max_image_pixels,
        list(settings),
    ]
    return hashlib.sha256(repr((VERSION, shard, ident, used)).encode()).hexdigest()[:32]


def load(folder: Path, name: str | None) -> ScanReport | None:
    """A saved scan, or None (never saved, or unreadable: the shard is scanned again)."""
    if name is None:
        return None
    try:
        raw = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    report = ScanReport()
    for name_, caption, w, h, digest, location, start, size, extra in raw["samples"]:
        blob = _blob([name_, digest, location, start, size])  # as `_row` saved it
        sample = Sample(Path(name_), caption, w, h, blob=blob)
        sample.mask = _blob(extra["mask"]) if "mask" in extra else None
        sample.control_blobs = [_blob(c) for c in extra.get("controls", [])]
        sample.controls = [Path(c.name) for c in sample.control_blobs]
        if "clip" in extra:
            sample.frames, sample.total_frames = extra["clip"]
            sample.clip = True
        report.samples.append(sample)
    for f in _LISTS:
        getattr(report, f).extend(Path(p) for p in raw[f])
    for f in _PAIRS:
        getattr(report, f).extend((Path(p), why) for p, why in raw[f])
    return report


def save(folder: Path, name: str | None, report: ScanReport) -> None:
    """Save a shard's scan (atomically); nothing when the shard has no identity."""
    if name is None:
        return
    samples = [
        [s.blob.name, s.caption, s.width, s.height, *_row(s.blob)[1:], _extra(s)]
        for s in report.samples
        if s.blob is not None
    ]
    raw: dict[str, Any] = {"samples": samples}
    raw.update({f: [str(p) for p in getattr(report, f)] for f in _LISTS})
    raw.update({f: [[str(p), why] for p, why in getattr(report, f)] for f in _PAIRS})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(folder / f"{name}.json", json.dumps(raw, separators=(",", ":")))
    except OSError:
        pass  # a read-only cache folder: the shard is scanned again next time, nothing lost


def _row(blob: Blob) -> list[Any]:
    """A Blob as saved: name, digest, where (a file, or a dataset's cell), byte range or row."""
    return [blob.name, blob.digest, blob.table or blob.location, blob.start, blob.size]


def _blob(row: list[Any]) -> Blob:
    name, digest, location, start, size = row
    table = tuple(location) if isinstance(location, list) else None  # a dataset's cell
    return Blob(name, digest, "" if table else location, start, size, table)


def _extra(sample: Sample) -> dict[str, Any]:
    """What a sample holds besides its image: its mask, its controls; a clip's frames."""
    out: dict[str, Any] = {}
    if sample.clip:
        out["clip"] = [sample.frames, sample.total_frames]
    if sample.mask is not None:
        out["mask"] = _row(sample.mask)
    if sample.control_blobs:
        out["controls"] = [_row(b) for b in sample.control_blobs]
    return out


def rotated(names: list[Any]) -> list[Any]:
    """Units of a scan (shards, blocks of rows, batches of objects) in the order this process
    scans them: from its own start (rank × n / world)."""
    rank = int(os.environ.get("RANK", "0") or 0)
    world = max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
    start = rank * len(names) // world
    return names[start:] + names[:start]
