"""The committed toy base draws what it is told, and a short fine-tune teaches it a new color."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.toy import world as toyworld
from kit.toy.judge import score

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "models" / "toy-sd15"
DEMO = ROOT / "datasets_example" / "config.json"
# Reduced targets for CI: 16 seeds rather than the 64 of the full check (see models/toy-sd15),
# where the committed base scores color 1.00 and shape 0.92 against targets of 0.90 and 0.80.
COLOR_MIN, SHAPE_MIN = 0.85, 0.7
# The demo fine-tune as it is, without validation grids while it trains; the report is reduced.
REDUCED = {"validation_steps": 0}


def test_learning_groups_and_caption_grammar():
    from kit.toy.learning import concept_of, parse_caption, prompt_groups

    scene = toyworld.Scene("zorbic", "square", "small", "gray", "center")
    assert parse_caption(toyworld.caption(scene)) == {
        "size": "small",
        "color": "zorbic",
        "shape": "square",
        "background": "gray",
        "position": "center",
    }
    assert parse_caption("a photo of a dog") is None
    train = [toyworld.caption(s) for s in toyworld.sample_scenes(6, 0, colors=("zorbic",))]
    keep = [toyworld.caption(s) for s in toyworld.sample_scenes(4, 1)]  # what must not change
    groups = prompt_groups(keep + train, per_group=3)
    assert groups["memorization"] == train[:3]
    assert all(" zorbic " in p and p not in train for p in groups["generalization"])
    assert not any("zorbic" in p for p in groups["unrelated"])
    assert concept_of(train, "zorbic") == ("color", "zorbic")


@pytest.mark.parametrize("concept", ["color", "shape"])
def test_any_trigger_word_stands_for_the_concept_in_its_slot(concept):
    from kit.toy.learning import concept_of, prompt_groups

    if concept == "color":
        scenes = toyworld.sample_scenes(6, 0, colors=("zorbic",))
        train = [toyworld.caption(s).replace("zorbic", "<zorb>") for s in scenes]
        expected = ("color", "zorbic")
    else:
        scenes = toyworld.sample_scenes(6, 0, shapes=toyworld.CONCEPT_SHAPES)
        train = [toyworld.caption(s).replace("zorbstar", "<star>") for s in scenes]
        expected = ("shape", "zorbstar")
    trigger = "<zorb>" if concept == "color" else "<star>"
    assert concept_of(train, trigger) == expected
    fresh = prompt_groups(train, trigger, per_group=4)["generalization"]
    assert len(fresh) == 4 and all(trigger in p and expected[1] not in p for p in fresh)


def _base_pipe():
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        BASE, safety_checker=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_committed_base_loads_and_is_small():
    import torch

    size = sum(f.stat().st_size for f in BASE.rglob("*") if f.is_file())
    assert size < 20 * 2**20
    assert not list(BASE.rglob("*.bin")), "safetensors only"
    image = _base_pipe()(
        "a small red circle on a white background, on the left",
        num_inference_steps=2,
        width=64,
        height=64,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)


@pytest.mark.slow
def test_committed_base_draws_what_it_is_told():
    import torch

    pipe = _base_pipe()
    scenes = toyworld.sample_scenes(16, seed=123)
    images = [
        pipe(
            toyworld.caption(s),
            num_inference_steps=20,
            guidance_scale=5.0,
            width=64,
            height=64,
            generator=torch.Generator().manual_seed(i),
        ).images[0]
        for i, s in enumerate(scenes)
    ]
    result = score(images, scenes)
    assert result["color"] >= COLOR_MIN and result["shape"] >= SHAPE_MIN, result


@pytest.mark.slow
def test_demo_fine_tune_teaches_the_concept(tmp_path):
    from kit.config import load_config
    from kit.toy.learning import learning_report
    from kit.train.loop import train

    cfg = load_config(DEMO, {"output_dir": str(tmp_path / "run"), **REDUCED})
    train(cfg)
    report = learning_report(tmp_path / "run", seeds=8, per_group=4, drift_seeds=8)
    s = report["summary"]
    assert json.loads((tmp_path / "run" / "learning_report.json").read_text()) == report
    assert report["concept"] == {"color": "zorbic"}
    # The full demo measures 0.00 -> 1.00 and no drop; here 4 prompts x 2 seeds per group.
    assert s["concept_rate_before"] <= 0.25 and s["concept_rate_after"] >= 0.75, s
    assert s["concept_rate_after"] >= s["concept_rate_before"] + 0.5, s
    assert s["unrelated_drop_points"] <= 12.5, s
    memorized = report["groups"]["memorization"]["after"]
    assert memorized["concept_rate"] >= 0.75, memorized
    # The drift measures agree with the independent check: plain diffusers, the exported file
    # loaded by `load_lora_weights`, on the same prompts and seeds.
    import sys

    from kit.export.writer import export

    lora = export(tmp_path / "run", "diffusers", verify=False).path
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import score_toy
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    check = score_toy.score_lora(str(BASE), str(lora), "zorbic", 8)
    drift = report["drift"]
    for key, value in check["drift"].items():
        assert drift[key] == pytest.approx(value, abs=1.0), (key, drift, check["drift"])
    assert drift["concept_rate_after"] == check["trigger_after"]["concept_rate"]
    assert drift["unrelated_color_after"] == check["unrelated_after"]["color"]
    # The base's own VAE brings the data's pink back about 20 units off at 64 px: the learned
    # color's distance is read against that floor.
    assert drift["concept_color_floor"] <= 40, drift
    # Output preservation (the demo's setting) holds the unrelated prompts' colors near the
    # base's own images: on the full check 9.2 RGB units against 24.2 without it, where the
    # base draws its colors 10.4 off their names. Here, on 8 prompts, under 2.5 times that.
    assert drift["color_drift"] < 2.5 * drift["color_error_before"], drift
    # The learned pink: 34.1 units from the data's on the full check; here under 60.
    assert drift["concept_color_distance"] < 60, drift


def test_saved_report_prints_as_a_table(tmp_path, capsys):
    from kit.cli import main
    from kit.toy.learning import GROUPS, summary

    def scores(concept, color):
        return {"n": 8, "concept_rate": concept, "color": color, "shape": 0.75, "position": 1.0}

    report = {"seeds": 8, "groups": {}}
    for g in GROUPS:
        after = scores(1.0 if g != "unrelated" else 0.0, 0.5)
        report["groups"][g] = {"before": scores(0.0, 0.75), "after": after}
    report["summary"] = summary(report)
    report["skipped"] = {"memorization": "no toy-world caption with '<zorb>'"}
    (tmp_path / "learning_report.json").write_text(json.dumps(report))
    assert main(["learning", str(tmp_path), "--show"]) == 0
    out = capsys.readouterr().out
    assert "generalization" in out and "0% before, 100% after" in out
    assert "(12.5 points lower)" in out
    assert "memorization: not drawn (no toy-world caption with '<zorb>')" in out
    assert main(["learning", str(tmp_path / "elsewhere"), "--show"]) == 2
    assert "elsewhere/learning_report.json not found" in capsys.readouterr().err
