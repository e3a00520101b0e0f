"""Drawing several specs in one pipeline call gives the images one call per spec gives."""

from __future__ import annotations

import numpy as np
import pytest

from kit.families import get_family
from kit.families.samplers import ImageSpec, draw, draw_batch
from kit.sample.validate import draw_in_batches


@pytest.fixture(scope="module")
def sd15(tiny_sd15):
    family = get_family("sd15")
    pipe = family.pipeline(family.load(str(tiny_sd15)))
    pipe.set_progress_bar_config(disable=True)
    return family, pipe


def _spec(prompt: str, seed: int, **kw) -> ImageSpec:
    return ImageSpec(prompt, "", seed, 2, 3.0, 64, 64, **kw)


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def test_a_batch_draws_what_single_calls_draw(sd15):
    family, pipe = sd15
    specs = [_spec(p, s) for p in ("a red star", "a blue moon") for s in (0, 7)]
    alone = [draw(family, pipe, s)[0][0] for s in specs]
    together = draw_batch(family, pipe, specs)
    assert len(together) == len(specs)
    for a, (frames, record) in zip(alone, together, strict=True):
        # Batched kernels may sum in another order: at most one level of 255 apart.
        assert np.abs(_pixels(a) - _pixels(frames[0])).max() <= 1
        assert record["sampler"] == "default"
    # Different seeds draw different images: the generators are per image, not shared.
    assert np.abs(_pixels(together[0][0][0]) - _pixels(together[1][0][0])).max() > 10


def test_specs_that_differ_beyond_prompt_and_seed_are_drawn_one_by_one(sd15, monkeypatch):
    family, pipe = sd15
    calls = []
    real = type(pipe).__call__

    def counting(self, **kwargs):
        calls.append(kwargs["prompt"])
        return real(self, **kwargs)

    monkeypatch.setattr(type(pipe), "__call__", counting)
    same = [_spec("a star", 0), _spec("a moon", 1)]
    draw_batch(family, pipe, same)
    assert calls == [["a star", "a moon"]]
    calls.clear()
    mixed = [_spec("a star", 0), _spec("a star", 0, adapter_scale=0.0)]
    draw_batch(family, pipe, mixed)
    assert calls == ["a star", "a star"]


def test_batches_keep_the_order_and_split_by_sampler(sd15):
    family, pipe = sd15
    specs = [_spec("a star", 0), _spec("a star", 1), _spec("a star", 2, sampler="ddim")]
    drawn = list(draw_in_batches(family, pipe, specs, batch=8))
    assert [r["sampler"] for _, r in drawn] == ["default", "default", "ddim"]
    with pytest.raises(ValueError, match="one sampler"):
        draw_batch(family, pipe, specs)
