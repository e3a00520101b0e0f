"""Checks on the validation images and held-out loss: memorization, images that stopped changing,
prompts that collapse into one picture, washed-out tones, a prior that drifts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from kit.data.captions import has_word
from kit.report.doctor.findings import Finding
from kit.report.doctor.run import RunRecord, finite, fmt_steps

STALLED_TOTAL = 0.002  # first to last validation grid changed less than this: nothing learned
PLATEAU_SHARE = 0.05  # a step between grids changing < 5% of the largest change is a plateau
COLLAPSE_SHARE = 0.35  # prompts' images as alike as this share of the reference: collapsed
WASHED_SHARE = 0.6  # contrast or saturation below this share of the reference: washed out
FLAT_CONTRAST = 0.02  # luminance std below this: a flat (grey) image
PRIOR_DRIFT = 0.08  # unrelated prompts moved this far from the reference…
PRIOR_SHARE = 0.5  # …and at least this share of the trigger prompts' move


def image_diff(a: dict, b: dict, keys: list | None = None) -> float | None:
    """Mean absolute pixel difference over the images both hold (None when they share none)."""
    common = [k for k in (keys if keys is not None else a) if k in a and k in b]
    if not common:
        return None
    return float(np.mean([np.abs(a[k] - b[k]).mean() for k in common]))


def memorization(run: RunRecord) -> Iterator[Finding]:
    """Training (stable) loss falling while held-out loss rises: memorizing the images."""
    pts = [
        (r["step"], r["stable_loss"], r["validation_loss"])
        for r in run.rows
        if finite(r.get("stable_loss")) and finite(r.get("validation_loss"))
    ]
    if len(pts) < 3:
        return
    best = min(pts, key=lambda p: p[2])
    first, last = pts[0], pts[-1]
    if last[1] < first[1] and last[2] > best[2] * 1.05 and last[0] > best[0]:
        yield Finding(
            "memorization",
            "warning",
            f"held-out loss rises since step {best[0]} while the training loss falls",
            [
                f"stable (training) loss {first[1]:.5g} at step {first[0]} → {last[1]:.5g} at step {last[0]}",
                f"validation loss lowest {best[2]:.5g} at step {best[0]} → {last[2]:.5g} at step {last[0]}",
            ],
            f"use the checkpoint nearest step {best[0]}; train fewer steps, a lower rank or "
            "learning rate, or add images",
        )


def validation_stalled(run: RunRecord) -> Iterator[Finding]:
    """Validation images that stopped changing between grids: the steps after are wasted."""
    steps = list(run.validation)
    if len(steps) < 3:
        return
    imgs = list(run.validation.values())
    diffs = [image_diff(a, b) for a, b in itertools.pairwise(imgs)]
    if any(d is None for d in diffs):
        return
    total = image_diff(imgs[0], imgs[-1]) or 0.0
    if total < STALLED_TOTAL and max(diffs) < STALLED_TOTAL:
        yield Finding(
            "nothing_learned",
            "warning",
            "the validation images barely change from step to step: nothing is being learned",
            [
                f"mean pixel change {total:.5f} from step {steps[0]} to step {steps[-1]} "
                f"(grids at steps {fmt_steps(steps)})",
                *(
                    [
                        f"learning rate peaked at {max(r['lr'] for r in run.rows if finite(r.get('lr'))):.3g}"
                    ]
                    if any(finite(r.get("lr")) for r in run.rows)
                    else []
                ),
            ],
            "raise learning_rate; check that the adapter trains and is applied when sampling",
        )
        return
    biggest = max(diffs)
    tail = 0
    for d in reversed(diffs):
        if d >= PLATEAU_SHARE * biggest:
            break
        tail += 1
    if tail >= 2:
        since = steps[-tail - 1]
        wasted = steps[-1] - since
        yield Finding(
            "validation_stalled",
            "warning" if wasted >= 0.25 * steps[-1] else "info",
            f"the validation images stopped changing after step {since}",
            [
                "change between grids: "
                + ", ".join(
                    f"{a}→{b}: {d:.4f}" for a, b, d in zip(steps, steps[1:], diffs, strict=False)
                )
            ]
            + [
                f"the last {wasted} steps changed them by less than {PLATEAU_SHARE:.0%} of the largest change"
            ],
            f"stop earlier (max_train_steps ≈ {since}) and use the checkpoint at step {since}; "
            "or raise learning_rate if the images never looked right",
        )


def _diversity(images: dict[tuple[str, int], np.ndarray]) -> float | None:
    """Mean difference between different prompts' images of the same seed."""
    by_seed: dict[int, list[np.ndarray]] = {}
    for (_prompt, seed, _settings), img in images.items():
        by_seed.setdefault(seed, []).append(img)
    d = [
        np.abs(a - b).mean()
        for imgs in by_seed.values()
        for a, b in itertools.combinations(imgs, 2)
    ]
    return float(np.mean(d)) if d else None


