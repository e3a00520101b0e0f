"""The pixels a sample is encoded from: fitted to its bucket, mirrored if placed so."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from kit.config import DataConfig
from kit.data import video
from kit.data.blob import is_url
from kit.data.buckets import Placement
from kit.data.datasets import views
from kit.data.images import DEFAULT_MAX_PIXELS, BadImage, open_rgb
from kit.data.scan import Sample
from kit.errors import DataError

if TYPE_CHECKING:
    import torch


def sample_pixels(
    sample: Sample,
    placement: Placement,
    cfg: DataConfig,
    data: bytes | None = None,
    alpha: bool = False,
) -> torch.Tensor:
    """The pixels that are encoded for a sample: fitted to its bucket, mirrored if placed so.

    `data`: the sample's bytes when already read (a shard read front to back), else its blob is
    read now. `alpha` (a family whose VAE reads RGBA): an image with transparency keeps it as
    a fourth channel."""
    if sample.blob is None:
        bg, limit = cfg.alpha_background, cfg.max_image_pixels
        return load_pixels(sample.image, placement, bg, limit, alpha)
    if placement.frames:  # a shard's video member: read by the same reader, from a copy
        import torch

        with video.as_file(sample.blob.read(), sample.blob.name) as path:
            try:
                frames = video.read_frames(path, placement.frames)
            except DataError as e:  # named by the member, not by its temporary copy (a bad
                # clip stays a BadImage, which the cache skips alone)
                raise type(e)(str(e).replace(str(path), sample.blob.name)) from None
        return torch.stack([_fit(f, placement) for f in frames], dim=1)
    try:
        raw = io.BytesIO(data) if data is not None else sample.blob.open()
        im = open_rgb(raw, cfg.alpha_background, cfg.max_image_pixels, alpha)
    except BadImage as e:
        raise BadImage(f"unreadable image {sample.blob.name}: {e}") from None
    except OSError as e:  # the store refused or lost the read (after its own retries)
        raise BadImage(f"unreadable image {sample.blob.name}: {e}") from None
    return _fit(im, placement)


def undecodable(samples: list[Sample], cfg: DataConfig) -> dict[Path, str]:
    """The images among `samples` whose pixels do not decode as the cache decodes them (a file
    cut short reads its header fine), each with why: what a run leaves out when it caches.

    Local files and the rows of a local table are decoded, several at a time (Pillow decodes
    without holding the GIL); clips and remote objects are left to the cache, as downloading
    a whole bucket to check it is not what a plan should cost."""
    seen = views(cfg)

    def why(sample: Sample) -> str | None:
        blob, d = sample.blob, seen[sample.dataset].data
        if sample.clip or (blob is not None and (is_url(blob.location) or blob.stream_block)):
            return None
        try:
            open_rgb(blob.open() if blob else sample.image, d.alpha_background, d.max_image_pixels)
        except (BadImage, OSError) as e:
            return f"unreadable image {blob.name if blob else sample.image}: {e}"
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = list(pool.map(why, samples))
    return {Path(s.image): w for s, w in zip(samples, found, strict=True) if w}


def load_pixels(
    path: Path,
    placement: Placement,
    background: str = "white",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    alpha: bool = False,
) -> torch.Tensor:
    """The image fitted to its bucket (mirrored if placed so), (3, H, W) in [-1, 1]; a clip's
    frames, (3, F, H, W).

    An image that cannot be decoded raises `BadImage`; `background` fills transparent parts,
    unless `alpha` keeps them: (4, H, W), the alpha channel last.
    """
    import torch  # here, not at the top: a bucket report imports this module without torch

    if placement.frames:
        frames = video.read_frames(path, placement.frames)
        return torch.stack([_fit(f, placement) for f in frames], dim=1)
    try:
        im = open_rgb(path, background, max_pixels, alpha)
    except BadImage as e:
        raise BadImage(f"unreadable image {path}: {e}") from None
    return _fit(im, placement)


def fit_to_bucket(im: Image.Image, placement: Placement) -> Image.Image:
    """A picture (or a mask) resized to cover its bucket, mirrored when the placement says so,
    then cropped to it: one filter and one order for everything that must line up."""
    im = im.resize(placement.resized, Image.Resampling.LANCZOS)
    if placement.flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    top, left = placement.crop
    bw, bh = placement.bucket
    return im.crop((left, top, left + bw, top + bh))


def _fit(im: Image.Image, placement: Placement) -> torch.Tensor:
    """Resize (and mirror) one picture, then crop it to its bucket: (C, H, W) in [-1, 1].

    Mirrored before the crop, so the recorded crop is the offset in the pixels trained on.
    """
    im = fit_to_bucket(im, placement)
    import numpy as np
    import torch

    arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()
