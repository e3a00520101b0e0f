"""Masked loss: masks from the alpha channel or `mask_dir`, fitted and flipped with the pixels,
averaged onto the latent grid, keyed in the cache, and bad masks left out with their reason."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import load_config
from kit.data.buckets import Placement
from kit.data.cache import build_cache, file_digest, plan_cache
from kit.data.masks import (
    ALPHA,
    MaskSource,
    fit_mask,
    latent_mask,
    mask_preview,
    plan_masks,
    read_mask,
)
from kit.errors import ConfigError, DataError
from kit.families import NoiseDraw, get_family
from kit.families.loading import load_base
from kit.train.objective import denoising_loss
from tests.conftest import write_run_config

IDENTITY = {"vae": "v", "text": "t"}


def _rgba(path: Path, w: int = 64, h: int = 64, opaque_cols: int | None = None, seed: int = 0):
    """A noisy RGB picture whose alpha is opaque in its left `opaque_cols` columns."""
    rng = np.random.default_rng(seed)
    arr = np.zeros((h, w, 4), np.uint8)
    arr[..., :3] = rng.integers(0, 256, (h, w, 3))
    arr[:, : w // 2 if opaque_cols is None else opaque_cols, 3] = 255
    Image.fromarray(arr, "RGBA").save(path)


def _rgb(path: Path, w: int = 64, h: int = 64, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(path)


def _grey_mask(path: Path, arr: np.ndarray) -> None:
    Image.fromarray((arr * 255).astype(np.uint8), "L").save(path)


def _caption(image: Path, text: str = "a zorbic thing") -> None:
    image.with_suffix(".txt").write_text(text)


def _config(tmp_path: Path, base: Path, data: Path, **over):
    path = write_run_config(
        tmp_path / "config.json", base=base, data=data, masked_loss=True, **over
    )
    return load_config(path)


@pytest.fixture()
def alpha_data(tmp_path) -> Path:
    data = tmp_path / "alpha"
    data.mkdir()
    for i in range(2):
        _rgba(data / f"img{i}.png", seed=i)
        _caption(data / f"img{i}.png")
    return data


def test_alpha_mask_lands_on_the_latent_grid_and_trains(
    tmp_path, tiny_sd15, alpha_data, monkeypatch
):
    """Left half opaque → the left half of the 8×8 latent grid is 1, the right 0; the run trains
    with the mask in every batch."""
    from kit.train.loop import train

    cfg = _config(
        tmp_path,
        tiny_sd15,
        alpha_data,
        max_train_steps=2,
        checkpointing_steps=0,
        validation_prompt=[],
    )
    import kit.train.step

    seen = []

    def recording(family, comps, batch, generator, device, *rest):
        seen.append(batch["loss_mask"].shape)
        return denoising_loss(family, comps, batch, generator, device, *rest)

    monkeypatch.setattr(kit.train.step, "denoising_loss", recording)
    assert train(cfg).step == 2
    assert seen == [(2, 1, 8, 8)] * 2  # every step's batch carries the masks
    rows = (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all(np.isfinite(json.loads(r)["loss"]) for r in rows)
    # The run's own cache entries: planned again, nothing left to encode.
    family = get_family(cfg.model.model_family, cfg)
    identity = family.identity(cfg.model.pretrained_model, cfg.model.revision)
    data = plan_cache(cfg, identity, torch.float32, family=family)
    assert data.missing()["latents"] == 0
    batch = data.load_batch([0, 1])
    mask = batch["loss_mask"]
    assert mask.shape == (2, 1, 8, 8) == (2, 1, *batch["latents"].shape[2:])
    expected = torch.zeros(8, 8)
    expected[:, :4] = 1.0
    assert torch.equal(mask[0, 0], expected) and torch.equal(mask[1, 0], expected)
    assert all(m.digest == ALPHA for m in data.masks)


class _Stub:
    """A family whose prediction is zero and whose target is given: the loss is the masked mean
    of target² per sample."""

    def __init__(self, cfg, target):
        self.cfg, self.target = cfg, target

    def noise_and_target(self, comps, latents, generator):
        return NoiseDraw(latents, torch.zeros(latents.shape[0]), self.target)

    def predict(self, comps, noisy, timesteps, cond):
        return torch.zeros_like(noisy)


def test_loss_ignores_the_masked_out_region(tmp_path, tiny_sd15, alpha_data):
    cfg = _config(tmp_path, tiny_sd15, alpha_data)
    data = plan_cache(cfg, IDENTITY, torch.float32)
    mask = torch.zeros(2, 1, 8, 8)
    mask[..., :4] = 1.0  # as the alpha gives (see above), without encoding
    target = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))

    def loss(t):
        batch = {"latents": torch.zeros(2, 4, 8, 8), "loss_mask": mask.clone()}
        return denoising_loss(_Stub(cfg, t), None, batch, torch.Generator(), "cpu")

    changed = target.clone()
    changed[..., 4:] += 100.0  # only where the mask is 0
    assert torch.allclose(loss(target), loss(changed))
    assert torch.allclose(loss(target), target[..., :4].pow(2).mean())
    changed[..., :1] += 1.0  # where it is 1
    assert not torch.allclose(loss(target), loss(changed))
    assert len(data.masks) == 2


def test_mask_dir_mirrors_subfolders_and_reads_grey(tmp_path, tiny_sd15):
    data, masks = tmp_path / "data", tmp_path / "masks"
    (data / "sub").mkdir(parents=True)
    (masks / "sub").mkdir(parents=True)
    _rgb(data / "sub/a.jpg")
    _caption(data / "sub/a.jpg")
    top = np.zeros((64, 64))
    top[:32] = 1.0  # the top half learns
    _grey_mask(masks / "sub/a.png", top)
    cfg = _config(tmp_path, tiny_sd15, data, mask_dir=str(masks))
    planned = plan_cache(cfg, IDENTITY, torch.float32)
    (src,) = planned.masks
    assert src.file == masks / "sub/a.png" and src.digest == file_digest(src.file)
    assert planned.manifest()[0]["mask"] == str(src.file)
    grid = latent_mask(fit_mask(read_mask(src), planned.plan.placements[0]), (4, 8, 8))
    expected = torch.zeros(1, 8, 8)
    expected[:, :4] = 1.0
    assert torch.equal(grid, expected)


def test_crop_and_flip_apply_to_the_mask(tmp_path, tiny_sd15):
    """A 96×64 image crops to the 64×64 bucket at x 16..80; its mask, white left of x 32, keeps
    x 16..32 (latent columns 0-1), and the mirrored twin's mask is that mirrored."""
    data, masks = tmp_path / "data", tmp_path / "masks"
    data.mkdir()
    masks.mkdir()
    _rgb(data / "wide.png", w=96, h=64)
    _caption(data / "wide.png")
    left = np.zeros((64, 96))
    left[:, :32] = 1.0
    _grey_mask(masks / "wide.png", left)
    cfg = _config(tmp_path, tiny_sd15, data, mask_dir=str(masks), random_flip=True)
    planned = plan_cache(cfg, IDENTITY, torch.float32)
    p, twin = planned.plan.placements
    assert p.crop == (0, 16) and twin.flip
    grids = [
        latent_mask(fit_mask(read_mask(m), q), (4, 8, 8))
        for m, q in zip(planned.masks, (p, twin), strict=True)
    ]
    expected = torch.zeros(1, 8, 8)
    expected[..., :2] = 1.0
    assert torch.equal(grids[0], expected)
    assert torch.equal(grids[1], expected.flip(-1))


