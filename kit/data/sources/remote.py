"""A folder at an fsspec URL (`s3://bucket/prefix`, `gs://...`, `hf://datasets/...`) as a
training dataset: images and same-stem caption files beside them, as in a local folder.

One listing gives every object's size and (where the store has one) its content tag; each image's
size is read from its first bytes by a range request, many at once; captions are fetched in the
same batches. Nothing else is downloaded until the cache encodes an image.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from typing import Any

from kit.data.blob import Blob, filesystem, remote, sha256, timed_out
from kit.data.datasets import DatasetView
from kit.data.images import BadImage
from kit.data.samples import ScanReport
from kit.data.sources import index
from kit.data.sources.common import add_sample, caption_text, header_size
from kit.data.video import FRAME_EXTS, VIDEO_EXTS
from kit.errors import DataError

HEADER_BYTES = 1 << 16
"""Bytes read for an image's header; a header longer than this (a large EXIF or ICC profile)
costs a second, whole read."""
BATCH = 256
"""Objects fetched per batch of concurrent requests."""
_TAGS = ("ETag", "etag", "md5Hash", "crc32c", "sha256")


def content_tag(info: dict[str, Any]) -> str:
    """A content digest the store gives in its listing (S3's ETag, GCS's md5), with the size;
    empty when it gives none (the bytes are then hashed)."""
    for key in _TAGS:
        if info.get(key):
            return f"{key}:{str(info[key]).strip(chr(34))}:{info.get('size')}"
    return ""


def scan_url_folder(view: DatasetView, family: Any = None) -> ScanReport:
    """Every image under the URL, with its caption file beside it. A video family's clips are
    read from a local folder or tar shards: here each video is named and skipped."""
    cfg = view.data
    url = cfg.image_dir.rstrip("/")
    if cfg.caption_dir:
        raise DataError(f"caption_dir: captions of {url} lie beside its images; leave it empty")
    fs, root = filesystem(url)
    try:
        listing = remote(f"the listing of {url}", fs.find, root, detail=True)
    except DataError:
        raise
    except (OSError, ValueError) as e:  # missing bucket, refused credentials
        raise DataError(f"image_dir {url} cannot be listed: {e}") from None
    except Exception as e:  # the library's own error for a service it could not reach
        raise DataError(
            f"image_dir {url} cannot be listed ({type(e).__name__}: {e}); check the network and "
            "the credentials in the environment"
        ) from None
    scheme = url.split("://", 1)[0]
    rel = {p: p[len(root) :].lstrip("/") for p in listing}
    files = {p for p in listing if not any(x.startswith(".") for x in rel[p].split("/"))}
    images = sorted(p for p in files if PurePosixPath(p).suffix.lower() in FRAME_EXTS)
    ext = cfg.caption_extension
    batches = [images[i : i + BATCH] for i in range(0, len(images), BATCH)]
    folder = index.scan_dir(cfg)
    parts: dict[int, ScanReport] = {}
    for b in index.rotated(list(range(len(batches)))):  # processes start at their own batches
        batch = batches[b]
        caps = [str(PurePosixPath(p).with_suffix(ext)) for p in batch]
        # Saved under the objects' (and captions') tags: a changed object changes the key.
        ident = [[p, content_tag(listing.get(p, {}))] for p in batch + caps if p in files]
        key = index.key(f"{url} {b}", cfg, ident if all(t for _, t in ident) else None)
        part = index.load(folder, key)
        if part is None:
            part = _scan_batch(fs, scheme, batch, caps, listing, files, cfg)
            index.save(folder, key, part)
        parts[b] = part
    report = ScanReport()
    for b in range(len(batches)):
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(parts[b], f.name))
    if family is not None and family.video:
        why = "a clip in a bucket: clips are read from a local folder or tar shards (`shards`)"
        report.skipped += [
            (Path(f"{scheme}://{p}"), why)
            for p in sorted(files)
            if PurePosixPath(p).suffix.lower() in VIDEO_EXTS
        ]
    captioned = {str(PurePosixPath(p).with_suffix(ext)) for p in images}
    report.orphan_captions = [
        Path(f"{scheme}://{p}") for p in sorted(files) if p.endswith(ext) and p not in captioned
    ]
    return report


def _needs_whole(head: bytes, size: int, cfg: Any) -> bool:
    """Whether a header read fell short: a partial read that Pillow cannot size."""
    if len(head) >= size:
        return False
    try:
        header_size(head, cfg)
    except BadImage:
        return True
    return False


def _scan_batch(
    fs: Any,
    scheme: str,
    batch: list[str],
    caps: list[str],
    listing: dict[str, Any],
    files: set[str],
    cfg: Any,
) -> ScanReport:
    """The samples of one batch of objects: their headers and captions fetched concurrently."""
    report = ScanReport()
    sizes = [int(listing[p].get("size") or 0) for p in batch]
    heads = fs.cat_ranges(
        batch, [0] * len(batch), [min(s, HEADER_BYTES) for s in sizes], on_error="return"
    )
    wanted = [c for c in caps if c in files] if cfg.caption_strategy == "textfile" else []
    texts = fs.cat(wanted, on_error="return") if wanted else {}
    if len(wanted) == 1 and not isinstance(texts, dict):
        texts = {wanted[0]: texts}
    # A request of the batch that got no answer is asked again alone (`remote_retries`), not
    # taken for an unreadable file.
    heads = [
        remote(f"{scheme}://{p}", fs.cat_file, p, start=0, end=min(s, HEADER_BYTES))
        if timed_out(h)
        else h
        for p, s, h in zip(batch, sizes, heads, strict=True)
    ]
    for c, raw in texts.items():
        if timed_out(raw):
            texts[c] = remote(f"{scheme}://{c}", fs.cat_file, c)
    for p, size, head, cap in zip(batch, sizes, heads, caps, strict=True):
        name = f"{scheme}://{p}"
        if isinstance(head, BaseException):
            report.unreadable.append((Path(name), f"cannot be read: {head}"))
            continue
        tag = content_tag(listing[p])
        if not tag or _needs_whole(head, size, cfg):
            try:
                head = fs.cat_file(p)  # the whole object: its header is longer than read
            except Exception as e:  # noqa: BLE001 (the store's own errors too: a read lost)
                report.unreadable.append((Path(name), f"cannot be read: {type(e).__name__}: {e}"))
                continue
            tag = tag or sha256(head)
        raw = texts.get(cap)
        if isinstance(raw, BaseException):
            report.unreadable.append((Path(name), f"caption {cap}: {raw}"))
            continue
        caption = None if raw is None else caption_text(raw, "txt", name, report)
        add_sample(report, cfg, Blob(name, tag, name, 0, size), head, caption)
    return report
