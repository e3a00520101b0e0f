"""Output preservation and base-prediction targets: config, the adapter switched off, the loss,
refusals, and training that resumes bit for bit and matches across processes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.config import from_dict, load_config
from kit.errors import ConfigError
from kit.run import checkpoint as ckpt

KEEP = {"kind": "output", "class_words": {"zorbic": "pink"}, "weight": 1.0}


def test_config_reads_and_refuses_preservation_by_key():
    cfg = from_dict({"image_dir": "x", "preservation": KEEP})
    keep = cfg.objective.preservation
    assert keep.prompt_for("a large zorbic circle, zorbicx <zorbic>") == (
        "a large pink circle, zorbicx <pink>"
    )
    assert from_dict({"image_dir": "x", "preservation": {"kind": "blank"}}).objective.preservation
    assert from_dict(cfg.to_dict()).objective.preservation == keep  # saved and read back
    bad = {
        "clas_words": "unknown config key 'clas_words' in preservation; did you mean 'class_words'",
        "kind": "preservation.kind: 'x' is not one of 'output', 'blank'",
        "weight": "weight: 0.0 must be a positive number",
        "class_words": "preservation.class_words.zorbic: expected a string, got 3",
    }
    values = {"clas_words": {}, "kind": "x", "weight": 0, "class_words": {"zorbic": 3}}
    for key, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            from_dict({"image_dir": "x", "preservation": {**KEEP, key: values[key]}})
    with pytest.raises(ConfigError, match="kind output needs each trigger's class word"):
        from_dict({"image_dir": "x", "preservation": {"kind": "output"}})
    with pytest.raises(ConfigError, match=r"datasets\[0\]: target: base_prediction is for a"):
        from_dict({"image_dir": "", "datasets": [{"image_dir": "a", "target": "base_prediction"}]})


@pytest.mark.parametrize("network_type", ["full", "textual_inversion"])
def test_refused_where_there_is_no_adapter_to_switch_off(make_config, network_type):
    from kit.train.loop import train

    extra = {"placeholder_tokens": ["<zorb>"], "initializer_token": "star"}
    fields = {"network_type": network_type, "preservation": KEEP}
    if network_type == "textual_inversion":
        fields.update(extra)
    with pytest.raises(ConfigError, match=f"network_type {network_type}: .* no adapter to switch"):
        train(load_config(make_config(**fields)))
    live = {"slider": SLIDE, "train_text_encoder": True}
    with pytest.raises(ConfigError, match="slider with train_text_encoder"):
        train(load_config(make_config("live.json", **live)))


def _prepared(make_config, **fields):
    from kit.train.prepare import prepare

    return prepare(load_config(make_config(**fields)))


@pytest.mark.parametrize("network_type", ["lora", "loha", "lokr", "dora"])
def test_adapter_off_predicts_as_the_base_and_puts_everything_back(make_config, network_type):
    s = _prepared(make_config, preservation=KEEP, network_type=network_type)
    trained = [p for p in s.comps.denoiser.parameters() if p.requires_grad]
    frozen = [p for p in s.comps.denoiser.parameters() if not p.requires_grad]
    assert trained and frozen
    with torch.no_grad():
        for p in trained:
            p.normal_()  # a trained-looking adapter: its output now differs from the base's
    batch = s.data.load_batch([0, 1])
    assert batch["preserve.prompt_embeds"].shape == batch["prompt_embeds"].shape
    noisy = torch.randn_like(batch["latents"])
    t = torch.tensor([500, 500])
    cond = {"prompt_embeds": batch["prompt_embeds"]}
    with torch.no_grad():
        on = s.family.predict(s.comps, noisy, t, cond)
        with s.method.adapter_off(s.comps):
            off = s.family.predict(s.comps, noisy, t, cond)
        again = s.family.predict(s.comps, noisy, t, cond)
    base = _prepared(make_config, network_type=network_type)  # the same base, its adapter at init
    with torch.no_grad():
        fresh = base.family.predict(base.comps, noisy, t, cond)
    assert not torch.allclose(on, off)
    assert torch.allclose(off, fresh, atol=1e-6)
    assert torch.equal(on, again)
    assert all(p.requires_grad for p in trained) and not any(p.requires_grad for p in frozen)
    # The preservation prompts are the captions with the class word: cached as text entries.
    i = 0
    assert s.data.preserve_texts[i][0] == s.data.variant_texts[i][0].replace("zorbic", "pink")


def test_preservation_loss_is_zero_for_an_untrained_adapter_and_grows_with_it(make_config):
    """At the start (LoRA B = 0) the adapter predicts as the base: the loss is the plain one.
    Once the adapter moves, the preservation term adds to it."""
    from kit.train.objective import denoising_loss

    s = _prepared(make_config, preservation={**KEEP, "weight": 3.0})
    batch = s.data.load_batch([0, 1])

    def loss(reg):
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            return float(denoising_loss(s.family, s.comps, dict(batch), generator, "cpu", reg))

    plain, kept = loss(None), loss(s.regular)
    assert kept == pytest.approx(plain, rel=1e-5)
    with torch.no_grad():
        for n, p in s.comps.denoiser.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    heavy = loss(s.regular) - loss(None)
    s.regular.keep.weight = 1.0
    light = loss(s.regular) - loss(None)
    assert light > 1e-4 and heavy == pytest.approx(3 * light, rel=1e-3)


def _with_base_prediction_set(tmp_path, dataset, n: int) -> list[dict]:
    """The dataset, and `n` of its images as a prior set trained toward the base's prediction."""
    import shutil

    reg = tmp_path / "reg"
    reg.mkdir()
    for i, im in enumerate(sorted(dataset.glob("*.png"))[:n]):
        shutil.copy(im, reg / f"reg_{i}.png")
        (reg / f"reg_{i}.txt").write_text("a small red circle on a white background, in the center")
    return [
        {"name": "chars", "image_dir": str(dataset)},
        {"image_dir": str(reg), "role": "prior", "target": "base_prediction"},
    ]


