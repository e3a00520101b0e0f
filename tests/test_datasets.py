"""Several datasets in one run: repeats, a prior dataset's loss weight, settings per dataset,
class images drawn by the base, and what every report counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kit.cli import main
from kit.config import load_config
from kit.errors import ConfigError, DataError
from tests.conftest import resumed_equals_straight


def _split(dataset: Path, root: Path) -> tuple[Path, Path]:
    """Six concept images in `chars/`, eight in `reg/` with captions that lack the trigger."""
    chars, reg = root / "chars", root / "reg"
    chars.mkdir()
    reg.mkdir()
    images = sorted(dataset.glob("*.png"))
    for im in images[:6]:
        shutil.copy(im, chars / im.name)
        shutil.copy(im.with_suffix(".txt"), chars / im.with_suffix(".txt").name)
    for i, im in enumerate(images[6:14]):
        shutil.copy(im, reg / f"reg_{i}.png")
        (reg / f"reg_{i}.txt").write_text("a plain shape\n")
    return chars, reg


def _datasets(chars: Path, reg: Path, **reg_fields) -> list[dict]:
    return [
        {"name": "chars", "image_dir": str(chars), "repeats": 3},
        {"image_dir": str(reg), "role": "prior", "loss_weight": 0.5, **reg_fields},
    ]


def _config(make_config, tmp_path, name="c.json", reg_fields=None, **fields):
    chars, reg = (
        (tmp_path / "chars", tmp_path / "reg")
        if (tmp_path / "chars").is_dir()
        else _split(fields.pop("source"), tmp_path)
    )
    fields.pop("source", None)
    return make_config(
        name, image_dir="", datasets=_datasets(chars, reg, **(reg_fields or {})), **fields
    )


def test_buckets_count_repeats_per_dataset(tmp_path, make_config, dataset, capsys):
    """`kit buckets --json`: 3 × the first dataset plus the second per epoch, each shown."""
    path = _config(make_config, tmp_path, source=dataset)
    assert main(["buckets", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 14
    assert report["samples_per_epoch"] == 3 * 6 + 8
    rows = {d["name"]: d for d in report["datasets"]}
    assert rows["chars"]["samples_per_epoch"] == 18 and rows["chars"]["repeats"] == 3
    assert rows["reg"]["role"] == "prior" and rows["reg"]["loss_weight"] == 0.5
    assert rows["reg"]["samples_per_epoch"] == 8
    assert sum(b["per_epoch"] for b in report["buckets"]) == 26
    # The trainer's own epoch holds exactly those draws (batch 2: 13 batches).
    assert report["batches_per_epoch"] == sum(-(-b["per_epoch"] // 2) for b in report["buckets"])
    assert main(["buckets", str(path)]) == 0
    text = capsys.readouterr().out
    assert "chars" in text and "prior" in text and "26 per epoch" in text


@pytest.mark.slow
def test_two_datasets_train_weight_and_resume_exactly(tmp_path, make_config, dataset):
    """Repeats and a prior loss weight train, the batch carries the weight, and a resume mid-run
    ends on the same weights as the uninterrupted run."""
    from kit.train.loop import train

    common = {"max_train_steps": 8, "checkpointing_steps": 4, "trigger_words": ["zorbic"]}
    a = _config(make_config, tmp_path, "a.json", output_dir=str(tmp_path / "a"), source=dataset)
    b = _config(make_config, tmp_path, "b.json", output_dir=str(tmp_path / "b"), **common)
    a_cfg = load_config(a, {**common})
    straight = train(a_cfg)
    assert straight.step == 8

    resumed_equals_straight(tmp_path, b, stop=4, end=8)

    manifest = json.loads((tmp_path / "a" / "dataset_manifest.json").read_text())
    by_set = {r["dataset"] for r in manifest}
    assert by_set == {"chars", "reg"}
    assert {r["role"] for r in manifest if r["dataset"] == "reg"} == {"prior"}
    assert {r["repeats"] for r in manifest if r["dataset"] == "chars"} == {3}
    # The trigger-word check of the doctor skips the prior dataset, whose captions lack it.
    report = json.loads((tmp_path / "a" / "doctor.json").read_text())
    assert not [f for f in report["findings"] if f["code"] == "trigger_missing"]
    archive = json.loads((tmp_path / "a" / "archive.json").read_text())
    names = {f["file"] for f in archive["dataset"]["files"]}
    assert "reg_0.png" in names, "archived names are relative to their dataset's folder"


def test_batches_carry_each_datasets_loss_weight(tmp_path, make_config, dataset):
    """Prior samples weigh 0.5 in the loss, instance samples 1; without weights none is sent."""
    from kit.data.cache import plan_cache

    cfg = load_config(_config(make_config, tmp_path, source=dataset))
    data = plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32)
    prior = [i for i, s in enumerate(data.samples) if s.dataset == 1]
    assert prior and all(data.loss_weights[i] == 0.5 for i in prior)
    assert all(data.loss_weights[i] == 1.0 for i, s in enumerate(data.samples) if s.dataset == 0)
    flat = load_config(make_config("flat.json"))
    assert plan_cache(flat, {"vae": "v", "text": "t"}, torch.float32).loss_weights == []


def test_loss_weight_scales_each_samples_loss():
    """`denoising_loss` multiplies each sample's loss by the batch's `loss_weight`."""
    from kit.train.objective import denoising_loss

    class Draw:
        noisy = torch.zeros(2, 4, 2, 2)
        timesteps = torch.zeros(2)
        target = torch.ones(2, 4, 2, 2)
        weight = None

    class Fam:
        from kit.config import Config

        cfg = Config()

        def noise_and_target(self, comps, latents, generator):
            return Draw()

        def predict(self, comps, noisy, timesteps, batch):
            return torch.tensor([0.0, 2.0]).view(2, 1, 1, 1).expand(2, 4, 2, 2)

    batch = {"latents": torch.zeros(2, 4, 2, 2)}
    plain = denoising_loss(Fam(), None, dict(batch), None, "cpu")
    weighted = denoising_loss(
        Fam(), None, {**batch, "loss_weight": torch.tensor([1.0, 0.5])}, None, "cpu"
    )
    assert plain.item() == pytest.approx(1.0)  # (1 + 1) / 2: both errors are 1
    assert weighted.item() == pytest.approx((1.0 + 0.5) / 2)


def test_settings_per_dataset(tmp_path, make_config, dataset):
    """A dataset's own resolution and caption strategy apply to its images only."""
    from kit.data.buckets import plan_dataset

    path = _config(
        make_config,
        tmp_path,
        source=dataset,
        reg_fields={
            "resolution": 32,
            "caption_strategy": "instanceprompt",
            "instance_prompt": "a shape",
        },
    )
    cfg = load_config(path)
    samples, plan = plan_dataset(cfg)
    for s, p in zip(plan.samples, plan.placements, strict=True):
        if s.dataset == 1:
            assert s.caption == "a shape"
            assert p.bucket[0] * p.bucket[1] <= 32 * 32
        else:
            assert p.bucket[0] * p.bucket[1] > 32 * 32


