"""Caption augmentation: shuffle, drop and count comma-separated tags, seeded and pure.

Tag-style captions (`zorb, red hat, sitting, grass`) train better when the model cannot lean on
the order or the presence of any one tag. Everything here takes its randomness from the caller's
`random.Random`, so the cache builder can precompute the same variants on every run.
"""

from __future__ import annotations

import hashlib
import random

from kit.config import DataConfig


def split_tags(caption: str) -> list[str]:
    """The comma-separated tags of a caption, stripped, without empty ones."""
    return [t.strip() for t in caption.split(",") if t.strip()]


def augmentation_enabled(cfg: DataConfig) -> bool:
    """Whether any setting changes captions (keep_tokens and priority_tags alone change nothing)."""
    return cfg.caption_shuffle or cfg.tag_dropout > 0 or bool(cfg.tag_count_range)


def augment_caption(caption: str, cfg: DataConfig, rng: random.Random) -> str:
    """One augmented version of a caption under the config's tag settings.

    The first `keep_tokens` tags stay at the front in order; `priority_tags` are never dropped.
    A caption of fewer than two tags (a plain sentence) is returned unchanged: whole-caption
    dropout is `caption_dropout`'s job, not this one's.
    """
    if not augmentation_enabled(cfg):
        return caption
    tags = split_tags(caption)
    if len(tags) < 2:
        return caption
    fixed, rest = tags[: cfg.keep_tokens], tags[cfg.keep_tokens :]
    priority = {t.strip().lower() for t in cfg.priority_tags}
    protected = [t.lower() in priority for t in rest]

    keep = [p or rng.random() >= cfg.tag_dropout for p in protected]
    if cfg.tag_count_range:
        lo, hi = cfg.tag_count_range
        target = rng.randint(lo, hi) - len(fixed)
        droppable = [i for i, k in enumerate(keep) if k and not protected[i]]
        surplus = sum(keep) - max(target, sum(protected))
        for i in rng.sample(droppable, max(0, min(surplus, len(droppable)))):
            keep[i] = False
    if not fixed and not any(keep):
        # Never turn a tag caption into the empty caption: that would be caption dropout.
        keep[rng.randrange(len(keep))] = True
    kept = [t for t, k in zip(rest, keep, strict=True) if k]
    if cfg.caption_shuffle:
        rng.shuffle(kept)
    return ", ".join(fixed + kept)


def caption_variants(caption: str, cfg: DataConfig, seed: int) -> list[str]:
    """`caption_variants` augmented versions of a caption, the same for the same caption and seed.

    With augmentation off every entry is the caption itself, so one embedding serves them all.
    """
    n = max(1, cfg.caption_variants)
    if not augmentation_enabled(cfg):
        return [caption] * n
    # Seeded from the text, not Python's salted hash(), so every process draws the same variants.
    digest = hashlib.sha256(f"{seed}\0{caption}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    return [augment_caption(caption, cfg, rng) for _ in range(n)]
