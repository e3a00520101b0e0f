"""Loss masks (`masked_loss`): where each image's mask comes from, and the mask as trained.

A mask says which parts of an image the loss learns from: white (1) trains, black (0) is
ignored, grey weighs in between. It is the image's own alpha channel, or a same-stem image in
`mask_dir` (subfolders mirrored, as `caption_dir` mirrors them). It goes through the same
resize, mirror and crop that fit the pixels to their bucket, and is then averaged down onto the
latent grid, so each latent cell is weighted by the share of its pixels that is to be learnt.

Masks are checked when the cache is planned, before anything is encoded: an image whose mask is
missing, unreadable or of another size is left out, with a reason naming its dataset, the file
and the key, in the data report; the other images, and the other datasets, still train.
A `mask_dir` that is not a folder is a config mistake and stops the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from PIL import Image, ImageOps, UnidentifiedImageError

from kit.config import Config, DataConfig
from kit.data.blob import Blob
from kit.data.buckets import Placement, plan_dataset
from kit.data.datasets import DatasetView, views
from kit.data.images import BadImage, probe
from kit.data.pixels import fit_to_bucket, sample_pixels
from kit.data.scan import IMAGE_EXTS, Sample, ScanReport, check_dataset
from kit.errors import ConfigError, DataError
from kit.families import family_info
from kit.io import sha256_file

if TYPE_CHECKING:
    import numpy as np
    import torch

ALPHA = "alpha"
"""`MaskSource.digest` of a mask read from the image's alpha channel: the image's own digest
already keys its cache entry, so the alpha needs no digest of its own."""
WHOLE = "whole"
"""The digest of a dataset trained without masks beside masked ones: every weight is 1."""
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError)


@dataclass(frozen=True)
class MaskSource:
    """Where one sample's loss mask comes from, and whom to name when it goes wrong."""

    image: Path
    file: Path | None
    """The mask image in `mask_dir`; None when the mask is the image's alpha channel."""
    digest: str
    """What keys the mask in the cache: the mask file's SHA-256, or `ALPHA`."""
    dataset: str = ""
    """The dataset, as messages name it."""
    blob: Blob | None = None
    """Where the bytes read for the mask are when they are no local file (the mask's, or for
    the alpha channel the image's; see `kit.data.sources`)."""

    def key(self) -> tuple[str, str]:
        """The part of the latent entry's key that the mask adds."""
        return ("mask", self.digest)

    @property
    def config_key(self) -> str:
        """The config key a problem with this mask is fixed under."""
        return "masked_loss" if self.file is None else "mask_dir"


@dataclass(frozen=True)
class _Folders:
    label: str
    image_dir: Path
    mask_dir: Path | None


def _folders(view: DatasetView) -> _Folders:
    """A dataset's name (as messages name it), image folder and mask folder (a dataset's own
    `mask_dir`, else the data section's; empty means the alpha channel)."""
    mask_dir = Path(view.data.mask_dir) if view.data.mask_dir else None
    return _Folders(view.where or f"dataset {view.name!r}", Path(view.data.image_dir), mask_dir)


def check_mask_dirs(cfg: DataConfig) -> None:
    """Refuse a `mask_dir` that is not a folder, or one inside the images' folder (its masks
    would be scanned as training images): config mistakes, which stop the run."""
    for view in views(cfg):
        mask_dir, image_dir = view.data.mask_dir, view.data.image_dir
        if not mask_dir:
            continue
        own = view.entry is not None and view.entry.mask_dir is not None
        key = f"{view.where}: mask_dir" if own else "mask_dir"
        folder = Path(mask_dir)
        if not folder.is_dir():
            raise ConfigError(f"{key}: mask folder not found: {folder}")
        if image_dir and folder.resolve().is_relative_to(Path(image_dir).resolve()):
            raise ConfigError(
                f"{key}: {folder} lies inside image_dir {image_dir}, so its masks would be "
                "read as training images; keep the masks in a folder of their own"
            )


def mask_candidates(image: Path, image_dir: Path, mask_dir: Path) -> list[Path]:
    """The image files in `mask_dir` named like the image (with any image extension), in the
    image's subfolder mirrored under `mask_dir`; a frame folder `clip.v2/` by its whole name."""
    try:
        folder = mask_dir / image.parent.relative_to(image_dir)
    except ValueError:
        folder = mask_dir
    if not folder.is_dir():
        return []
    stem = image.name if image.is_dir() else image.stem
    return sorted(
        p
        for p in folder.iterdir()
        if p.stem == stem and p.suffix.lower() in IMAGE_EXTS and p.is_file()
    )


