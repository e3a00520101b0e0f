"""Buckets as training uses them: explicit lists, upscale limits, flips, small-bucket policies,
and a report whose batch and step counts are the trainer's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from kit.cli import main as kit_main
from kit.config import DataConfig, from_dict, load_config
from kit.data.buckets import epoch_batches, plan_buckets, with_mirrored
from kit.data.pixels import sample_pixels
from kit.data.report import aspect_histogram, bucket_report
from kit.data.scan import Sample
from kit.errors import ConfigError


def sample(w: int, h: int, name: str) -> Sample:
    return Sample(Path(name), "a caption", w, h)


def data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"resolution": 128, "bucket_step": 32, **kw})


# ---------------------------------------------------------------- buckets and placement


def test_explicit_buckets_are_used_and_checked_against_the_step():
    cfg = data_cfg(buckets=[[128, 128], [192, 96]], bucket_step=0)
    samples = [sample(300, 150, "wide.png"), sample(100, 100, "square.png")]
    plan = plan_buckets(samples, cfg, step=32, seed=0)
    assert sorted(plan.buckets) == [(128, 128), (192, 96)]
    assert [p.bucket for p in plan.placements] == [(192, 96), (128, 128)]
    # The family's step (64 for sd15) applies when bucket_step is 0.
    with pytest.raises(ConfigError, match=r"buckets: \[192, 96\] is not a multiple .* 64"):
        plan_buckets(samples, cfg, step=64, seed=0)
    with pytest.raises(ConfigError, match="bucket_step 32"):
        DataConfig(buckets=[[100, 64]], bucket_step=32)


def test_images_needing_too_much_upscale_are_dropped_with_the_factor():
    samples = [sample(40, 40, "tiny.png"), sample(64, 64, "half.png"), sample(200, 200, "ok.png")]
    plan = plan_buckets(samples, data_cfg(max_upscale=2.0), step=32, seed=0)
    assert [s.image.name for s in plan.samples] == ["half.png", "ok.png"]  # 2.0× is allowed
    assert plan.dropped == [(Path("tiny.png"), "too small: needs 3.20× upscale (max_upscale 2)")]
    relaxed = plan_buckets(samples, data_cfg(max_upscale=4.0), step=32, seed=0)
    assert len(relaxed.samples) == 3 and not relaxed.dropped


def test_random_flip_twins_are_recorded_and_applied(tmp_path):
    path = tmp_path / "half.png"
    im = Image.new("RGB", (128, 128), (255, 0, 0))
    im.paste((0, 0, 255), (64, 0, 128, 128))  # left red, right blue
    im.save(path)
    plan = plan_buckets([sample(128, 128, str(path))], data_cfg(random_flip=True), 32, 0)
    assert not any(p.flip for p in plan.placements)  # the plan itself is never mirrored
    twins = with_mirrored(plan)
    straight, flipped = twins.placements
    assert twins.size == 1 and twins.samples == plan.samples * 2
    assert flipped.record()["flip"] is True and "flip" not in straight.record()
    a = sample_pixels(plan.samples[0], straight, data_cfg())
    b = sample_pixels(plan.samples[0], flipped, data_cfg())
    assert a[0, :, :32].mean() > 0.9 and b[2, :, :32].mean() > 0.9  # blue moved to the left
    assert (a.flip(-1) == b).all()


# ---------------------------------------------------------------- small buckets


def mixed(n_square: int = 10, n_wide: int = 3) -> list[Sample]:
    return [sample(128, 128, f"sq_{i}.png") for i in range(n_square)] + [
        sample(256, 128, f"wide_{i}.png") for i in range(n_wide)
    ]


def test_small_bucket_drop():
    plan = plan_buckets(mixed(), data_cfg(small_bucket_policy="drop"), 32, 0, group_size=4)
    assert [s.image.name for s in plan.samples] == [f"sq_{i}.png" for i in range(10)]
    assert [f.name for f, _ in plan.dropped] == ["wide_0.png", "wide_1.png", "wide_2.png"]
    reason = plan.dropped[0][1]
    assert "3 sample(s)" in reason and "effective batch of 4" in reason and "drop" in reason


def test_small_bucket_repeat_fills_one_effective_batch():
    plan = plan_buckets(mixed(), data_cfg(small_bucket_policy="repeat"), 32, 0, group_size=4)
    assert len(plan.samples) == 13 and not plan.dropped
    (wide,) = [k for k in plan.groups() if k[0] > k[1]]
    assert plan.repeats == {wide: 2}
    for epoch in range(3):
        seen = [i for b in epoch_batches(plan, 2, seed=0, epoch=epoch) for i in b]
        for i, s in enumerate(plan.samples):
            assert seen.count(i) == (2 if s.image.name.startswith("wide") else 1)


def test_small_bucket_merge_moves_to_the_nearest_big_bucket_and_recrops():
    samples = mixed() + [sample(128, 256, f"tall_{i}.png") for i in range(5)]
    cfg = data_cfg(small_bucket_policy="merge", max_upscale=4.0)
    plan = plan_buckets(samples, cfg, 32, 0, group_size=4)
    assert not plan.dropped and len(plan.samples) == 18
    by_name = {s.image.name: p for s, p in zip(plan.samples, plan.placements, strict=True)}
    square = by_name["sq_0.png"].bucket
    tall = by_name["tall_0.png"].bucket
    assert tall[1] > tall[0]  # five tall images are enough to stay
    for i in range(3):
        p = by_name[f"wide_{i}.png"]
        # The square bucket is nearer in aspect ratio to the wide one than the tall bucket.
        assert p.bucket == square
        rw, rh = p.resized
        assert rh == square[1] and rw == 2 * square[0]  # covers the new bucket, aspect kept
        assert p.crop == (0, (rw - square[0]) // 2)
    # With no bucket big enough to take them, merged images are dropped, with why.
    lonely = plan_buckets(mixed(2, 2), cfg, 32, 0, group_size=4)
    assert len(lonely.dropped) == 4 and "no bucket has enough" in lonely.dropped[0][1]


# ---------------------------------------------------------------- the report vs. the trainer


def loader_batches(plan, batch_size: int, seed: int, epoch: int, rank: int, world: int) -> list:
    """(index, batch) of each batch one process trains in an epoch, walked as kit.train.loop does."""
    batches = epoch_batches(plan, batch_size, seed, epoch, world)
    out, position = [], 0
    while position < len(batches):
        out.append((position + rank, batches[position + rank]))
        position += world
    return out


def example_cfg(dataset: Path, **kw):
    fields = {
        "image_dir": str(dataset),
        "resolution": 64,
        "bucket_step": 16,  # buckets of 14, 5 and 5 example images
        "train_batch_size": 2,
        "max_train_steps": 50,
        **kw,
    }
    return from_dict(fields)


@pytest.mark.parametrize("policy", ["keep", "drop", "repeat", "merge"])
@pytest.mark.parametrize(("world", "accum"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_report_counts_what_the_trainer_loads(dataset, policy, world, accum):
    from kit.data.buckets import plan_dataset

    cfg = example_cfg(dataset, small_bucket_policy=policy, gradient_accumulation_steps=accum)
    report = bucket_report(cfg, num_processes=world)
    _, plan = plan_dataset(cfg, world)
    for epoch in range(3):
        per_rank = [loader_batches(plan, 2, cfg.train.seed, epoch, r, world) for r in range(world)]
        assert all(len(b) == report["batches_per_epoch"] for b in per_rank)
        # The processes never share a batch.
        flat = [i for batches in per_rank for i, _ in batches]
        assert len(flat) == len(set(flat)) == report["batches_all_processes"]
    assert report["steps_per_epoch"] == pytest.approx(report["batches_per_epoch"] / accum)
    assert report["effective_batch"] == 2 * accum * world
    small = report["effective_batch"] > 5  # the 5-image buckets fall short of one batch
    kept = sum(b["count"] for b in report["buckets"])
    assert kept + len(report["dropped"]) == 24
    if policy == "drop":
        assert len(report["dropped"]) == (10 if small else 0)
    else:
        assert not report["dropped"]
    if policy == "repeat" and small:
        assert {b["repeats"] for b in report["buckets"] if b["count"] == 5} == {2}
    if policy == "keep":  # short batches: nothing repeats, moves or goes
        assert {b["repeats"] for b in report["buckets"]} == {1}
        assert [b["count"] for b in report["buckets"]] == [5, 14, 5]
    if policy == "merge" and small:
        assert [b["count"] for b in report["buckets"]] == [24]
    # Enough epochs for max_train_steps, and no more.
    per_epoch = report["batches_per_epoch"]
    assert (report["epochs"] - 1) * per_epoch < 50 * accum <= report["epochs"] * per_epoch


def test_aspect_histogram_counts_every_image():
    hist = aspect_histogram([0.5, 0.5, 1.0, 1.0, 1.0, 2.0])
    assert sum(b["count"] for b in hist) == 6
    assert hist[0]["count"] == 2 and hist[-1]["count"] == 1
    assert hist[0]["from"] == 0.5 and hist[-1]["to"] == 2.0
    assert aspect_histogram([1.0, 1.0]) == [{"from": 1.0, "to": 1.0, "count": 2}]


def test_cli_buckets_json_and_table(dataset, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "image_dir": str(dataset),
                "resolution": 64,
                "bucket_step": 16,
                "train_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "small_bucket_policy": "drop",
            }
        )
    )
    assert kit_main(["buckets", str(path), "--json", "--processes", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == json.loads(json.dumps(bucket_report(load_config(path), 2)))
    assert shown["processes"] == 2 and len(shown["dropped"]) == 10
    assert kit_main(["buckets", str(path)]) == 0
    out = capsys.readouterr().out
    assert "64x64" in out and "dropped" in out and "optimizer step(s) per epoch" in out


@pytest.mark.slow
def test_a_real_run_logs_the_reported_steps_per_epoch(make_config, dataset):
    from kit.train.loop import train

    cfg = load_config(
        make_config(bucket_step=16, max_train_steps=15, checkpointing_steps=0, logging_steps=1)
    )
    report = bucket_report(cfg)
    assert report["steps_per_epoch"] == 13  # 7 + 3 + 3 batches of 2
    train(cfg)
    rows = [
        json.loads(line)
        for line in (Path(cfg.train.output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    epochs = [r["epoch"] for r in rows if "loss" in r]
    assert epochs.count(0) == report["steps_per_epoch"]
    assert epochs.count(1) == 15 - 13
