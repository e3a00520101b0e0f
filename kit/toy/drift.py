"""How far a fine-tune moved what it was not asked to change, in distances rather than pass rates.

A judge's pass rate hides drift: a red circle that turned salmon is still named red. These
measures compare each image drawn after the fine-tune with the base model's image for the same
prompt and seed:

- `color_drift`: the median RGB distance between the two images' shape colors;
- `shape_agreement` and `position_agreement`: how often the judge reads the same shape (position)
  in both;
- `color_error_before` / `_after`: the median distance of the shape color to the color the prompt
  names, as the base draws it and after;
- `concept_color_distance`: on trigger prompts, the median distance of the learned color to the
  data's (the toy world's concept color).

`scripts/score_toy.py` and the learning report both call `drift_measures` on the same prompts and
seeds (`drift_scenes`), so their numbers can be compared one for one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kit.toy import world as toyworld

DRIFT_SEEDS = 32
"""Prompts per group; prompt i is drawn with seed i."""


def drift_scenes(concept: str, n: int = DRIFT_SEEDS) -> dict[str, list[toyworld.Scene]]:
    """The scenes both the report and the independent check draw: `trigger` (the concept in
    scenes a dataset may not have) and `unrelated` (the base world)."""
    if concept in toyworld.CONCEPT_COLORS:
        trigger = toyworld.sample_scenes(n, 1000, colors=(concept,))
    elif concept in toyworld.CONCEPT_SHAPES:
        trigger = toyworld.sample_scenes(n, 1000, shapes=(concept,))
    else:
        raise ValueError(f"{concept!r} is no toy-world concept")
    return {"trigger": trigger, "unrelated": toyworld.sample_scenes(n, 2000)}


def prompt_of(scene: toyworld.Scene, concept: str, trigger: str) -> str:
    """A scene's caption, with the concept's name replaced by the trigger word (whole words)."""
    return " ".join(trigger if w == concept else w for w in toyworld.caption(scene).split(" "))


def _distance(a: Sequence[float], b: Sequence[float]) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def named_rgb(color: str) -> tuple[int, int, int]:
    """The RGB of a toy-world color name (base or concept)."""
    return toyworld.COLORS.get(color) or toyworld.CONCEPT_COLORS[color]


def drift_measures(
    unrelated_before: list[dict[str, Any]],
    unrelated_after: list[dict[str, Any]],
    unrelated_scenes: list[toyworld.Scene],
    trigger_after: list[dict[str, Any]],
    concept: str,
) -> dict[str, Any]:
    """The distances of the module docstring, from the judge's verdicts (`judge`) of images
    drawn for the same prompts and seeds before and after."""
    pairs = list(zip(unrelated_before, unrelated_after, strict=True))
    both = [(b, a) for b, a in pairs if b["rgb"] is not None and a["rgb"] is not None]

    def agreement(attr: str) -> float:
        return round(sum(b[attr] == a[attr] for b, a in pairs) / max(1, len(pairs)), 4)

    def error(verdicts: list[dict[str, Any]]) -> float | None:
        return _median(
            [
                _distance(v["rgb"], named_rgb(s.color))
                for v, s in zip(verdicts, unrelated_scenes, strict=True)
                if v["rgb"] is not None
            ]
        )

    out: dict[str, Any] = {
        "color_drift": _median([_distance(b["rgb"], a["rgb"]) for b, a in both]),
        "shape_agreement": agreement("shape"),
        "position_agreement": agreement("position"),
        "color_error_before": error(unrelated_before),
        "color_error_after": error(unrelated_after),
    }
    if concept in toyworld.CONCEPT_COLORS:
        target = toyworld.CONCEPT_COLORS[concept]
        out["concept_color_distance"] = _median(
            [_distance(v["rgb"], target) for v in trigger_after if v["rgb"] is not None]
        )
    return out


def accuracy(verdicts: list[dict[str, Any]], scenes: list[toyworld.Scene], attr: str) -> float:
    """Share of verdicts whose `attr` is the scene's."""
    hits = sum(v[attr] == getattr(s, attr) for v, s in zip(verdicts, scenes, strict=True))
    return round(hits / max(1, len(scenes)), 4)