def test_fit_follows_the_resize(tmp_path):
    """A 128×128 mask halves to the 64×64 bucket: the same edge, at half the size."""
    mask = np.zeros((128, 128), np.float32)
    mask[:, :64] = 1.0
    p = Placement(bucket=(64, 64), resized=(64, 64), crop=(0, 0), original=(128, 128))
    fitted = fit_mask(mask, p)
    assert fitted.shape == (64, 64)
    # Lanczos reaches three output pixels past the edge at half size, as it does for the pixels.
    assert torch.allclose(fitted[:, :29], torch.ones(64, 29))
    assert torch.allclose(fitted[:, 35:], torch.zeros(64, 29))
    assert (fitted[:, 31] > 0.5).all() and (fitted[:, 32] < 0.5).all()
    grid = latent_mask(fitted, (16, 1, 8, 8))  # a video family's one-frame latents
    assert grid.shape == (1, 1, 8, 8) and grid[..., :4].min() > 0.99 and grid[..., 4:].max() < 0.01


def test_editing_a_mask_re_encodes_that_entry_only(tmp_path, tiny_sd15):
    data, masks = tmp_path / "data", tmp_path / "masks"
    data.mkdir()
    masks.mkdir()
    for i in range(3):
        _rgb(data / f"m{i}.png", seed=i)
        _caption(data / f"m{i}.png")
        _grey_mask(masks / f"m{i}.png", np.ones((64, 64)))
    cfg = _config(tmp_path, tiny_sd15, data, mask_dir=str(masks))
    family, comps = load_base(cfg)
    first = build_cache(cfg, family, comps, progress=False)
    assert first.stats["latents_encoded"] == 3
    half = np.ones((64, 64))
    half[:, 32:] = 0.0
    _grey_mask(masks / "m1.png", half)
    second = build_cache(cfg, family, comps, progress=False)
    assert second.stats["latents_encoded"] == 1 and second.stats["latents_reused"] == 2
    changed = [a != b for a, b in zip(first.latent_files, second.latent_files, strict=True)]
    assert changed == [False, True, False]
    assert second.load_batch([1])["loss_mask"][0, 0, :, 4:].max() == 0.0


