"""Caption augmentation: kept tags stay put, dropout and counts follow the settings, seeds repeat."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kit.config import DataConfig
from kit.data.augment import augment_caption, augmentation_enabled, caption_variants, split_tags
from kit.errors import ConfigError

CAPTION = "zorb, red hat, sitting, grass, blue sky, smiling, outdoors, tree, cloud, sun, photo"


def test_off_by_default_and_unchanged():
    cfg = DataConfig()
    assert not augmentation_enabled(cfg)
    assert augment_caption(CAPTION, cfg, random.Random(0)) == CAPTION
    assert caption_variants(CAPTION, DataConfig(caption_variants=3), seed=1) == [CAPTION] * 3
    # keep_tokens and priority_tags alone change nothing
    assert not augmentation_enabled(DataConfig(keep_tokens=2, priority_tags=["grass"]))


def test_keep_tokens_stay_in_place_and_priority_tags_are_never_dropped():
    cfg = DataConfig(
        caption_shuffle=True, keep_tokens=2, priority_tags=["Outdoors"], tag_dropout=0.7
    )
    rng = random.Random(3)
    orders = set()
    for _ in range(300):
        tags = split_tags(augment_caption(CAPTION, cfg, rng))
        assert tags[:2] == ["zorb", "red hat"]
        assert "outdoors" in tags
        assert set(tags) <= set(split_tags(CAPTION))
        orders.add(tuple(tags))
    assert len(orders) > 50  # it really shuffles and drops


def test_shuffle_keeps_every_tag():
    cfg = DataConfig(caption_shuffle=True)
    rng = random.Random(0)
    outs = [augment_caption(CAPTION, cfg, rng) for _ in range(20)]
    assert all(sorted(split_tags(o)) == sorted(split_tags(CAPTION)) for o in outs)
    assert len(set(outs)) > 10


def test_dropout_rate_is_near_the_setting():
    tags = [f"tag{i}" for i in range(40)]
    caption = ", ".join(tags)
    cfg = DataConfig(tag_dropout=0.3, keep_tokens=1)
    rng = random.Random(7)
    trials = 500
    dropped = sum(
        len(tags) - len(split_tags(augment_caption(caption, cfg, rng))) for _ in range(trials)
    )
    rate = dropped / (trials * (len(tags) - 1))  # the kept first tag is never a candidate
    assert abs(rate - 0.3) < 0.02


def test_tag_count_range_is_respected_and_uniform():
    cfg = DataConfig(tag_count_range=[3, 6], keep_tokens=1, caption_shuffle=True)
    rng = random.Random(11)
    counts = Counter()
    for _ in range(2000):
        tags = split_tags(augment_caption(CAPTION, cfg, rng))
        assert tags[0] == "zorb"
        counts[len(tags)] += 1
    assert set(counts) == {3, 4, 5, 6}
    assert all(400 < n < 600 for n in counts.values())  # 500 each if uniform


def test_priority_tags_win_over_a_small_count():
    cfg = DataConfig(tag_count_range=[1, 1], priority_tags=["grass", "sun"])
    for seed in range(20):
        tags = split_tags(augment_caption(CAPTION, cfg, random.Random(seed)))
        assert sorted(tags) == ["grass", "sun"]


def test_variants_are_deterministic_per_seed_and_differ():
    cfg = DataConfig(caption_shuffle=True, tag_dropout=0.2, caption_variants=5)
    a = caption_variants(CAPTION, cfg, seed=42)
    assert len(a) == 5
    assert a == caption_variants(CAPTION, cfg, seed=42)
    assert len(set(a)) > 1
    assert a != caption_variants(CAPTION, cfg, seed=43)
    assert caption_variants("other, tags, here", cfg, seed=42) != a


def test_sentence_captions_and_empty_results():
    cfg = DataConfig(tag_dropout=0.9, caption_shuffle=True)
    sentence = "a photo of zorb sitting in the grass"
    assert augment_caption(sentence, cfg, random.Random(0)) == sentence
    # a tag caption never becomes the empty caption
    for seed in range(50):
        assert augment_caption("a, b, c", cfg, random.Random(seed))


@pytest.mark.parametrize(
    "bad",
    [
        {"keep_tokens": -1},
        {"tag_dropout": 1.0},
        {"tag_dropout": -0.1},
        {"tag_count_range": [5]},
        {"tag_count_range": [4, 2]},
        {"caption_variants": 0},
        {"priority_tags": [" "]},
    ],
)
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        DataConfig(**bad)
