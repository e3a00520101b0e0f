"""Full fine-tuning: every weight of the denoiser (and, if asked, of the first text encoder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.families import Components, Family
from kit.families.loading import load_base
from kit.io import atomic_dir, write_json
from kit.methods import register
from kit.methods.base import (
    Apply,
    Method,
    NetworkSummary,
    freeze_all,
    text_encoder_parts,
    trainable_count,
    unwrap,
)


@register
class Full(Method):
    """Every weight of the denoiser; with `train_text_encoder`, the first text encoder's too."""

    name = "full"
    title = "full fine-tuning"
    base_learning_rate = 2e-6
    whole_denoiser = True

    @classmethod
    def unsupported(cls, family: Family) -> str | None:
        return family.full_refusal or None

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        self.live_text = cfg.network.train_text_encoder
        # Families that condition on a text encoder's penultimate layer (SDXL) never use its
        # last layer: under DDP those parameters get no gradient.
        self.leaves_unused = self.live_text

    def trained_text_encoders(self) -> tuple[int, ...]:
        return (0,) if self.live_text else ()

    def _trained(self, comps: Components) -> dict[str, nn.Module]:
        parts = {"denoiser": unwrap(comps.denoiser)}
        if self.live_text:
            parts["text_encoder"] = unwrap(comps.text_encoders[0])
        return parts

    def attach(self, comps: Components) -> NetworkSummary:
        freeze_all(comps.frozen_modules())
        for m in self._trained(comps).values():
            m.requires_grad_(True)
        trainable = sum(p.numel() for p in self.parameters(comps))
        total = sum(p.numel() for m in comps.frozen_modules() for p in m.parameters())
        per = {n: trainable_count(m) for n, m in self._trained(comps).items()}
        return NetworkSummary(self.name, list(per), per, trainable, total)

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        return {
            f"{part}.{k}": v.detach().clone().contiguous()
            for part, m in self._trained(comps).items()
            for k, v in m.state_dict().items()
        }

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        for part, m in self._trained(comps).items():
            prefix = f"{part}."
            m.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )

    def mark_trainable(self, parts: dict[str, nn.Module]) -> NetworkSummary:
        freeze_all(parts.values())
        trained = {"denoiser": parts["denoiser"]}
        encoders = text_encoder_parts(parts)
        if self.live_text and encoders:
            trained["text_encoder"] = encoders[0]
        for m in trained.values():
            m.requires_grad_(True)
        per = {n: trainable_count(m) for n, m in trained.items()}
        total = sum(p.numel() for m in parts.values() for p in m.parameters())
        return NetworkSummary(self.name, list(per), per, sum(per.values()), total)

    def export_formats(self) -> tuple[str, ...]:
        return ("diffusers",)

    def write_export(self, fmt, weights, meta, step, out) -> tuple[Path, Apply]:
        """A complete diffusers pipeline folder with the trained weights in it."""
        family = self.family
        _, comps = load_base(self.cfg)
        self.attach(comps)
        self.load_state_dict(comps, weights)
        pipe = family.pipeline(comps).to(weights[next(iter(weights))].dtype)
        folder = out / "pipeline"
        with atomic_dir(folder) as tmp:
            pipe.save_pretrained(tmp, safe_serialization=True)
            write_json(tmp / "kit_export.json", meta)

        def apply(base_pipe: Any, path: Path) -> Any:
            return type(base_pipe).from_pretrained(path, **family.pipeline_kwargs)

        return folder, apply
