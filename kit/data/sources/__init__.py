"""Datasets that are not a local folder: a Hugging Face dataset (`hf_dataset`), WebDataset tar
shards (`shards`), or a folder at an fsspec URL (`image_dir: s3://bucket/prefix`).

Each gives the same `Sample` records a folder scan gives, with a `Blob` saying where the bytes
are, so captions, repeats, roles, buckets, the cache and resume treat every source alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kit.data.blob import is_url
from kit.data.datasets import DatasetView
from kit.data.samples import ScanReport
from kit.data.sources.hf import scan_hf
from kit.data.sources.remote import scan_url_folder
from kit.data.sources.stream import scan_stream
from kit.data.sources.tar import scan_shards, shard_names


def elsewhere(view: DatasetView) -> bool:
    """Whether a dataset is read by a source here rather than as a local folder."""
    entry = view.entry
    return bool(entry is not None and (entry.hf_dataset or entry.shards)) or is_url(
        view.data.image_dir
    )


def describe(view: DatasetView) -> str:
    """Where a dataset's images are, as messages name it."""
    entry = view.entry
    if entry is not None and entry.hf_dataset:
        streamed = ", streamed" if entry.streaming else ""
        return f"hf_dataset {entry.hf_dataset} ({entry.split}{streamed})"
    if entry is not None and entry.shards:
        return f"shards {entry.shards}"
    return view.data.image_dir


def owns(view: DatasetView, name: str | Path) -> bool:
    """Whether a reported file (a sample's name) comes from this non-folder dataset."""
    entry, text = view.entry, str(name)
    if entry is not None and entry.hf_dataset:
        return text.startswith(entry.source_name() + "[")
    if entry is not None and entry.shards:
        return any(text.startswith(s + "/") or text == s for s in shard_names(entry.shards))
    return text.startswith(str(Path(view.data.image_dir)))


def scan_source(view: DatasetView, family: Any = None) -> ScanReport:
    """Scan a dataset that `elsewhere` says is not a local folder. `family` decides, as for a
    folder, whether clips are read (a video family, or none given)."""
    entry = view.entry
    if entry is not None and entry.hf_dataset:
        return scan_stream(view) if entry.streaming else scan_hf(view)
    if entry is not None and entry.shards:
        return scan_shards(view, family)
    return scan_url_folder(view, family)
