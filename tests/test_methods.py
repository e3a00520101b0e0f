"""Training methods and objectives on the tiny SD1.5 model: each adapter kind, the layer
filters, min-SNR, offset noise, caption dropout, EMA, optimizers, schedules and the NaN guard."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kit.config import from_dict, load_config
from kit.errors import ConfigError, KitError
from kit.export.writer import export
from kit.families import get_family
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.train.loop import train
from tests.conftest import TEXTUAL_INVERSION, write_run_config


def _weights(run, step):
    return load_file(str(ckpt.checkpoint_dir(run, step) / ckpt.ADAPTER_FILE))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "formats", "marker"),
    [
        ("dora", ("diffusers", "kohya"), "lora_magnitude_vector"),
        ("loha", ("kohya",), "hada_w1_a"),
        ("lokr", ("kohya",), "lokr_w"),
    ],
)
def test_adapter_kind_trains_resumes_and_exports(tmp_path, make_config, kind, formats, marker):
    common = {"network_type": kind, "lora_alpha": 2, "max_train_steps": 4, "checkpointing_steps": 2}
    train(load_config(make_config("a.json", output_dir=str(tmp_path / "a"), **common)))
    weights = _weights(tmp_path / "a", 4)
    assert any(marker in k for k in weights)

    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    train(load_config(b, {"max_train_steps": 2}))
    train(load_config(b), resume="latest")
    assert all(torch.equal(weights[k], _weights(tmp_path / "b", 4)[k]) for k in weights)

    for fmt in formats:
        result = export(tmp_path / "a", fmt)
        assert result.verification.passed, result.verification
    if "kohya" in formats:
        path = export(tmp_path / "a", "kohya", verify=False).path
        keys = list(load_file(str(path)))
        assert all(k.startswith("lora_unet_") for k in keys)
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["ss_network_alpha"] == "2.0"


@pytest.mark.slow
def test_lycoris_reader_matches_peft_delta(tmp_path, make_config, tiny_sd15):
    """The independent LyCORIS reader computes the same update as the layers that trained."""
    from kit.families import get_family
    from kit.families.adapter_keys import lycoris_keys as to_lycoris
    from kit.methods import get_method
    from tests.lycoris_reference import delta_weights

    for kind in ("loha", "lokr"):
        cfg = load_config(
            make_config(
                f"{kind}.json",
                output_dir=str(tmp_path / kind),
                network_type=kind,
                max_train_steps=2,
                lora_alpha=3,
            )
        )
        train(cfg)
        family = get_family("sd15", cfg)
        comps = family.load(str(tiny_sd15))
        method = get_method(cfg, family)
        method.attach(comps)
        weights = _weights(tmp_path / kind, 2)
        method.load_state_dict(comps, weights)
        fresh = family.load(str(tiny_sd15)).denoiser
        deltas = delta_weights(to_lycoris(weights, 3.0, 4, "lora_unet"), fresh, "lora_unet")
        layers = dict(comps.denoiser.named_modules())
        assert deltas
        for name, delta in deltas.items():
            expected = layers[name].get_delta_weight("default")
            torch.testing.assert_close(delta, expected.float(), rtol=1e-4, atol=1e-6)


def test_layer_filters_preview_matches_what_trains(tmp_path, make_config):
    from kit.cli import main
    from kit.methods import preview

    path = make_config(
        only_if_contains=["attn2"], ignore_if_contains=["up_blocks"], max_train_steps=1
    )
    cfg = load_config(path)
    shown = preview(cfg)
    assert shown.modules and all("attn2" in m and "up_blocks" not in m for m in shown.modules)
    train(cfg)
    trained = {k.rsplit(".lora_", 1)[0] for k in _weights(tmp_path / "run", 1)}
    assert trained == set(shown.modules)
    assert main(["network", str(path), "--json"]) == 0
    with pytest.raises(ConfigError, match="no module"):
        preview(load_config(path, {"ignore_if_contains": ["attn"]}))


def test_min_snr_weights_follow_the_formula(tiny_sd15):
    from diffusers import DDPMScheduler

    from kit.families.noise import ddpm_noise_and_target

    sched = DDPMScheduler.from_pretrained(tiny_sd15, subfolder="scheduler")
    latents = torch.zeros(64, 4, 8, 8)
    draw = ddpm_noise_and_target(
        sched, latents, torch.Generator().manual_seed(0), min_snr_gamma=5.0
    )
    a = sched.alphas_cumprod[draw.timesteps]
    snr = a / (1 - a)
    torch.testing.assert_close(draw.weight, torch.clamp(snr, max=5.0) / snr)
    assert (draw.weight <= 1).all() and (draw.weight < 1).any()
    plain = ddpm_noise_and_target(sched, latents, torch.Generator().manual_seed(0))
    assert plain.weight is None


def test_offset_noise_shifts_channel_means(tiny_sd15):
    from diffusers import DDPMScheduler

    from kit.families.noise import ddpm_noise_and_target

    sched = DDPMScheduler.from_pretrained(tiny_sd15, subfolder="scheduler")
    latents = torch.zeros(256, 4, 16, 16)
    plain = ddpm_noise_and_target(sched, latents, torch.Generator().manual_seed(0))
    offset = ddpm_noise_and_target(
        sched, latents, torch.Generator().manual_seed(0), noise_offset=0.5
    )
    spread = lambda d: d.target.mean(dim=(2, 3)).std()  # noqa: E731
    assert spread(offset) > 3 * spread(plain)


def test_caption_dropout_uses_the_empty_caption():
    from kit.train.objective import drop_captions

    batch = {"latents": torch.zeros(200, 1), "prompt_embeds": torch.ones(200, 3, 2)}
    empty = {"prompt_embeds": torch.full((3, 2), 7.0)}
    mask = drop_captions(batch, empty, 0.25, torch.Generator().manual_seed(0))
    dropped = (batch["prompt_embeds"] == 7.0).all(dim=(1, 2))
    assert dropped.tolist() == mask and 25 < sum(mask) < 75
    assert not any(drop_captions(batch, empty, 0.0, torch.Generator()))


def test_ema_is_saved_validated_and_exported(tmp_path, make_config):
    cfg = load_config(
        make_config(
            ema_decay=0.9,
            ema_on_cpu=True,
            max_train_steps=3,
            caption_dropout=0.5,
            min_snr_gamma=5.0,
            noise_offset=0.05,
        )
    )
    train(cfg)
    folder = ckpt.checkpoint_dir(tmp_path / "run", 3)
    raw, ema = load_file(str(folder / ckpt.ADAPTER_FILE)), load_file(str(folder / ckpt.EMA_FILE))
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    assert export(tmp_path / "run", "diffusers").verification.passed  # EMA drew and exported


def test_ema_resume_is_exact(tmp_path, make_config):
    common = {
        "ema_decay": 0.9,
        "max_train_steps": 4,
        "checkpointing_steps": 2,
        "caption_dropout": 0.3,
    }
    train(load_config(make_config("a.json", output_dir=str(tmp_path / "a"), **common)))
    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    train(load_config(b, {"max_train_steps": 2}))
    train(load_config(b), resume="latest")
    for name in (ckpt.ADAPTER_FILE, ckpt.EMA_FILE):
        wa = load_file(str(ckpt.checkpoint_dir(tmp_path / "a", 4) / name))
        wb = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 4) / name))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


@pytest.mark.parametrize(
    ("settings", "expect"),
    [
        ({"optimizer": "adafactor"}, None),
        ({"lr_scheduler": "cosine_with_restarts", "lr_num_cycles": 2, "lr_warmup_steps": 1}, None),
        ({"lr_scheduler": "polynomial", "lr_power": 2.0}, None),
        ({"lr_scheduler": "piecewise_constant", "lr_step_rules": "1:2,0.1"}, None),
        ({"optimizer": "adamw8bit"}, "adamw8bit needs a CUDA GPU"),
    ],
)
def test_optimizers_and_schedules(tmp_path, make_config, settings, expect):
    cfg = load_config(make_config(max_train_steps=3, **settings))
    if expect:
        with pytest.raises(ConfigError, match=expect):
            train(cfg)
        return
    assert train(cfg).step == 3
    rows = [json.loads(x) for x in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] > 0 for r in rows)


def test_piecewise_schedule_changes_the_rate(tmp_path, make_config):
    train(
        load_config(
            make_config(
                max_train_steps=4, lr_scheduler="piecewise_constant", lr_step_rules="1:2,0.1"
            )
        )
    )
    lrs = [
        json.loads(x)["lr"] for x in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()
    ]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)


def test_sqrt_learning_rate_scaling():
    from kit.optim import scale_learning_rate

    assert scale_learning_rate(1e-4, 4, 16) == pytest.approx(2e-4)
    assert scale_learning_rate(1e-4, 16, 4) == pytest.approx(5e-5)


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, make_config, nan_at_call):
    cfg = load_config(make_config(max_train_steps=6, checkpointing_steps=2))
    nan_at_call(3)
    with pytest.raises(KitError, match="loss became nan at step 3.*step-000002"):
        train(cfg)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-000002"]


def test_stable_and_validation_loss(tmp_path, make_config, dataset):
    import shutil

    holdout = tmp_path / "holdout"
    holdout.mkdir()
    for stem in ("zorbic_020", "zorbic_021"):
        for ext in (".png", ".txt"):
            shutil.move(dataset / f"{stem}{ext}", holdout / f"{stem}{ext}")
    cfg = load_config(
        make_config(
            max_train_steps=4,
            stable_loss_steps=2,
            stable_loss_samples=4,
            validation_image_dir=str(holdout),
        )
    )
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run/logs/metrics.jsonl").read_text().splitlines()]
    marked = [r for r in rows if "stable_loss" in r]
    assert [r["step"] for r in marked] == [2, 4]
    assert all(r["validation_loss"] > 0 for r in marked)


def test_fixed_loss_is_deterministic(make_config, tiny_sd15):
    from kit.data.cache import build_cache
    from kit.families.loading import load_base
    from kit.train.objective import FixedLoss

    cfg = load_config(make_config())
    family, comps = load_base(cfg)
    data = build_cache(cfg, family, comps)
    fixed = FixedLoss(data, 4, 2, seed=1)
    assert fixed(family, comps, "cpu") == fixed(family, comps, "cpu")


REFUSED = [
    ("flux", "textual_inversion", "one key per text encoder"),
    ("sd3", "textual_inversion", "one key per text encoder"),
    ("wan", "textual_inversion", "cannot load textual-inversion"),
]


def _refused(tmp_path, make_config, family, kind, match):
    """A config of a pair the kit cannot finish, on a base model that does not exist (so
    nothing can be read from it), and the refusal it must meet."""
    ti = {"placeholder_tokens": ["<zorb>"], "initializer_token": "star"}
    path = make_config(
        model_family=family,
        pretrained_model=str(tmp_path / "no-such-model"),
        network_type=kind,
        **(ti if kind == "textual_inversion" else {}),
    )
    return (
        path,
        f"network_type {kind} on {family}: .*{match}.*supports: dora, full, loha, lokr, lora",
    )


@pytest.mark.parametrize(("family", "kind", "match"), REFUSED)
def test_pairs_the_kit_cannot_finish_are_refused(tmp_path, make_config, family, kind, match):
    from kit.cli import main
    from kit.families import get_family
    from kit.methods import get_method
    from kit.preflight.estimate import estimate

    path, pair = _refused(tmp_path, make_config, family, kind, match)
    cfg = load_config(path)
    with pytest.raises(ConfigError, match=pair):
        get_method(cfg, get_family(family, cfg))
    with pytest.raises(ConfigError, match=pair):
        estimate(cfg)
    assert main(["network", str(path)]) == 2


@pytest.mark.parametrize(("family", "kind", "match"), REFUSED[::2])
def test_training_refuses_such_a_pair_before_anything_loads(
    tmp_path, make_config, family, kind, match
):
    path, pair = _refused(tmp_path, make_config, family, kind, match)
    with pytest.raises(ConfigError, match=pair):
        train(load_config(path))


def test_textual_inversion_without_tokens_is_refused_before_anything_loads(tiny_sd15):
    cfg = from_dict({"pretrained_model": str(tiny_sd15), "network_type": "textual_inversion"})
    with pytest.raises(ConfigError, match="placeholder_tokens and initializer_token"):
        get_method(cfg, get_family("sd15", cfg))


def test_deepspeed_refuses_a_run_that_trains_several_models(tmp_path, tiny_base, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    path = write_run_config(
        tmp_path / "cfg.json",
        base=tiny_base("sdxl"),
        data=tmp_path / "no-data-needed",
        family="sdxl",
        **TEXTUAL_INVERSION,
    )
    with pytest.raises(KitError, match="trains 2 models.*DeepSpeed"):
        train(load_config(path))
    assert not (tmp_path / "run").exists()
