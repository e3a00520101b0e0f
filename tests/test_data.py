"""Buckets, crops, batches, dataset scanning and the latent / text-embedding caches."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from kit.config import DataConfig, load_config
from kit.data.buckets import (
    BucketPlan,
    Placement,
    assign_bucket,
    epoch_batches,
    make_buckets,
    place,
    plan_buckets,
)
from kit.data.cache import build_cache
from kit.data.pixels import load_pixels
from kit.data.scan import Sample, image_size, load_samples, scan
from kit.errors import DataError

# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize(
    ("resolution", "step", "max_ar"),
    [(512, 64, 2.0), (768, 64, 2.0), (1024, 64, 2.0), (64, 32, 2.0), (256, 32, 3.0), (96, 32, 1.5)],
)
def test_area_buckets(resolution, step, max_ar):
    buckets = make_buckets(resolution, "area", step, max_ar)
    assert buckets
    assert len(set(buckets)) == len(buckets)
    for w, h in buckets:
        assert w % step == 0 and h % step == 0, (w, h)
        assert max(w / h, h / w) <= max_ar + 1e-6, (w, h)
        assert abs(w * h - resolution**2) <= step * max(w, h), (w, h)
        assert (h, w) in buckets
    assert (resolution, resolution) in buckets


def test_area_buckets_reach_toward_the_widest_ratio():
    buckets = make_buckets(1024, "area", 64, 2.0)
    widest = max(w / h for w, h in buckets)
    assert 1.75 <= widest <= 2.0
    assert len(buckets) >= 9
    assert make_buckets(1024, "area", 64, 1.0) == [(1024, 1024)]


def test_area_buckets_include_a_square_when_resolution_is_not_a_multiple():
    buckets = make_buckets(1000, "area", 64, 2.0)
    assert any(w == h for w, h in buckets)
    assert assign_bucket(500, 500, buckets)[0] == assign_bucket(500, 500, buckets)[1]


@pytest.mark.parametrize(("resolution", "step"), [(512, 64), (768, 64), (64, 32)])
def test_pixel_buckets_keep_the_short_side(resolution, step):
    buckets = make_buckets(resolution, "pixel", step, 2.0)
    assert (resolution, resolution) in buckets
    assert len(buckets) > 1
    for w, h in buckets:
        assert min(w, h) == resolution
        assert max(w, h) <= 2 * resolution
        assert w % step == 0 and h % step == 0
        assert (h, w) in buckets


def test_assign_bucket_picks_the_closest_aspect_ratio():
    buckets = make_buckets(512, "area", 64, 2.0)
    wide = assign_bucket(300, 150, buckets)
    tall = assign_bucket(150, 300, buckets)
    square = assign_bucket(200, 200, buckets)
    assert wide[0] > wide[1]
    assert tall[1] > tall[0]
    assert square[0] == square[1]
    assert tall == (wide[1], wide[0])
    for width, height in [(300, 150), (123, 456), (640, 480), (480, 640), (1000, 999)]:
        got = assign_bucket(width, height, buckets)
        best = min(abs(math.log(b[0] / b[1]) - math.log(width / height)) for b in buckets)
        assert abs(math.log(got[0] / got[1]) - math.log(width / height)) == pytest.approx(best)


# ---------------------------------------------------------------- placement


SIZES = [(128, 128), (160, 128), (128, 192), (301, 97), (97, 301), (1000, 750), (64, 64)]


def sample(w: int, h: int, name: str | None = None) -> Sample:
    return Sample(Path(name or f"img_{w}x{h}.png"), "a caption", w, h)


@pytest.mark.parametrize("center", [True, False])
def test_place_covers_the_bucket_and_crops_inside(center):
    buckets = make_buckets(128, "area", 32, 2.0)
    for w, h in SIZES:
        s = sample(w, h)
        bucket = assign_bucket(w, h, buckets)
        p = place(s, bucket, center=center, seed=3)
        (bw, bh), (rw, rh), (top, left) = p.bucket, p.resized, p.crop
        assert p.bucket == bucket and p.original == (w, h)
        assert rw >= bw and rh >= bh
        assert 0 <= top <= rh - bh and 0 <= left <= rw - bw
        # Resized, not stretched: one side fits the bucket, the aspect ratio holds.
        assert rw == bw or rh == bh
        scale = max(bw / w, bh / h)
        assert abs(rw - w * scale) <= 1 and abs(rh - h * scale) <= 1
        if center:
            assert (top, left) == ((rh - bh) // 2, (rw - bw) // 2)


def test_random_crop_is_seeded():
    s = sample(301, 97)
    bucket = (128, 64)
    a = [place(s, bucket, center=False, seed=seed).crop for seed in range(8)]
    b = [place(s, bucket, center=False, seed=seed).crop for seed in range(8)]
    assert a == b
    assert len(set(a)) > 1  # the offset depends on the seed
    assert place(s, bucket, center=True, seed=0).crop == place(s, bucket, center=True, seed=5).crop


def test_load_pixels_has_the_bucket_shape(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (200, 100), (255, 0, 0)).save(path)
    p = place(sample(200, 100, str(path)), (96, 64), center=True, seed=0)
    x = load_pixels(path, p)
    assert tuple(x.shape) == (3, 64, 96)
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert x[0].mean() > 0.9 and x[1].mean() < -0.9  # red stays red, in [-1, 1]


# ---------------------------------------------------------------- batches


def mixed_plan(n: int = 37) -> BucketPlan:
    cfg = DataConfig(resolution=128, bucket_step=32)
    samples = [sample(*SIZES[i % len(SIZES)], name=f"img_{i:03d}.png") for i in range(n)]
    return plan_buckets(samples, cfg, step=64, seed=0)


def test_epoch_batches_never_mix_buckets_and_cover_every_sample_once():
    plan = mixed_plan()
    assert len(plan.counts()) >= 3
    for epoch in range(3):
        batches = epoch_batches(plan, 4, seed=1, epoch=epoch)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(plan.placements)))
        for b in batches:
            assert 1 <= len(b) <= 4
            assert len({plan.placements[i].bucket for i in b}) == 1
        # Only a bucket's last batch may be short.
        short = Counter(plan.placements[b[0]].bucket for b in batches if len(b) < 4)
        assert all(n == 1 for n in short.values())


def test_epoch_batches_are_seeded_and_change_between_epochs():
    plan = mixed_plan()
    assert epoch_batches(plan, 4, seed=1, epoch=0) == epoch_batches(plan, 4, seed=1, epoch=0)
    assert epoch_batches(plan, 4, seed=1, epoch=0) != epoch_batches(plan, 4, seed=1, epoch=1)
    assert epoch_batches(plan, 4, seed=1, epoch=0) != epoch_batches(plan, 4, seed=2, epoch=0)


# ---------------------------------------------------------------- scanning


def captions_of(samples: list[Sample]) -> dict[str, str]:
    return {s.image.name: s.caption for s in samples}


def test_captions_beside_the_images(dataset):
    samples = load_samples(DataConfig(image_dir=str(dataset)))
    assert len(samples) == 24
    for s in samples:
        assert s.caption == s.image.with_suffix(".txt").read_text().strip()
        assert (s.width, s.height) == Image.open(s.image).size
    report = scan(DataConfig(image_dir=str(dataset)))
    assert not report.problems() and not report.orphan_captions


def test_captions_in_a_separate_folder(dataset, tmp_path):
    beside = captions_of(load_samples(DataConfig(image_dir=str(dataset))))
    captions = tmp_path / "captions"
    captions.mkdir()
    for txt in sorted(dataset.glob("*.txt")):
        shutil.move(txt, captions / txt.name)
    # A subfolder of images keeps its captions in the same subfolder of caption_dir.
    (dataset / "more").mkdir()
    (captions / "more").mkdir()
    shutil.move(dataset / "zorbic_000.png", dataset / "more" / "zorbic_000.png")
    shutil.move(captions / "zorbic_000.txt", captions / "more" / "zorbic_000.txt")

    cfg = DataConfig(image_dir=str(dataset), caption_dir=str(captions))
    assert captions_of(load_samples(cfg)) == beside
    report = scan(cfg)
    assert not report.problems() and not report.orphan_captions and not report.missing_captions

    with pytest.raises(DataError, match="no caption file"):
        load_samples(DataConfig(image_dir=str(dataset)))  # the images alone lack captions
    with pytest.raises(DataError, match="caption_dir"):
        scan(DataConfig(image_dir=str(dataset), caption_dir=str(tmp_path / "nope")))


def test_exif_rotated_image_reports_its_displayed_size(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    # Stored 80 wide, 40 tall: left half red, right half blue.
    im = Image.new("RGB", (80, 40), (255, 0, 0))
    im.paste((0, 0, 255), (40, 0, 80, 40))
    exif = Image.Exif()
    exif[274] = 6  # rotate 90° clockwise to display
    path = folder / "phone.jpg"
    im.save(path, exif=exif, quality=95)
    (folder / "phone.txt").write_text("a phone photo")

    assert Image.open(path).size == (80, 40)
    assert image_size(path) == (40, 80)
    (s,) = load_samples(DataConfig(image_dir=str(folder)))
    assert (s.width, s.height) == (40, 80)
    bw, bh = assign_bucket(s.width, s.height, make_buckets(128, "area", 32, 2.0))
    assert bh / bw > 1.5  # a tall bucket (the tallest within 128² pixels is 96×160)

    x = load_pixels(path, Placement((40, 80), (40, 80), (0, 0), (40, 80)))
    assert tuple(x.shape) == (3, 80, 40)
    top, bottom = x[:, :30], x[:, 50:]
    assert top[0].mean() > 0.8 and top[2].mean() < -0.8  # the stored left (red) is on top
    assert bottom[2].mean() > 0.8 and bottom[0].mean() < -0.8


# ---------------------------------------------------------------- caches


N_CACHED = 8  # images kept for the cache tests: enough to show reuse, few to encode


@pytest.fixture()
def base(make_config, dataset):
    from kit.families.loading import load_base

    for png in sorted(dataset.glob("*.png"))[N_CACHED:]:
        png.unlink()
        png.with_suffix(".txt").unlink()
    cfg = load_config(make_config())
    family, comps = load_base(cfg)
    return cfg, family, comps


def cache_files(root: Path) -> set[Path]:
    return set(root.rglob("*.safetensors"))


def test_cache_is_written_and_reused(base):
    cfg, family, comps = base
    root = Path(cfg.data.cache_dir)
    first = build_cache(cfg, family, comps)
    n = len(first.samples)
    assert n == N_CACHED
    assert first.stats["latents_encoded"] == n and first.stats["latents_reused"] == 0
    assert first.stats["text_encoded"] == len({s.caption for s in first.samples})
    files = cache_files(root)
    assert set(first.latent_files) | set(first.text_files) == files
    lat = load_file(first.latent_files[0])["latents"]
    assert lat.ndim == 3 and lat.shape[1:] == (8, 8)  # 64 px through the VAE's factor 8
    assert "prompt_embeds" in load_file(first.text_files[0])
    mtimes = {f: f.stat().st_mtime_ns for f in files}

    second = build_cache(cfg, family, comps)
    assert second.stats["latents_reused"] == n
    assert second.stats["latents_encoded"] == 0 and second.stats["text_encoded"] == 0
    assert second.latent_files == first.latent_files
    assert {f: f.stat().st_mtime_ns for f in cache_files(root)} == mtimes

    batch = second.load_batch(epoch_batches(second.plan, 2, seed=0, epoch=0)[0])
    assert batch["latents"].shape[0] == 2 and batch["prompt_embeds"].shape[0] == 2


def test_changed_image_is_encoded_again(base, dataset):
    cfg, family, comps = base
    first = build_cache(cfg, family, comps)
    target = dataset / "zorbic_005.png"
    im = Image.open(target).convert("RGB")
    im.putpixel((0, 0), (1, 2, 3) if im.getpixel((0, 0)) != (1, 2, 3) else (4, 5, 6))
    im.save(target)

    again = build_cache(cfg, family, comps)
    assert again.stats["latents_encoded"] == 1
    assert again.stats["latents_reused"] == len(first.samples) - 1
    assert again.stats["text_encoded"] == 0
    changed = [
        s.image.name
        for s, a, b in zip(again.samples, first.latent_files, again.latent_files, strict=True)
        if a != b
    ]
    assert changed == ["zorbic_005.png"]


def test_changed_resolution_is_encoded_again(base):
    cfg, family, comps = base
    first = build_cache(cfg, family, comps)
    bigger = build_cache(cfg.replace(resolution=96), family, comps)
    assert bigger.stats["latents_encoded"] == len(first.samples)
    assert bigger.stats["latents_reused"] == 0
    assert bigger.stats["text_encoded"] == 0  # captions did not change
    assert not set(bigger.latent_files) & set(first.latent_files)


def test_prior_image_patterns(tmp_path):
    from kit.config import DataConfig
    from kit.data.scan import is_prior_image
    from kit.errors import ConfigError

    root = tmp_path / "data"
    assert is_prior_image(root / "prior_003.png", ["prior_*"], root)
    assert is_prior_image(root / "sub" / "prior_003.png", ["prior_*"], root)  # names match anywhere
    assert not is_prior_image(root / "zorbic_003.png", ["prior_*"], root)
    assert is_prior_image(root / "reg" / "a.png", ["reg/*"], root)
    assert not is_prior_image(root / "more" / "reg" / "a.png", ["reg/*"], root)
    assert not is_prior_image(root / "prior_003.png", [], root)
    with pytest.raises(ConfigError, match="prior_images"):
        DataConfig(prior_images=["prior_*", " "])