@contextmanager
def _opened(path: Path | IO[bytes]) -> Iterator[Image.Image]:
    """The image opened lazily; files the scan accepted are not refused by Pillow's own limit
    (the scan has held them to `max_image_pixels`)."""
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
    except FileNotFoundError:
        raise BadImage("file not found") from None
    except _DECODE_ERRORS as e:
        raise BadImage(f"not an image Pillow can read ({e or type(e).__name__})") from None
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    with im:
        yield im


def _transparent(im: Image.Image) -> bool:
    return im.mode in _ALPHA_MODES or "transparency" in im.info


def has_alpha(path: Path) -> bool:
    """Whether an image carries transparency (an alpha channel, or a transparent palette entry
    or colour key), read from its header alone."""
    with _opened(path) as im:
        return _transparent(im)


def mask_source(sample: Sample, cfg: DataConfig, view: DatasetView | None = None) -> MaskSource:
    """Where the sample's mask comes from, checked from headers (no pixels decoded); `view` is
    the sample's dataset when the caller has it (see `kit.data.datasets`).

    A DataError, naming the dataset, the file and the key, when there is no mask, the mask file
    cannot be read, or its size (as displayed, after EXIF rotation) is not the image's.
    """
    view = view or views(cfg)[sample.dataset]
    where = _folders(view)
    image = sample.image
    if not view.data.masked_loss:
        # A dataset trained whole (its own `masked_loss: false`) beside masked ones.
        return MaskSource(image, None, WHOLE, where.label)
    if sample.blob is not None and sample.clip:
        raise DataError(
            f"{where.label}: {sample.blob.name}: a clip from shards has no mask to train with; "
            "train clips with masks from a folder (mask_dir), or set masked_loss false for it"
        )
    if sample.blob is not None:
        return _source_mask(sample, cfg, where.label)
    if where.mask_dir is None:
        if sample.clip:
            raise DataError(
                f"{where.label}: {image}: a clip has no alpha channel to take a mask from; "
                "give its mask as a same-stem image in mask_dir (masked_loss)"
            )
        try:
            alpha = has_alpha(image)
        except BadImage as e:
            raise DataError(f"{where.label}: {image}: {e} (masked_loss)") from None
        if not alpha:
            raise DataError(
                f"{where.label}: {image} has no alpha channel to take its mask from, and no "
                "mask_dir is set (masked_loss)"
            )
        return MaskSource(image, None, ALPHA, where.label)
    found = mask_candidates(image, where.image_dir, where.mask_dir)
    stem = image.name if image.is_dir() else image.stem
    if not found:
        try:
            folder = where.mask_dir / image.parent.relative_to(where.image_dir)
        except ValueError:
            folder = where.mask_dir
        raise DataError(
            f"{where.label}: {image}: no mask {folder / stem}.* (png, jpg, webp, bmp) in mask_dir"
        )
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise DataError(
            f"{where.label}: {image}: several masks share its name ({names}); keep one (mask_dir)"
        )
    file = found[0]
    try:
        size = probe(file, cfg.max_image_pixels)
    except BadImage as e:
        raise DataError(f"{where.label}: mask {file} is unreadable: {e} (mask_dir)") from None
    if size != (sample.width, sample.height):
        raise DataError(
            f"{where.label}: mask {file} is {size[0]}x{size[1]}, but its image {image} is "
            f"{sample.width}x{sample.height}; a mask must match its image's size (mask_dir)"
        )
    return MaskSource(image, file, sha256_file(file), where.label)


def _source_mask(sample: Sample, cfg: DataConfig, label: str) -> MaskSource:
    """The mask of a sample read from a dataset, shard or bucket: its `mask_column` cell, else
    its image's alpha channel; checked from headers as a folder's masks are."""
    blob = sample.mask or sample.blob
    assert blob is not None
    try:
        with _opened(blob.open()) as im:
            alpha, size = _transparent(im), im.size
    except (BadImage, OSError) as e:
        raise DataError(f"{label}: {blob.name}: {e} (masked_loss)") from None
    if sample.mask is None:
        if not alpha:
            raise DataError(
                f"{label}: {blob.name} has no alpha channel to take its mask from, and no "
                "mask_column is set (masked_loss)"
            )
        return MaskSource(sample.image, None, ALPHA, label, blob)
    if size != (sample.width, sample.height):
        raise DataError(
            f"{label}: mask {blob.name} is {size[0]}x{size[1]}, but its image is "
            f"{sample.width}x{sample.height}; a mask must match its image's size (mask_column)"
        )
    return MaskSource(sample.image, Path(blob.name), blob.digest, label, blob)


