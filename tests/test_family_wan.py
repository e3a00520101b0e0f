"""Clips as data (frame folders, GIFs, video files), frame sampling, and the Wan family's own parts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import Config, DataConfig
from kit.data import video
from kit.data.buckets import epoch_batches, place, plan_buckets, plan_dataset
from kit.data.cache import build_cache, file_digest
from kit.data.pixels import load_pixels
from kit.data.scan import load_samples, scan
from kit.families import get_family
from kit.toy.world import write_example_clips, write_example_dataset

COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


@pytest.fixture(scope="module")
def wan_base(tiny_base) -> Path:
    return tiny_base("wan")


def write_frames(folder: Path, n: int, size: tuple[int, int] = (64, 64), names=None) -> None:
    """A frame folder whose frame i is filled with COLORS[i % 6]."""
    folder.mkdir(parents=True)
    for i in range(n):
        name = names[i] if names else f"{i:04d}.png"
        Image.new("RGB", size, COLORS[i % len(COLORS)]).save(folder / name)


def write_gif(path: Path, n: int, size: tuple[int, int] = (64, 64)) -> None:
    frames = [Image.new("RGB", size, COLORS[i % len(COLORS)]) for i in range(n)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)


def color_of(im: Image.Image) -> tuple[int, int, int]:
    return tuple(int(v) for v in np.asarray(im.convert("RGB"))[8, 8])


def wan_config(data: Path, **fields) -> Config:
    return Config().replace(
        model_family="wan", image_dir=str(data), resolution=64, bucket_step=32, **fields
    )


# ---------------------------------------------------------------- reading clips


def test_frame_folder_is_read_in_numeric_order(tmp_path):
    folder = tmp_path / "clip"
    names = ["1.png", "2.png", "10.png", "3.png"]  # 10 sorts after 3 by number, not by text
    write_frames(folder, 4, names=names)
    assert [p.name for p in video.frame_files(folder)] == ["1.png", "2.png", "3.png", "10.png"]
    assert video.clip_info(folder) == (64, 64, 4)
    frames = video.read_frames(folder, [3, 0])
    assert [color_of(f) for f in frames] == [COLORS[2], COLORS[0]]  # 10.png, then 1.png
    # Named images are images, not the frames of a clip.
    (tmp_path / "named").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "named" / "dog.png")
    assert video.frame_files(tmp_path / "named") == []


def test_animated_gif_is_a_clip(tmp_path):
    gif = tmp_path / "spin.gif"
    write_gif(gif, 6, size=(96, 64))
    assert video.clip_info(gif) == (96, 64, 6)
    assert [color_of(f) for f in video.read_frames(gif, [0, 2, 5])] == [
        COLORS[0],
        COLORS[2],
        COLORS[5],
    ]
    (tmp_path / "spin.txt").write_text("a spinning thing")
    (s,) = load_samples(DataConfig(image_dir=str(tmp_path), num_frames=5), get_family("wan"))
    assert (s.clip, s.frames, s.total_frames, s.caption) == (True, 5, 6, "a spinning thing")


def test_example_clips_are_deterministic_and_captioned(tmp_path):
    a = write_example_clips(tmp_path / "a", n=4, frames=9, seed=0)
    b = write_example_clips(tmp_path / "b", n=4, frames=9, seed=0)
    assert [file_digest(p) for p in a] == [file_digest(p) for p in b]
    assert file_digest(a[0]) != file_digest(a[1])
    sizes = set()
    for clip in a:
        w, h, n = video.clip_info(clip)
        sizes.add((w, h))
        assert n == 9
        caption = clip.with_name(clip.name + ".txt").read_text()
        assert " zorbic " in caption and " moving " in caption
        # The shape moves: first and last frames differ.
        first, last = (np.asarray(f) for f in video.read_frames(clip, [0, 8]))
        assert np.abs(first.astype(int) - last.astype(int)).max() > 0
    assert sizes == {(64, 64), (96, 64)}


# ---------------------------------------------------------------- frame sampling


def test_wan_frame_rule_is_4k_plus_1():
    wan = get_family("wan")
    assert [wan.frame_count(n) for n in (0, 1, 4, 5, 8, 9, 16, 17, 81)] == [
        0,
        1,
        1,
        5,
        5,
        9,
        13,
        17,
        81,
    ]


def test_usable_frames_takes_the_largest_valid_count():
    rule = get_family("wan").frame_count
    assert video.usable_frames(30, 17, 1, rule) == 17
    assert video.usable_frames(12, 17, 1, rule) == 9  # short clip: 12 → 9 (4k+1)
    assert video.usable_frames(12, 17, 2, rule) == 5  # every 2nd of 12 frames: 6 → 5
    assert video.usable_frames(12, 16, 1, None) == 12  # no rule: as many as asked and held


def test_frame_selection_by_stride_and_start():
    assert video.select_frames(20, 5, 1, "first", "k") == (0, 1, 2, 3, 4)
    assert video.select_frames(20, 5, 3, "first", "k") == (0, 3, 6, 9, 12)
    assert video.select_frames(21, 5, 1, "center", "k") == (8, 9, 10, 11, 12)
    rand = [video.select_frames(50, 5, 2, "random", f"clip{i}") for i in range(8)]
    assert rand == [video.select_frames(50, 5, 2, "random", f"clip{i}") for i in range(8)]
    assert len({r[0] for r in rand}) > 1  # seeded per clip, not one offset for all
    assert all(r[-1] < 50 and r[1] - r[0] == 2 for r in rand)
    with pytest.raises(ValueError):
        video.select_frames(4, 5, 1, "first", "k")


def test_random_start_is_seeded_per_clip_and_run(tmp_path):
    write_example_clips(tmp_path, n=4, frames=17, seed=0)
    family = get_family("wan")
    samples = load_samples(DataConfig(image_dir=str(tmp_path), num_frames=5), family)
    cfg = DataConfig(image_dir=str(tmp_path), num_frames=5, frame_start="random", resolution=64)
    starts = [p.frames[0] for p in plan_buckets(samples, cfg, 32, seed=0).placements]
    assert starts == [p.frames[0] for p in plan_buckets(samples, cfg, 32, seed=0).placements]
    others = [
        [p.frames[0] for p in plan_buckets(samples, cfg, 32, seed=s).placements]
        for s in range(1, 6)
    ]
    assert any(o != starts for o in others)


def test_clips_too_short_are_named(tmp_path):
    write_frames(tmp_path / "long", 9)
    write_frames(tmp_path / "tiny", 3)
    for name in ("long", "tiny"):
        (tmp_path / f"{name}.txt").write_text(f"a {name} clip")
    report = scan(DataConfig(image_dir=str(tmp_path), num_frames=17), get_family("wan"))
    assert [s.image.name for s in report.samples] == ["long"] and report.samples[0].frames == 9
    (problem,) = report.problems()
    assert "too short" in problem and str(tmp_path / "tiny") in problem
    # Stills from clips: one frame asked, so no clip is too short.
    ok = scan(DataConfig(image_dir=str(tmp_path), num_frames=1), get_family("wan"))
    assert not ok.problems() and [s.frames for s in ok.samples] == [1, 1]


# ---------------------------------------------------------------- buckets and batches


def test_buckets_never_mix_frame_counts(tmp_path):
    for i in range(5):
        write_frames(tmp_path / f"long{i}", 9)
        write_frames(tmp_path / f"short{i}", 6)
        Image.new("RGB", (64, 64), COLORS[i]).save(tmp_path / f"still{i}.png")
        for name in (f"long{i}", f"short{i}", f"still{i}"):
            (tmp_path / f"{name}.txt").write_text(name)
    samples, plan = plan_dataset(wan_config(tmp_path, num_frames=9))
    frames = Counter(p.num_frames for p in plan.placements)
    assert frames == {9: 5, 5: 5, 1: 5}  # 6 frames → 5 (4k+1); a still image is one frame
    assert plan.frame_counts() == {(64, 64, 9): 5, (64, 64, 5): 5, (64, 64, 1): 5}
    assert plan.counts() == {(64, 64): 15}  # one spatial bucket, three frame groups
    for epoch in range(3):
        for batch in epoch_batches(plan, 4, seed=0, epoch=epoch):
            assert len({plan.placements[i].num_frames for i in batch}) == 1
    clip = next(i for i, s in enumerate(samples) if s.image.name == "short0")
    pixels = load_pixels(samples[clip].image, plan.placements[clip])
    assert tuple(pixels.shape) == (3, 5, 64, 64)
    # Frame i of the folder is COLORS[i]: red, then green (in [-1, 1]).
    assert pixels[0, 0].mean() > 0.9 and pixels[1, 1].mean() > 0.9


def test_images_are_untouched_by_clip_support(tmp_path):
    write_example_dataset(tmp_path, n=6, seed=0)
    cfg = DataConfig(image_dir=str(tmp_path), resolution=128, bucket_step=32)
    by_family = scan(cfg, get_family("sd15")).samples
    assert by_family == scan(cfg).samples
    assert all((s.frames, s.clip) == (1, False) for s in by_family)
    p = place(by_family[0], (128, 128), center=True, seed=0)
    # No `frames` in an image's record: its cache key is what it was before clips existed.
    assert list(p.record()) == ["bucket", "resized", "crop", "original"]
    assert tuple(load_pixels(by_family[0].image, p).shape) == (3, 128, 128)


def test_without_a_family_only_captioned_clips_count(tmp_path):
    write_example_dataset(tmp_path, n=2, seed=0, priors=0)
    write_example_clips(tmp_path, n=1, frames=5, seed=0)
    write_gif(tmp_path / "stray.gif", 3)  # no caption: left alone, as image datasets always did
    assert {s.image.name for s in scan(DataConfig(image_dir=str(tmp_path))).samples} == {
        "zorbic_000.png",
        "zorbic_001.png",
        "zorbic_clip_000",
    }
    report = scan(DataConfig(image_dir=str(tmp_path)), get_family("wan"))
    assert report.missing_captions == [tmp_path / "stray.gif"]
    # An image family reads images only: a frame folder's frames are images without captions.
    report = scan(DataConfig(image_dir=str(tmp_path)), get_family("sd15"))
    assert len(report.missing_captions) == 5


# ---------------------------------------------------------------- the family's parts


def test_encodings_match_the_pipeline(wan_base):
    from diffusers import WanPipeline

    wan = get_family("wan", Config().replace(max_sequence_length=32))
    comps = wan.load(str(wan_base))
    pipe = WanPipeline.from_pretrained(str(wan_base))
    captions = ["a large red zorbic moving right", "a"]
    ours = wan.encode_text(comps, captions)["prompt_embeds"]
    with torch.no_grad():  # as in the pipeline's call (autograd picks other kernels)
        theirs, _ = pipe.encode_prompt(
            captions, do_classifier_free_guidance=False, max_sequence_length=32
        )
    assert torch.equal(ours, theirs)
    assert ours[1, 2:].abs().sum() == 0  # "a" + </s>, then zeros

    x = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    latents = wan.encode_images(comps, x)
    assert tuple(latents.shape) == (1, 16, 2, 4, 4)
    # What the pipeline does before decoding undoes the normalisation.
    vae = comps.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std_inv = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        raw = vae.encode(x).latent_dist.mean
    assert torch.allclose(latents / std_inv + mean, raw, atol=1e-5)


def test_cache_holds_clip_latents_and_batches_carry_sizes(wan_base, tmp_path):
    write_example_clips(tmp_path / "data", n=2, frames=9, seed=0)
    cfg = wan_config(
        tmp_path / "data",
        pretrained_model=str(wan_base),
        cache_dir=str(tmp_path / "cache"),
        num_frames=9,
    )
    family = get_family("wan", cfg)
    comps = family.load(str(wan_base))
    data = build_cache(cfg, family, comps)
    batch = data.load_batch([0, 1])
    assert tuple(batch["latents"].shape) == (2, 16, 3, 8, 8)  # 9 frames → 3 latent frames
    assert batch["prompt_embeds"].shape[:2] == (2, 512)
    assert batch["original_size"].tolist() == [[64, 64], [64, 96]]
    assert batch["target_size"].tolist() == [[64, 64], [64, 64]]
    assert batch["crop_top_left"].tolist() == [[0, 0], [0, 16]]
    # The frame selection is part of a clip's cache key.
    again = build_cache(cfg.replace(frame_start="center"), family, comps)
    assert again.stats["latents_reused"] == 2
    shifted = build_cache(cfg.replace(num_frames=5, frame_start="center"), family, comps)
    assert shifted.stats["latents_encoded"] == 2
    assert data.manifest()[0]["frames"] == list(range(9))


def test_validation_writes_a_looping_webp_and_a_frame_strip(wan_base, tmp_path):
    from kit.families.base import ImageSpec
    from kit.sample.validate import run_validation

    wan = get_family("wan", Config().replace(num_frames=5, max_sequence_length=16))
    comps = wan.load(str(wan_base))
    spec = ImageSpec("a large red zorbic", "", 0, 1, 1.0, 32, 48)
    run_validation(wan, wan.pipeline(comps), [spec], tmp_path, cols=1, meta={"base_model": "x"})
    strip = Image.open(tmp_path / "00_seed0.png")
    assert strip.size == (5 * 32, 48)
    clip = Image.open(tmp_path / "00_seed0.webp")
    assert (clip.n_frames, clip.size, clip.info["loop"]) == (5, (32, 48), 0)
    assert not (tmp_path / "00_seed0.gif").exists()  # nothing reads a GIF: the WebP replaces it
