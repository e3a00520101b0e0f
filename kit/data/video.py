"""Clips as training data: folders of numbered frames and video files, and which frames to take.

A clip is either a folder of numbered frames (`clip01/0000.png, 0001.png …`, captioned by
`clip01.txt` beside the folder) or a video file. GIFs are read with PIL; other containers through
imageio's ffmpeg plugin, a dependency of the kit whose wheel carries its own ffmpeg binary, so an
mp4 reads without a system ffmpeg. An install without it gets an error that says what to install.

A clip trains as one or more *windows*: `frames` frames, `frame_stride` apart. `frame_sampling`
says which: one window (`head`, placed by `frame_start`), windows spread evenly (`uniform`),
back-to-back (`chunk`), or every `window_stride` frames (`slide`). Each window is a training
sample of its own, with its own cache entry, so a long clip is not reduced to its first second.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from kit.data.images import BadImage
from kit.errors import DataError

FRAME_EXTS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
"""Still-image formats: a dataset's images, and the frames a frame folder may hold."""
VIDEO_EXTS = frozenset({".mp4", ".webm", ".mov", ".mkv", ".gif"})
"""Video files read as clips (all but GIF through imageio's ffmpeg plugin)."""
UNREAD_EXTS = frozenset({".gif", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jp2"})
"""Image formats the kit does not read (GIF: only as a video family's clip): skipped, named."""


def unread(name: str, video_family: bool) -> str:
    """Why a file of a format the kit does not read is skipped ("" for any other file)."""
    ext = name[name.rfind(".") :].lower() if "." in name else ""
    if ext not in UNREAD_EXTS or (video_family and ext in VIDEO_EXTS):
        return ""
    return f"a {ext} image: a format the kit does not read; convert it to PNG, JPEG or WebP"


FRAME_STARTS = ("first", "center", "random")
FRAME_SAMPLINGS = ("head", "uniform", "chunk", "slide")


def is_video_file(path: Path) -> bool:
    """True for a file with a video extension."""
    return path.suffix.lower() in VIDEO_EXTS


def is_clip(path: Path) -> bool:
    """True for a clip's path: a video file or a folder (of frames)."""
    return path.is_dir() or is_video_file(path)


def frame_files(folder: Path) -> list[Path]:
    """The numbered frames directly in `folder`, in order; [] when it is not a frame folder.

    A frame folder holds still images only named by number (`0000.png`, `1.jpg` …), so a
    folder of ordinary named images is never mistaken for a clip.
    """
    images = [
        p
        for p in folder.iterdir()
        if p.suffix.lower() in FRAME_EXTS and not p.name.startswith(".") and p.is_file()
    ]
    if not images or not all(p.stem.isdigit() for p in images):
        return []
    return sorted(images, key=lambda p: (int(p.stem), p.name))


def clip_info(path: Path) -> tuple[int, int, int]:
    """(width, height, frame count) of a clip, reading as little as the format allows."""
    if path.is_dir():
        frames = frame_files(path)
        if not frames:
            raise DataError(f"{path} holds no numbered frames (0000.png, 0001.png …)")
        sizes = set()
        for f in frames:
            with Image.open(f) as im:
                sizes.add(im.size)
        if len(sizes) > 1:
            raise DataError(f"the frames of {path} differ in size: {sorted(sizes)}")
        (w, h) = sizes.pop()
        return w, h, len(frames)
    if path.suffix.lower() == ".gif":
        with Image.open(path) as im:
            return im.size[0], im.size[1], int(getattr(im, "n_frames", 1))
    with _ffmpeg_reader(path) as reader:
        w, h = reader.get_meta_data()["size"]
        return int(w), int(h), int(reader.count_frames())


def read_frames(path: Path, indices: Sequence[int]) -> list[Image.Image]:
    """The clip's frames at `indices` (in that order), as RGB images; a clip whose frames
    cannot be decoded raises BadImage naming it (the cache then skips that clip alone)."""
    try:
        if path.is_dir():
            frames = frame_files(path)
            out = []
            for i in indices:
                try:
                    with Image.open(frames[i]) as im:
                        out.append(im.convert("RGB"))
                except (UnidentifiedImageError, OSError, EOFError) as e:
                    why = f"{frames[i].name}: {e or type(e).__name__}"
                    raise BadImage(f"unreadable clip {path}: frame {why}") from None
            return out
        if path.suffix.lower() == ".gif":
            with Image.open(path) as im:
                out = []
                for i in indices:
                    im.seek(i)  # PIL composites each GIF frame onto the ones before it
                    out.append(im.convert("RGB"))
                return out
    except (UnidentifiedImageError, OSError, IndexError, EOFError) as e:
        raise BadImage(f"unreadable clip {path}: {e or type(e).__name__}") from None
    wanted = set(indices)
    got: dict[int, Image.Image] = {}
    try:
        with _ffmpeg_reader(path) as reader:
            # Decoding in order is the one access every container supports.
            for i, frame in enumerate(reader):
                if i in wanted:
                    got[i] = Image.fromarray(frame).convert("RGB")
                if len(got) == len(wanted):
                    break
    except BadImage:
        raise
    except (OSError, RuntimeError, ValueError) as e:  # ffmpeg stopped on a damaged stream
        raise BadImage(f"unreadable clip {path}: {(str(e).splitlines() or [repr(e)])[0]}") from None
    missing = wanted - set(got)
    if missing:
        raise BadImage(f"unreadable clip {path}: frame {min(missing)} is past its end")
    return [got[i] for i in indices]


def _ffmpeg_reader(path: Path):
    """An imageio ffmpeg reader, or a DataError that says what to install."""
    try:
        import imageio.v2 as iio
        import imageio_ffmpeg  # noqa: F401  (the plugin; imageio alone cannot read video)
    except ImportError:
        raise DataError(
            f"cannot read {path}: {path.suffix} video needs imageio with its ffmpeg plugin; "
            "run `pip install imageio[ffmpeg]`, or convert the clip to a folder of frames or a GIF"
        ) from None
    try:
        return iio.get_reader(str(path), format="ffmpeg")
    except (OSError, RuntimeError, ValueError) as e:
        raise BadImage(f"unreadable clip {path}: {e}") from None


def usable_frames(
    total: int, wanted: int, stride: int, rule: Callable[[int], int] | None = None
) -> int:
    """Frames a clip of `total` gives: at most `wanted`, every `stride`-th, cut to the family's rule.

    `rule(n)` is the largest frame count <= n the model takes (Wan: 4k+1); 0 means none.
    """
    reachable = (total - 1) // stride + 1 if total > 0 else 0
    n = min(wanted, reachable)
    return rule(n) if rule is not None and n > 0 else n


def clip_frames(
    total: int, num_frames: int, frame_stride: int, rule: Callable[[int], int] | None
) -> tuple[int, str]:
    """Frames a clip trains on, and why it is too short ("" when it is not).

    A clip shorter than `num_frames` gives the largest count the family allows; it is too short
    when that is below the family's smallest clip (Wan: 5 frames), as one frame is no motion.
    """
    frames = usable_frames(total, num_frames, frame_stride, rule)
    if rule is None:
        return frames, "" if frames else "has no frames"
    target = rule(num_frames)
    smallest = next((n for n in range(2, target + 1) if rule(n) == n), target)
    if frames >= smallest:
        return frames, ""
    need = (smallest - 1) * frame_stride + 1
    return frames, (
        f"has {total} frame(s); {smallest} frames at frame_stride {frame_stride} need {need}"
    )


@contextmanager
def as_file(data: bytes | memoryview, name: str) -> Iterator[Path]:
    """A clip's bytes (a tar shard's video member) as a temporary file with its name's suffix,
    for the readers that take a path (ffmpeg, PIL's GIF); removed afterwards."""
    fd, tmp = tempfile.mkstemp(suffix=Path(name).suffix.lower())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield Path(tmp)
    finally:
        os.unlink(tmp)


def select_frames(total: int, count: int, stride: int, start: str, key: str) -> tuple[int, ...]:
    """Indices of `count` frames, `stride` apart, starting first, centred, or seeded by `key`."""
    span = (count - 1) * stride + 1
    slack = total - span
    if slack < 0:
        raise ValueError(f"{count} frames at stride {stride} need {span}, the clip has {total}")
    if start == "first":
        begin = 0
    elif start == "center":
        begin = slack // 2
    elif start == "random":
        begin = random.Random(key).randint(0, slack)
    else:
        raise ValueError(f"frame_start {start!r} is not one of {', '.join(FRAME_STARTS)}")
    return tuple(range(begin, begin + span, stride))


def window_span(frames: int, stride: int) -> int:
    """Frames of the clip one window covers: `frames` frames `stride` apart, first to last."""
    return (frames - 1) * stride + 1 if frames > 0 else 0


def window_frames(begin: int, frames: int, stride: int) -> tuple[int, ...]:
    """The frame indices of the window that starts at `begin`."""
    return tuple(range(begin, begin + window_span(frames, stride), stride))


def window_starts(
    total: int,
    frames: int,
    stride: int = 1,
    sampling: str = "head",
    windows: int = 1,
    window_stride: int = 0,
    start: str = "first",
    key: str = "",
) -> tuple[int, ...]:
    """Where each window of a clip of `total` frames starts, in order; () when none fits.

    A window is `frames` frames `stride` apart (`frames` is already cut to the family's rule, as
    the scan does). `head`: one window placed by `start` (first, centred, or seeded by `key`).
    `uniform`: `windows` windows spread evenly from the first frame to the last (one window is
    placed as `head` places it); a clip too short for that many distinct windows gives fewer, as
    two identical windows would only weight that stretch twice. `chunk`: back to back, each
    starting where the one before ends. `slide`: every `window_stride` frames (0: the window's
    span, which is `chunk`). `windows` caps `chunk` and `slide` (0: every window that fits),
    taken from the start of the clip.
    """
    if sampling not in FRAME_SAMPLINGS:
        raise ValueError(f"frame_sampling {sampling!r} is not one of {', '.join(FRAME_SAMPLINGS)}")
    if frames < 1 or stride < 1 or windows < 0 or window_stride < 0:
        raise ValueError(
            f"a window needs frames >= 1 and stride >= 1 (got {frames}, {stride}), "
            f"and windows, window_stride >= 0 (got {windows}, {window_stride})"
        )
    if sampling == "uniform" and windows == 0:
        raise ValueError("frame_sampling uniform spreads frame_windows windows: it needs 1 or more")
    span = window_span(frames, stride)
    slack = total - span
    if slack < 0:
        return ()
    if sampling == "head" or (sampling == "uniform" and windows == 1):
        return (select_frames(total, frames, stride, start, key)[0],)
    if sampling == "uniform":
        # Evenly from 0 to slack, both ends included; rounding can merge starts of a short clip.
        # A clip has slack + 1 distinct windows: asking for more (1e9) gives those, at once.
        windows = min(windows, slack + 1)
        if windows == 1:
            return (0,)
        return tuple(sorted({round(i * slack / (windows - 1)) for i in range(windows)}))
    step = span if sampling == "chunk" or window_stride == 0 else window_stride
    starts = range(0, slack + 1, step)
    return tuple(starts[:windows] if windows else starts)
