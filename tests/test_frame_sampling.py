"""Frame sampling: the windows a clip trains as (head, uniform, chunk, slide), each a sample of its
own in the buckets, the bucket report and the cache; and mp4 clips read with no system ffmpeg."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kit.cli import main as kit_main
from kit.config import Config, DataConfig, load_config
from kit.data import video
from kit.data.buckets import clip_windows, place, plan_buckets, plan_dataset
from kit.data.pixels import load_pixels
from kit.data.scan import load_samples, scan
from kit.errors import ConfigError, DataError
from kit.families import get_family
from tests.conftest import write_run_config

COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


def write_frames(folder: Path, n: int, size: tuple[int, int] = (64, 64)) -> Path:
    """A captioned frame folder whose frame i is filled with COLORS[i % 6]."""
    folder.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", size, COLORS[i % len(COLORS)]).save(folder / f"{i:04d}.png")
    (folder.parent / f"{folder.name}.txt").write_text(f"a clip called {folder.name}")
    return folder


def write_mp4(path: Path, n: int, size: tuple[int, int] = (64, 64)) -> Path:
    """A captioned H.264 mp4 whose frame i has red 20·i: the frame index reads back from a pixel."""
    import imageio.v2 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    with iio.get_writer(path, fps=8, codec="libx264", macro_block_size=16) as writer:
        for i in range(n):
            frame = np.zeros((size[1], size[0], 3), np.uint8)
            frame[...] = (20 * i, 128, 64)
            writer.append_data(frame)
    path.with_suffix(".txt").write_text(f"a video called {path.stem}")
    return path


def wan_data(image_dir: Path, **fields) -> DataConfig:
    return Config().replace(image_dir=str(image_dir), resolution=64, bucket_step=32, **fields).data


# ---------------------------------------------------------------- window starts, mode by mode


def test_head_is_one_window_placed_by_frame_start():
    assert video.window_starts(20, 5) == (0,)
    assert video.window_starts(21, 5, 1, "head", start="center") == (8,)
    seeded = video.window_starts(50, 5, 2, "head", start="random", key="a")
    assert seeded == video.window_starts(50, 5, 2, "head", start="random", key="a")
    assert seeded == video.select_frames(50, 5, 2, "random", "a")[:1]  # as before windows


def test_uniform_spreads_windows_from_first_to_last_frame():
    # 5 frames of 21: starts 0..16, three windows at both ends and the middle.
    assert video.window_starts(21, 5, 1, "uniform", windows=3) == (0, 8, 16)
    assert video.window_starts(21, 5, 1, "uniform", windows=2) == (0, 16)
    # One window is placed as head places it.
    assert video.window_starts(21, 5, 1, "uniform", windows=1, start="center") == (8,)
    # A short clip cannot hold that many distinct windows: fewer, never the same one twice.
    assert video.window_starts(7, 5, 1, "uniform", windows=6) == (0, 1, 2)
    assert video.window_starts(5, 5, 1, "uniform", windows=4) == (0,)
    with pytest.raises(ValueError, match="uniform"):
        video.window_starts(21, 5, 1, "uniform", windows=0)


def test_chunk_is_back_to_back_and_capped():
    assert video.window_starts(20, 5, 1, "chunk", windows=0) == (0, 5, 10, 15)
    assert video.window_starts(19, 5, 1, "chunk", windows=0) == (0, 5, 10)  # no partial window
    assert video.window_starts(20, 5, 1, "chunk", windows=2) == (0, 5)
    assert video.window_starts(20, 5, 1, "chunk") == (0,)  # the default frame_windows is 1
    # Stride 3: a window of 5 frames spans 13 (0, 3, … 12); the next starts after it.
    assert video.window_starts(30, 5, 3, "chunk", windows=0) == (0, 13)
    assert video.window_frames(13, 5, 3) == (13, 16, 19, 22, 25)


def test_slide_steps_by_window_stride():
    assert video.window_starts(12, 5, 1, "slide", windows=0, window_stride=2) == (0, 2, 4, 6)
    assert video.window_starts(12, 5, 1, "slide", windows=3, window_stride=2) == (0, 2, 4)
    # 0 takes the window's span: the chunks.
    assert video.window_starts(20, 5, 1, "slide", windows=0) == (0, 5, 10, 15)
    assert video.window_starts(20, 3, 2, "slide", windows=0, window_stride=4) == (0, 4, 8, 12)


def test_a_clip_shorter_than_one_window_has_none():
    for mode in video.FRAME_SAMPLINGS:
        assert video.window_starts(4, 5, 1, mode, windows=2) == ()
        assert video.window_starts(8, 5, 2, mode, windows=2) == ()  # 5 frames at stride 2 span 9
    with pytest.raises(ValueError, match="frame_sampling"):
        video.window_starts(20, 5, 1, "full")


def test_uniform_without_a_window_count_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="frame_windows"):
        DataConfig(frame_sampling="uniform", frame_windows=0)
    DataConfig(frame_sampling="chunk", frame_windows=0)  # chunk and slide: 0 is every window


# ---------------------------------------------------------------- samples, buckets, cache keys


def test_windows_follow_the_family_frame_rule(tmp_path):
    write_frames(tmp_path / "long", 20)
    wan = get_family("wan")
    cfg = wan_data(tmp_path, num_frames=8, frame_sampling="chunk", frame_windows=0)
    # The scan gives the clip once (caption tools see each file once), cut to Wan's 4k+1.
    (clip,) = load_samples(cfg, wan)
    assert (clip.frames, clip.total_frames, clip.window_start) == (5, 20, None)
    plan = plan_buckets([clip], cfg, 32, seed=0)
    assert [s.window_start for s in plan.samples] == [0, 5, 10, 15]
    assert [p.frames for p in plan.placements] == [tuple(range(b, b + 5)) for b in (0, 5, 10, 15)]
    # The run's data report counts files: four windows of one clip are one file.
    assert replace(scan(cfg, wan), samples=plan.samples).summary().startswith("1 of 1 file(s)")
    # Each window's record (the latent cache key) is its own.
    assert len({json.dumps(p.record()) for p in plan.placements}) == 4
    # Pixels of a window are its frames: frame 5 is COLORS[5] (magenta: red and blue high).
    pixels = load_pixels(plan.samples[1].image, plan.placements[1])
    assert tuple(pixels.shape) == (3, 5, 64, 64)
    assert pixels[0, 0].mean() > 0.9 and pixels[1, 0].mean() < -0.9 and pixels[2, 0].mean() > 0.9
    # Stride 2 and the rule together: every 2nd of 20 frames is 10, cut to 9 (span 17).
    strided = wan_data(
        tmp_path,
        num_frames=9,
        frame_stride=2,
        frame_sampling="slide",
        frame_windows=0,
        window_stride=3,
    )
    (clip,) = load_samples(strided, wan)
    windows = plan_buckets([clip], strided, 32, seed=0).placements
    assert [p.frames[0] for p in windows] == [0, 3]
    assert windows[1].frames == tuple(range(3, 20, 2))


def test_head_and_images_are_unchanged(tmp_path):
    write_frames(tmp_path / "clip", 21)
    Image.new("RGB", (64, 64), COLORS[0]).save(tmp_path / "still.png")
    (tmp_path / "still.txt").write_text("a still")
    cfg = wan_data(tmp_path, num_frames=5, frame_start="center")
    samples = load_samples(cfg, get_family("wan"))
    plan = plan_buckets(samples, cfg, 32, seed=0)
    assert plan.samples == samples  # head: one sample per clip, no window start
    still = next(i for i, s in enumerate(samples) if not s.clip)
    assert list(plan.placements[still].record()) == ["bucket", "resized", "crop", "original"]
    clip = next(i for i, s in enumerate(samples) if s.clip)
    assert plan.placements[clip].frames == (8, 9, 10, 11, 12)
    assert plan.placements[clip] == place(samples[clip], (64, 64), True, 0, 1, "center")
    # An image, and a sample already split, pass through unchanged.
    chunked = replace(cfg, frame_sampling="chunk", frame_windows=0)
    assert clip_windows(samples[still], chunked, 0) == [samples[still]]
    split = clip_windows(samples[clip], chunked, 0)
    assert len(split) == 4 and clip_windows(split[2], chunked, 0) == [split[2]]


def test_frame_folders_count_windows_in_kit_buckets(tmp_path, capsys):
    for name in ("a", "b", "c"):
        write_frames(tmp_path / "data" / name, 15)
    path = tmp_path / "config.json"
    fields = {
        "model_family": "wan",
        "image_dir": str(tmp_path / "data"),
        "resolution": 64,
        "bucket_step": 32,
        "num_frames": 5,
        "frame_sampling": "chunk",
        "frame_windows": 0,
        "train_batch_size": 3,
    }
    path.write_text(json.dumps(fields))
    assert kit_main(["buckets", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["clips"], shown["windows"], shown["images"]) == (3, 9, 9)
    (row,) = shown["buckets"]
    assert (row["bucket"], row["count"], row["clips"], row["frames"]) == ("64x64x5f", 9, 3, 5)
    assert shown["batches_per_epoch"] == 3  # 9 windows in batches of 3
    assert kit_main(["buckets", str(path)]) == 0
    assert "3 clip(s) → 9 window(s)" in capsys.readouterr().out
    # Uniform: two windows per clip.
    path.write_text(json.dumps({**fields, "frame_sampling": "uniform", "frame_windows": 2}))
    assert kit_main(["buckets", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == 6


def test_mp4_clip_gives_windows_through_scan_buckets_and_pixels(tmp_path, capsys):
    mp4 = write_mp4(tmp_path / "data" / "walk.mp4", 12)
    assert video.clip_info(mp4) == (64, 64, 12)
    path = tmp_path / "config.json"
    fields = {
        "model_family": "wan",
        "image_dir": str(tmp_path / "data"),
        "resolution": 64,
        "bucket_step": 32,
        "num_frames": 5,
        "frame_sampling": "slide",
        "frame_windows": 0,
        "window_stride": 3,
    }
    path.write_text(json.dumps(fields))
    assert kit_main(["buckets", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["clips"], shown["windows"]) == (1, 3)  # starts 0, 3, 6 of 12 frames
    assert shown["buckets"][0]["files"] == [str(mp4)] * 3
    samples, plan = plan_dataset(load_config(path))
    pixels = load_pixels(samples[2].image, plan.placements[2])
    assert tuple(pixels.shape) == (3, 5, 64, 64)
    # The window's first frame is frame 6: red 120 of 255, → about -0.06 in [-1, 1].
    red = [float(pixels[0, f].mean()) for f in range(5)]
    expected = [(20 * i / 255) * 2 - 1 for i in range(6, 11)]
    assert np.allclose(red, expected, atol=0.05), (red, expected)


@pytest.fixture(scope="module")
def wan_base(tiny_base) -> Path:
    return tiny_base("wan")


def test_wan_trains_on_chunked_windows_with_their_own_cache_entries(
    wan_base, tmp_path, monkeypatch
):
    from kit.data.cache import CachedDataset
    from kit.train.loop import train

    write_frames(tmp_path / "data" / "spin", 10)
    write_mp4(tmp_path / "data" / "walk.mp4", 11)
    seen: list[int] = []
    real = CachedDataset.load_batch

    def recording(self, indices, variants=None):
        seen.extend(indices)
        return real(self, indices, variants)

    monkeypatch.setattr(CachedDataset, "load_batch", recording)
    path = write_run_config(
        tmp_path / "config.json",
        base=wan_base,
        data=tmp_path / "data",
        family="wan",
        num_frames=5,
        frame_sampling="chunk",
        frame_windows=0,
        max_train_steps=2,
        checkpointing_steps=2,
        max_sequence_length=16,
    )
    result = train(load_config(path))
    assert result.step == 2
    manifest = json.loads((result.run_dir / "dataset_manifest.json").read_text())
    windows = sorted((Path(r["image"]).name, r["frames"][0]) for r in manifest)
    assert windows == [("spin", 0), ("spin", 5), ("walk.mp4", 0), ("walk.mp4", 5)]
    assert all(len(r["frames"]) == 5 for r in manifest)
    latents = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert len(latents) == 4  # one entry per window
    assert sorted(set(seen)) == [0, 1, 2, 3]  # one epoch of batches of 2 trains every window
    # The caption report still sees two files.
    assert len(scan(load_config(path).data, get_family("wan")).samples) == 2


def test_without_the_ffmpeg_plugin_an_mp4_names_the_fix(tmp_path, monkeypatch):
    import sys

    mp4 = write_mp4(tmp_path / "walk.mp4", 3)
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as an install without it
    with pytest.raises(DataError, match=r"walk\.mp4.*pip install imageio\[ffmpeg\]"):
        video.read_frames(mp4, [0])
    report = scan(DataConfig(image_dir=str(tmp_path)), get_family("wan"))
    ((file, why),) = report.unreadable
    assert file == mp4 and "pip install imageio[ffmpeg]" in why
