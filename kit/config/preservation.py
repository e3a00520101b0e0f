"""Output preservation and sliders: what a run keeps as the base model drew it, and an adapter
that moves one attribute with its scale."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kit.errors import ConfigError


@dataclass
class PreservationConfig:
    kind: Literal["output", "blank"] = "output"
    """`output`: each step, the adapter's prediction for the caption with every trigger word
    replaced by its class word is pulled toward the base model's (differential output
    preservation); `blank`: the same for the empty prompt."""
    class_words: dict[str, str] = field(default_factory=dict)
    """Trigger word → the class word that stands in for it, e.g. `{"zorbic": "pink"}` (needed
    by `output`)."""
    weight: float = 1.0
    """Weight of the preservation loss beside the denoising loss."""

    def __post_init__(self) -> None:
        if not self.weight > 0 or self.weight == float("inf"):
            raise ConfigError(f"weight: {self.weight} must be a positive number")
        if self.kind == "output" and not self.class_words:
            raise ConfigError(
                "class_words: kind output needs each trigger's class word, "
                'e.g. {"zorbic": "pink"}; or use kind blank (the empty prompt)'
            )
        if self.kind == "blank" and self.class_words:
            raise ConfigError(
                "class_words: kind blank trains on the empty prompt and uses no "
                "class words; remove class_words, or use kind output"
            )
        for trigger, word in self.class_words.items():
            if not trigger.strip() or not word.strip():
                raise ConfigError(
                    f"class_words: {trigger!r}: {word!r} needs a trigger word and "
                    "a class word, neither empty"
                )

    def prompt_for(self, caption: str) -> str:
        """The preservation prompt of a caption: the empty prompt (`blank`), or the caption with
        each trigger word, as a whole word, replaced by its class word (`output`)."""
        if self.kind == "blank":
            return ""
        for trigger, word in self.class_words.items():
            caption = re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)", word, caption)
        return caption


@dataclass
class SliderConfig:
    target: str = ""
    """The prompt the slider acts on, e.g. `a red circle on a white background`."""
    positive: str = ""
    """The prompt of the attribute's high end (what scale +1 moves toward), e.g. `a large ...`."""
    negative: str = ""
    """The prompt of its low end (what scale -1 moves toward), e.g. `a small ...`."""
    strength: float = 1.0
    """How far scale ±1 moves: the adapter's prediction for `target` at scale s is trained
    toward the base's for `target` plus s × strength × (positive − negative)."""
    scales: list[float] = field(default_factory=lambda: [-2.0, -1.0, 0.0, 1.0, 2.0])
    """Adapter scales of the slider's validation grid."""

    def __post_init__(self) -> None:
        for name in ("target", "positive", "negative"):
            if not getattr(self, name).strip():
                raise ConfigError(f"{name}: a slider needs its {name} prompt")
        if self.positive == self.negative:
            raise ConfigError("positive and negative: a slider needs two different prompts")
        if not self.strength > 0 or not self.scales:
            raise ConfigError("strength must be positive and scales not empty")
        if not all(math.isfinite(s) for s in [self.strength, *self.scales]):
            raise ConfigError(f"scales: {self.scales} (strength {self.strength}) must be numbers")

    def prompts(self) -> list[str]:
        """The three prompts, cached like captions: target, positive, negative."""
        return [self.target, self.positive, self.negative]


def base_targets(cfg: Any) -> bool:
    """Whether a dataset trains toward the base model's prediction (`target: base_prediction`)."""
    return any(d.target == "base_prediction" for d in cfg.data.datasets)


def denoiser_rows(cfg: Any) -> tuple[int, int]:
    """Rows the denoiser sees per step, in batches: (with gradients, without). Preservation adds
    the preservation prompts to the trained pass and a pass of the base on them (2, 1); samples
    trained toward the base's prediction add a pass of the base on their own captions (+1)."""
    if cfg.objective.slider is not None:
        return 1, 3  # the target at a scale; the base on target, positive and negative
    kept = 1 if cfg.objective.preservation is not None else 0
    return 1 + kept, kept + int(base_targets(cfg))


__all__ = ["PreservationConfig", "SliderConfig", "base_targets", "denoiser_rows"]
