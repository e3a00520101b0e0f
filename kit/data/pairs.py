"""Paired datasets for edit models: each target image with its control (reference) images.

A dataset's `control_dir` is one folder, or one per reference; a target `sub/cat.png` of
`image_dir` pairs with the image of relative stem `sub/cat` (any image extension) in each control
folder. A Hugging Face dataset or tar shards name their controls with `control_column` (a column,
a member of each key): their scan pairs them (`kit.data.sources`), read lazily as Blobs. The scan leaves out every target lacking a control and names every control lacking its
target, before anything is cached. A control is placed as its target is (the same mirror and
the same crop, in proportion to its own size), then resized by the family's pipeline rule
(`Family.control_pixels`), so a pair stays aligned whatever the bucket.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from PIL import Image

from kit.config import Config, DataConfig
from kit.data import video
from kit.data.blob import Blob
from kit.data.datasets import DatasetView, views
from kit.data.images import DEFAULT_MAX_PIXELS, BadImage, open_rgb, probe
from kit.data.sound import check_rates
from kit.errors import ConfigError, DataError
from kit.families import family_info


def check_family(cfg: DataConfig, family: Any) -> None:
    """Refuse `control_dir` for a family that takes no controls, a dataset without controls for
    one that needs them, and more control folders than the family's pipeline takes.
    `family` is the family or its `FamilyInfo` (which knows the same, without torch)."""
    for view in views(cfg):
        where = view.where or "the data section"
        entry = view.entry
        named = list(entry.control_column) if entry is not None else []
        key, given = ("control_column", len(named)) if named else ("control_dir", 0)
        given = given or len(view.data.control_dir)
        if given and not family.control_images:
            raise ConfigError(
                f"{where}: {key} is set, but {family.name} takes no control images; "
                f"remove {key} or train an edit family (flux_kontext)"
            )
        if given > family.control_images:
            raise ConfigError(
                f"{where}: {key} lists {given} controls, but {family.name} takes at most "
                f"{family.control_images} control image(s) per target"
            )
        if family.needs_control and not given:
            source = entry is not None and (entry.hf_dataset or entry.shards)
            raise ConfigError(
                f"{where}: {family.name} is an edit model and trains on pairs; "
                + (
                    "set control_column to the column (hf_dataset) or member (shards: "
                    "`control` for KEY.control.png) of each target's control image"
                    if source
                    else "set control_dir to the folder of control images paired with the "
                    "targets by name"
                )
            )


def _images(folder: Path) -> dict[str, list[Path]]:
    """Image files under a folder (hidden ones skipped), by relative stem (`sub/cat`)."""
    out: dict[str, list[Path]] = {}
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(folder)
        for name in sorted(files):
            path = Path(root) / name
            if name.startswith(".") or path.suffix.lower() not in video.FRAME_EXTS:
                continue
            out.setdefault((rel / path.stem).as_posix(), []).append(path)
    return out


def pair_controls(report: Any, cfg: DataConfig, family: Any = None) -> Any:
    """Give each sample of a dataset with `control_dir` its controls (`Sample.controls`).

    A target without a control (or with two of one stem) is moved to `report.skipped`; a control
    without a target is added to `report.skipped` too (a file found and not trained on). With a
    family, its control rules are checked first (`check_family`).
    """
    if family is not None:
        check_family(cfg, family)
    for view in views(cfg):
        if view.data.control_dir:
            _pair_view(report, view)
    return report


def _pair_view(report: Any, view: DatasetView) -> None:
    image_dir = Path(view.data.image_dir)
    folders = [Path(f) for f in view.data.control_dir]
    for folder in folders:
        if not folder.is_dir():
            raise DataError(f"{view.where or 'control_dir'}: control folder not found: {folder}")
    indexes = [_images(f) for f in folders]
    targets = set(_images(image_dir))
    kept = []
    for sample in report.samples:
        if sample.dataset != view.index or not Path(sample.image).is_relative_to(image_dir):
            kept.append(sample)
            continue
        rel = Path(sample.image).relative_to(image_dir)
        stem = (rel.parent / rel.stem).as_posix()
        found, why = [], ""
        for folder, index in zip(folders, indexes, strict=True):
            mine = index.get(stem, [])
            if len(mine) != 1:
                why = (
                    f"no control image {folder / stem}.* in control_dir"
                    if not mine
                    else f"ambiguous control: {', '.join(p.name for p in mine)} in {folder}"
                )
                break
            try:  # its header, as the target's was read: a control that cannot be used skips
                probe(mine[0], view.data.max_image_pixels)  # its pair alone, named
            except BadImage as e:
                why = f"unreadable control image {mine[0]}: {e}"
                break
            found.append(mine[0])
        if why:
            report.skipped.append((Path(sample.image), why))
            continue
        sample.controls = found
        kept.append(sample)
    report.samples = kept
    for index in indexes:
        for stem, paths in sorted(index.items()):
            if stem not in targets:
                report.skipped += [
                    (p, f"control image without a target {image_dir / stem}.*") for p in paths
                ]


def unpaired(report: Any) -> list[tuple[Path, str]]:
    """The files the pairing left out (targets without controls, controls without targets)."""
    marks = (
        "no control image",
        "ambiguous control",
        "control image without",
        "unreadable control image",
    )
    return [(p, why) for p, why in report.skipped if why.startswith(marks)]


def controls_of(sample: Any) -> list[Path | Blob]:
    """A sample's controls as they are read: Blobs from a source, else its control files."""
    return list(sample.control_blobs) or list(sample.controls)