@dataclass
class MaskPlan:
    """The scan with only the samples whose masks are usable, and each one's mask."""

    scanned: ScanReport
    family: Any
    sources: dict[tuple[Path, int], MaskSource] = field(default_factory=dict)
    refused: list[tuple[Path, str]] = field(default_factory=list)
    """(image, why) of each image left out for its mask."""

    def for_samples(self, samples: list[Sample]) -> list[MaskSource]:
        """The mask of each of these samples (kept by the scan above)."""
        return [self.sources[(s.image, s.dataset)] for s in samples]


def plan_masks(cfg: Config, family: Any = None, scanned: ScanReport | None = None) -> MaskPlan:
    """Check every scanned sample's mask before anything is encoded or bucketed.

    An image whose mask is unusable is left out (in `refused`, with why), so that buckets are
    planned on what trains. A `mask_dir` that is no folder raises ConfigError; not one usable
    mask left raises DataError, naming the first problem.
    """
    check_mask_dirs(cfg.data)
    if family is None:
        family = family_info(cfg.model.model_family)
    if scanned is None:
        scanned = check_dataset(cfg.data, family)
    plan = MaskPlan(scanned, family)
    seen = views(cfg.data)
    kept = []
    for s in scanned.samples:
        try:
            plan.sources[(s.image, s.dataset)] = mask_source(s, cfg.data, seen[s.dataset])
        except DataError as e:
            plan.refused.append((s.image, str(e)))
            continue
        kept.append(s)
    if not kept:
        why = plan.refused[0][1]
        raise DataError(
            f"masked_loss: not one image has a usable mask ({len(plan.refused)} refused; "
            f"first: {why})"
        )
    plan.scanned = replace(scanned, samples=kept)
    return plan


# ------------------------------------------------------------------ the mask's values


def _grey(im: Image.Image) -> np.ndarray:
    """A mask image's values in [0, 1]: its alpha when it has any transparency (white strokes on
    a transparent layer, or a cut-out), else its grey level (16-bit and float images keep their
    full range; colours count by their luminance)."""
    import numpy as np

    if _transparent(im):
        rgba = im if im.mode in _ALPHA_MODES else im.convert("RGBA")
        alpha = np.asarray(rgba.getchannel(len(rgba.getbands()) - 1), dtype=np.float32) / 255.0
        if (alpha < 1.0).any():
            return alpha
        im = rgba
    if im.mode.startswith("I") or im.mode == "F":
        arr = np.asarray(im).astype(np.float32)
        if im.mode == "F":
            scale = 1.0 if arr.max(initial=0.0) <= 1.0 else 255.0
        else:
            scale = 65535.0 if im.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        return np.clip(arr / scale, 0.0, 1.0)
    return np.asarray(im.convert("L"), dtype=np.float32) / 255.0


def read_mask(source: MaskSource) -> np.ndarray:
    """The mask at the image's displayed size, (H, W) float32 in [0, 1], upright as the image is.

    The alpha channel of the image itself (`file` None), or the mask file read by `_grey`. A
    file whose header read fine but whose pixels do not raises BadImage naming it and the key.
    """
    import numpy as np

    path = source.file or source.image
    try:
        with _opened(source.blob.open() if source.blob is not None else path) as im:
            im.load()
            im = ImageOps.exif_transpose(im)
            if source.file is not None:
                return _grey(im)
            if not _transparent(im):
                raise BadImage("it has no alpha channel")
            rgba = im if im.mode in _ALPHA_MODES else im.convert("RGBA")
            band = rgba.getchannel(len(rgba.getbands()) - 1)
            return np.asarray(band, dtype=np.float32) / 255.0
    except BadImage as e:
        what = f"mask {path}" if source.file is not None else f"the alpha channel of {path}"
        raise BadImage(
            f"{source.dataset}: {what} is unreadable: {e} ({source.config_key})"
        ) from None
    except _DECODE_ERRORS as e:
        what = f"mask {path}" if source.file is not None else f"the alpha channel of {path}"
        raise BadImage(
            f"{source.dataset}: cannot decode {what}: {e or type(e).__name__} ({source.config_key})"
        ) from None


