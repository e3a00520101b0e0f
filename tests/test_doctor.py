"""The doctor: each finding shown by a run built to show it, with its evidence.

Real runs on the tiny model for what only training shows (a forced NaN, a resume with the
optimizer and scheduler state wiped); synthetic run folders for the rest, which is what the
doctor reads anyway (logs, manifest, validation images and sidecars).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from kit.cli import main
from kit.config import Config, load_config
from kit.errors import KitError
from kit.report import doctor
from kit.train.loop import train


def make_run(root, rows=(), manifest=None, **config):
    """A run folder as training writes it: config, metrics, data manifest."""
    fields = {"pretrained_model": str(root / "no-model"), "output_dir": str(root), **config}
    (root / "logs").mkdir(parents=True, exist_ok=True)
    Config().replace(**fields).save(root / "config.json")
    (root / "logs/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if manifest is None:
        manifest = [
            {
                "image": f"img_{i}.png",
                "sha256": f"h{i}",
                "caption": f"a zorbstar, pose {i}",
                "bucket": [64, 64],
            }
            for i in range(8)
        ]
    (root / "dataset_manifest.json").write_text(json.dumps(manifest))
    return root


def steady_rows(n, **extra):
    return [
        {
            "step": s,
            "loss": 0.1 + 0.01 * (s % 3),
            "lr": 1e-4,
            "grad_norm": 0.1,
            "time": float(s),
            **{k: f(s) for k, f in extra.items()},
        }
        for s in range(1, n + 1)
    ]


def codes(findings):
    return [f.code for f in findings]


def draw_grid(root, step, images, scale=None):
    """Write validation images with sidecars: `images` maps (prompt, seed) to an array."""
    folder = (
        root / "validation" / (f"step-{step:06d}" if scale is None else f"step-{step:06d}-scales")
    )
    folder.mkdir(parents=True, exist_ok=True)
    for i, ((prompt, seed), arr) in enumerate(images.items()):
        stem = f"{i:02d}_seed{seed}"
        Image.fromarray(np.clip(arr * 255, 0, 255).astype(np.uint8)).save(folder / f"{stem}.png")
        meta = {"prompt": prompt, "seed": seed, "adapter_scale": 1.0 if scale is None else scale}
        (folder / f"{stem}.json").write_text(json.dumps(meta))


def picture(seed, grey=0.0):
    """A colourful random picture; `grey` mixes it toward flat grey."""
    rng = np.random.default_rng(seed)
    arr = np.kron(rng.random((8, 8, 3)), np.ones((8, 8, 1))).astype(np.float32)
    return (1 - grey) * arr + grey * 0.5


PROMPTS = ["a zorbstar on a beach", "a zorbstar in space", "a house at night"]


# ---------------------------------------------------------------- real runs


@pytest.mark.slow
def test_forced_nan_is_named_first_with_precision(tmp_path, make_config, monkeypatch):
    """A loss that turns NaN at step 3 stops training; the doctor names it, with the state."""
    import kit.train.step

    real, calls = kit.train.step.denoising_loss, {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(kit.train.step, "denoising_loss", poisoned)
    cfg = load_config(make_config(max_train_steps=6, train_batch_size=2))
    with pytest.raises(KitError) as err:
        train(cfg)
    # What the end of train() does (see the report): the error goes into doctor.json.
    report = doctor.write_report(cfg.train.output_dir, error=err.value)
    assert report is not None and report.name == "doctor.json"
    findings = doctor.diagnose(cfg.train.output_dir)  # reads the stored error back
    first = findings[0]
    assert first.code == "nonfinite_loss" and first.severity == "error"
    assert any("loss became nan at step 3" in e for e in first.evidence)
    assert any("mixed_precision=no" in e for e in first.evidence)
    assert any("step-000002" in e for e in first.evidence)  # the last good checkpoint
    stopped = next(f for f in findings if f.code == "run_stopped")
    assert "step 2 of 6" in stopped.title
    saved = json.loads(report.read_text())
    assert saved["counts"]["error"] >= 1 and "nan" in saved["error"]


@pytest.mark.slow
def test_resume_with_wiped_optimizer_and_scheduler(tmp_path, make_config):
    """Resuming from a checkpoint whose optimizer moments and schedule were lost is an error."""
    cfg = load_config(
        make_config(
            max_train_steps=2,
            lr_scheduler="constant_with_warmup",
            lr_warmup_steps=3,
            validation_num_inference_steps=1,
        )
    )
    train(cfg)
    assert not doctor.serious(doctor.diagnose(cfg.train.output_dir))
    cfg = cfg.replace(max_train_steps=4)
    ck = tmp_path / "run/checkpoints/step-000002"
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    torch.save({"state": {}, "param_groups": opt["param_groups"]}, ck / "optimizer.pt")
    sch = torch.load(ck / "scheduler.pt", weights_only=True)
    torch.save({**sch, "last_epoch": 0, "_step_count": 1}, ck / "scheduler.pt")
    train(cfg, resume=str(ck))
    findings = doctor.diagnose(cfg.train.output_dir)
    first = findings[0]
    assert first.code == "resume_jump" and first.severity == "error", doctor.format_findings(
        findings
    )
    text = " ".join(first.evidence)
    assert "step-000002" in text and "no optimizer moments" in text
    assert "learning rate 0.000333 at step 3; the schedule gives 0.001 there" in text


# ---------------------------------------------------------------- synthetic runs: logs


def test_fp16_overflows_show_the_scaler(tmp_path):
    rows = steady_rows(40, loss_scale=lambda s: 65536.0 / 2 ** min(s, 16))
    for r in rows[10:]:
        r["grad_norm"] = math.inf
    run = make_run(tmp_path, rows, mixed_precision="fp16", max_train_steps=40)
    f = doctor.diagnose(run)[0]
    assert f.code == "nonfinite_loss" and f.severity == "warning"
    assert any("gradient scaler 32768 at step 1 → 1 at step 40" in e for e in f.evidence)
    assert any("30 step(s) overflowed" in e for e in f.evidence)


def test_flat_loss_with_the_data_check(tmp_path):
    """A learning rate far too low: the stable loss does not move; the data check is shown."""
    rows = steady_rows(30, stable_loss=lambda s: 0.25)
    for r in rows:
        r["lr"] = 1e-9
    manifest = [{"image": "x.png", "sha256": "same", "caption": "", "bucket": [64, 64]}] * 6
    run = make_run(tmp_path, rows, manifest=manifest, max_train_steps=30)
    f = doctor.diagnose(run)[0]
    assert f.code == "loss_not_falling" and f.severity == "warning"
    text = " | ".join(f.evidence)
    assert "stable loss 0.25 at step 1 → 0.25 at step 30 (+0.000%)" in text
    assert "learning rate peaked at 1e-09" in text
    assert "PROBLEM: 6 of 6 captions are empty" in text
    assert "only 1 distinct image file" in text


def test_rising_loss(tmp_path):
    run = make_run(
        tmp_path, steady_rows(30, stable_loss=lambda s: 0.1 * (1 + s / 10)), max_train_steps=30
    )
    assert doctor.diagnose(run)[0].code == "loss_rising"


def test_loss_jump_after_resume(tmp_path):
    """The logged time starting again marks a resume; the loss right after it jumps."""
    rows = steady_rows(20)
    for r in rows[10:]:
        r["time"] -= 10.5
        r["loss"] += 0.5
    run = make_run(tmp_path, rows, max_train_steps=20)
    f = doctor.diagnose(run)[0]
    assert f.code == "resume_jump" and "step 10" in f.title
    assert any(e.startswith("loss 0.11") and "steps before" in e for e in f.evidence)


def test_memory_rising(tmp_path):
    run = make_run(
        tmp_path, steady_rows(50, memory_gib=lambda s: 10 + 0.05 * s), max_train_steps=50
    )
    f = doctor.diagnose(run)[0]
    assert f.code == "memory_rising"
    assert "memory_gib 10.3 at step 6 → 12.5 at step 50" in f.evidence[0]


def test_memorization(tmp_path):
    held = {10: 0.30, 20: 0.25, 30: 0.27, 40: 0.32}
    rows = [
        {
            "step": s,
            "loss": 0.2,
            "lr": 1e-4,
            "time": s,
            "stable_loss": 0.3 - s / 400,
            "validation_loss": v,
        }
        for s, v in held.items()
    ]
    run = make_run(tmp_path, rows, max_train_steps=40)
    f = doctor.diagnose(run)[0]
    assert f.code == "memorization" and "since step 20" in f.title
    assert "lowest 0.25 at step 20 → 0.32 at step 40" in f.evidence[1]


# ---------------------------------------------------------------- synthetic runs: data


def test_small_bucket(tmp_path):
    manifest = [
        {"image": f"{i}.png", "sha256": str(i), "caption": f"zorbstar {i}", "bucket": [64, 64]}
        for i in range(16)
    ]
    manifest.append(
        {"image": "wide.png", "sha256": "w", "caption": "zorbstar wide", "bucket": [128, 32]}
    )
    run = make_run(
        tmp_path, steady_rows(30), manifest=manifest, train_batch_size=8, max_train_steps=30
    )
    f = doctor.diagnose(run)[0]
    assert f.code == "small_buckets" and f.severity == "warning"
    assert "bucket 128x32 holds 1 image(s) with train_batch_size 8" in f.evidence[0]
    assert "8.0× an image in a full batch" in f.evidence[0]
    assert "about 10 epochs" in f.evidence[0]
    # Under `repeat` the lone image fills an effective batch of 8 by itself: shown 8 times.
    make_run(
        tmp_path,
        steady_rows(30),
        manifest=manifest,
        train_batch_size=2,
        gradient_accumulation_steps=4,
        small_bucket_policy="repeat",
        max_train_steps=30,
    )
    f = doctor.diagnose(run)[0]
    assert f.code == "small_buckets" and f.severity == "warning"
    assert "fewer than an effective batch of 8" in f.evidence[0]
    assert "shows each 8× per epoch" in f.evidence[0] and "policy keep" in f.fix


def test_identical_captions_and_missing_trigger(tmp_path):
    manifest = [
        {"image": f"{i}.png", "sha256": str(i), "caption": "a photo of a cat", "bucket": [64, 64]}
        for i in range(8)
    ]
    manifest += [
        {"image": f"z{i}.png", "sha256": f"z{i}", "caption": f"zorbstar {i}", "bucket": [64, 64]}
        for i in range(2)
    ]
    run = make_run(
        tmp_path, steady_rows(5), manifest=manifest, trigger_words=["zorbstar"], max_train_steps=5
    )
    found = {f.code: f for f in doctor.diagnose(run)}
    assert "8 of 10 captions are identical" in found["captions_identical"].title
    assert "'a photo of a cat' appears 8 times" in found["captions_identical"].evidence[0]
    missing = found["trigger_missing"]
    assert missing.severity == "warning" and "missing from 8 of 10" in missing.title
    assert "0.png" in missing.evidence[0]


def test_prior_images_need_no_trigger(tmp_path):
    manifest = [
        {
            "image": f"/data/z{i}.png",
            "sha256": f"z{i}",
            "caption": f"zorbic {i}",
            "bucket": [64, 64],
        }
        for i in range(4)
    ]
    manifest += [
        {"image": f"/data/reg/{i}.png", "sha256": str(i), "caption": f"red {i}", "bucket": [64, 64]}
        for i in range(4)
    ]
    common = {"manifest": manifest, "trigger_words": ["zorbic"], "max_train_steps": 5}
    run = make_run(tmp_path / "a", steady_rows(5), **common)
    assert "missing from 4 of 8" in next(
        f.title for f in doctor.diagnose(run) if f.code == "trigger_missing"
    )
    run = make_run(
        tmp_path / "b", steady_rows(5), image_dir="/data", prior_images=["reg/*"], **common
    )
    assert not [f for f in doctor.diagnose(run) if f.code == "trigger_missing"]


def test_truncated_captions(tmp_path, tiny_sd15):
    long = "a zorbstar " + " ".join(f"word{i}" for i in range(120))
    manifest = [
        {"image": "long.png", "sha256": "l", "caption": long, "bucket": [64, 64]},
        {"image": "ok.png", "sha256": "o", "caption": "a zorbstar", "bucket": [64, 64]},
    ]
    run = make_run(
        tmp_path,
        steady_rows(5),
        manifest=manifest,
        pretrained_model=str(tiny_sd15),
        max_train_steps=5,
    )
    f = doctor.diagnose(run)[0]
    assert f.code == "captions_truncated"
    assert "1 of 2 captions exceed 77 tokens" in f.evidence[0]
    assert "long.png" in f.evidence[1]


# ---------------------------------------------------------------- synthetic runs: images


def _grids(root, per_step):
    for step, imgs in per_step.items():
        draw_grid(root, step, imgs)


def test_images_stop_changing(tmp_path):
    run = make_run(tmp_path, steady_rows(40), max_train_steps=40)
    early = {(p, 0): picture(i) for i, p in enumerate(PROMPTS)}
    late = {(p, 0): picture(i + 10) for i, p in enumerate(PROMPTS)}
    _grids(run, {10: early, 20: late, 30: late, 40: late})
    f = doctor.diagnose(run)[0]
    assert f.code == "validation_stalled" and "after step 20" in f.title
    assert f.severity == "warning" and "20→30: 0.0000" in f.evidence[0]


def test_nothing_learned(tmp_path):
    run = make_run(tmp_path, steady_rows(30), max_train_steps=30)
    same = {(p, 0): picture(i) for i, p in enumerate(PROMPTS)}
    _grids(run, {10: same, 20: same, 30: same})
    f = doctor.diagnose(run)[0]
    assert f.code == "nothing_learned" and "0.00000 from step 10 to step 30" in f.evidence[0]


def test_collapse_to_one_image(tmp_path):
    run = make_run(tmp_path, steady_rows(20), max_train_steps=20)
    _grids(
        run,
        {
            10: {(p, 0): picture(i) for i, p in enumerate(PROMPTS)},
            20: {(p, 0): picture(99) for p in PROMPTS},
        },
    )
    assert "collapse" in codes(doctor.serious(doctor.diagnose(run)))


def test_washed_out_and_grey(tmp_path):
    run = make_run(tmp_path, steady_rows(20), max_train_steps=20)
    _grids(
        run,
        {
            10: {(p, 0): picture(i) for i, p in enumerate(PROMPTS)},
            20: {(p, 0): picture(i, grey=0.6) for i, p in enumerate(PROMPTS)},
        },
    )
    f = doctor.diagnose(run)[0]
    assert f.code == "washed_out"
    assert any(
        e.startswith("contrast") and "first validation grid (step 10)" in e for e in f.evidence
    )
    draw_grid(run, 30, {(p, 0): picture(i, grey=0.99) for i, p in enumerate(PROMPTS)})
    assert doctor.diagnose(run)[0].code == "grey_images"


def test_prior_drift_against_the_base(tmp_path):
    """The unrelated prompt moves from the base model's image as much as the trigger prompts."""
    run = make_run(tmp_path, steady_rows(20), trigger_words=["zorbstar"], max_train_steps=20)
    base = {(p, 0): picture(i) for i, p in enumerate(PROMPTS)}
    draw_grid(run, 20, base, scale=0.0)  # as draw_checkpoint writes the base at scale 0
    _grids(run, {10: base, 20: {(p, 0): picture(i + 20) for i, p in enumerate(PROMPTS)}})
    f = next(f for f in doctor.diagnose(run) if f.code == "prior_drift")
    assert "base model (adapter scale 0)" in f.evidence[0]
    assert "'a house at night'" in f.evidence[1]