def _opened(control: Path | Blob) -> Any:
    return control.open() if isinstance(control, Blob) else control


def control_image(
    path: Path | Blob,
    placement: Any,
    background: str = "white",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Image.Image:
    """A control (a file, or a source's Blob) as its target was placed: mirrored alike, and
    cropped to the same part of the picture (the target's crop in proportion to the control's
    own size); not yet resized. `placement` is the target's `kit.data.buckets.Placement`."""
    name = path.name if isinstance(path, Blob) else path
    try:
        im = open_rgb(_opened(path), background, max_pixels)
    except (BadImage, OSError) as e:  # OSError: a store that refused or lost the read
        raise BadImage(f"unreadable control image {name}: {e}") from None
    if placement.flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    box = _crop_box(im.size, placement)
    return im if box is None else im.crop(box)


def control_pixels(family: Any, image: Image.Image, control: Path | Blob) -> Any:
    """The family's pixels of a control image (`Family.control_pixels`); a control its
    pipeline refuses (FLUX.2: under 64 px a side) is a DataError naming it."""
    try:
        return family.control_pixels(image)
    except (DataError, ValueError, ZeroDivisionError) as e:
        name = control.name if isinstance(control, Blob) else control
        raise DataError(f"control image {name}: {e}") from None


def _crop_box(size: tuple[int, int], placement: Any) -> tuple[int, int, int, int] | None:
    """The target's crop in a control of this size (None: the target was not cropped)."""
    (rw, rh), (top, left), (bw, bh) = placement.resized, placement.crop, placement.bucket
    if (rw, rh) == (bw, bh):
        return None
    sx, sy = size[0] / rw, size[1] / rh
    return round(left * sx), round(top * sy), round((left + bw) * sx), round((top + bh) * sy)


def check_batchable(
    samples: list[Any],
    placements: list[Any],
    family: Any,
    cfg: Config,
    batched: bool = True,
    controls: bool = True,
) -> None:
    """Refuse, before anything is cached, a control the pipeline's rule cannot resize (see
    `resized_control`) and, when samples are `batched`, a bucket whose controls the rule resizes
    to different sizes, or (a family that trains on sound) whose clips' frame rates differ, so
    that their sound has different lengths: they could not share a batch. Reads headers only.

    `family` None: the configured one's facts (which resize no controls)."""
    if batched and (family or family_info(cfg.model.model_family)).audio:
        check_rates(samples, placements)
    if not controls or not hasattr(family, "control_size"):
        return
    sizes: dict[tuple[Any, int], dict[tuple[int, int], Path]] = {}
    for sample, placement in zip(samples, placements, strict=True):
        for r, control in enumerate(controls_of(sample)):
            seen = sizes.setdefault((placement.bucket, r), {})
            size = resized_control(control, placement, family, cfg.data)
            seen.setdefault(size, sample.controls[r])
            if len(seen) > 1 and batched:
                (a, fa), (b, fb) = list(seen.items())[:2]
                raise DataError(
                    f"{fa} and {fb} are controls of one bucket {placement.bucket} that the "
                    f"{family.name} pipeline resizes to {a} and {b}: give each control its "
                    "target's aspect ratio, or train with train_batch_size 1"
                )


def resized_control(
    path: Path | Blob, placement: Any, family: Any, cfg: DataConfig
) -> tuple[int, int]:
    """The (width, height) a control trains at: cropped as its target was, then resized by the
    family's pipeline rule (`Family.control_size`). Reads the image's header only; a control
    that cannot be read, or that the pipeline's rule leaves no pixel of, is a DataError naming it."""
    name = path.name if isinstance(path, Blob) else path
    try:
        w, h = size = probe(_opened(path), cfg.max_image_pixels)
    except (BadImage, OSError) as e:  # OSError: a store that refused or lost the read
        raise DataError(f"unreadable control image {name}: {e}") from None
    box = _crop_box((w, h), placement)
    if box is not None:
        w, h = box[2] - box[0], box[3] - box[1]
    try:
        out = family.control_size(w, h) if min(w, h) > 0 else (0, 0)
    except ZeroDivisionError:  # a rule that keeps the aspect ratio, of a side rounded to 0
        out = (0, 0)
    if min(out) < 1:
        raise DataError(
            f"control image {name} is {size[0]}x{size[1]} px: too small for the {family.name} "
            f"pipeline, which resizes it to {out[0]}x{out[1]}; give it its target's size, or "
            "remove the pair"
        )
    return out
