"""A procedural toy world of simple shapes with exact captions, and its example dataset."""

from __future__ import annotations

import argparse
import io
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image, ImageDraw

from kit.io import atomic_dir

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 90, 230),
    "yellow": (240, 210, 30),
    "purple": (140, 60, 190),
    "orange": (245, 130, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
POSITIONS: tuple[str, ...] = ("left", "center", "right")

# Concepts: drawn by the toy world and read by the judge, but never shown to the toy base model,
# so a fine-tune has something new to teach. Each is named by its own trigger word.
CONCEPT_COLORS: dict[str, tuple[int, int, int]] = {"zorbic": (245, 110, 185)}
"""A pink, farther from every base color (the nearest, purple, is 116 apart) than yellow from orange (81)."""
CONCEPT_SHAPES: tuple[str, ...] = ("zorbstar",)
"""A five-pointed star. At 64 px the toy base's 4x VAE cannot hold a small star (see
models/toy-sd15/RECIPE.md), so the example dataset teaches the color; the star is for larger bases."""

TRIGGER_WORD = "zorbic"
"""The concept of the example dataset and clips."""
CONCEPT_SIZE: tuple[int, int] = (128, 128)
"""The example dataset's concept images are square, like everything the toy base ever drew."""
EXAMPLE_SIZES: tuple[tuple[int, int], ...] = (
    (128, 128),
    (192, 128),
    (128, 192),
    (160, 128),
    (128, 160),
)
"""Sizes of the example dataset's prior images, in turn, so aspect bucketing has work to do."""
PRIOR_PREFIX = "prior_"
"""File-name prefix of the example dataset's prior images (see `write_example_dataset`)."""
CLIP_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (96, 64))
DIRECTIONS: tuple[str, ...] = ("left", "right")

_SIZE_FRACTION = {"small": 0.35, "large": 0.65}
_MARGIN_FRACTION = 0.06
_POSITION_PHRASE = {"left": "on the left", "center": "in the center", "right": "on the right"}
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    """One toy image: a single filled shape on a plain background."""

    color: str
    shape: str
    size: str
    background: str
    position: str

    def __post_init__(self) -> None:
        _check("color", self.color, tuple(COLORS) + tuple(CONCEPT_COLORS))
        _check("shape", self.shape, SHAPES + CONCEPT_SHAPES)
        _check("size", self.size, SIZES)
        _check("background", self.background, tuple(BACKGROUNDS))
        _check("position", self.position, POSITIONS)


def _check(field: str, value: str, allowed: Sequence[str]) -> None:
    """Raise ValueError naming the field and the allowed values when value is not one of them."""
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; expected one of {', '.join(allowed)}")


def caption(scene: Scene) -> str:
    """Exact caption, e.g. 'a large red circle on a white background, on the left'."""
    # Every size word starts with a consonant, so the article is always "a".
    return (
        f"a {scene.size} {scene.color} {scene.shape} on a {scene.background} background, "
        f"{_POSITION_PHRASE[scene.position]}"
    )


def shape_box(scene: Scene, width: int, height: int) -> tuple[float, float, float, float]:
    """Bounding box (left, top, right, bottom) of the shape in pixels of a width x height image."""
    short = min(width, height)
    side = _SIZE_FRACTION[scene.size] * short
    margin = _MARGIN_FRACTION * short
    # Positions are horizontal in every aspect ratio, so a caption never depends on image size.
    cx = {
        "left": margin + side / 2,
        "center": width / 2,
        "right": width - margin - side / 2,
    }[scene.position]
    cy = height / 2
    return (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)


def _star(cx: float, cy: float, outer: float) -> list[tuple[float, float]]:
    """Vertices of a regular five-pointed star, point up."""
    # Inner/outer radius ratio of a regular pentagram, so its edges line up point to point.
    inner = outer * math.sin(math.radians(18)) / math.sin(math.radians(126))
    points = []
    for i in range(10):
        radius = outer if i % 2 == 0 else inner
        angle = math.radians(-90 + 36 * i)
        points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
    return points


def moving_box(
    scene: Scene, width: int, height: int, direction: str, t: float
) -> tuple[float, float, float, float]:
    """The shape's box at time t in [0, 1] as it crosses the image from side to side."""
    _check("direction", direction, DIRECTIONS)
    start, end = (shape_box(replace(scene, position=p), width, height) for p in ("left", "right"))
    if direction == "left":
        start, end = end, start
    left, top, right, bottom = (a + (b - a) * t for a, b in zip(start, end, strict=True))
    return left, top, right, bottom


def render(
    scene: Scene,
    width: int,
    height: int,
    box: tuple[float, float, float, float] | None = None,
) -> Image.Image:
    """Draw the scene as an RGB image of width x height; the same arguments give identical pixels.

    `box` places the shape elsewhere than its position says (the frames of a moving clip).
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    k = _SUPERSAMPLE
    image = Image.new("RGB", (width * k, height * k), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    box = box or shape_box(scene, width, height)
    left, top, right, bottom = (v * k for v in box)
    fill = COLORS.get(scene.color) or CONCEPT_COLORS[scene.color]
    if scene.shape == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    elif scene.shape == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    elif scene.shape == "triangle":
        draw.polygon([((left + right) / 2, top), (right, bottom), (left, bottom)], fill=fill)
    else:
        outer = (right - left) / 2
        # The star reaches cos(36°) of its radius below its centre, so lower it to fill the box evenly.
        cy = (top + bottom) / 2 + outer * (1 - math.cos(math.radians(36))) / 2
        draw.polygon(_star((left + right) / 2, cy, outer), fill=fill)
    # A box filter rather than LANCZOS: edge pixels become exact coverage blends of the two
    # colours, with no ringing halo of colours that exist nowhere else in the world.
    return image.reduce(k)


def _balanced(values: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n values where every value appears equally often (within one), in shuffled order."""
    out: list[str] = []
    while len(out) < n:
        cycle = list(values)
        rng.shuffle(cycle)
        out.extend(cycle)
    out = out[:n]
    rng.shuffle(out)
    return out


