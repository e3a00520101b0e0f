"""A judge for toy-world images: which background, color, shape, size and position an image shows.

Deterministic and numpy only, so a test, a notebook and an outside script get the same verdicts.
It is meant for images drawn by a model, which are blurred and noisy: the background is read from
the top and bottom rows (no toy shape reaches them), the foreground is every pixel nearer to the
shape's color than to the background's, and the shape is the nearest of prototypes rendered by
`kit.toy.world` itself, compared by how they fill their bounding box band by band.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image

from kit.toy import world as toyworld

ATTRIBUTES = ("background", "color", "shape", "size", "position")
"""The attributes the judge reads, in the order of a caption's table."""
_BANDS = 5
_MIN_PIXELS = 12
_MAX_SHAPE_DISTANCE = 0.35
"""Half the smallest distance between two prototypes: farther than this from all, a blob is no shape."""


def _rgb(image: Image.Image | np.ndarray) -> np.ndarray:
    """An image as a float (h, w, 3) array of 0..255."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    return np.asarray(image, dtype=np.float64)[..., :3]


def _nearest(color: np.ndarray, table: Mapping[str, tuple[int, int, int]]) -> tuple[str, float]:
    """The name of the nearest table color and its distance."""
    names = list(table)
    dist = np.linalg.norm(np.array([table[n] for n in names], dtype=np.float64) - color, axis=1)
    i = int(np.argmin(dist))
    return names[i], float(dist[i])


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean mask."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return labels == best


def _features(mask: np.ndarray) -> np.ndarray:
    """Fill of the bounding box overall, then in horizontal bands from top to bottom."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].astype(np.float64)
    edges = np.linspace(0, box.shape[0], _BANDS + 1)
    bands = [
        box[int(round(a)) : max(int(round(a)) + 1, int(round(b)))].mean()
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    return np.array([box.mean(), *bands])


@lru_cache(maxsize=1)
def _prototypes() -> dict[str, np.ndarray]:
    """Shape name → features of that shape as the toy world draws it (large, centered, 64 px)."""
    out = {}
    for shape in toyworld.SHAPES + toyworld.CONCEPT_SHAPES:
        scene = toyworld.Scene("red", shape, "large", "white", "center")
        out[shape] = _features(
            _foreground(_rgb(toyworld.render(scene, 64, 64)), np.full(3, 255.0))[0]
        )
    return out


def _foreground(rgb: np.ndarray, background: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shape's mask (largest region nearer the shape color than the background) and color."""
    dist = np.linalg.norm(rgb - background, axis=-1)
    candidates = dist > 40.0
    if candidates.sum() < _MIN_PIXELS:
        return np.zeros(dist.shape, dtype=bool), background
    # The shape's color: the median of the pixels that differ most from the background.
    core = dist >= np.quantile(dist[candidates], 0.5)
    color = np.median(rgb[core & candidates], axis=0)
    nearer = np.linalg.norm(rgb - color, axis=-1) < dist
    mask = _largest_component(nearer & candidates)
    return mask, np.median(rgb[mask], axis=0) if mask.any() else color


def judge(image: Image.Image | np.ndarray) -> dict[str, Any]:
    """The toy-world attributes an image shows, with a confidence in [0, 1] for its shape.

    Returns background, color, shape, size and position (names from `kit.toy.world`; color and
    shape may be concepts such as `zorbic` and `zorbstar`, shape None for a blob like no shape),
    plus `confidence`, `found` (False when nothing stands out from the background; then only
    `background` counts) and `rgb`, the shape's measured color (None when nothing was found), and `extent`, the
    longer side of its bounding box over the image's shorter side (0 when nothing was found).
    """
    rgb = _rgb(image)
    h, w = rgb.shape[:2]
    rows = max(1, h // 20)
    bg_pixels = np.concatenate([rgb[:rows].reshape(-1, 3), rgb[-rows:].reshape(-1, 3)])
    bg_color = np.median(bg_pixels, axis=0)
    background, _ = _nearest(bg_color, toyworld.BACKGROUNDS)
    mask, fg_color = _foreground(rgb, bg_color)
    if mask.sum() < _MIN_PIXELS:
        return {
            "background": background,
            "color": None,
            "shape": None,
            "size": None,
            "position": None,
            "confidence": 0.0,
            "found": False,
            "rgb": None,
            "extent": 0.0,
        }
    color, _ = _nearest(fg_color, {**toyworld.COLORS, **toyworld.CONCEPT_COLORS})
    feats = _features(mask)
    dists = sorted((float(np.linalg.norm(feats - p)), name) for name, p in _prototypes().items())
    (d1, shape), (d2, _) = dists[0], dists[1]
    if d1 > _MAX_SHAPE_DISTANCE:
        shape = None
    ys, xs = np.nonzero(mask)
    side = max(xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) / min(h, w)
    cx = (xs.min() + xs.max() + 1) / 2
    # Positions are placed from the short side (see toyworld.shape_box), so compare to the middle.
    offset = (cx - w / 2) / min(h, w)
    position = "left" if offset < -0.09 else "right" if offset > 0.09 else "center"
    return {
        "background": background,
        "color": color,
        "shape": shape,
        "size": "small" if side < 0.5 else "large",
        "position": position,
        "confidence": round((d2 - d1) / (d2 + d1 + 1e-9), 4),
        "found": True,
        "rgb": [round(float(c), 2) for c in fg_color],
        "extent": round(float(side), 4),
    }


def expected_of(scene: toyworld.Scene | Mapping[str, Any]) -> dict[str, Any]:
    """A scene (or a mapping of some attributes) as the dict `score` compares against."""
    return asdict(scene) if isinstance(scene, toyworld.Scene) else dict(scene)


def score(
    images: Sequence[Image.Image | np.ndarray],
    expected: Iterable[toyworld.Scene | Mapping[str, Any]],
) -> dict[str, Any]:
    """Accuracy of each attribute over images (a missing or None expectation is not scored).

    Returns `{"n": ..., "color": 0.95, ...}` for every attribute that had an expectation, plus
    `verdicts`, the judge's output for each image.
    """
    expected = [expected_of(e) for e in expected]
    if len(expected) != len(images):
        raise ValueError(f"{len(images)} images but {len(expected)} expectations")
    verdicts = [judge(im) for im in images]
    out: dict[str, Any] = {"n": len(images)}
    for attr in ATTRIBUTES:
        pairs = [
            (v[attr], e[attr])
            for v, e in zip(verdicts, expected, strict=True)
            if e.get(attr) is not None
        ]
        if pairs:
            out[attr] = sum(a == b for a, b in pairs) / len(pairs)
    out["verdicts"] = verdicts
    return out
