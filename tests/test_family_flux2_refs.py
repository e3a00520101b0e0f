"""FLUX.2 reference images: the training input of a pair with one or more references equals,
tensor for tensor, what Flux2Pipeline / Flux2KleinPipeline build from `image=[...]`; a
reference is resized as the pipelines resize it; validation draws through `image=`; a run with
references trains, resumes bit for bit and exports the same keys as one without."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict
from kit.data.cache import fill_cache, plan_cache
from kit.errors import DataError
from kit.families import get_family
from kit.families.flux2 import family as flux2
from kit.families.flux2.family import patchify, reference_pixels, reference_size

CAPTION = "put the cat from image 1 on the sofa"
SIDE = 64  # the target: 8 × 8 latents, 4 × 4 tokens
REFERENCE_SIZES = [(80, 64), (64, 96)]  # (width, height): the pipelines' 64 px minimum


class Stop(Exception):
    """Raised by a spy to end a pipeline call once it has shown what it was after."""


@pytest.fixture(scope="module")
def bases(tiny_base, tmp_path_factory):
    klein = tmp_path_factory.mktemp("klein_refs") / "base"
    return {"dev": tiny_base("flux2"), "klein": get_family("flux2").make_tiny(klein, kind="klein")}


def _pairs(root, references: int):
    """One target with `references` reference images (each its own folder), and a caption."""
    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)).save(
        root / "data" / "a.png"
    )
    (root / "data" / "a.txt").write_text(CAPTION)
    files = []
    for r, (w, h) in enumerate(REFERENCE_SIZES[:references]):
        (root / f"refs{r}").mkdir()
        files.append(root / f"refs{r}" / "a.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(files[-1])
    return files


def _cfg(root, base, references, **extra):
    return from_dict(
        {
            "model_family": "flux2",
            "pretrained_model": str(base),
            "image_dir": str(root / "data"),
            "control_dir": [str(root / f"refs{r}") for r in range(references)],
            "cache_dir": str(root / "cache"),
            "output_dir": str(root / "run"),
            "resolution": SIDE,
            "max_sequence_length": 32,
            **extra,
        }
    )


def test_reference_sizes_are_the_pipelines(bases):
    """The pixels the kit encodes for a reference are the pipeline's own (`prepare_image_latents`
    sees them), for a small reference (cropped to multiples of 16) and a large one (shrunk to
    about a megapixel first)."""
    family = get_family("flux2")
    comps = family.load(str(bases["dev"]))
    pipe = family.pipeline(comps)
    seen = []

    def stop(images, **kwargs):
        seen.extend(images)
        raise Stop

    pipe.prepare_image_latents = stop
    rng = np.random.default_rng(1)
    for w, h in [(90, 70), (1300, 1000)]:
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        with pytest.raises(Stop):
            pipe(prompt="x", image=[image], height=SIDE, width=SIDE, max_sequence_length=8)
        theirs = seen.pop()
        assert theirs.shape[-2:] == reference_size(w, h)[::-1]
        assert torch.equal(reference_pixels(image), theirs[0])
    assert reference_size(1300, 1000) == (1152, 896)
    with pytest.raises(DataError, match="too small"):
        reference_pixels(Image.new("RGB", (48, 64)))


@pytest.mark.parametrize(
    ("which", "references", "sampling"),
    [("dev", 1, "mean"), ("dev", 2, "mean"), ("klein", 1, "mean"), ("klein", 2, "sample")],
)
def test_training_inputs_with_references_are_the_pipelines(
    which, references, sampling, bases, tmp_path
):
    """THE test: one cached training pair through `predict`, and the pipeline's first step for
    the same reference images, caption, size, noise and timestep: every transformer input is
    equal (`torch.equal`), and the prediction is the target's tokens of the output. With
    `latent_sampling: sample` too: references are encoded to the mode, as the pipelines do."""
    files = _pairs(tmp_path, references)
    cfg = _cfg(tmp_path, bases[which], references, latent_sampling=sampling)
    family = get_family("flux2", cfg)
    comps = family.load(str(bases[which]))
    data = plan_cache(cfg, comps.identity, torch.float32, family=family)
    fill_cache(data, cfg, family, comps, progress=False)
    assert data.samples[0].controls == files
    batch = data.load_batch([0])
    cond = {k: v for k, v in batch.items() if k != "latents"}
    assert sorted(k for k in cond if k.startswith("control")) == [
        f"control_latents_{r}" for r in range(references)
    ]

    calls = []
    forward = comps.denoiser.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append({**kwargs, "out": out[0]})
        return out

    comps.denoiser.forward = record
    noise = torch.randn(1, comps.vae.config.latent_channels, SIDE // 8, SIDE // 8)
    pipe = family.pipeline(comps)
    with torch.no_grad():
        pipe(
            prompt=CAPTION,
            image=[Image.open(f).convert("RGB") for f in files],
            latents=patchify(noise),
            height=SIDE,
            width=SIDE,
            num_inference_steps=2,
            guidance_scale=family.train_guidance_scale(),
            max_sequence_length=32,
            output_type="latent",
        )
        theirs = calls[0]
        pred = family.predict(comps, noise, pipe.scheduler.timesteps[:1], cond)
    ours = calls[-1]
    keys = ("hidden_states", "timestep", "guidance", "encoder_hidden_states", "txt_ids", "img_ids")
    for key in keys:
        if theirs[key] is None:  # klein has no guidance input
            assert ours[key] is None and which == "klein", key
            continue
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    # The references' tokens follow the target's 16, at times 10, 20, ...
    tokens = [(w // 16) * (h // 16) for w, h in REFERENCE_SIZES[:references]]
    assert ours["hidden_states"].shape[1] == 16 + sum(tokens)
    times = ours["img_ids"][0, :, 0].tolist()
    expected = [0] * 16 + [t for r, n in enumerate(tokens) for t in [10 * (r + 1)] * n]
    assert times == expected
    n = 16
    out = theirs["out"][:, :n].transpose(1, 2).reshape(1, -1, SIDE // 16, SIDE // 16)
    from kit.families.flux2.family import unpatchify

    assert torch.equal(pred, unpatchify(out))


def test_datasets_with_different_reference_counts_need_batches_of_one(tmp_path):
    from kit.config import Config
    from kit.errors import ConfigError

    refs = [str(tmp_path / "refs0"), str(tmp_path / "refs1")]
    sets = [{"image_dir": str(tmp_path / "a"), "control_dir": refs}, {"image_dir": str(tmp_path)}]
    cfg = Config().replace(model_family="flux2", datasets=sets, train_batch_size=2)
    with pytest.raises(ConfigError, match="give 0 or 2 reference image"):
        get_family("flux2", cfg)
    get_family("flux2", cfg.replace(train_batch_size=1))  # each batch one sample: any count


def test_the_estimate_counts_configured_references(bases, tmp_path):
    """`kit estimate`'s inputs: each configured reference adds its tokens (at the target's size)
    after the target's, with its ids."""
    _pairs(tmp_path, 2)
    for references in (0, 2):
        family = get_family("flux2", _cfg(tmp_path, bases["dev"], references))
        parts = family.empty_parts(str(bases["dev"]))
        (tokens,), kwargs = family.denoiser_inputs(parts, 1, SIDE, SIDE)
        assert tokens.shape[1] == kwargs["img_ids"].shape[1] == 16 * (1 + references)