def test_bad_dataset_entries_name_the_dataset(tmp_path, make_config, dataset):
    chars, reg = _split(dataset, tmp_path)
    with pytest.raises(ConfigError, match=r"'repeatz' in datasets\[1\]; did you mean 'repeats'"):
        load_config(
            make_config(
                image_dir="",
                datasets=[{"image_dir": str(chars)}, {"image_dir": str(reg), "repeatz": 2}],
            )
        )
    with pytest.raises(
        ConfigError, match=r"datasets\[0\] \(chars\): repeats: 0 must be at least 1"
    ):
        load_config(
            make_config(
                image_dir="", datasets=[{"name": "chars", "image_dir": str(chars), "repeats": 0}]
            )
        )
    missing = load_config(
        make_config(
            image_dir="",
            datasets=[{"image_dir": str(chars)}, {"image_dir": str(tmp_path / "gone")}],
        )
    )
    from kit.data.scan import check_dataset

    with pytest.raises(DataError, match=r"datasets\[1\] \(gone\): image folder not found"):
        check_dataset(missing.data)
    # A broken image in one dataset skips that file only; the other dataset is untouched.
    (reg / "reg_0.png").write_bytes(b"not a png")
    both = load_config(make_config(image_dir="", datasets=_datasets(chars, reg)))
    report = check_dataset(both.data)
    assert sum(s.dataset == 0 for s in report.samples) == 6
    assert sum(s.dataset == 1 for s in report.samples) == 7
    assert any(p.name == "reg_0.png" for p, _ in report.unreadable)