def test_trained_text_encoders_preserve_against_the_base_encoders(make_config, tmp_path, dataset):
    """With `train_text_encoder`, the adapter's pass reads the preservation prompts as the trained
    encoders encode them, the base's pass as the base's encoders did, and a base-prediction
    sample's target is the base's prediction for its caption as the base encodes it."""
    from kit.train.objective import elementwise_loss

    datasets = _with_base_prediction_set(tmp_path, dataset, 2)
    fields = {
        "preservation": KEEP,
        "train_text_encoder": True,
        "image_dir": "",
        "datasets": datasets,
    }
    s = _prepared(make_config, **fields)
    base = _prepared(make_config, image_dir="", datasets=datasets)  # the base, no preservation
    prior = [i for i, x in enumerate(s.data.samples) if x.dataset == 1]
    mine = [i for i, x in enumerate(s.data.samples) if x.dataset == 0]
    text_lora = [p for n, p in s.comps.text_encoders[0].named_parameters() if "lora_B" in n]
    assert text_lora
    with torch.no_grad():
        for p in text_lora:  # only the text encoder's adapter moves: the denoiser's is the base
            p.normal_(std=0.5)

    def live_batch(indices):
        batch = s.data.load_batch(indices)
        captions = [s.data.variant_texts[i][0] for i in indices]
        kept = [s.data.preserve_texts[i][0] for i in indices]
        with torch.no_grad():
            text = s.family.encode_text(s.comps, captions)
            s.regular.add_live_text(s.family, s.comps, batch, text, kept)
        batch.update(text)
        return batch, captions, kept

    # The trained samples: the preservation term is the adapter's prediction for the kept prompt
    # (trained encoders) against the base's (cached, base encoders).
    batch, _, kept = live_batch(mine[:2])
    assert "preserve.own.prompt_embeds" not in batch  # no base-prediction sample in this batch
    with torch.no_grad():
        with s.method.adapter_off(s.comps):  # the base's encoders
            cached = s.family.encode_text(s.comps, kept)["prompt_embeds"]
        assert torch.allclose(batch["preserve.prompt_embeds"], cached, atol=1e-5)
        live = s.family.encode_text(s.comps, kept)["prompt_embeds"]
        assert not torch.allclose(live, cached, atol=1e-3)
        draw = s.family.noise_and_target(
            s.comps, batch["latents"], torch.Generator().manual_seed(0)
        )
        extras = {
            k: batch.pop(k) for k in list(batch) if k.startswith(("preserve.", "base_target"))
        }
        _, _, extra = s.regular(s.family, s.comps, draw, batch, extras)
        noisy, t = draw.noisy, draw.timesteps
        student = base.family.predict(base.comps, noisy, t, {"prompt_embeds": live})
        teacher = base.family.predict(base.comps, noisy, t, {"prompt_embeds": cached})
    want = elementwise_loss(student, teacher).flatten(1).mean(1) * KEEP["weight"]
    torch.testing.assert_close(extra, want, rtol=1e-4, atol=1e-7)
    assert float(extra.min()) > 0
    # A base-prediction sample: its target is the base's prediction for its caption as the base's
    # encoders read it, so the loss of the base's own pass on that caption is zero.
    batch, captions, _ = live_batch(prior[:2])
    with torch.no_grad():
        with s.method.adapter_off(s.comps):
            mine_base = s.family.encode_text(s.comps, captions)["prompt_embeds"]
        assert torch.allclose(batch["preserve.own.prompt_embeds"], mine_base, atol=1e-5)
        assert not torch.allclose(batch["prompt_embeds"], mine_base, atol=1e-3)
        draw = s.family.noise_and_target(
            s.comps, batch["latents"], torch.Generator().manual_seed(1)
        )
        extras = {
            k: batch.pop(k) for k in list(batch) if k.startswith(("preserve.", "base_target"))
        }
        _, target, _ = s.regular(s.family, s.comps, draw, batch, extras)
        cond = {"prompt_embeds": extras["preserve.own.prompt_embeds"]}
        own = base.family.predict(base.comps, draw.noisy, draw.timesteps, cond)
    torch.testing.assert_close(target, own, rtol=1e-4, atol=1e-6)


