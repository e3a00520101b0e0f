"""Advice: the cheapest settings that fit a memory budget, searched with the estimate."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

from kit.config import Config
from kit.families import get_family
from kit.methods import get_method
from kit.preflight.estimate import GIB, NO_BF16, Estimate, estimate


@dataclass(frozen=True)
class Option:
    """One setting the advice may change, with its expected cost in time per sample."""

    name: str
    value: Any
    cost: float


def options(cfg: Config, card: str | None) -> dict[str, list[Option]]:
    """Setting → the values the advice tries for it (on `card`, when named)."""
    t = cfg.train
    res = cfg.data.resolution
    family = get_family(cfg.model.model_family, cfg)
    step = cfg.data.bucket_step or family.bucket_step
    effective = t.train_batch_size * t.gradient_accumulation_steps
    batches = sorted({b for b in (t.train_batch_size, 4, 2, 1) if b <= t.train_batch_size})
    half = "fp16" if card in NO_BF16 else "bf16"
    precisions = [Option("mixed_precision", half, 1.0)]
    if t.mixed_precision != "no":
        precisions = [Option("mixed_precision", t.mixed_precision, 1.0)]
    elif card is None or card not in NO_BF16:
        precisions.append(Option("mixed_precision", "no", 2.0))
    optimizers = [Option("optimizer", t.optimizer, 1.0)]
    for name, cost in (("adamw8bit", 1.02), ("adafactor", 1.05), ("adamw", 1.0)):
        if name != t.optimizer:
            optimizers.append(Option("optimizer", name, cost))
    live_text = get_method(cfg, family).live_text
    return {
        "batch": [
            Option("batch", (b, -(-effective // b)), 1.0 + 0.15 * (t.train_batch_size / b - 1) / 2)
            for b in batches
        ],
        "gradient_checkpointing": [
            Option("gradient_checkpointing", v, 1.3 if v else 1.0) for v in (False, True)
        ],
        "mixed_precision": precisions,
        "optimizer": optimizers,
        "unload_encoders": [Option("unload_encoders", False, 1.0)]
        + ([] if live_text else [Option("unload_encoders", True, 1.01)]),
        "resolution": [
            Option("resolution", r, 1.0 + 1.0 * i)
            for i, r in enumerate(range(res, max(step * 4, res // 2) - 1, -step * 2))
        ],
    }


def advise(
    cfg: Config, budget_gib: float, *, card: str | None = None, top: int = 3, max_traces: int = 24
) -> list[dict[str, Any]]:
    """The `top` cheapest settings that fit `budget_gib`, cheapest first, with their peaks.

    Cost is the expected time per sample relative to the config (plus a steep penalty for a
    lower resolution, which changes what is learned). Candidates are tried in order of cost, so
    only the traces that might fit are run.
    """
    opts = options(cfg, card)
    combos = []
    for combo in itertools.product(*opts.values()):
        cost = functools.reduce(lambda a, o: a * o.cost, combo, 1.0)
        combos.append((cost, combo))
    combos.sort(key=lambda c: c[0])
    found: list[dict[str, Any]] = []
    traced: set[tuple] = set()
    for cost, combo in combos:
        s = {o.name: o.value for o in combo}
        key = (s["batch"][0], s["gradient_checkpointing"], s["mixed_precision"], s["resolution"])
        if key not in traced and len(traced) >= max_traces:
            continue
        traced.add(key)
        est = estimate(
            cfg,
            resolution=s["resolution"],
            batch_size=s["batch"][0],
            gradient_accumulation_steps=s["batch"][1],
            gradient_checkpointing=s["gradient_checkpointing"],
            mixed_precision=s["mixed_precision"],
            optimizer=s["optimizer"],
            unload_encoders=s["unload_encoders"],
        )
        if est.fits(budget_gib):
            found.append(_advice_row(cfg, est, cost))
            if len(found) >= top:
                break
    return found


def _advice_row(cfg: Config, est: Estimate, cost: float) -> dict[str, Any]:
    s = est.settings
    t = cfg.train
    changes = []
    for key, now in (
        ("resolution", cfg.data.resolution),
        ("batch_size", t.train_batch_size),
        ("gradient_accumulation_steps", t.gradient_accumulation_steps),
        ("gradient_checkpointing", t.gradient_checkpointing),
        ("mixed_precision", t.mixed_precision),
        ("optimizer", t.optimizer),
        ("unload_encoders", False),
    ):
        if s[key] != now:
            changes.append(f"{key}={s[key]}")
    return {
        "changes": ", ".join(changes) or "(as configured)",
        "peak_gib": round(est.total_bytes / GIB, 2),
        "slowdown": round(cost, 2),
        "settings": {k: s[k] for k in s if k not in ("height", "width", "trainable_params")},
        "estimate": est,
    }


__all__ = ["Option", "advise", "options"]