def fit_mask(mask: np.ndarray, placement: Placement) -> torch.Tensor:
    """The mask fitted to the bucket as the pixels are (`kit.data.pixels`): resized with the same
    filter (so its edges fall where the image's do), mirrored, then cropped; (H, W) in [0, 1]."""
    import numpy as np
    import torch  # here, not at the top: a bucket report imports this module without torch

    im = Image.fromarray(np.ascontiguousarray(mask, dtype=np.float32), "F")
    im = fit_to_bucket(im, placement)
    # Lanczos rings a little past a hard edge: a weight stays within [0, 1].
    return torch.from_numpy(np.clip(np.asarray(im, dtype=np.float32), 0.0, 1.0))


def bucket_mask(source: MaskSource, placement: Placement) -> torch.Tensor:
    """The sample's mask as its pixels are trained: (H, W) on the bucket's pixel grid."""
    import torch

    if source.digest == WHOLE:
        return torch.ones(placement.bucket[1], placement.bucket[0])
    return fit_mask(read_mask(source), placement)


def masked(cfg: DataConfig) -> bool:
    """Whether any dataset trains with masks (the data section's `masked_loss`, or a dataset's)."""
    return any(v.data.masked_loss for v in views(cfg))


def latent_mask(mask: torch.Tensor, latent_shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A bucket mask averaged down onto the latent grid of one sample's latents.

    `latent_shape` is the sample's latents, (C, h, w), or (C, F, h, w) for a video family; the
    mask comes out (1, h, w), or (1, F, h, w) with every latent frame masked alike. Each cell
    holds the mean of the pixels it covers (an area average).
    """
    import torch

    h, w = int(latent_shape[-2]), int(latent_shape[-1])
    grid = torch.nn.functional.adaptive_avg_pool2d(mask.float()[None, None], (h, w))[0]
    if len(latent_shape) == 4:
        grid = grid.unsqueeze(1).expand(1, int(latent_shape[1]), h, w)
    return grid.clamp(0.0, 1.0).contiguous()


# ------------------------------------------------------------------ preview


def mask_preview(cfg: Config, n: int = 8, size: int = 192, columns: int = 4) -> Image.Image:
    """A contact sheet of the first `n` training images as cropped for their buckets, the parts
    the loss ignores tinted red (half-masked parts half-tinted); mirrored twins are not shown.

    Images left out for their masks are not on the sheet: `plan_masks(cfg).refused` lists them.
    """
    import numpy as np

    if not masked(cfg.data):
        raise ConfigError("masked_loss: is off, so no image trains with a mask")
    masks = plan_masks(cfg)
    samples, plan = plan_dataset(cfg, family=masks.family, scanned=masks.scanned)
    tiles = []
    for s, p, src in list(zip(samples, plan.placements, masks.for_samples(samples), strict=True))[
        :n
    ]:
        if p.frames:
            p = replace(p, frames=p.frames[:1])  # a clip shows its first frame
        pixels = sample_pixels(s, p, cfg.data)
        if pixels.ndim == 4:
            pixels = pixels[:, 0]
        rgb = ((pixels.permute(1, 2, 0).numpy() + 1.0) * 127.5).clip(0, 255)
        m = bucket_mask(src, p).numpy()[..., None]
        red = np.array([220.0, 40.0, 40.0])
        shown = rgb * (0.35 + 0.65 * m) + red * 0.65 * (1.0 - m)
        tile = Image.fromarray(shown.clip(0, 255).astype(np.uint8), "RGB")
        tile.thumbnail((size, size))
        tiles.append(tile)
    if not tiles:
        return Image.new("RGB", (size, size), "white")
    cols = max(1, min(columns, len(tiles)))
    rows = -(-len(tiles) // cols)
    sheet = Image.new("RGB", (cols * (size + 4) + 4, rows * (size + 4) + 4), "white")
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        x = 4 + c * (size + 4) + (size - tile.width) // 2
        y = 4 + r * (size + 4) + (size - tile.height) // 2
        sheet.paste(tile, (x, y))
    return sheet
