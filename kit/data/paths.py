"""Where a dataset's files are found beside each other."""

from __future__ import annotations

import os
from pathlib import Path

from kit.config import DataConfig


def caption_path(image: Path, cfg: DataConfig, is_dir: bool | None = None) -> Path:
    """The caption file of an image or frame folder (it may not exist yet)."""
    folder = Path(cfg.caption_dir) if cfg.caption_dir else image.parent
    if cfg.caption_dir:
        folder = folder / image.parent.relative_to(Path(cfg.image_dir))
    # A frame folder `clip.v2/` is captioned by `clip.v2.txt`: its whole name is the stem.
    stem = image.name if (image.is_dir() if is_dir is None else is_dir) else image.stem
    return folder / (stem + cfg.caption_extension)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/kit`, else `~/.cache/kit`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kit"