def test_masked_loss_off_keeps_the_keys(tmp_path, tiny_sd15, alpha_data):
    """Without masks a latent entry's key is what it always was; with them it changes."""
    cfg = _config(tmp_path, tiny_sd15, alpha_data).replace(masked_loss=False)
    off = plan_cache(cfg, IDENTITY, torch.float32)
    assert not off.masks
    for s, p, f in zip(off.samples, off.plan.placements, off.latent_files, strict=True):
        parts = (file_digest(s.image), p.record(), str(torch.float32))
        assert f.stem == hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
    on = plan_cache(cfg.replace(masked_loss=True), IDENTITY, torch.float32)
    assert not set(on.latent_files) & set(off.latent_files)


def test_bad_masks_are_left_out_with_file_and_key(tmp_path, tiny_sd15):
    data, masks = tmp_path / "data", tmp_path / "masks"
    data.mkdir()
    masks.mkdir()
    for name in ("good", "small", "broken", "missing"):
        _rgb(data / f"{name}.png")
        _caption(data / f"{name}.png")
    _grey_mask(masks / "good.png", np.ones((64, 64)))
    _grey_mask(masks / "small.png", np.ones((32, 32)))
    (masks / "broken.png").write_bytes(b"not a png at all")
    cfg = _config(tmp_path, tiny_sd15, data, mask_dir=str(masks))
    planned = plan_cache(cfg, IDENTITY, torch.float32)
    assert [s.image.name for s in planned.samples] == ["good.png"]
    why = {p.name: r for p, r in planned.skipped}
    assert set(why) == {"small.png", "broken.png", "missing.png"}
    assert "32x32" in why["small.png"] and "64x64" in why["small.png"]
    assert str(masks / "broken.png") in why["broken.png"] and "unreadable" in why["broken.png"]
    assert str(masks / "missing") in why["missing.png"]
    assert all("mask_dir" in r and "dataset 'data'" in r for r in why.values())
    assert {p.name for p, _ in planned.plan.dropped} >= set(why)


def test_no_alpha_and_no_mask_dir(tmp_path, tiny_sd15, alpha_data):
    _rgb(alpha_data / "flat.png")
    _caption(alpha_data / "flat.png")
    cfg = _config(tmp_path, tiny_sd15, alpha_data)
    refused = dict(plan_masks(cfg).refused)
    assert list(refused) == [alpha_data / "flat.png"]
    assert "no alpha channel" in refused[alpha_data / "flat.png"]
    assert "masked_loss" in refused[alpha_data / "flat.png"]
    flat_only = tmp_path / "flat"
    flat_only.mkdir()
    _rgb(flat_only / "x.png")
    _caption(flat_only / "x.png")
    with pytest.raises(DataError, match=r"masked_loss: not one image.*x\.png"):
        plan_cache(cfg.replace(image_dir=str(flat_only)), IDENTITY, torch.float32)