def test_base_prediction_target_trains_toward_the_base(make_config, tmp_path, dataset):
    """Prior samples with `target: base_prediction` have zero loss while the adapter is the base."""
    from kit.train.objective import denoising_loss

    datasets = _with_base_prediction_set(tmp_path, dataset, 4)
    s = _prepared(make_config, image_dir="", datasets=datasets)
    prior = [i for i, x in enumerate(s.data.samples) if x.dataset == 1]
    mine = [i for i, x in enumerate(s.data.samples) if x.dataset == 0]
    assert s.regular is not None and all(s.data.base_targets[i] for i in prior)
    assert not any(s.data.base_targets[i] for i in mine)

    @torch.no_grad()
    def loss(indices, reg):
        batch = s.data.load_batch(indices)
        return float(
            denoising_loss(s.family, s.comps, batch, torch.Generator().manual_seed(0), "cpu", reg)
        )

    assert loss(prior[:2], s.regular) == pytest.approx(0.0, abs=1e-10)
    assert loss(prior[:2], None) > 1e-3  # toward their noise, the same images are far off
    assert loss(mine[:2], s.regular) == pytest.approx(loss(mine[:2], None), rel=1e-6)


def _adapter(run_dir, step):
    return load_file(str(ckpt.checkpoint_dir(run_dir, step) / ckpt.ADAPTER_FILE))


@pytest.mark.slow
@pytest.mark.parametrize("live", [False, True], ids=["cached-text", "train_text_encoder"])
def test_preservation_run_resumes_bit_for_bit_under_accumulation(tmp_path, make_config, live):
    from kit.train.loop import train

    common = {
        "max_train_steps": 6,
        "checkpointing_steps": 3,
        "gradient_accumulation_steps": 2,
        "lora_dropout": 0.1,
        "caption_dropout": 0.2,
        "preservation": KEEP,
        "train_text_encoder": live,
    }
    a, b, plain = tmp_path / "a", tmp_path / "b", tmp_path / "plain"
    train(load_config(make_config("a.json", output_dir=str(a), **common)))
    without = {k: v for k, v in common.items() if k != "preservation"}
    train(load_config(make_config("p.json", output_dir=str(plain), **without)))
    cfg_b = load_config(make_config("b.json", output_dir=str(b), **common))

    def stop_at_3(event):
        if event["kind"] == "checkpoint" and event["step"] == 3:
            raise KeyboardInterrupt

    assert train(cfg_b, callbacks=[stop_at_3]).interrupted
    assert train(cfg_b, resume="latest").step == 6
    wa, wb, wp = _adapter(a, 6), _adapter(b, 6), _adapter(plain, 6)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wp[k]) for k in wa), "preservation changed nothing"
    saved = json.loads((a / "config.json").read_text())
    assert saved["objective"]["preservation"] == KEEP