def sample_scenes(
    n: int,
    seed: int,
    *,
    colors: Sequence[str] = tuple(COLORS),
    shapes: Sequence[str] = SHAPES,
    sizes: Sequence[str] = SIZES,
    backgrounds: Sequence[str] = tuple(BACKGROUNDS),
    positions: Sequence[str] = POSITIONS,
) -> list[Scene]:
    """n seeded scenes; each attribute is balanced on its own and shuffled independently."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    for name, values in (
        ("colors", colors),
        ("shapes", shapes),
        ("sizes", sizes),
        ("backgrounds", backgrounds),
        ("positions", positions),
    ):
        if not values:
            raise ValueError(f"{name} must not be empty")
    rng = random.Random(seed)
    columns = [_balanced(v, n, rng) for v in (colors, shapes, sizes, backgrounds, positions)]
    return [
        Scene(color=c, shape=sh, size=si, background=b, position=p)
        for c, sh, si, b, p in zip(*columns, strict=True)
    ]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write data to path through a temporary file in the same folder, then rename over it."""
    # Not tempfile.mkstemp: its files are private (0600) and would stay so after the rename.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_image(path: Path, scene: Scene, width: int, height: int) -> Path:
    """Render a scene to a PNG with its caption in a same-stem .txt file, both atomically."""
    buffer = io.BytesIO()
    render(scene, width, height).save(buffer, format="PNG", optimize=True)
    _write_atomic(path, buffer.getvalue())
    _write_atomic(path.with_suffix(".txt"), (caption(scene) + "\n").encode())
    return path


def write_example_dataset(
    out_dir: str | os.PathLike[str],
    n: int = 24,
    seed: int = 0,
    priors: int = 8,
    sizes: Sequence[tuple[int, int]] = (CONCEPT_SIZE,),
) -> list[Path]:
    """Write the example dataset: n images of the `zorbic` color and `priors` of the base world.

    Each PNG has its caption in a same-stem .txt file. The concept images (`zorbic_000.png`, ...)
    take `sizes` in turn (square by default). The prior images (`prior_000.png`, ...) show the base world's own colors, in
    five aspect ratios: pictures of what must not change, trained alongside the concept (as in
    DreamBooth's prior preservation), so that a fine-tune learns "zorbic is pink" rather than
    "everything is a little pinker".
    """
    if n < 0 or priors < 0:
        raise ValueError(f"n and priors must be >= 0, got {n} and {priors}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not sizes:
        raise ValueError("sizes must not be empty")
    paths = [
        _write_image(out / f"{TRIGGER_WORD}_{i:03d}.png", scene, *sizes[i % len(sizes)])
        for i, scene in enumerate(sample_scenes(n, seed, colors=(TRIGGER_WORD,)))
    ]
    for i, scene in enumerate(sample_scenes(priors, seed + 1)):
        width, height = EXAMPLE_SIZES[i % len(EXAMPLE_SIZES)]
        paths.append(_write_image(out / f"{PRIOR_PREFIX}{i:03d}.png", scene, width, height))
    return paths


def clip_caption(scene: Scene, direction: str) -> str:
    """Exact caption of a clip, e.g. 'a small zorbic circle moving right on a black background'."""
    return f"a {scene.size} {scene.color} {scene.shape} moving {direction} on a {scene.background} background"


def write_example_clips(
    out_dir: str | os.PathLike[str], n: int = 8, frames: int = 17, seed: int = 0
) -> list[Path]:
    """Write n clips of `zorbic` shapes crossing the frame: folders of PNG frames plus `<clip>.txt`."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scenes = sample_scenes(n, seed, colors=(TRIGGER_WORD,))
    directions = _balanced(DIRECTIONS, n, random.Random(f"{seed}-directions"))
    paths = []
    for i, (scene, direction) in enumerate(zip(scenes, directions, strict=True)):
        width, height = CLIP_SIZES[i % len(CLIP_SIZES)]
        folder = out / f"{TRIGGER_WORD}_clip_{i:03d}"
        # The whole folder appears at once, so a reader never sees half a clip.
        with atomic_dir(folder) as tmp:
            os.chmod(tmp, out.stat().st_mode & 0o777)  # not mkdtemp's private 0700
            for f in range(frames):
                box = moving_box(scene, width, height, direction, f / max(1, frames - 1))
                render(scene, width, height, box).save(tmp / f"{f:04d}.png", optimize=True)
        caption_path = out / f"{folder.name}.txt"
        _write_atomic(caption_path, (clip_caption(scene, direction) + "\n").encode())
        paths.append(folder)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write the example dataset into a folder."""
    parser = argparse.ArgumentParser(
        prog="python -m kit.toy.world", description=write_example_dataset.__doc__
    )
    parser.add_argument("out_dir", help="folder for the images and captions")
    parser.add_argument("--n", type=int, default=24, help="number of images (of the concept)")
    parser.add_argument("--priors", type=int, default=8, help="number of base-world images")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--frames", type=int, default=0, help="write clips of this many frames instead of images"
    )
    args = parser.parse_args(argv)
    if args.frames:
        paths = write_example_clips(args.out_dir, n=args.n, frames=args.frames, seed=args.seed)
        print(f"wrote {len(paths)} clips with captions to {args.out_dir}")
        return
    paths = write_example_dataset(args.out_dir, n=args.n, seed=args.seed, priors=args.priors)
    print(f"wrote {len(paths)} images with captions to {args.out_dir}")


if __name__ == "__main__":
    main()
