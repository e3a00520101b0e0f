"""A concept slider: one adapter that moves an attribute up or down with its scale.

Trained as the concept sliders of Gandikota et al. are, and as ai-toolkit and SimpleTuner train
them, from a prompt pair rather than from what the images show: at a noisy latent and timestep
(from the run's images, noised as for any step), the adapter at scale s, prompted with `target`,
is trained toward the base model's prediction for `target` plus s × strength × (the base's
prediction for `positive` − its prediction for `negative`). Each micro-step draws s = +1 or −1
from the batch's own stream, so both directions train and a resume draws the same signs.
"""

from __future__ import annotations

from typing import Any

import torch

from kit.config import Config
from kit.families import Components, Family
from kit.train.preserve import predict_sets


class Slider:
    """The training loss's hook (`denoising_loss(..., reg=...)`) of a slider run."""

    def __init__(self, cfg: Config, method: Any, data: Any) -> None:
        self.method = method
        self.slider = cfg.objective.slider
        self.texts = [
            {k: v.float() for k, v in data.prompt_text(p).items()} for p in self.slider.prompts()
        ]

    def _conds(self, batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
        """The batch's conditioning with its text replaced by each prompt's, for `n` rows."""
        out = []
        for text in self.texts:
            rows = {k: v.unsqueeze(0).expand(n, *v.shape).to(batch[k]) for k, v in text.items()}
            out.append({**batch, **rows})
        return out

    def __call__(
        self,
        family: Family,
        comps: Components,
        draw: Any,
        batch: dict[str, torch.Tensor],
        extras: dict[str, torch.Tensor],
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(the adapter's prediction at scale ±1, its target, no extra loss)."""
        n = draw.noisy.shape[0]
        sign = (
            1.0 if generator is None else float(torch.randint(2, (1,), generator=generator)) * 2 - 1
        )
        target, positive, negative = conds = self._conds(batch, n)
        with torch.no_grad(), self.method.adapter_off(comps):
            base_t, base_p, base_n = predict_sets(family, comps, draw.noisy, draw.timesteps, conds)
        goal = base_t + sign * self.slider.strength * (base_p - base_n)
        with self.method.adapter_scaled(comps, sign):
            pred = family.predict(comps, draw.noisy, draw.timesteps, target)
        return pred, goal.to(draw.target.dtype), None
