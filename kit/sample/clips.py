"""Validation clips as people watch them, and the index of what each validation folder holds.

A clip is drawn as frames; the kit saves it three ways beside the grid: a frame strip (PNG, the
cell the grid shows), an animated WebP that loops (what a notebook, a browser and a hub model
card play inline) and an MP4 (H.264 through the ffmpeg binary that imageio-ffmpeg's wheel
carries, the dependency that already reads video datasets; skipped, and said so in the index,
when it is missing). Every file is written to a temporary name and renamed.

The run's `validation/index.json` lists every validation folder (newest step last) with what was
drawn in it (prompt, seed, the strip, the clip, the video, the sidecar), so a script or a viewer
finds a step's clips without guessing names. It is read from the sidecars (which stay the
record of each image), and lives above the step folders, where nothing takes it for a sidecar.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image

from kit.io import write_json, write_with
from kit.run.folder import RunDir

FPS = 16
"""Frames per second a validation clip plays at where its model says no other (`Family.clip_fps`:
Wan 2.1 and 2.2 A14B 16, TI2V-5B 24, as diffusers' `export_to_video` examples write them)."""
INDEX = "index.json"
"""The name of a validation folder's index (and of the run's, in `validation/`)."""


def write_webp(frames: list[Image.Image], path: Path, fps: int = FPS) -> Path:
    """An animated WebP that loops forever, lossless (a clip of a few frames is small), atomic."""
    duration = max(1, round(1000 / fps))
    write_with(
        path,
        lambda tmp: frames[0].save(
            tmp,
            format="WEBP",
            save_all=True,
            append_images=frames[1:],
            duration=duration,
            loop=0,
            lossless=True,
        ),
    )
    return path


def ffmpeg() -> Any:
    """The `imageio_ffmpeg` module when it (and its binary) is installed, else None."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()  # raises when the wheel carries no binary for this OS
    except (ImportError, RuntimeError, OSError):
        return None
    return imageio_ffmpeg


def write_mp4(frames: list[Image.Image], path: Path, fps: float = FPS) -> Path | None:
    """An H.264 MP4 (yuv420p, what every player reads), atomic; None without imageio-ffmpeg.

    H.264 in yuv420p needs even sides: an odd width or height is padded by one pixel (edge
    copied), never resized, so the frames stay the ones drawn. Frames drawn with their sound
    (a `Clip` with `sound` and `sample_rate`: LTX-2) get it as an AAC audio track."""
    ff = ffmpeg()
    if ff is None:
        return None
    import numpy as np

    w, h = frames[0].size
    pad_w, pad_h = w % 2, h % 2
    heard = getattr(frames, "sound", None)

    def write(tmp: Path) -> None:
        with tempfile.TemporaryDirectory() as folder:
            wav = None
            if heard is not None:
                wav = write_wav(np.asarray(heard), frames.sample_rate, Path(folder) / "sound.wav")
            gen = ff.write_frames(
                str(tmp),
                (w, h),
                fps=fps,
                codec="libx264",
                pix_fmt_out="yuv420p",
                macro_block_size=1,
                ffmpeg_log_level="error",
                # The temporary name ends in .tmp: the container is named, not guessed from it.
                output_params=["-vf", f"pad={w + pad_w}:{h + pad_h}", "-movflags", "+faststart"]
                + ["-f", "mp4"],
                audio_path=None if wav is None else str(wav),
                audio_codec=None if wav is None else "aac",
            )
            gen.send(None)
            try:
                for f in frames:
                    gen.send(np.ascontiguousarray(np.asarray(f.convert("RGB"))))
            finally:
                gen.close()

    write_with(path, write)
    return path


def write_wav(sound: Any, rate: int, path: Path) -> Path:
    """`sound` (channels, samples) floats in [-1, 1] as a 16-bit PCM WAV file."""
    import wave

    import numpy as np

    pcm = (np.clip(np.atleast_2d(sound), -1.0, 1.0) * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())
    return path


def save_clip(frames: list[Image.Image], stem: Path, fps: int = FPS) -> dict[str, str]:
    """`stem.webp` and (where imageio-ffmpeg is installed) `stem.mp4`; their names by kind."""
    out = {"clip": write_webp(frames, stem.with_suffix(".webp"), fps).name}
    mp4 = write_mp4(frames, stem.with_suffix(".mp4"), fps)
    if mp4 is not None:
        out["video"] = mp4.name
    return out


def index_run(run: RunDir) -> Path | None:
    """Write the run's `validation/index.json` from the sidecars of every validation folder
    (steps in order, each with its with-training-adapter folder, then the scale folders):
    per folder its grid and, per drawn image or clip, the prompt, seed, adapter scale and
    files. Paths are relative to `validation/`; None when nothing was drawn yet."""
    folders: list[tuple[int | None, Path]] = []
    for step, d in run.validation_steps().items():
        folders += [(step, d), *((step, sub) for sub in sorted(d.iterdir()) if sub.is_dir())]
    folders += [(None, d) for d in run.scale_folders()]
    listed = [_folder_entry(run, step, d) for step, d in folders if (d / "grid.png").is_file()]
    if not listed:
        return None
    drawn = [item for f in listed for item in f["items"]]
    # The rate the clips were written at (their sidecars say; older ones at FPS).
    rates = [i["fps"] for i in drawn if "fps" in i]
    record: dict[str, Any] = {"fps": rates[-1] if rates else FPS, "folders": listed}
    if any("clip" in i for i in drawn) and not any("video" in i for i in drawn):
        record["video"] = (
            "no MP4: imageio-ffmpeg is not installed (`pip install imageio[ffmpeg]`); "
            "the animated WebP plays everywhere the MP4 would"
        )
    write_json(run.validation / INDEX, record)
    return run.validation / INDEX


def _folder_entry(run: RunDir, step: int | None, folder: Path) -> dict[str, Any]:
    """One validation folder's grid and drawn files, read from its sidecars."""
    items = []
    for sidecar in sorted(folder.glob("*.json")):
        try:
            record = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not a sidecar the kit wrote
        if not isinstance(record, dict) or "prompt" not in record:
            continue
        item = {k: record.get(k) for k in ("prompt", "seed", "adapter_scale")}
        for kind, suffix in (("image", ".png"), ("clip", ".webp"), ("video", ".mp4")):
            if sidecar.with_suffix(suffix).is_file():
                item[kind] = sidecar.with_suffix(suffix).name
        for key in ("frames", "fps"):
            if key in record:
                item[key] = record[key]
        items.append({**item, "sidecar": sidecar.name})
    rel = folder.relative_to(run.validation).as_posix()
    return {"folder": rel, "step": step, "grid": "grid.png", "items": items}


def latest_clips(run: RunDir) -> list[Path]:
    """The animated clips of the latest validation step (its own folder, not the
    with-training-adapter one), in drawing order; [] when the run draws images."""
    steps = run.validation_steps()
    if not steps:
        return []
    folder = steps[max(steps)]
    return [folder / sc.with_suffix(".webp").name for sc in sorted(folder.glob("*.json"))
            if sc.with_suffix(".webp").is_file()]  # fmt: skip