def test_caption_tools_work_across_datasets(tmp_path, make_config, dataset):
    """The trigger check skips the prior dataset; a bulk edit backs up each folder it changes
    and a restore puts each back."""
    from kit.data.captions import Edit, apply_edit, caption_report, plan_edit, restore_backup

    cfg = load_config(_config(make_config, tmp_path, source=dataset, trigger_words=["zorbic"]))
    report = caption_report(cfg, token_counts=False)
    assert report["prior_images"] == 8
    assert not any("reg_" in f for fs in report["trigger_missing"].values() for f in fs)
    changes = plan_edit(cfg, Edit(append="extra"))
    assert {c.path.parent.name for c in changes} == {"chars", "reg"}
    before = (tmp_path / "reg" / "reg_1.txt").read_text()
    backup = apply_edit(cfg, changes)
    assert "extra" in (tmp_path / "reg" / "reg_1.txt").read_text()
    twin = tmp_path / "reg" / ".caption-backups" / backup.name
    assert twin.is_dir() and (twin / "reg_1.txt").read_text() == before
    restore_backup(cfg, twin)
    assert (tmp_path / "reg" / "reg_1.txt").read_text() == before


@pytest.mark.slow
def test_class_images_drawn_once_for_a_prior_dataset(tmp_path, make_config, dataset):
    """`generate` draws the missing class images with their prompt as caption, before the
    scan; a second run draws none, and a changed prompt is refused naming both."""
    from kit.train.loop import train

    chars, _ = _split(dataset, tmp_path)
    classes = tmp_path / "classes"
    sets = [
        {"name": "chars", "image_dir": str(chars)},
        {
            "name": "classes",
            "image_dir": str(classes),
            "role": "prior",
            "generate": {"count": 2, "prompt": "a plain shape", "num_inference_steps": 2},
        },
    ]
    path = make_config(image_dir="", datasets=sets, max_train_steps=1, checkpointing_steps=0)
    train(load_config(path))
    pngs = sorted(p.name for p in classes.glob("*.png"))
    assert pngs == ["class_00000.png", "class_00001.png"]
    assert (classes / "class_00000.txt").read_text().strip() == "a plain shape"
    stamp = (classes / "class_00000.png").stat().st_mtime_ns
    manifest = json.loads((tmp_path / "run" / "dataset_manifest.json").read_text())
    assert sum(r["dataset"] == "classes" for r in manifest) == 2
    train(load_config(path), overwrite=True)
    assert (classes / "class_00000.png").stat().st_mtime_ns == stamp
    sets[1]["generate"]["prompt"] = "a dog"
    changed = make_config("changed.json", image_dir="", datasets=sets, max_train_steps=1)
    with pytest.raises(Exception, match="drawn with prompt 'a plain shape'.*'a dog'"):
        train(load_config(changed), overwrite=True)


def test_a_dataset_can_train_whole_beside_masked_ones(tmp_path, make_config, dataset):
    """`masked_loss: false` on a prior dataset: its images (without alpha) train whole while
    the other dataset's masks come from their alpha channel."""
    from PIL import Image

    from kit.data.cache import plan_cache
    from kit.data.masks import WHOLE, bucket_mask

    chars, reg = _split(dataset, tmp_path)
    for im in chars.glob("*.png"):
        rgba = Image.open(im).convert("RGBA")
        alpha = Image.new("L", rgba.size, 0)
        alpha.paste(255, (0, 0, rgba.size[0] // 2, rgba.size[1]))
        rgba.putalpha(alpha)
        rgba.save(im)
    sets = _datasets(chars, reg, masked_loss=False)
    cfg = load_config(make_config(image_dir="", datasets=sets, masked_loss=True))
    data = plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32)
    assert not data.skipped, data.skipped
    whole = [m for m, s in zip(data.masks, data.samples, strict=True) if s.dataset == 1]
    assert whole and all(m.digest == WHOLE for m in whole)
    i = next(i for i, s in enumerate(data.samples) if s.dataset == 0)
    mask = bucket_mask(data.masks[i], data.plan.placements[i])
    assert mask[:, : mask.shape[1] // 4].min() == 1 and mask[:, -mask.shape[1] // 4 :].max() == 0
    w = bucket_mask(
        whole[0],
        data.plan.placements[data.samples.index(next(s for s in data.samples if s.dataset == 1))],
    )
    assert w.min() == 1
