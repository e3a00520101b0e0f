"""What the notebooks show of an edit dataset: each target beside its control images, and the
files the pairing left out (targets without controls, controls without targets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from kit.config import Config
from kit.data.blob import Blob
from kit.data.pairs import controls_of, unpaired
from kit.data.scan import scan
from kit.export.edits import fitted, stack, strip
from kit.families import family_info


def dataset_pairs(cfg: Config) -> tuple[list[Any], list[dict[str, str]]]:
    """(the samples that have controls, the unpaired files as table rows: file, reason)."""
    scanned = scan(cfg.data, family_info(cfg.model.model_family))
    left = [{"file": str(f), "reason": why} for f, why in unpaired(scanned)]
    return [s for s in scanned.samples if s.controls], left


def pair_sheet(samples: list[Any], n: int = 6, height: int = 96) -> Image.Image | None:
    """The first `n` pairs, a row each: control(s) → target, under the target's file name and
    caption; None without pairs."""
    rows = [
        strip(
            [fitted(_picture(c), height) for c in controls_of(s)]
            + [fitted(_picture(s.blob or s.image), height)],
            len(s.controls),
            f"{Path(s.image).name}: {s.caption or ''}",
        )
        for s in samples[:n]
        if s.controls
    ]
    return stack(rows) if rows else None


def _picture(image: Any) -> Any:
    """A file to open, or a source's Blob as the bytes it holds."""
    return image.open() if isinstance(image, Blob) else image
