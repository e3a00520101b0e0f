"""A clip's sound, for families that train on it (`Family.audio`, LTX-2).

A video file's audio track is decoded by the ffmpeg binary that imageio-ffmpeg's wheel carries
(the one that reads the frames): resampled to the family's rate, two channels, 32-bit floats,
for exactly the stretch of time its training window covers, from its first frame's time for
`frames · frame_stride / fps` seconds. A clip without an audio track (a frame folder, a GIF, a
silent file) trains silent, as does one whose track ffmpeg cannot decode: that one is named in a
warning, and trains on its frames alone.
"""

from __future__ import annotations

import re
import subprocess
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kit.data.video import as_file, is_video_file
from kit.errors import DataError

SILENT_EXTS = frozenset({".gif"})
"""Clip formats that never carry sound."""


def _ffmpeg() -> str:
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError, OSError):
        raise DataError(
            "reading a clip's sound needs imageio-ffmpeg (`pip install imageio[ffmpeg]`)"
        ) from None


@lru_cache(maxsize=4096)
def _probe(path: str, size: int, mtime: float) -> tuple[bool, float | None]:
    """(has an audio stream, frames per second) of a video file, from ffmpeg's stream list."""
    out = subprocess.run(
        [_ffmpeg(), "-hide_banner", "-nostdin", "-i", path],
        capture_output=True,
        text=True,
        errors="replace",
    ).stderr
    fps = re.search(r"Stream #.*Video:.*?([\d.]+) fps", out)
    return bool(re.search(r"Stream #.*Audio:", out)), float(fps.group(1)) if fps else None


def probe(path: Path) -> tuple[bool, float | None]:
    """Whether clip `path` has an audio track, and its frame rate (None where unknown)."""
    if path.is_dir() or not is_video_file(path) or path.suffix.lower() in SILENT_EXTS:
        return False, None
    st = path.stat()
    return _probe(str(path), st.st_size, st.st_mtime)


def has_sound(path: Path) -> bool:
    """Whether clip `path` is a video file with an audio track."""
    return probe(path)[0]


def read_sound(path: Path, start: float, seconds: float, rate: int) -> np.ndarray:
    """`seconds` of the file's sound from `start`, (2, samples) float32 at `rate`; a
    `DataError` naming the file when ffmpeg cannot decode it (or it holds none there)."""
    cmd = [_ffmpeg(), "-hide_banner", "-nostdin", "-v", "error", "-ss", f"{start:.6f}"]
    cmd += ["-t", f"{seconds:.6f}", "-i", str(path), "-map", "0:a:0", "-vn"]
    cmd += ["-ac", "2", "-ar", str(rate), "-f", "f32le", "pipe:1"]
    out = subprocess.run(cmd, capture_output=True)
    if out.returncode != 0 or not out.stdout:
        why = out.stderr.decode(errors="replace").strip().splitlines()
        raise DataError(
            f"{path}: its sound cannot be decoded ({why[-1] if why else 'no audio samples'})"
        )
    return np.frombuffer(out.stdout, dtype="<f4").reshape(-1, 2).T.copy()


def clip_sound(
    family: Any, comps: Any, sample: Any, frames: tuple[int, ...], raw: Any = None
) -> dict[str, Any]:
    """The latent entry's sound tensors of a clip window (the `frames` it takes), as the family
    encodes them (`encode_sound`); {} for a family that does not train on sound."""
    if not getattr(family, "audio", False):
        return {}
    if raw is not None and sample.clip and is_video_file(sample.image):
        with as_file(raw, sample.image.name) as path:
            return _window_sound(family, comps, path, sample, frames)
    return _window_sound(family, comps, sample.image, sample, frames)


def _window_sound(family: Any, comps: Any, path: Path, sample: Any, frames: tuple) -> Any:
    count = len(frames) or 1
    stride = frames[1] - frames[0] if len(frames) > 1 else 1
    heard, fps = probe(path) if sample.clip else (False, None)
    waveform = None
    if heard and not fps:
        warnings.warn(f"{path}: its frame rate is unknown; it trains silent", stacklevel=2)
    if heard and fps:
        import torch

        rate = family.sound_rate(comps)
        try:
            wave = read_sound(path, frames[0] / fps, count * stride / fps, rate)
            waveform = torch.from_numpy(wave)
        except DataError as e:
            warnings.warn(f"{e}; it trains silent (video only)", stacklevel=2)
    return family.encode_sound(comps, waveform, count, fps / stride if fps else None)


def sound_counts(samples: list) -> dict[str, int]:
    """Clips (each file once) with an audio track, and silent ones."""
    clips = {s.image for s in samples if s.clip and s.blob is None}
    heard = sum(has_sound(c) for c in clips)
    return {"clips_with_sound": heard, "silent_clips": len(clips) - heard}


def check_rates(samples: list, placements: list) -> None:
    """Refuse clips of one bucket and frame count whose frames play at different rates: their
    sound spans different times, so its latents differ in length and cannot share a batch."""
    seen: dict[tuple, dict[float | None, Path]] = {}
    for sample, placement in zip(samples, placements, strict=True):
        frames = placement.frames
        if not sample.clip or len(frames) < 2 or sample.blob is not None:
            continue
        fps = probe(sample.image)[1]
        rate = round(fps / (frames[1] - frames[0]), 2) if fps else None
        rates = seen.setdefault((placement.bucket, len(frames)), {})
        rates.setdefault(rate, sample.image)
        if len(rates) > 1:
            (a, fa), (b, fb) = list(rates.items())[:2]
            raise DataError(
                f"{fa} and {fb} share a bucket but play at {a or 'an unknown rate of'} and "
                f"{b or 'an unknown rate of'} frames a second: their sound would differ in "
                "length within a batch; convert them to one frame rate, or train with "
                "train_batch_size 1"
            )