def test_mask_dir_config_mistakes(tmp_path, tiny_sd15, alpha_data):
    cfg = _config(tmp_path, tiny_sd15, alpha_data)
    with pytest.raises(ConfigError, match=r"mask_dir: mask folder not found: .*nowhere"):
        plan_cache(cfg.replace(mask_dir=str(tmp_path / "nowhere")), IDENTITY, torch.float32)
    (alpha_data / "masks").mkdir()
    with pytest.raises(ConfigError, match="inside image_dir"):
        plan_cache(cfg.replace(mask_dir=str(alpha_data / "masks")), IDENTITY, torch.float32)


def test_one_datasets_bad_mask_keeps_the_others(tmp_path, tiny_sd15, alpha_data):
    other, masks = tmp_path / "other", tmp_path / "masks"
    other.mkdir()
    masks.mkdir()
    _rgb(other / "o.png")
    _caption(other / "o.png")
    _grey_mask(masks / "o.png", np.ones((48, 48)))
    cfg = _config(
        tmp_path,
        tiny_sd15,
        alpha_data,
        image_dir="",
        datasets=[
            {"image_dir": str(alpha_data), "name": "cutouts"},
            {"image_dir": str(other), "name": "photos", "mask_dir": str(masks)},
        ],
    )
    planned = plan_cache(cfg, IDENTITY, torch.float32)
    assert sorted(s.image.name for s in planned.samples) == ["img0.png", "img1.png"]
    ((path, why),) = planned.skipped
    assert path == other / "o.png"
    assert "photos" in why and str(masks / "o.png") in why and "mask_dir" in why


def test_mask_files_in_every_format(tmp_path):
    """16-bit, palette, RGBA (by its alpha) and EXIF-rotated masks read as the grey they show."""
    img = tmp_path / "i.png"
    _rgb(img, w=4, h=2)

    def read(file: Path) -> np.ndarray:
        return read_mask(MaskSource(img, file, "x", "dataset 'd'"))

    ramp = np.array([[0, 65535, 32768, 0], [0, 0, 0, 65535]], np.uint16)
    Image.fromarray(ramp).save(tmp_path / "m16.png")
    assert np.allclose(read(tmp_path / "m16.png"), ramp / 65535.0, atol=1e-4)
    pal = Image.fromarray(np.array([[0, 1, 1, 0], [1, 0, 0, 1]], np.uint8), "P")
    pal.putpalette([0, 0, 0, 255, 255, 255])
    pal.save(tmp_path / "pal.png")
    assert np.array_equal(read(tmp_path / "pal.png"), [[0, 1, 1, 0], [1, 0, 0, 1]])
    strokes = np.zeros((2, 4, 4), np.uint8)
    strokes[..., :3] = 255
    strokes[0, 1, 3] = 255
    Image.fromarray(strokes, "RGBA").save(tmp_path / "strokes.png")
    assert np.array_equal(read(tmp_path / "strokes.png"), [[0, 1, 0, 0], [0, 0, 0, 0]])
    tall = Image.fromarray(np.array([[255, 0], [0, 0], [0, 0], [0, 0]], np.uint8), "L")
    exif = tall.getexif()
    exif[274] = 6  # displayed rotated 90° clockwise: 4 wide, 2 high
    tall.save(tmp_path / "rot.jpg", exif=exif, quality=100)
    shown = read(tmp_path / "rot.jpg")
    assert shown.shape == (2, 4) and shown[0, 3] > 0.9 and shown[1].max() < 0.1


def test_mask_preview_tints_what_is_ignored(tmp_path, tiny_sd15, alpha_data):
    cfg = _config(tmp_path, tiny_sd15, alpha_data, alpha_background="white")
    sheet = mask_preview(cfg, n=2, size=64)
    assert sheet.size == (2 * 68 + 4, 68 + 4)
    arr = np.asarray(sheet, np.float32)
    right = arr[4:68, 4 + 40 : 4 + 60]  # transparent: white background, tinted red
    assert (right[..., 0] > right[..., 1] + 80).all()
    with pytest.raises(ConfigError, match="masked_loss"):
        mask_preview(cfg.replace(masked_loss=False))
