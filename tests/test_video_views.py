"""Seeing a video run: validation clips that play (WebP, MP4), their index, the notebook's and the
model card's view of them, and the bucket report's frames, windows and conditioning frame."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from kit.config import load_config
from kit.run.folder import RunDir
from kit.sample import clips
from tests.conftest import write_run_config


@pytest.fixture(scope="module")
def wan_base(tiny_base) -> Path:
    return tiny_base("wan")


@pytest.fixture(scope="module")
def video_run(tmp_path_factory, wan_base, family_dataset) -> RunDir:
    """Two steps of a tiny Wan LoRA on 5-frame clips, validated at its last step."""
    from kit.train.loop import train

    tmp = tmp_path_factory.mktemp("video_run")
    path = write_run_config(
        tmp / "config.json",
        base=wan_base,
        data=family_dataset("wan"),
        family="wan",
        num_frames=5,
        max_train_steps=2,
        checkpointing_steps=2,
        validation_steps=2,
        max_sequence_length=16,
    )
    train(load_config(path))
    return RunDir(tmp / "run")


def mp4_frames(path: Path) -> tuple[int, tuple[int, int]]:
    import imageio.v2 as iio

    with iio.get_reader(str(path), format="ffmpeg") as reader:
        return reader.count_frames(), tuple(reader.get_meta_data()["size"])


def test_validation_clips_loop_as_webp_and_mp4_and_are_indexed(video_run):
    folder = video_run.validation_step(2)
    clip = Image.open(folder / "00_seed0.webp")
    assert clip.is_animated and clip.n_frames == 5 and clip.info["loop"] == 0
    clip.seek(4)
    clip.load()  # a frame's timing is read with the frame
    assert clip.info["duration"] == round(1000 / clips.FPS) and clip.info["timestamp"] == 4 * 62
    strip = Image.open(folder / "00_seed0.png")
    assert strip.size == (5 * clip.width, clip.height)
    assert mp4_frames(folder / "00_seed0.mp4") == (5, clip.size)
    assert not list(folder.glob("*.gif")) and not list(folder.glob(".*"))  # no temporary left
    # The run's index lists the step's folder, its grid and the clip's files (read from the
    # sidecars, which stay the only JSON files in the step's folder).
    assert sorted(p.name for p in folder.glob("*.json")) == ["00_seed0.json"]
    index = json.loads((video_run.validation / clips.INDEX).read_text())
    assert index["fps"] == clips.FPS and "video" not in index  # no note: the MP4 is there
    (entry,) = index["folders"]
    assert (entry["folder"], entry["step"], entry["grid"]) == ("step-000002", 2, "grid.png")
    (item,) = entry["items"]
    assert item["prompt"] == "a red zorbstar" and item["frames"] == 5
    assert (item["clip"], item["video"], item["image"], item["sidecar"]) == (
        "00_seed0.webp",
        "00_seed0.mp4",
        "00_seed0.png",
        "00_seed0.json",
    )
    assert clips.latest_clips(video_run) == [folder / "00_seed0.webp"]


def test_notebook_plays_the_latest_clips(video_run):
    from kit.ui.widgets import show_clips

    webp = clips.latest_clips(video_run)
    html = show_clips([*webp, webp[0].with_suffix(".mp4")]).data
    assert html.count("data:image/webp;base64,") == 1
    assert "<video" in html and "loop" in html and "data:video/mp4;base64," in html
    # Notebook 05's own cell, run on this run: its result is the playing clip.
    import kit.ui.widgets as kw

    nb = json.loads((Path(__file__).parents[1] / "notebooks/05_validate.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    cell = next(c for c in code if "latest_clips(run)" in c).splitlines()
    scope = {"run": video_run, "kw": kw}
    exec("\n".join(cell[:-1]), scope)
    shown = eval(cell[-1], scope)
    assert shown.data.count("data:image/webp;base64,") == 1


def test_the_model_card_shows_the_clip_playing(video_run):
    from kit.export.card import model_card
    from kit.export.push import sample_images

    cfg = load_config(video_run.config)
    grid, pairs = sample_images(video_run, 2)
    assert [(p, f.name) for p, f in pairs] == [("a red zorbstar", "00_seed0.webp")]
    samples = [("a red zorbstar", "images/00_seed0.webp")]
    videos = {"images/00_seed0.webp": "images/00_seed0.mp4"}
    card = model_card(video_run, cfg, {}, "images/grid.png", samples=samples, videos=videos)
    head = yaml.safe_load(card.removeprefix("---\n").partition("\n---\n")[0])
    assert head["pipeline_tag"] == "text-to-video"
    assert head["widget"] == [{"text": "a red zorbstar", "output": {"url": "images/00_seed0.webp"}}]
    assert "![a red zorbstar](images/00_seed0.webp)" in card
    assert "[MP4](images/00_seed0.mp4)" in card
    assert "![validation frame strips at step 2](images/grid.png)" in card


def test_the_archive_lists_the_clips(video_run):
    from kit.report.archive import build_archive

    listed = {Path(v["path"]).name for v in build_archive(video_run.root)["validation"]}
    assert {"00_seed0.png", "00_seed0.webp", "00_seed0.mp4", "grid.png"} <= listed


def test_without_imageio_ffmpeg_the_webp_alone_is_written_and_said(tmp_path, monkeypatch):
    frames = [Image.new("RGB", (33, 25), (40 * i, 0, 0)) for i in range(5)]
    # Odd sides: the MP4 pads one pixel (H.264 in yuv420p needs even ones), never resizes.
    assert clips.save_clip(frames, tmp_path / "a") == {"clip": "a.webp", "video": "a.mp4"}
    assert mp4_frames(tmp_path / "a.mp4") == (5, (34, 26))
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as an install without it
    assert clips.save_clip(frames, tmp_path / "b") == {"clip": "b.webp"}
    assert Image.open(tmp_path / "b.webp").n_frames == 5
    # The run's index says why a clip has no MP4.
    from kit.sample.validate import save_drawn

    run = RunDir(tmp_path / "run")
    folder = run.validation_step(4)
    assert save_drawn(frames, folder / "c") == {"image": "c.png", "clip": "c.webp"}
    (folder / "c.json").write_text(json.dumps({"prompt": "p", "seed": 0, "frames": 5}))
    Image.new("RGB", (8, 8)).save(folder / "grid.png")
    index = json.loads(clips.index_run(run).read_text())
    assert index["folders"][0]["items"][0]["clip"] == "c.webp"
    assert "imageio-ffmpeg is not installed" in index["video"]
    assert clips.latest_clips(run) == [folder / "c.webp"]


def write_clip(folder: Path, n: int) -> None:
    """A captioned frame folder of `n` frames."""
    folder.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (64, 64), (20 * i, 0, 0)).save(folder / f"{i:04d}.png")
    folder.with_suffix(".txt").write_text(folder.name)


def test_the_bucket_report_counts_frames_windows_and_the_conditioning_frame(tmp_path, capsys):
    from types import SimpleNamespace

    from kit.cli import main
    from kit.config import Config
    from kit.data.report import bucket_report, conditioning, report_lines

    write_clip(tmp_path / "data" / "long", 12)  # 5-frame windows back to back: 0-4, 5-9
    write_clip(tmp_path / "data" / "short", 7)  # 7 frames: Wan's 4k+1 rule trains 5
    cfg = Config().replace(
        model_family="wan",
        image_dir=str(tmp_path / "data"),
        resolution=64,
        bucket_step=32,
        num_frames=9,
        frame_sampling="chunk",
        frame_windows=0,
    )
    report = bucket_report(cfg.replace(num_frames=5))
    rows = {r["clip"]: r for r in report["clip_frames"]}
    assert rows["long"] == {
        "clip": "long",
        "source_frames": 12,
        "frames_trained": 5,
        "frame_stride": 1,
        "windows": 2,
        "window_frames": ["0-4", "5-9"],
        "conditioning_frames": [0, 5],
    }
    assert (rows["short"]["windows"], rows["short"]["window_frames"]) == (1, ["0-4"])
    assert report["conditioning_frame"] == "first frame of each window"
    # Asked for 9 frames, the 7-frame clip trains the largest 4k+1 below: 5.
    nine = {r["clip"]: r for r in bucket_report(cfg)["clip_frames"]}
    assert (nine["long"]["frames_trained"], nine["short"]["frames_trained"]) == (9, 5)
    lines = report_lines(report)
    assert "2 clip(s) → 3 window(s)" in lines
    assert any(line.split() == "long 12 5 1 2 0-4 (0), 5-9 (5)".split() for line in lines)
    # An image-to-video config's own key, where a family defines one, names the frame.
    keyed = SimpleNamespace(data=SimpleNamespace(condition_frame=2), model=cfg.model)
    assert conditioning(keyed) == {
        "conditioning_frame": "frame 2 of each window",
        "conditioning_index": 2,
    }
    # `kit buckets` prints the same table, and its JSON carries the rows.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg.replace(num_frames=5).to_dict(flat=True)))
    assert main(["buckets", str(config)]) == 0
    out = capsys.readouterr().out
    assert "source frames" in out and "conditioning frame (image-to-video): first frame" in out


def _bench():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_video_estimates.py"
    spec = importlib.util.spec_from_file_location("bench_video_estimates", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a14b_estimate_names_the_expert_on_the_gpu_and_the_one_in_host_ram(
    module_trace_cache, tmp_path
):
    """The real A14B against one of its experts as a base of its own (same architecture)."""
    from kit.config import from_dict
    from kit.preflight.estimate import GIB, estimate
    from kit.preflight.storage import on_accelerator

    bench = _bench()
    expert = str(bench.one_expert_base(tmp_path / "expert"))
    shape = {"bucket": (256, 256)}
    one = estimate(from_dict(bench.settings(expert, "", 5)), **shape)
    both = estimate(from_dict(bench.settings(bench.A14B, "both", 5)), **shape)
    size = one.details["frozen_weights_stored"]["denoiser"]
    assert 26 < size / GIB < 27.5  # one 14.3B expert in bf16
    assert one.details["on_accelerator"] is None and not one.details["waiting_in_host_ram"]
    # The same expert's size on the GPU, the other's whole size waiting in host RAM, named.
    assert both.components["denoiser_weights"] == size
    assert sum(both.details["waiting_in_host_ram"].values()) == size
    assert "expert of the batch's timesteps" in both.details["on_accelerator"]
    note = next(n for n in both.notes if "waits in host RAM" in n)
    assert f"({size / GIB:.2f} GiB); " in note and "change places" in note
    # Host RAM: the two-expert base loads one expert more than the one-expert base.
    assert both.host_bytes - one.host_bytes == size
    # Training one expert: the note names it (the other still waits, for validation).
    high = from_dict(bench.settings(bench.A14B, "high", 5))
    assert on_accelerator(high) == "the high-noise expert, which trains"
    # Quantized experts: the one on the GPU and the one waiting in host RAM both stored int8.
    int8 = bench.row("A14B", bench.A14B, "high", "int8", 0, (256, 256, 5), "")
    assert "refused" not in int8 and int8["denoiser_gpu_gib"] == int8["waiting_host_gib"] == 13.5
