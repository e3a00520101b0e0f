"""Reading one image safely: its size from the header, then its pixels as plain 8-bit RGB.

Datasets gathered from phones, scanners and the web hold every kind of file: CMYK JPEGs, 16-bit
PNGs, palettes with transparency, files cut short by a failed copy. Each is turned into RGB here,
or refused with a `BadImage` error that says why, so that one bad file never stops a run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

from PIL import Image, ImageOps, UnidentifiedImageError

from kit.config.sections import parse_color
from kit.errors import DataError

ORIENTATION_TAG = 274
"""EXIF orientation; values 5-8 swap width and height when displayed."""
DEFAULT_MAX_PIXELS = 178_956_970
"""Pillow's own refusal point (twice its warning limit): larger files are decompression bombs."""
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError)


class BadImage(DataError):
    """An image file that cannot be used; the message is the reason, without the path."""


_PIXEL_LIMIT = threading.Lock()
"""Held while Pillow's global pixel limit is lifted for one `open`, so that two threads opening
images at once cannot leave it lifted."""


def _open_header(path: str | Path | BinaryIO, max_pixels: int) -> Image.Image:
    """The image opened lazily (header only), with the kit's own pixel limit in place of Pillow's.

    Pillow checks its global limit inside `open` (warning, then refusing); with the limit lifted
    it neither warns nor refuses, so no warning filter is needed, and the kit checks `max_pixels`
    itself just below, so that a user may raise the limit for a real panorama without touching
    Pillow. A plain function rather than a context manager: a scan calls it once per image.
    """
    try:
        with _PIXEL_LIMIT:
            limit = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
            try:
                im = Image.open(path)
            finally:
                Image.MAX_IMAGE_PIXELS = limit
    except UnidentifiedImageError:
        # The size is looked at only now, so that a good file costs no extra system call.
        if (os.stat(path).st_size if isinstance(path, str | Path) else path.seek(0, 2)) == 0:
            raise BadImage("empty file (0 bytes)") from None
        raise BadImage("not an image (corrupt, or a format Pillow cannot read)") from None
    except FileNotFoundError:
        raise BadImage("file not found (moved or deleted since the scan)") from None
    except _DECODE_ERRORS as e:
        raise BadImage(f"cannot read the header: {e or type(e).__name__}") from None
    w, h = im.size
    if w * h > max_pixels:
        im.close()
        raise BadImage(
            f"{w}x{h} is {w * h:,} pixels, over max_image_pixels {max_pixels:,} "
            "(a possible decompression bomb)"
        )
    return im


def _displayed_size(im: Image.Image) -> tuple[int, int]:
    w, h = im.size
    if im.format == "PNG" and "exif" not in im.info:
        # Pillow's PNG reader would decode every pixel to look for an EXIF chunk after the image
        # data; cameras write EXIF before it (where the header read finds it), so none is upright.
        return w, h
    try:
        rotated = im.getexif().get(ORIENTATION_TAG, 1) in (5, 6, 7, 8)
    except _DECODE_ERRORS:
        rotated = False  # broken EXIF: the stored orientation is the best guess
    return (h, w) if rotated else (w, h)


def probe(path: str | Path | BinaryIO, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Width and height as displayed (after EXIF rotation), from the header; BadImage if unusable."""
    with _open_header(path, max_pixels) as im:
        return _displayed_size(im)


def open_rgb(
    path: str | Path | BinaryIO,
    background: str | tuple[int, int, int] = "white",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    keep_alpha: bool = False,
) -> Image.Image:
    """The decoded image, upright, as 8-bit RGB with transparency laid on `background`; with
    `keep_alpha`, an image with transparency as 8-bit RGBA instead."""
    bg = parse_color(background) if isinstance(background, str) else tuple(background)
    with _open_header(path, max_pixels) as im:
        try:
            im.load()
            im = ImageOps.exif_transpose(im)
            return _to_rgb(im, bg, keep_alpha)
        except BadImage:
            raise
        except _DECODE_ERRORS as e:
            raise BadImage(f"cannot decode the pixels: {e or type(e).__name__}") from None


def _to_rgb(im: Image.Image, bg: tuple[int, int, int], keep_alpha: bool = False) -> Image.Image:
    """Any Pillow mode as 8-bit RGB (RGBA where it has transparency and `keep_alpha`)."""
    if im.mode == "P":
        # A palette may mark one entry (or many, via an alpha palette) as transparent.
        im = im.convert("RGBA" if "transparency" in im.info or im.palette.mode == "RGBA" else "RGB")
    elif im.mode in ("L", "1") and "transparency" in im.info:
        im = im.convert("LA")
    elif im.mode.startswith("I") or im.mode == "F":
        im = _to_8bit(im)
    if im.mode in _ALPHA_MODES:
        rgba = im.convert("RGBA")
        if keep_alpha:
            return rgba
        base = Image.new("RGBA", rgba.size, (*bg, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    if im.mode == "RGB":
        return im
    try:
        return im.convert("RGB")
    except ValueError:
        raise BadImage(f"colour mode {im.mode} cannot be converted to RGB") from None


def _to_8bit(im: Image.Image) -> Image.Image:
    """A 16-bit or 32-bit grayscale image as 8-bit `L`, keeping its full range."""
    import numpy as np  # here: only these rare images need it, and a scan never does

    arr = np.asarray(im).astype(np.float64)
    if im.mode == "F":
        scale = 1.0 if arr.max(initial=0.0) > 1.0 else 255.0  # floats in [0, 1] or in [0, 255]
        arr = arr * scale
    elif im.mode.startswith("I;16") or arr.max(initial=0) > 255:
        arr = arr / 257.0  # 0..65535 onto 0..255
    return Image.fromarray(np.clip(arr.round(), 0, 255).astype(np.uint8), "L")
