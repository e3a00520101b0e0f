"""What keeps a fine-tune from changing what it was not asked to: output preservation and
base-prediction targets, both measured against the base model (the adapter switched off).

- **Output preservation** (`preservation`): for each sample, the adapter's prediction for its
  preservation prompt (the caption with each trigger word replaced by its class word, or the
  empty prompt) at the same noisy latent and timestep is pulled toward the base model's
  prediction for it. This is ai-toolkit's differential output preservation (`kind: output`)
  and blank-prompt preservation (`kind: blank`).
- **Base-prediction targets** (`target: base_prediction` on a prior dataset): those samples
  train toward what the base model predicts for them rather than toward their noise
  (SimpleTuner's and OneTrainer's prior prediction for regularisation images).

The trained pass runs once over the batch and its preservation rows together (one forward, so
that a wrapped model under DDP sees one pass per backward); the base's predictions come from one
pass without gradients. Neither draws random numbers, so a resumed run stays on the straight
run's stream.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kit.config import Config
from kit.config.preservation import base_targets
from kit.data.datasets import views
from kit.errors import ConfigError
from kit.families import Components, Family

EXTRA_KEYS = ("preserve.", "base_target")
"""Batch keys (prefixes) the loss takes out before the denoiser sees the batch."""

LIVE, OWN = "preserve.live.", "preserve.own."
"""Under trained text encoders: the preservation prompts as the trained encoders encode them
(the adapter's pass), and the batch's captions as the base's encoders did (the base's pass on
a base-prediction sample). `preserve.<key>` alone is the preservation prompt as the base's
encoders encoded it (cached)."""


def check_preservation(cfg: Config, method: Any) -> None:
    """Refuse preservation or base-prediction targets where there is no base to compare with."""
    asked = []
    if cfg.objective.preservation is not None:
        asked.append(f"preservation (kind {cfg.objective.preservation.kind})")
    if base_targets(cfg):
        asked.append("a dataset's target: base_prediction")
    if cfg.objective.slider is not None:
        if asked:
            raise ConfigError(
                f"slider with {' and '.join(asked)}: a slider trains on its prompt pair alone; "
                "train it in a run of its own"
            )
        asked.append("slider")
    if not asked:
        return
    what = " and ".join(asked)
    if not method.switchable:
        raise ConfigError(
            f"{what} with network_type {method.name}: {method.title or method.name} has no "
            "adapter to switch off, so there is no base model's prediction to keep; train an "
            "adapter (network_type lora, loha, lokr or dora), or remove it"
        )
    if method.live_text and cfg.objective.slider is not None:
        raise ConfigError(
            "slider with train_text_encoder: a slider's prompts are encoded once, by the base's "
            "text encoders, so their adapters would not learn; set train_text_encoder: false"
        )


def check_triggers(cfg: Config, samples: Sequence[Any]) -> None:
    """Refuse an output-preservation trigger that no caption of the taught data holds: its
    class word would replace nothing, and the run would keep the base on the captions it is
    asked to change."""
    keep = cfg.objective.preservation
    if keep is None or keep.kind != "output":
        return
    roles = [v.role for v in views(cfg.data)]
    captions = [s.caption for s in samples if roles[s.dataset] != "prior"]
    for trigger in keep.class_words:
        word = re.compile(rf"(?<!\w){re.escape(trigger)}(?!\w)")  # as `prompt_for` finds it
        if not any(word.search(c) for c in captions):
            raise ConfigError(
                f"class_words: {trigger!r} is in no caption of the training data "
                f"({len(captions)} captions); put the trigger in the captions, or remove it"
            )


def _joined(sets: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Conditioning dicts of `n` rows each, joined row-wise (a tensor without `n` rows, the
    same in every set, is kept as it is)."""
    out = {}
    for k, v in sets[0].items():
        if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n:
            out[k] = torch.cat([s[k].to(v) for s in sets])
        else:
            out[k] = v
    return out


def predict_sets(
    family: Family, comps: Components, noisy: torch.Tensor, timesteps: Any, sets: list[dict]
) -> list[torch.Tensor]:
    """One denoiser pass over the same noisy latents and timesteps under each set of
    conditioning (one set: a plain pass); the predictions split back per set."""
    n, k = noisy.shape[0], len(sets)
    if k == 1:
        return [family.predict(comps, noisy, timesteps, sets[0])]
    t = timesteps
    if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == n:
        t = torch.cat([t] * k)
    return list(family.predict(comps, torch.cat([noisy] * k), t, _joined(sets, n)).split(n))


class Preserver:
    """The training loss's hook (`denoising_loss(..., reg=...)`): the predictions and targets of
    a batch, and each sample's preservation loss."""

    def __init__(self, cfg: Config, method: Any, elementwise: Any) -> None:
        self.method = method
        self.keep = cfg.objective.preservation
        self.elementwise = elementwise  # (pred, target) -> per-element loss (`loss_type`)

    def add_live_text(
        self,
        family: Family,
        comps: Components,
        batch: dict[str, torch.Tensor],
        captions: dict[str, torch.Tensor],
        kept_texts: list[str],
    ) -> None:
        """Under trained text encoders, before `captions` (the batch's captions as the trained
        encoders encode them) replace the cached ones in `batch`: the cached ones are kept for
        the base's pass on base-prediction samples, and the preservation prompts are encoded by
        the trained encoders for the adapter's pass (their cached encodings stay the base's)."""
        toward = batch.get("base_target")
        if toward is not None and bool(toward.any()):
            batch.update({OWN + k: batch[k] for k in captions if k in batch})
        if kept_texts:
            batch.update({LIVE + k: v for k, v in family.encode_text(comps, kept_texts).items()})

    def __call__(
        self,
        family: Family,
        comps: Components,
        draw: Any,
        batch: dict[str, torch.Tensor],
        extras: dict[str, torch.Tensor],
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(prediction, target, per-sample preservation loss or None) of the batch."""
        kept, live, own_text = {}, {}, {}
        for k, v in extras.items():
            if k.startswith(LIVE):
                live[k.removeprefix(LIVE)] = v
            elif k.startswith(OWN):
                own_text[k.removeprefix(OWN)] = v
            elif k != "base_target":
                kept[k.removeprefix("preserve.")] = v
        toward = extras.get("base_target")
        own = toward is not None and bool(toward.any())
        noisy, t = draw.noisy, draw.timesteps
        with_kept = {**batch, **kept}
        base: list[torch.Tensor] = []
        if kept or own:
            sets = ([with_kept] if kept else []) + ([{**batch, **own_text}] if own else [])
            with torch.no_grad(), self.method.adapter_off(comps):
                base = predict_sets(family, comps, noisy, t, sets)
        target = draw.target
        if own:
            mine = base[-1].to(target.dtype)
            pick = toward.to(target.device).bool().view(-1, *[1] * (target.ndim - 1))
            target = torch.where(pick, mine, target)
        if not kept:
            return family.predict(comps, noisy, t, batch), target, None
        pred, pred_kept = predict_sets(family, comps, noisy, t, [batch, {**with_kept, **live}])
        extra = self.elementwise(pred_kept, base[0]).flatten(1).mean(1) * self.keep.weight
        return pred, target, extra
