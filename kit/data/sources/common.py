"""What every source does with one sample's bytes: its size from the header, its caption by the
dataset's caption strategy, and the problems recorded as a folder scan records them."""

from __future__ import annotations

import io
import json
from pathlib import Path

from kit.config import DataConfig
from kit.data.blob import Blob
from kit.data.images import BadImage, probe
from kit.data.samples import Sample, ScanReport, decode_caption
from kit.errors import DataError


def header_size(data: bytes | memoryview, cfg: DataConfig) -> tuple[int, int]:
    """Width and height as displayed, from the bytes' header; BadImage when unusable."""
    return probe(io.BytesIO(data), cfg.max_image_pixels)


def caption_text(raw: bytes | str | None, ext: str, name: str, report: ScanReport) -> str:
    """A caption from its bytes: text (not UTF-8 is replaced and noted), or a JSON record's
    `caption` (else `text`, else `prompt`) field."""
    if raw is None:
        return ""
    if isinstance(raw, bytes):
        text = decode_caption(raw, name, report)
    else:
        text = str(raw)
    if ext != "json":
        return text.strip()
    try:
        record = json.loads(text)
    except ValueError as e:
        raise DataError(f"caption JSON cannot be read: {e}") from None
    found = next((record[k] for k in ("caption", "text", "prompt") if k in record), None)
    if not isinstance(found, str):
        raise DataError("caption JSON has no `caption`, `text` or `prompt` string")
    return found.strip()


def add_sample(
    report: ScanReport,
    cfg: DataConfig,
    blob: Blob,
    header: bytes | memoryview,
    caption: str | None,
    where: str = "",
    size: tuple[int, int] | None = None,
) -> bool:
    """Record one sample (True), or why it is left out (`where`: its shard and key, for the
    reason).

    `caption` None: the source has no caption for it (with `caption_strategy` textfile).
    `size`: its width and height when already known (a clip's), else read from `header`.
    """
    name = Path(blob.name)
    try:
        w, h = size or header_size(header, cfg)
    except BadImage as e:
        report.unreadable.append((name, f"{e}{where}"))
        return False
    smallest = cfg.min_image_size
    if w < smallest or h < smallest:
        report.skipped.append((name, f"too small: {w}x{h}, under min_image_size {smallest} px"))
        return False
    if cfg.caption_strategy == "instanceprompt":
        caption = cfg.instance_prompt
    elif cfg.caption_strategy == "filename":
        caption = name.stem.replace("_", " ").strip()
    elif caption is None:
        report.missing_captions.append(name)
        return False
    elif not caption:
        report.empty_captions.append(name)
    report.samples.append(Sample(name, caption, w, h, blob=blob))
    return True


def add_controls(
    report: ScanReport,
    cfg: DataConfig,
    controls: list[tuple[str, Blob | None, bytes | memoryview | str]],
    where: str = "",
) -> None:
    """Give the sample just recorded its controls, each (what names it, its Blob or None when
    the row or key has none, its bytes, or why its file cannot be read): a sample whose control
    is missing or cannot be read is moved to `report.skipped`, the control named, as a folder's
    unpaired target is."""
    sample = report.samples[-1]
    for name, blob, data in controls:
        if isinstance(data, str):
            why = f"unreadable control image {name}: {data}{where}"
        elif blob is None or not len(data):
            why = f"no control image {name}{where}"
        else:
            try:
                header_size(data, cfg)
                continue
            except BadImage as e:
                why = f"unreadable control image {name}: {e}{where}"
        report.samples.pop()
        report.skipped.append((sample.image, why))
        return
    sample.control_blobs = [b for _, b, _ in controls if b is not None]  # every one, checked
    sample.controls = [Path(b.name) for b in sample.control_blobs]
