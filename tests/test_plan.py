"""The planner: settings from the dataset and the task, each with a reason that cites numbers;
its config file loads unchanged, trains, and the doctor finds nothing serious in the run."""

from __future__ import annotations

import json

import pytest

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.preflight.plan import guess_trigger, plan
from kit.report import doctor
from kit.train.loop import train


def _reason(p, key):
    return next(x.reason for x in p.proposals if key in x.fields)


def test_plan_writes_a_config_that_trains_healthy(tmp_path, tiny_sd15, dataset):
    """`kit plan` on the example dataset → a file load_config takes unchanged → a healthy run."""
    out = tmp_path / "planned.json"
    args = [
        "plan",
        str(dataset),
        "--task",
        "character",
        "--pretrained-model",
        str(tiny_sd15),
        "--output-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    cfg = load_config(out)
    p = plan(
        dataset, "character", pretrained_model=str(tiny_sd15), output_dir=str(tmp_path / "run")
    )
    assert cfg.to_dict() == p.config.to_dict()
    assert json.loads(out.read_text())["_plan"] == p.reasons()
    assert cfg.data.trigger_words == ["zorbic"]
    assert cfg.train.gradient_accumulation_steps * cfg.train.train_batch_size == 8
    # A CPU test trains shorter and smaller; every other value is the plan's.
    fast = cfg.replace(
        max_train_steps=3,
        resolution=64,
        learning_rate=1e-2,
        stable_loss_steps=1,
        gradient_accumulation_steps=1,
        checkpointing_steps=2,
        validation_seeds=[0],
        validation_num_inference_steps=1,
        validation_prompt=cfg.validation.validation_prompt[:1],
        cache_dir=str(tmp_path / "c"),
    )
    assert train(fast).step == 3
    findings = doctor.diagnose(tmp_path / "run")
    assert not doctor.serious(findings), doctor.format_findings(findings)


def test_reasons_cite_the_numbers(dataset):
    p = plan(dataset, "style", pretrained_model="/nowhere")
    steps = _reason(p, "max_train_steps")
    assert steps.startswith(
        "24 images in 1 bucket(s) → 12 batches of ≤2 per epoch / accumulation 4"
    )
    assert "× 50 epochs" in steps and "raised to 500" in steps
    assert p.config.train.max_train_steps == 500
    assert "median image is 128 px" in _reason(p, "resolution")
    assert "×√(8/8)" in _reason(p, "learning_rate")
    assert "25 warm-up steps (5%)" in _reason(p, "lr_warmup_steps")
    assert "every 62 steps" in _reason(p, "validation_steps")
    assert p.config.network.lora_rank == 32 and "style: rank 32" in _reason(p, "lora_rank")
    assert "no GPU given" in _reason(p, "train_batch_size")
    groups = p.dataset["prompt_groups"]
    assert len(groups["training"]) == 2 and all(
        g in p.config.validation.validation_prompt for g in groups["training"]
    )
    assert all("zorbic" in g for g in groups["new_contexts"])
    assert not any("zorbic" in g for g in groups["unrelated"])


def test_batch_falls_back_to_accumulation_when_memory_is_short(dataset, tiny_sd15):
    """A budget that holds batch 2 but not 4: batch 2 × accumulation 4, checked by the estimator."""
    p = plan(dataset, "concept", pretrained_model=str(tiny_sd15), budget_gib=0.465)
    t = p.config.train
    assert (t.train_batch_size, t.gradient_accumulation_steps) == (2, 4)
    assert t.mixed_precision == "bf16"
    assert "batch 2 fits a 0.465 GiB budget" in _reason(p, "train_batch_size")


def test_few_images_and_trigger_guess(tmp_path, dataset):
    small = tmp_path / "few"
    small.mkdir()
    for f in sorted(dataset.glob("zorbic_00[0-4].*")):
        (small / f.name).write_bytes(f.read_bytes())
    p = plan(small, "character", pretrained_model="/nowhere", trigger="zorbic")
    assert p.config.network.lora_rank == 8 and "halved as 5 images" in _reason(p, "lora_rank")
    assert p.config.train.train_batch_size * p.config.train.gradient_accumulation_steps <= 5
    assert guess_trigger(["a photo of sks dog", "sks dog on grass"]) == ("sks", 2)
    assert guess_trigger(["a red ball", "a blue cube", "a green cone"]) is None
    with pytest.raises(KitError, match="unknown task"):
        plan(small, "portrait")


def test_cli_plan_prints_json(dataset, capsys):
    assert main(["plan", str(dataset), "--task", "concept", "--pretrained-model", "/nowhere"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["lr_scheduler"] == "cosine" and printed["_plan"]


def test_training_prompts_carry_the_trigger_when_some_captions_do():
    from kit.preflight.plan import _prompts

    captions = ["a red circle on white", "a zorbic square", "a large zorbic circle on black"]
    assert _prompts(captions, "zorbic", "character")["training"] == captions[1:]
    assert _prompts(captions[:1], "zorbic", "character")["training"] == captions[:1]


@pytest.mark.slow
def test_a_base_too_large_for_the_card_is_planned_quantized_or_swapped(dataset, tmp_path):
    """Flux.1 dev on a 24 GB card: no batch fits in bf16, so the plan takes the advice's
    cheapest storage settings, and its config loads and fits by the estimate."""
    from kit.preflight.estimate import GPUS, estimate

    card = "RTX 4090 24GB"
    p = plan(
        dataset,
        "character",
        family="flux",
        pretrained_model="black-forest-labs/FLUX.1-dev",
        gpu=card,
        output_dir=str(tmp_path / "run"),
    )
    t = p.config.train
    assert t.train_batch_size == 1 and t.gradient_accumulation_steps == 8
    storage = {
        "base_quantization": p.config.model.base_quantization,
        "blocks_to_swap": t.blocks_to_swap,
    }
    assert storage != {"base_quantization": "none", "blocks_to_swap": 0}
    reason = _reason(p, "train_batch_size")
    assert f"more than {card}'s" in reason and "fits (" in reason, reason
    path = p.save(tmp_path / "planned.json")
    assert estimate(load_config(path)).fits(GPUS[card])


def test_a_config_with_datasets_is_planned_with_repeats(tmp_path, dataset):
    """With `datasets`, the plan counts the taught images with their repeats, takes the trigger
    from their captions only, keeps the datasets, and refuses a folder argument beside them."""
    from kit.config import from_dict

    chars, reg = tmp_path / "chars", tmp_path / "reg"
    chars.mkdir()
    reg.mkdir()
    for f in sorted(dataset.glob("zorbic_00[0-5].*")):
        (chars / f.name).write_bytes(f.read_bytes())
    for i, f in enumerate(sorted(dataset.glob("*.png"))[6:16]):
        (reg / f"reg_{i}.png").write_bytes(f.read_bytes())
        (reg / f"reg_{i}.txt").write_text("a plain shape\n")
    base = from_dict(
        {
            "datasets": [
                {"image_dir": str(chars), "repeats": 4},
                {"image_dir": str(reg), "role": "prior", "loss_weight": 0.5},
            ],
            "pretrained_model": "/nowhere",
        }
    )
    p = plan("", "character", base=base)
    assert _reason(p, "max_train_steps").startswith("24 samples per epoch (with repeats)")
    assert p.dataset["datasets"] == {"chars": 6, "reg": 10}
    assert p.config.data.trigger_words == ["zorbic"]
    assert [d.repeats for d in p.config.data.datasets] == [4, 1]
    with pytest.raises(KitError, match="lists `datasets`"):
        plan(dataset, "character", base=base)


def test_a_step_distilled_base_is_planned_with_the_way_out(dataset, tiny_base):
    """Z-Image Turbo (the tiny one is Turbo: its scheduler's shift) is said to be distilled,
    with the training adapter and the non-distilled base as the ways out; the base is not."""
    p = plan(dataset, "character", family="zimage", pretrained_model=str(tiny_base("zimage")))
    why = _reason(p, "training_adapter")
    assert "step-distilled" in why and "training_adapter" in why and "non-distilled" in why
    assert p.config.model.training_adapter == ""
    sd = plan(dataset, "character", pretrained_model=str(tiny_base("sd15")))
    assert not any("training_adapter" in r["setting"] for r in sd.rows())