@pytest.mark.slow
def test_preservation_two_processes_match_one(tmp_path, two_processes_and_one):
    two_processes_and_one(max_train_steps=3, checkpointing_steps=0, preservation=KEEP)
    a = load_file(str(ckpt.checkpoint_dir(tmp_path / "ddp", 3) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(tmp_path / "one", 3) / ckpt.ADAPTER_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)


@pytest.mark.slow
def test_estimate_counts_the_preservation_passes(tiny_sd15, monkeypatch, tmp_path):
    """The trained pass holds the batch and its preservation rows: about twice the activations,
    and the base's pass without gradients is traced before it."""
    from kit.config import Config, PreservationConfig
    from kit.preflight import estimate as estimating
    from kit.preflight.estimate import estimate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KIT_VRAM_CACHE", str(tmp_path / "vram"))
    estimating.forget_traces()
    cfg = Config()
    cfg.model.model_family, cfg.model.pretrained_model = "sd15", str(tiny_sd15)
    cfg.data.resolution = 256
    plain = estimate(cfg).components["activations"]
    calls = []
    traced = estimating.trace
    monkeypatch.setattr(estimating, "trace", lambda *a: calls.append(1) or traced(*a))
    cfg.objective.preservation = PreservationConfig(class_words={"zorbic": "pink"})
    kept = estimate(cfg).components["activations"]
    assert calls, "a run with preservation has its own trace"
    assert 1.7 < kept / plain < 2.3, (kept, plain)
    # Trained text encoders encode the preservation prompts too, with gradients.
    peaks = []
    monkeypatch.setattr(estimating, "trace", lambda *a: peaks.append(traced(*a)) or peaks[-1])
    cfg.network.train_text_encoder = True
    estimate(cfg)
    cfg.objective.preservation = None
    estimate(cfg)
    live_kept, live_plain = (p["peak"]["text_encoder"] for p in peaks)
    assert 1.7 < live_kept / live_plain < 2.3, (live_kept, live_plain)
    estimating.forget_traces()


SLIDE = {
    "target": "a red circle",
    "positive": "a large red circle",
    "negative": "a small red circle",
    "scales": [-2, -1, 0, 1, 2],
}


def test_adapter_scaled_acts_at_the_scale_and_puts_the_scaling_back(make_config):
    s = _prepared(make_config, slider=SLIDE)
    # The slider's prompts are cached (beside the grid's own prompts).
    assert {SLIDE["target"], SLIDE["positive"], SLIDE["negative"]} <= set(s.data.prompt_files)
    with torch.no_grad():
        for n, p in s.comps.denoiser.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batch = s.data.load_batch([0, 1])
    noisy, t = torch.randn_like(batch["latents"]), torch.tensor([300, 700])
    cond = {"prompt_embeds": batch["prompt_embeds"]}
    layers = [m for m in s.comps.denoiser.modules() if hasattr(m, "scaling") and m.scaling]
    before = [dict(m.scaling) for m in layers]
    with torch.no_grad():
        one = s.family.predict(s.comps, noisy, t, cond)
        with s.method.adapter_off(s.comps):
            base = s.family.predict(s.comps, noisy, t, cond)
        with s.method.adapter_scaled(s.comps, 0.0):
            zero = s.family.predict(s.comps, noisy, t, cond)
        with s.method.adapter_scaled(s.comps, -1.0):
            minus = s.family.predict(s.comps, noisy, t, cond)
    assert torch.allclose(zero, base, atol=1e-6) and not torch.allclose(one, base)
    assert not torch.allclose(minus, one)
    assert [dict(m.scaling) for m in layers] == before
    with pytest.raises(ConfigError, match="slider with preservation"):
        train_cfg = load_config(make_config("both.json", slider=SLIDE, preservation=KEEP))
        from kit.train.loop import train

        train(train_cfg)


@pytest.mark.slow
def test_slider_run_resumes_bit_for_bit(tmp_path, make_config):
    from kit.train.loop import train

    common = {"max_train_steps": 4, "checkpointing_steps": 2, "slider": SLIDE}
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config(make_config("a.json", output_dir=str(a), **common)))
    cfg_b = load_config(make_config("b.json", output_dir=str(b), **common))

    def stop_at_2(event):
        if event["kind"] == "checkpoint" and event["step"] == 2:
            raise KeyboardInterrupt

    assert train(cfg_b, callbacks=[stop_at_2]).interrupted
    assert train(cfg_b, resume="latest").step == 4
    wa, wb = _adapter(a, 4), _adapter(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)
    # The validation grid: the slider's target prompt, a row per scale.
    sidecars = sorted((a / "validation/step-000004").glob("*.json"))
    drawn = [json.loads(f.read_text()) for f in sidecars]
    assert [d["adapter_scale"] for d in drawn] == SLIDE["scales"]
    assert {d["prompt"] for d in drawn} == {SLIDE["target"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdxl", "sd3", "flux", "wan"])
def test_every_family_trains_with_preservation(tmp_path, tiny_base, family_dataset, name):
    """Family-agnostic: the batch and its preservation rows go through each family's own
    `predict` in one pass; while the adapter is still the base (init), the loss is the plain one,
    and two steps train."""
    from kit.train.objective import denoising_loss
    from kit.train.prepare import prepare
    from tests.conftest import short_clips, write_run_config

    keep = {"kind": "output", "class_words": {"zorbic": "pink"}}
    fields = {**short_clips(name), "max_train_steps": 2, "checkpointing_steps": 0}
    path = write_run_config(
        tmp_path / "c.json", base=tiny_base(name), data=family_dataset(name), family=name,
        preservation=keep, **fields,
    )  # fmt: skip
    s = prepare(load_config(path))
    batch = s.data.load_batch([0, 1])
    with torch.no_grad():
        plain, kept = (
            float(denoising_loss(s.family, s.comps, dict(batch), torch.Generator().manual_seed(0), "cpu", reg))
            for reg in (None, s.regular)
        )  # fmt: skip
    assert kept == pytest.approx(plain, rel=1e-4, abs=1e-6)
    from kit.train.loop import fit

    assert fit(s).step == 2
