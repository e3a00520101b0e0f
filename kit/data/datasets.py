"""Several datasets in one run: each entry of `datasets` seen as a data section of its own.

A run reads one folder (`image_dir`) or several (`datasets`). Each dataset is trained through a
*view*: the data section with the entry's folders and the settings it gives for itself (caption
strategy, resolution, buckets...), so every per-image step (scan, buckets, pixels, captions)
reads its settings from one place whatever the number of folders. Samples carry the index of
their dataset (`Sample.dataset`); repeats, role and loss weight are looked up from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kit.config import DataConfig, DatasetConfig
from kit.config.sources import URL
from kit.errors import ConfigError


@dataclass(frozen=True)
class DatasetView:
    """One dataset as training sees it."""

    index: int
    name: str
    data: DataConfig
    """The data section with this dataset's folders and own settings."""
    repeats: int = 1
    role: str = "instance"
    loss_weight: float = 1.0
    entry: DatasetConfig | None = None
    """The `datasets` entry (None for the single-folder form)."""

    @property
    def prior(self) -> bool:
        return self.role == "prior"

    @property
    def target(self) -> str:
        """What its samples train toward: `noise`, or the base model's prediction."""
        return self.entry.target if self.entry is not None else "noise"

    @property
    def where(self) -> str:
        """How messages name the dataset: `datasets[1] (reg)`, or '' for a single folder."""
        return f"datasets[{self.index}] ({self.name})" if self.entry is not None else ""


def views(data: DataConfig) -> list[DatasetView]:
    """Every dataset of the data section, in config order (one for the single-folder form)."""
    if not data.datasets:
        if data.control_dir and URL.match(data.image_dir):
            raise ConfigError(
                f"control_dir: pairs the images of a local image_dir, and {data.image_dir} is a "
                "URL; write the pairs as tar shards (shards, control_column) or copy them here"
            )
        name = Path(data.image_dir).name if data.image_dir else "images"
        return [DatasetView(0, name, data)]
    out = []
    names: dict[str, int] = {}
    for i, entry in enumerate(data.datasets):
        name = entry.name or entry.source_name() or f"dataset{i}"
        if name in names:
            raise ConfigError(
                f"datasets[{i}]: the name {name!r} is also datasets[{names[name]}]'s; "
                "give each dataset its own `name`"
            )
        names[name] = i
        try:
            view = dataclasses.replace(
                data,
                image_dir=entry.image_dir,
                caption_dir=entry.caption_dir,
                control_dir=entry.control_dir,
                datasets=[],
                **entry.overrides(),
            )
        except ConfigError as e:
            raise ConfigError(f"datasets[{i}] ({name}): {e}") from None
        out.append(DatasetView(i, name, view, entry.repeats, entry.role, entry.loss_weight, entry))
    folders: dict[str, int] = {}
    for v in out:
        key, field = _source_key(v)
        if key in folders:
            raise ConfigError(
                f"{v.where}: {field} {key} is also datasets[{folders[key]}]'s; "
                "one source trains once (use `repeats` to weight it)"
            )
        folders[key] = v.index
    return out


def _source_key(view: DatasetView) -> tuple[str, str]:
    """What makes a dataset's source itself (its folder, URL, hub dataset and split, shards), and
    the field that names it."""
    entry = view.entry
    if entry is not None and entry.hf_dataset:
        return f"{entry.hf_dataset} ({entry.split})", "hf_dataset"
    if entry is not None and entry.shards:
        return entry.shards, "shards"
    folder = view.data.image_dir
    return (folder if URL.match(folder) else str(Path(folder).resolve())), "image_dir"


def weighted(data: DataConfig) -> bool:
    """Whether any dataset's loss weight is not 1 (the batch then carries per-sample weights)."""
    return any(v.loss_weight != 1.0 for v in views(data))


def view_of(image: str | Path, data: DataConfig) -> DatasetView:
    """The dataset an image file belongs to (the deepest folder holding it)."""
    path = Path(image).absolute()
    best: DatasetView | None = None
    for v in views(data):
        root = Path(v.data.image_dir).absolute()
        if path.is_relative_to(root) and (
            best is None or len(root.parts) > len(Path(best.data.image_dir).absolute().parts)
        ):
            best = v
    if best is None:
        raise ConfigError(f"{image} is in none of the datasets' image folders")
    return best