def collapse(run: RunRecord) -> Iterator[Finding]:
    """Every prompt drawing the same picture: overfit to the training images."""
    ref = run.reference()
    if ref is None or not run.validation:
        return
    what, base = ref
    step, last = list(run.validation.items())[-1]
    d0, d1 = _diversity(base), _diversity(last)
    if d0 and d1 is not None and d0 > 0.02 and d1 < COLLAPSE_SHARE * d0:
        yield Finding(
            "collapse",
            "warning",
            "different prompts now draw nearly the same image (overfit)",
            [f"difference between prompts' images: {d0:.4f} in {what} → {d1:.4f} at step {step}"],
            "use an earlier checkpoint; lower learning_rate, rank or steps; caption what varies",
        )


def _tone(images: dict[Any, np.ndarray]) -> tuple[float, float]:
    """Mean contrast (luminance std) and saturation ((max-min)/max) of images."""
    c, s = [], []
    for img in images.values():
        lum = img @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        c.append(float(lum.std()))
        hi, lo = img.max(axis=2), img.min(axis=2)
        s.append(float(np.mean((hi - lo) / np.maximum(hi, 1e-3))))
    return float(np.mean(c)), float(np.mean(s))


def washed_out(run: RunRecord) -> Iterator[Finding]:
    """Validation images losing contrast or saturation against the base: grey results."""
    if not run.validation:
        return
    step, last = list(run.validation.items())[-1]
    c1, s1 = _tone(last)
    fix = (
        "fp16 overflow in the VAE or a learning rate too high: train in bf16 (or fp32), "
        "lower learning_rate, and use an earlier checkpoint"
    )
    if c1 < FLAT_CONTRAST:
        yield Finding(
            "grey_images",
            "error",
            f"the validation images at step {step} are flat grey",
            [f"contrast (luminance std) {c1:.4f}"],
            fix,
        )
        return
    ref = run.reference()
    if ref is None:
        return
    what, base = ref
    c0, s0 = _tone(base)
    lost = []
    if c0 > 0 and c1 < WASHED_SHARE * c0:
        lost.append(f"contrast {c0:.3f} in {what} → {c1:.3f} at step {step} ({c1 / c0:.0%})")
    if s0 > 0.05 and s1 < WASHED_SHARE * s0:
        lost.append(f"saturation {s0:.3f} in {what} → {s1:.3f} at step {step} ({s1 / s0:.0%})")
    if lost:
        yield Finding("washed_out", "warning", "the validation images are washing out", lost, fix)


def prior_drift(run: RunRecord) -> Iterator[Finding]:
    """Prompts without the trigger word drifting from the base: the prior is being overwritten."""
    ref = run.reference()
    if ref is None or not run.triggers or not run.validation:
        return
    what, base = ref
    step, last = list(run.validation.items())[-1]
    captions = set(run.captions)
    keys = [k for k in last if k in base]
    unrelated = [
        k for k in keys if k[0] not in captions and not any(has_word(k[0], t) for t in run.triggers)
    ]
    trigger = [k for k in keys if any(has_word(k[0], t) for t in run.triggers)]
    if not unrelated or not trigger:
        return
    du, dt = image_diff(base, last, unrelated), image_diff(base, last, trigger)
    if du is not None and dt and du > PRIOR_DRIFT and du > PRIOR_SHARE * dt:
        yield Finding(
            "prior_drift",
            "warning",
            "prompts without the trigger word drift from the base: the prior is being overwritten",
            [
                f"unrelated prompts moved {du:.4f} from {what} by step {step}; trigger prompts {dt:.4f}",
                f"unrelated prompts: {', '.join(repr(k[0]) for k in unrelated[:3])}",
            ],
            "lower learning_rate or rank, train fewer steps, caption with a rare trigger word, "
            "or add regularisation images of the class",
        )


CHECKS = (memorization, validation_stalled, collapse, washed_out, prior_drift)
"""This module's checks, in report order."""
