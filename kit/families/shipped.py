"""Architecture configs that ship with the kit, and the hub ids and short names that select them.

With these, the estimator, the network preview and the tests build real architectures (on the
meta device or with random weights) without any download.

Each family folder keeps its architectures under `configs/`: one folder per architecture in
diffusers layout (configs, no weights) with a `shipped.json` beside its `model_index.json`: its
title, its family (the folder's), the hub ids and short names that select it, and its denoiser's
published size in billions of parameters. A new architecture is a new folder; nothing here names
one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FAMILIES_DIR = Path(__file__).parent
"""The families package: `<family>/configs/<architecture>/` holds each shipped architecture."""


@dataclass(frozen=True)
class Shipped:
    """One shipped architecture, as its `shipped.json` describes it."""

    folder: str
    """Its folder's name (unique across families)."""
    title: str
    """The released model's name, for tables and notebooks."""
    family: str
    """The `model_family` that trains it."""
    names: tuple[str, ...]
    """Hub ids and short names that select it (the first is the hub id)."""
    denoiser_billions: tuple[float, float]
    """The published denoiser size, low and high, in billions of parameters."""

    @property
    def path(self) -> Path:
        """The folder of its configs."""
        return FAMILIES_DIR / self.family / "configs" / self.folder

    @property
    def hub_id(self) -> str:
        """The hub repository of the released model."""
        return self.names[0]


def _read() -> dict[str, Shipped]:
    found: dict[str, Shipped] = {}
    for path in sorted(FAMILIES_DIR.glob("*/configs/*/shipped.json"), key=lambda p: p.parent.name):
        meta = json.loads(path.read_text(encoding="utf-8"))
        family = path.parent.parent.parent.name
        if meta["family"] != family or path.parent.name in found:
            raise ValueError(
                f"{path}: an architecture's folder name is unique and its family is its "
                f"folder's ({family!r})"
            )
        found[path.parent.name] = Shipped(
            folder=path.parent.name,
            title=meta["title"],
            family=meta["family"],
            names=tuple(meta["names"]),
            denoiser_billions=tuple(meta["denoiser_billions"]),
        )
    return found


ARCHITECTURES: dict[str, Shipped] = _read()
"""Folder name → the shipped architecture."""

SHIPPED: dict[str, str] = {
    name: folder for folder, arch in ARCHITECTURES.items() for name in (*arch.names, folder)
}
"""Hub id or short name → the architecture's folder name (`shipped_dir` gives its path)."""


def shipped_dir(folder: str) -> Path:
    """The configs of shipped architecture `folder` (a name of `ARCHITECTURES`)."""
    return ARCHITECTURES[folder].path


def config_source(pretrained: str) -> str:
    """Where configs are read: a local folder, the shipped copy, or the hub id."""
    if Path(pretrained).is_dir():
        return pretrained
    if pretrained in SHIPPED:
        return str(shipped_dir(SHIPPED[pretrained]))
    return pretrained
