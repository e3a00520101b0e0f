"""Cache keys that never go stale, caption variants, resumable building, and training from a
full cache without the VAE or text encoders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from kit.config import load_config
from kit.data.cache import build_cache, plan_cache

COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200)]
CAPTIONS = [
    "zorbstar, red, square, plain background, centered",
    "zorbstar, green, square, plain background, left",
    "zorbstar, blue, wide, dark background, right",
    "zorbstar, yellow, tall, light background, centered",
    "zorbstar, cyan, square, gray background, left",
]


@pytest.fixture()
def small_data(tmp_path) -> Path:
    """Five small images with tag captions."""
    folder = tmp_path / "small"
    folder.mkdir()
    for i, (color, caption) in enumerate(zip(COLORS, CAPTIONS, strict=True)):
        Image.new("RGB", (64 + 32 * (i % 2), 64), color).save(folder / f"img_{i}.png")
        (folder / f"img_{i}.txt").write_text(caption)
    return folder


@pytest.fixture()
def setup(make_config, small_data):
    from kit.families.loading import load_base

    def make(**kw):
        cfg = load_config(make_config(image_dir=str(small_data), **kw))
        family, comps = load_base(cfg)
        return cfg, family, comps

    return make


def entries(root: Path) -> dict[Path, int]:
    return {f: f.stat().st_mtime_ns for f in root.rglob("*.safetensors")}


def test_one_changed_image_or_caption_rebuilds_exactly_one_entry(setup, small_data):
    cfg, family, comps = setup()
    root = Path(cfg.data.cache_dir)
    first = build_cache(cfg, family, comps, progress=False)
    assert first.stats == {
        "latents_encoded": 5,
        "latents_reused": 0,
        "text_encoded": 5,
        "text_reused": 0,
    }
    before = entries(root)

    im = Image.open(small_data / "img_3.png").convert("RGB")
    im.putpixel((0, 0), (0, 0, 0))
    im.save(small_data / "img_3.png")
    again = build_cache(cfg, family, comps, progress=False)
    assert again.stats["latents_encoded"] == 1 and again.stats["latents_reused"] == 4
    assert again.stats["text_encoded"] == 0 and again.stats["text_reused"] == 5
    after = entries(root)
    assert set(after) - set(before) == {again.latent_files[3]}
    assert all(after[f] == t for f, t in before.items())  # nothing rewritten

    (small_data / "img_1.txt").write_text("zorbstar, green, square, on the left")
    edited = build_cache(cfg, family, comps, progress=False)
    assert edited.stats["text_encoded"] == 1 and edited.stats["latents_encoded"] == 0
    assert set(entries(root)) - set(after) == {edited.text_files[1]}


def test_keys_follow_dtype_flip_and_encoder_identity(setup):
    cfg, family, comps = setup()
    ident = comps.identity
    f32 = plan_cache(cfg, ident, torch.float32)
    bf16 = plan_cache(cfg, ident, torch.bfloat16)
    # Latents are always encoded in fp32 (LATENT_DTYPE): one entry serves every training dtype.
    assert f32.latent_files == bf16.latent_files
    assert not set(f32.text_files) & set(bf16.text_files)
    # Flipping adds a mirrored entry per image, keyed apart; the straight ones keep their keys.
    flipped = plan_cache(cfg.replace(random_flip=True), ident, torch.float32)
    n = len(f32.latent_files)
    assert [p.flip for p in flipped.plan.placements] == [False] * n + [True] * n
    assert flipped.latent_files[:n] == f32.latent_files
    assert not set(flipped.latent_files[n:]) & set(f32.latent_files)
    assert flipped.text_files == f32.text_files * 2 and flipped.kept() == f32.samples
    # Another VAE or text encoder (weights or tokenizer) gives other entries.
    other = plan_cache(cfg, {"vae": "v2", "text": ident["text"]}, torch.float32)
    assert not set(other.latent_files) & set(f32.latent_files)
    assert other.text_files == f32.text_files
    assert family.identity(cfg.model.pretrained_model) == ident  # read without loading weights


def test_tokenizer_files_are_part_of_the_text_key(tiny_sd15, tmp_path):
    import shutil

    from kit.families import get_family

    copy = tmp_path / "model"
    shutil.copytree(tiny_sd15, copy)
    family = get_family("sd15")
    before = family.identity(str(copy))
    config = copy / "tokenizer" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["model_max_length"] = 33  # embeddings of another length
    config.write_text(json.dumps(settings))
    after = family.identity(str(copy))
    assert after["text"] != before["text"] and after["vae"] == before["vae"]


def test_caption_variants_are_cached_and_drawn_from_the_batch_stream(setup, small_data):
    k = 3
    cfg, family, comps = setup(caption_shuffle=True, keep_tokens=1, caption_variants=k)
    data = build_cache(cfg, family, comps, progress=False)
    assert data.variants == k
    distinct = {t for ts in data.variant_texts for t in ts}
    assert data.stats["text_encoded"] == len(distinct) > len(CAPTIONS)
    for ts, fs in zip(data.variant_texts, data.variant_files, strict=True):
        assert len(ts) == len(fs) == k
        assert all(t.startswith("zorbstar, ") for t in ts)  # keep_tokens holds the trigger
        assert all(f.is_file() for f in fs)
    # Each variant's embedding is the encoding of its own text.
    text, path = data.variant_texts[2][1], data.variant_files[2][1]
    from safetensors.torch import load_file

    with torch.no_grad():
        direct = family.encode_text(comps, [text])["prompt_embeds"][0]
    assert torch.allclose(load_file(path)["prompt_embeds"], direct, atol=1e-5)

    a = data.draw_variants(4, torch.Generator().manual_seed(7))
    b = data.draw_variants(4, torch.Generator().manual_seed(7))
    assert a == b and all(0 <= v < k for v in a)
    batch = data.load_batch([0, 1, 2, 3][:2], a[:2])
    assert batch["prompt_embeds"].shape[0] == 2

    # One edited caption: exactly its K variants are encoded again.
    (small_data / "img_4.txt").write_text("zorbstar, cyan, square, white background, right, big")
    again = build_cache(cfg, family, comps, progress=False)
    assert again.stats["text_encoded"] == len(set(again.variant_texts[4])) == k
    assert again.stats["latents_encoded"] == 0

    # Without augmentation, one embedding per caption and no draw from the stream.
    plain = build_cache(cfg.replace(caption_shuffle=False), family, comps, progress=False)
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    assert plain.variants == 1 and plain.draw_variants(4, g) is None
    assert torch.equal(g.get_state(), state)


def test_an_interrupted_build_resumes_and_leaves_no_partial_entry(setup, monkeypatch, capsys):
    cfg, family, comps = setup()
    root = Path(cfg.data.cache_dir)
    real = family.encode_images
    calls = {"n": 0}

    def flaky(c, pixels):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(c, pixels)

    monkeypatch.setattr(family, "encode_images", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, family, comps, progress=False)
    assert len(entries(root)) == 2
    assert not [p for p in root.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    monkeypatch.setattr(family, "encode_images", real)
    done = build_cache(cfg, family, comps, progress=True)
    assert done.stats["latents_reused"] == 2 and done.stats["latents_encoded"] == 3
    assert "cache latents" in capsys.readouterr().err  # the progress bar, when asked for
    build_cache(cfg, family, comps, progress=False)
    assert "cache" not in capsys.readouterr().err


@pytest.mark.slow
def test_training_from_a_full_cache_never_loads_the_encoders(
    make_config, small_data, tmp_path, monkeypatch
):
    import shutil

    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from kit.train.loop import train

    holdout = tmp_path / "holdout"
    shutil.copytree(small_data, holdout)
    fields = {
        "image_dir": str(small_data),
        "validation_image_dir": str(holdout),
        "caption_dropout": 0.5,
        "stable_loss_steps": 2,
        "max_train_steps": 3,
        "checkpointing_steps": 0,
    }
    train(load_config(make_config(**fields)))

    loads: list[tuple[str, int]] = []
    steps: list[int] = []
    for cls in (AutoencoderKL, CLIPTextModel):
        real = cls.from_pretrained.__func__

        def counted(klass, *args, _real=real, **kwargs):
            loads.append((klass.__name__, len(steps)))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(counted))

    def on_event(event):
        if event["kind"] == "start":
            assert event["data"]["latents_encoded"] == event["data"]["text_encoded"] == 0
        if event["kind"] == "step":
            steps.append(event["step"])

    cfg = load_config(make_config(output_dir=str(tmp_path / "run2"), **fields))
    result = train(cfg, callbacks=[on_event])
    assert result.step == 3 and steps == [1, 2, 3]
    # The VAE loads once, after the last step, to sample the validation grid; the text encoder
    # never does: the grid's prompts were cached with the captions.
    assert sorted(loads) == [("AutoencoderKL", 3)]
    assert result.validation_grids and result.validation_grids[0].is_file()
    rows = [
        json.loads(x) for x in (result.run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("validation_loss" in r for r in rows)  # the holdout came from the cache too
    # The same run as with every part loaded: same adapter init, same data, same losses.
    first = (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in first] == [r["loss"] for r in rows]