# ---------------------------------------------------------------- robustness and the CLI


def test_half_written_runs_never_raise(tmp_path):
    assert doctor.diagnose(tmp_path / "nothing")[0].code == "not_a_run"
    run = make_run(tmp_path / "r", steady_rows(3), max_train_steps=10)
    (run / "logs/metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n{"step": 2, "lo')
    (run / "dataset_manifest.json").write_text("[{")
    (run / "checkpoints/step-000002").mkdir(parents=True)  # no COMPLETE marker
    (run / "validation/step-000002").mkdir(parents=True)
    (run / "validation/step-000002/00_seed0.png").write_bytes(b"not a png")
    (run / "config.json").write_text('{"lora_rank": "many"')
    findings = doctor.diagnose(run)
    assert "run_stopped" in codes(findings)
    assert doctor.write_report(run) == run / "doctor.json"


def test_cli_doctor(tmp_path, capsys):
    run = make_run(tmp_path, steady_rows(30, stable_loss=lambda s: 0.25), max_train_steps=30)
    assert main(["doctor", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["code"] == "loss_not_falling" and out[0]["fix"]
    assert main(["doctor", str(run), "--fail-on", "warning"]) == 1
    assert "[warning] the loss is not falling" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "missing")]) == 2


def test_images_of_one_prompt_and_seed_drawn_differently_stay_apart(tmp_path):
    """Two `validation_prompts` entries with the same prompt and seed but another guidance are
    two images to the doctor, not one overwriting the other."""
    import json

    from PIL import Image

    from kit.report.doctor.run import read_images

    for i, cfg in enumerate((3.0, 9.0)):
        Image.new("RGB", (8, 8), (i * 200, 0, 0)).save(tmp_path / f"0{i}_seed0.png")
        meta = {"prompt": "a cat", "seed": 0, "guidance_scale": cfg, "negative_prompt": ""}
        (tmp_path / f"0{i}_seed0.json").write_text(json.dumps(meta))
    images = read_images(tmp_path)
    assert len(images) == 2
    assert {k[:2] for k in images} == {("a cat", 0)}
