"""The judge reads generator images back to their scenes."""

from __future__ import annotations

import numpy as np
import pytest

from kit.toy import world as toyworld
from kit.toy.judge import ATTRIBUTES, judge, score


@pytest.mark.slow
@pytest.mark.parametrize("size", [(64, 64), (96, 64), (128, 128), (128, 192)])
def test_judge_reads_generator_images(size):
    scenes = toyworld.sample_scenes(60, seed=7)
    images = [toyworld.render(s, *size) for s in scenes]
    result = score(images, scenes)
    for attr in ATTRIBUTES:
        assert result[attr] >= 0.98, (attr, size, result[attr])


def test_judge_tells_the_concepts_apart():
    colors = tuple(toyworld.COLORS) + tuple(toyworld.CONCEPT_COLORS)
    scenes = toyworld.sample_scenes(
        42, seed=3, colors=colors, shapes=toyworld.CONCEPT_SHAPES + toyworld.SHAPES
    )
    images = [toyworld.render(s, 64, 64) for s in scenes]
    result = score(images, scenes)
    assert result["shape"] >= 0.98 and result["color"] == 1.0
    assert sum(v["color"] in toyworld.CONCEPT_COLORS for v in result["verdicts"]) == 6


def test_judge_survives_noise_and_blur():
    from PIL import ImageFilter

    rng = np.random.default_rng(0)
    scenes = toyworld.sample_scenes(48, seed=11, shapes=toyworld.SHAPES + toyworld.CONCEPT_SHAPES)
    scenes += toyworld.sample_scenes(12, seed=12, colors=tuple(toyworld.CONCEPT_COLORS))
    images = []
    for s in scenes:
        im = toyworld.render(s, 64, 64).filter(ImageFilter.GaussianBlur(1.0))
        noisy = np.asarray(im, dtype=np.float64) + rng.normal(0, 12, (64, 64, 3))
        images.append(np.clip(noisy, 0, 255).astype(np.uint8))
    result = score(images, scenes)
    assert result["color"] >= 0.95 and result["background"] >= 0.95
    assert result["shape"] >= 0.9 and result["position"] >= 0.95


def test_judge_is_deterministic_and_reports_empty_images():
    im = toyworld.render(toyworld.Scene("blue", "triangle", "small", "gray", "left"), 64, 64)
    assert judge(im) == judge(im)
    blank = np.full((64, 64, 3), 255, dtype=np.uint8)
    verdict = judge(blank)
    assert verdict["found"] is False and verdict["background"] == "white"
    with pytest.raises(ValueError, match="expectations"):
        score([im], [])