@pytest.mark.slow
def test_validation_draws_references_through_image(bases, tmp_path):
    from kit.sample.validate import image_specs, run_validation

    files = _pairs(tmp_path, 2)
    entry = {"prompt": CAPTION, "control": [str(f) for f in files], "num_inference_steps": 1}
    cfg = _cfg(tmp_path, bases["klein"], 2, validation_prompts=[entry], validation_seeds=[1])
    family = get_family("flux2", cfg)
    comps = family.load(str(bases["klein"]))
    seen = []
    forward = comps.denoiser.forward

    def record(*args, **kwargs):
        seen.append(kwargs["hidden_states"].shape[1])
        return forward(*args, **kwargs)

    comps.denoiser.forward = record
    specs = image_specs(cfg, family, [])
    grid = run_validation(family, family.pipeline(comps), specs, tmp_path / "grid", 1, meta={})
    assert seen == [16 + 5 * 4 + 4 * 6]  # the target's tokens, then each reference's
    assert Image.open(grid).width == 3 * SIDE  # two references, then the result
    sidecar = json.loads(next((tmp_path / "grid").glob("*.json")).read_text())
    assert sidecar["call_kwargs"]["image"] == [str(f) for f in files]


@pytest.mark.slow
def test_a_run_with_references_trains_resumes_and_exports(bases, tmp_path, monkeypatch):
    """Two references per target: 4 steps straight equal 2 + 2 resumed, bit for bit; every export
    verifies, and holds the same keys as a run without references (the transformer is the same)."""
    from safetensors.torch import load_file

    from kit.config import load_config
    from kit.export.writer import export
    from kit.run import checkpoint as ckpt
    from kit.train.loop import train
    from tests.conftest import EXAMPLE, write_run_config

    data = tmp_path / "data"
    data.mkdir()
    for f in sorted((EXAMPLE / "images").glob("prior_00[0-3].*")):
        shutil.copy(f, data)
    refs = []
    for r in range(2):
        refs.append(tmp_path / f"refs{r}")
        refs[-1].mkdir()
        for f in sorted(data.glob("*.png")):  # a mirror, then a darker copy
            im = Image.open(f).convert("RGB")
            im = (
                im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                if r == 0
                else im.point(lambda v: v // 2)
            )
            im.save(refs[-1] / f.name)

    def config(run, **extra):
        fields = {"base": bases["dev"], "data": data, "cache_dir": str(tmp_path / "cache")}
        path = write_run_config(
            tmp_path / f"{run}.json",
            family="flux2",
            output_dir=str(tmp_path / run),
            train_batch_size=1,
            max_sequence_length=32,
            **fields,
            **extra,
        )
        return load_config(path)

    fed = []  # how many references each training step fed the transformer
    real = flux2.with_references
    monkeypatch.setattr(
        flux2, "with_references", lambda kw, refs: fed.append(len(refs)) or real(kw, refs)
    )
    both = {"control_dir": [str(r) for r in refs]}
    assert train(config("straight", **both)).step == 4
    assert fed == [2] * 4
    split = config("split", **both)
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    a, b = (
        load_file(str(ckpt.checkpoint_dir(tmp_path / r, 4) / ckpt.ADAPTER_FILE))
        for r in ("straight", "split")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    plain = config("plain", max_train_steps=2, checkpointing_steps=2)
    fed.clear()
    train(plain)
    assert fed == [0] * 2
    for fmt in get_family("flux2").export_formats:
        with_refs, without = export(tmp_path / "straight", fmt), export(tmp_path / "plain", fmt)
        assert with_refs.verification.passed, (fmt, with_refs.verification)
        keys = [set(load_file(str(_file(r.path)))) for r in (with_refs, without)]
        assert keys[0] == keys[1], fmt


def _file(path):
    """An export's safetensors file (the folder's one file, for diffusers)."""
    return path if path.is_file() else next(path.glob("*.safetensors"))
