"""Data handling where the reference trainers (diffusers, kohya) are right: augmented captions
trained on with the default one variant, small buckets kept as a short batch rather than
repeated, buckets within the configured area, and flips per epoch with mirrored crops."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from kit.config import DataConfig, from_dict
from kit.data.buckets import epoch_batches, make_buckets, mirrored, place, plan_buckets
from kit.data.cache import plan_cache
from kit.data.pixels import sample_pixels
from kit.data.scan import Sample

IDENTITY = {"vae": "vae-test", "text": "text-test"}


def write_images(folder: Path, sizes: list[tuple[int, int]], caption: str) -> Path:
    """Images of these sizes, left half and right half in different colours, with a caption."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(sizes):
        im = Image.new("RGB", (w, h), (200, 30, 30))
        im.paste((30, 30, 200), (w // 3, 0, w, h))  # not symmetric: a flip shows
        im.save(folder / f"img_{i:02d}.png")
        (folder / f"img_{i:02d}.txt").write_text(caption)
    return folder


def config(tmp_path: Path, **fields):
    return from_dict(
        {
            "image_dir": str(tmp_path / "images"),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "bucket_step": 16,
            "train_batch_size": 2,
            **fields,
        }
    )


def fake_cache(data) -> dict[Path, str]:
    """Write every planned entry as `fill_cache` would, each text entry tagged with its text."""
    for f in data.latent_files:
        f.parent.mkdir(parents=True, exist_ok=True)
        save_file({"latents": torch.zeros(4, 8, 8)}, str(f))
    texts = {}
    for ts, fs in zip(data.variant_texts, data.variant_files, strict=True):
        texts.update(zip(fs, ts, strict=True))
    for f, t in texts.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        save_file({"prompt_embeds": torch.tensor([float(hash(t) % 10007)])}, str(f))
    return texts


# ---------------------------------------------------------------- 6: one caption variant


def test_one_augmented_variant_is_what_both_text_paths_train_on(tmp_path):
    caption = "zorbic, red hat, sitting, grass, sunny, left, small"
    write_images(tmp_path / "images", [(64, 64)] * 8, caption)
    cfg = config(tmp_path, caption_shuffle=True)  # caption_variants stays at its default 1
    assert cfg.data.caption_variants == 1
    data = plan_cache(cfg, IDENTITY, torch.float32)
    fake_cache(data)
    trained = []
    for i in range(len(data.samples)):
        variants = data.draw_variants(1, torch.Generator().manual_seed(0))
        cached = data.load_batch([i], variants)["prompt_embeds"][0]
        # What a live text encoder encodes for this sample (kit.train.step): variant 0.
        live = data.variant_texts[i][variants[0] if variants else 0]
        assert data.text_files[i] == data.variant_files[i][0]
        assert cached.item() == float(hash(live) % 10007)  # the same caption on both paths
        trained.append(live)
    # Augmentation acts with the default: the captions trained on are shuffled ones.
    assert any(t != caption for t in trained)
    assert all(sorted(t.split(", ")) == sorted(caption.split(", ")) for t in trained)


# ---------------------------------------------------------------- 7: small buckets


def odd_one_out() -> list[Sample]:
    return [Sample(Path(f"sq_{i}.png"), "c", 128, 128) for i in range(16)] + [
        Sample(Path("wide.png"), "c", 256, 128)
    ]


def test_a_lone_odd_image_is_shown_once_per_epoch_by_default():
    cfg = DataConfig(resolution=128, bucket_step=32)
    assert cfg.small_bucket_policy == "keep"
    # Batch 2 × accumulation 4: an effective batch of 8 the wide bucket cannot fill.
    plan = plan_buckets(odd_one_out(), cfg, 32, 0, group_size=8)
    assert not plan.dropped and not plan.repeats
    wide = len(plan.samples) - 1
    for epoch in range(3):
        batches = epoch_batches(plan, 2, seed=0, epoch=epoch)
        seen = [i for b in batches for i in b]
        assert sorted(seen) == list(range(17))  # every image once, the wide one too
        assert [b for b in batches if wide in b] == [[wide]]  # alone, in a short batch
    # `repeat` stays a choice, and does what it says: the lone image fills the batch of 8.
    plan = plan_buckets(
        odd_one_out(), dataclasses.replace(cfg, small_bucket_policy="repeat"), 32, 0, 8
    )
    seen = [i for b in epoch_batches(plan, 2, seed=0, epoch=0) for i in b]
    assert seen.count(wide) == 8


# ---------------------------------------------------------------- 8: bucket area


@pytest.mark.parametrize("resolution", [64, 96, 512, 1024])
@pytest.mark.parametrize("step", [8, 16, 32, 64])
@pytest.mark.parametrize("max_aspect", [1.5, 2.0, 4.0])
def test_area_buckets_never_exceed_the_resolution_squared(resolution, step, max_aspect):
    buckets = make_buckets(resolution, "area", step, max_aspect)
    assert buckets
    for w, h in buckets:
        assert w * h <= resolution * resolution, (w, h)
        assert w % step == 0 and h % step == 0
        assert max(w / h, h / w) <= max_aspect + 1e-6
    side = resolution // step * step
    if side >= step:
        assert (side, side) in buckets  # squares are never cropped


def test_a_wide_image_at_64_px_is_not_upscaled_into_a_bigger_bucket():
    # 96×64 at resolution 64 and step 64 went to a 128×64 bucket: twice the area, upscaled.
    samples = [Sample(Path("wide.png"), "c", 96, 64)]
    plan = plan_buckets(samples, DataConfig(resolution=64, bucket_step=64), 64, 0)
    (p,) = plan.placements
    assert p.bucket == (64, 64)


# ---------------------------------------------------------------- 9: flips


def test_a_flipped_crop_is_mirrored_and_matches_its_pixels(tmp_path):
    write_images(tmp_path / "images", [(200, 96)], "c")
    s = Sample(tmp_path / "images" / "img_00.png", "c", 200, 96)
    cfg = DataConfig(resolution=64, bucket_step=16, center_crop=False)
    for seed in range(6):
        p = place(s, (80, 48), center=False, seed=seed)
        twin = mirrored(p)
        (rw, _), (bw, _) = p.resized, p.bucket
        assert twin.flip and twin.crop == (p.crop[0], rw - p.crop[1] - bw)
        # The twin's pixels are the straight crop mirrored: the recorded crop is where they lie
        # in the mirrored image, as diffusers (flip, then crop) and kohya record it.
        assert torch.equal(sample_pixels(s, twin, cfg), sample_pixels(s, p, cfg).flip(-1))
        if p.crop[1] != rw - p.crop[1] - bw:
            break
    else:
        pytest.fail("every seeded crop was centred: the mirror went untested")


def test_each_epoch_flips_each_sample_by_its_own_coin(tmp_path):
    write_images(tmp_path / "images", [(160, 64)] * 6 + [(64, 64)] * 6, "zorbic, a shape")
    cfg = config(tmp_path, random_flip=True, center_crop=False)
    data = plan_cache(cfg, IDENTITY, torch.float32)
    plain = plan_cache(cfg.replace(random_flip=False), IDENTITY, torch.float32)
    n = len(plain.samples)
    assert data.plan.size == n and len(data.latent_files) == 2 * n and data.kept() == plain.samples
    # Both orientations are cache entries of their own, keyed by the orientation.
    assert data.latent_files[:n] == plain.latent_files
    assert not set(data.latent_files[n:]) & set(plain.latent_files)
    manifest = data.manifest()
    assert len(manifest) == n and all("mirrored_crop" in r for r in manifest)
    # The recorded crop of a twin is mirrored, and it is what the batch conditions on.
    fake_cache(data)
    assert any(p.crop[1] for p in data.plan.placements[:n])  # crops off the centre line
    for i in range(n):
        p, twin = data.plan.placements[i], data.plan.placements[i + n]
        mirror = p.resized[0] - p.crop[1] - p.bucket[0]
        assert twin.crop == (p.crop[0], mirror) and manifest[i]["mirrored_crop"] == list(twin.crop)
        crop = data.load_batch([i + n])["crop_top_left"][0].tolist()
        assert crop == [p.crop[0], mirror]
    # Over epochs, every sample trains in both orientations; within one, in exactly one.
    seen: dict[int, set[bool]] = {i: set() for i in range(n)}
    for epoch in range(12):
        batches = epoch_batches(data.plan, 2, cfg.train.seed, epoch)
        flat = [i for b in batches for i in b]
        assert sorted(i % n for i in flat) == list(range(n))
        assert len(batches) == len(epoch_batches(plain.plan, 2, cfg.train.seed, epoch))
        for i in flat:
            seen[i % n].add(i >= n)
        assert epoch_batches(data.plan, 2, cfg.train.seed, epoch) == batches  # seeded
    assert all(v == {False, True} for v in seen.values())
    # Another seed draws other coins.
    other = [epoch_batches(data.plan, 2, cfg.train.seed + 1, e) for e in range(4)]
    assert other != [epoch_batches(data.plan, 2, cfg.train.seed, e) for e in range(4)]
