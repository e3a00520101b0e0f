"""Caption statistics and safe caption edits."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from kit.config import Config, DataConfig
from kit.data import _caption_path, scan
from kit.io import write_text

_WORD = re.compile(r"[\w'-]+")


def words(caption: str) -> list[str]:
    """Lower-case words of a caption."""
    return [w.lower() for w in _WORD.findall(caption)]


def caption_report(cfg: Config, token_counts: bool = True) -> dict[str, Any]:
    """What the captions hold: problems, word frequencies, trigger coverage, token counts."""
    from kit.families import get_family

    rep = scan(cfg.data, get_family(cfg.model.model_family, cfg))
    captions = [s.caption for s in rep.samples]
    dup = [c for c, n in Counter(captions).items() if n > 1 and c]
    counts = Counter(w for c in captions for w in words(c))
    coverage = {
        t: sum(t.lower() in c.lower() for c in captions) / max(1, len(captions))
        for t in cfg.data.trigger_words
    }
    out: dict[str, Any] = {
        "images": len(rep.samples) + len(rep.missing_captions) + len(rep.unreadable),
        "captioned": len(rep.samples),
        "missing_captions": [str(p) for p in rep.missing_captions],
        "orphan_captions": [str(p) for p in rep.orphan_captions],
        "empty_captions": [str(p) for p in rep.empty_captions],
        "unreadable": [f"{p}: {why}" for p, why in rep.unreadable],
        "duplicate_captions": dup,
        "top_words": counts.most_common(40),
        "trigger_coverage": coverage,
        "samples": [{"image": str(s.image), "caption": s.caption} for s in rep.samples],
    }
    if token_counts and rep.samples:
        out["tokens"] = _token_counts(cfg, captions)
    return out


def _token_counts(cfg: Config, captions: list[str]) -> dict[str, Any] | None:
    """Per text encoder: tokens per caption, the limit, and how many captions it cuts off.

    A silently truncated caption looks like a learning-rate problem, so this is reported early.
    """
    from kit.families import get_family

    family = get_family(cfg.model.model_family, cfg)
    try:
        tokenizers = family.load_tokenizers(cfg.model.pretrained_model)
    except (OSError, ValueError):
        return None  # the base model is not reachable yet; counts come later
    out = {}
    for name, tok in tokenizers.items():
        limit = family.token_limit(name, tok)
        n = [len(tok(c).input_ids) for c in captions]
        over = [x - limit for x in n if x > limit]
        out[name] = {
            "limit": limit,
            "max": max(n),
            "mean": round(sum(n) / len(n), 1),
            "truncated": len(over),
            "most_over_by": max(over, default=0),
        }
    return out


def save_caption(image: str | Path, text: str, cfg: DataConfig) -> Path:
    """Write one image's caption atomically; return the caption file."""
    path = _caption_path(Path(image), cfg)
    write_text(path, text.strip() + "\n")
    return path
