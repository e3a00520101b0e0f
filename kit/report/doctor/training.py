"""Checks on how training went: a non-finite loss, a run that stopped, a loss that does not fall,
a resume that lost state, memory that keeps rising."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kit.families import Family, get_family
from kit.methods import get_method
from kit.methods.base import Method, untrained_parts
from kit.report.doctor.data import data_facts
from kit.report.doctor.findings import Finding
from kit.report.doctor.run import RunRecord, finite, fmt_steps
from kit.run.checkpoint import (
    OPTIMIZER_FILE,
    PROGRESS_FILE,
    SCHEDULER_FILE,
    STATE_FILES,
    exported_weights,
    sharded_by,
)

STABLE_FLAT = 1e-4  # stable loss changed by less than this share: nothing trains
MEMORY_RISE = 0.10  # allocated memory grew by this share after the first tenth of the run
_CKPT_LOAD_LIMIT = 256 * 2**20  # optimizer files larger than this are not opened

_GUARD = re.compile(r"(loss|gradient norm) became (\S+) at step (\d+)")


def nonfinite_loss(run: RunRecord) -> Iterator[Finding]:
    """A NaN or infinite loss, from the log or from the error that stopped training."""
    precision = run.flat.get("mixed_precision", "no")
    bad = [r for r in run.rows if any(k in r and not finite(r[k]) for k in ("loss", "stable_loss"))]
    evidence = []
    m = _GUARD.search(run.error or "")
    if m:
        evidence.append(f"training stopped: {m.group(1)} became {m.group(2)} at step {m.group(3)}")
    if bad:
        evidence.append(
            f"{len(bad)} logged step(s) with a non-finite loss, first at step {bad[0]['step']} "
            f"(loss {bad[0].get('loss')})"
        )
    scales = [(r["step"], r["loss_scale"]) for r in run.rows if finite(r.get("loss_scale"))]
    overflows = [
        r["step"]
        for r in run.rows
        if "grad_norm" in r and r["grad_norm"] is not None and not finite(r["grad_norm"])
    ]
    if evidence or (scales and len(overflows) > max(3, 0.05 * len(run.rows))):
        state = f"mixed_precision={precision}"
        if scales:
            low = min(scales, key=lambda s: s[1])
            state += (
                f"; gradient scaler {scales[0][1]:g} at step {scales[0][0]} → "
                f"{scales[-1][1]:g} at step {scales[-1][0]} (lowest {low[1]:g} at step {low[0]})"
            )
        elif precision == "fp16":
            state += "; no loss scale logged"
        evidence.append(state)
        if overflows:
            evidence.append(
                f"{len(overflows)} step(s) overflowed (gradient norm inf/NaN): steps {fmt_steps(overflows)}"
            )
        if run.checkpoints:
            evidence.append(f"last good checkpoint: {list(run.checkpoints.values())[-1]}")
        real_nan = bool(m or bad)
        yield Finding(
            "nonfinite_loss",
            "error" if real_nan else "warning",
            "the loss became NaN or infinite" if real_nan else "fp16 gradients keep overflowing",
            evidence,
            "lower learning_rate (÷3–10), keep max_grad_norm at 1.0, train in bf16 instead of fp16 "
            "(or fp32), check the data for broken images; resume from the last good checkpoint",
        )


def run_stopped(run: RunRecord) -> Iterator[Finding]:
    """The log ends before max_train_steps: a crash, an interruption, or a run still going."""
    if not run.rows:
        if run.dir.config.is_file():
            yield Finding(
                "no_metrics",
                "info",
                "no training step has been logged yet",
                [f"{run.dir.metrics} is missing or empty"],
                "wait for the run to start, or look at its console output for an early error",
            )
        return
    last, target = run.rows[-1]["step"], int(run.flat.get("max_train_steps") or 0)
    if target and last < target:
        ck = list(run.checkpoints)
        evidence = [f"metrics end at step {last} of {target}"]
        evidence.append(f"newest checkpoint: step {ck[-1]}" if ck else "no complete checkpoint")
        if run.error:
            evidence.append(f"error: {run.error[:300]}")
        yield Finding(
            "run_stopped",
            "warning",
            f"the run stopped at step {last} of {target} (or is still running)",
            evidence,
            "read the error above; then `kit train CONFIG --resume latest` continues from the "
            "newest checkpoint",
        )


def loss_trend(run: RunRecord) -> Iterator[Finding]:
    """Stable loss (fixed noise) flat or rising; raw loss only for long runs, as it is noisy."""
    stable = [(r["step"], r["stable_loss"]) for r in run.rows if finite(r.get("stable_loss"))]
    lrs = [r["lr"] for r in run.rows if finite(r.get("lr"))]
    grads = [r["grad_norm"] for r in run.rows if finite(r.get("grad_norm"))]
    context = []
    if lrs:
        context.append(f"learning rate peaked at {max(lrs):.3g}")
    if grads and max(grads) == 0:
        context.append("every logged gradient norm is 0: nothing receives a gradient")
    if len(stable) >= 3:
        (s0, first), (s1, last) = stable[0], stable[-1]
        change = (last - first) / abs(first) if first else 0.0
        span = f"stable loss {first:.5g} at step {s0} → {last:.5g} at step {s1} ({change:+.3%})"
        if abs(change) < STABLE_FLAT or (s1 >= 100 and -0.01 < change <= 0.25):
            yield Finding(
                "loss_not_falling",
                "warning",
                "the loss is not falling",
                [span, *context, *data_facts(run)],
                "raise learning_rate (LoRA: 1e-4 to 5e-4), check that the network trains "
                "(`kit network CONFIG`) and that captions and images are what you expect",
            )
        elif change > 0.25:
            yield Finding(
                "loss_rising",
                "warning",
                "the loss is rising",
                [span, *context],
                "lower learning_rate (÷3–10) or add warm-up (lr_warmup_steps ≈ 5% of the steps)",
            )
        return
    loss = [r["loss"] for r in run.rows if finite(r.get("loss"))]
    if len(loss) >= 50:
        k = len(loss) // 5
        head, tail = statistics.fmean(loss[:k]), statistics.fmean(loss[-k:])
        span = f"mean loss of the first {k} logged steps {head:.4g} → last {k} {tail:.4g}"
        if tail > 1.5 * head:
            yield Finding(
                "loss_rising",
                "warning",
                "the loss is rising",
                [span, *context],
                "lower learning_rate (÷3–10) or add warm-up",
            )
        elif tail >= head:
            yield Finding(
                "loss_not_falling",
                "info",
                "the raw loss is not falling (it is noisy by nature)",
                [span, *context, *data_facts(run)],
                "set stable_loss_steps to log a loss on fixed noise, which shows learning clearly",
            )


def _resumes(run: RunRecord) -> list[int]:
    """Indices of rows that start a new process: the logged time starts again, or the learning
    rate leaves the configured schedule right after a checkpoint."""
    rows = run.rows
    return [
        i
        for i in range(1, len(rows))
        if finite(rows[i].get("time"))
        and finite(rows[i - 1].get("time"))
        and rows[i]["time"] < rows[i - 1]["time"]
        or rows[i - 1]["step"] in run.checkpoints
        and _lr_off_schedule(run, rows[i - 1], rows[i])
    ]


def _checkpoint_state(path: Path, step: int) -> list[str]:
    """What a checkpoint lacks for an exact resume."""
    out = []
    # Under DeepSpeed or FSDP the optimizer state is split by process, in its own folder.
    sharded = sharded_by(path) is not None
    missing = [
        n for n in STATE_FILES if not (path / n).is_file() and not (sharded and n == OPTIMIZER_FILE)
    ]
    if missing:
        out.append(f"{path.name} lacks {', '.join(missing)}")
    opt = path / OPTIMIZER_FILE
    if opt.is_file() and opt.stat().st_size < _CKPT_LOAD_LIMIT and step > 0:
        state = torch.load(opt, map_location="cpu", weights_only=True)
        if not state.get("state"):
            out.append(f"{path.name}/{OPTIMIZER_FILE} holds no optimizer moments (state is empty)")
    sch = path / SCHEDULER_FILE
    if sch.is_file():
        state = torch.load(sch, map_location="cpu", weights_only=True)
        if isinstance(state.get("last_epoch"), int) and state["last_epoch"] < step:
            out.append(
                f"{path.name}/{SCHEDULER_FILE} is at position {state['last_epoch']}, "
                f"the checkpoint at step {step}"
            )
    return out


def _lr_off_schedule(run: RunRecord, before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The learning rate after a resume against the configured schedule, where it matched before."""
    want = run.expected_lr
    lr0, lr1, s0, s1 = before.get("lr"), after.get("lr"), before["step"], after["step"]
    if not want or not (finite(lr0) and finite(lr1)) or s0 not in want or s1 not in want:
        return None
    peak = run.flat.get("learning_rate") or 1.0

    def off(lr: float, expected: float) -> float:
        return abs(lr - expected) / max(abs(expected), 1e-3 * peak)

    if off(lr0, want[s0]) <= 0.01 and off(lr1, want[s1]) > 0.05:
        return (
            f"learning rate {lr1:.3g} at step {s1}; the schedule gives {want[s1]:.3g} there "
            f"(it matched at step {s0}: {lr0:.3g}), so the scheduler state was not restored"
        )
    return None


def resume_jump(run: RunRecord) -> Iterator[Finding]:
    """A jump in learning rate, loss scale or loss right after a resume: state not restored."""
    rows = run.rows
    init_scale = run.flat.get("grad_scaler_init_scale", 65536.0)
    for i in _resumes(run):
        before, after = rows[max(0, i - 10) : i], rows[i : i + 5]
        at = rows[i - 1]["step"]
        hard, soft = [], []
        lr_note = _lr_off_schedule(run, rows[i - 1], rows[i])
        if lr_note:
            hard.append(lr_note)
        s0, s1 = rows[i - 1].get("loss_scale"), rows[i].get("loss_scale")
        if finite(s0) and finite(s1) and s1 == init_scale and s0 != init_scale:
            hard.append(
                f"loss scale {s0:g} at step {at} → {s1:g} (the initial scale) after the resume"
            )
        b = [r["loss"] for r in before if finite(r.get("loss"))]
        a = [r["loss"] for r in after if finite(r.get("loss"))]
        if len(b) >= 3 and a:
            mb, ma = statistics.fmean(b), statistics.fmean(a)
            sd = statistics.pstdev(b)
            if ma > mb + max(3 * sd / math.sqrt(len(a)), 0.25 * abs(mb)):
                soft.append(
                    f"loss {mb:.4g} (mean of {len(b)} steps before) → {ma:.4g} "
                    f"(mean of {len(a)} steps after)"
                )
        st = [r for r in rows[max(0, i - 10) : i + 5] if finite(r.get("stable_loss"))]
        sb = [r for r in st if r["step"] <= at]
        sa = [r for r in st if r["step"] > at]
        if sb and sa and sa[0]["stable_loss"] > 1.1 * sb[-1]["stable_loss"]:
            soft.append(
                f"stable loss {sb[-1]['stable_loss']:.5g} at step {sb[-1]['step']} → "
                f"{sa[0]['stable_loss']:.5g} at step {sa[0]['step']}"
            )
        if not (hard or soft):
            continue
        ck = run.checkpoints.get(at)
        if ck is not None:
            hard += _checkpoint_state(ck, at)
        yield Finding(
            "resume_jump",
            "error" if hard else "warning",
            f"training jumped right after the resume at step {at}: state not fully restored",
            [f"resumed from {ck or f'step {at}'}", *hard, *soft],
            "resume from a complete checkpoint (optimizer, scheduler, RNG and scaler state); "
            "if one was edited or copied without its .pt files, resume from the one before",
        )


_MEMORY_KEYS = ("memory_gib", "memory_allocated_gib", "gpu_memory_gib", "memory_allocated")


def memory_rising(run: RunRecord) -> Iterator[Finding]:
    """GPU memory that keeps growing across steps: a leak (logged only on a GPU)."""
    key = next((k for k in _MEMORY_KEYS if any(finite(r.get(k)) for r in run.rows)), None)
    if key is None:
        return
    pts = [(r["step"], float(r[key])) for r in run.rows if finite(r.get(key))]
    pts = pts[len(pts) // 10 :]  # the first tenth fills caches and optimizer state
    if len(pts) < 5:
        return
    (s0, m0), (s1, m1) = pts[0], pts[-1]
    if m1 > m0 * (1 + MEMORY_RISE) and all(
        b[1] >= a[1] - 1e-9 for a, b in itertools.pairwise(pts[-5:])
    ):
        per100 = (m1 - m0) / max(1, s1 - s0) * 100
        yield Finding(
            "memory_rising",
            "warning",
            "GPU memory keeps rising across steps",
            [f"{key} {m0:.3g} at step {s0} → {m1:.3g} at step {s1} ({per100:+.3g} per 100 steps)"],
            "something keeps tensors from earlier steps (a loss stored without .item(), a growing "
            "list of outputs); an out-of-memory error will follow if it goes on",
        )


def untrained(run: RunRecord) -> Iterator[Finding]:
    """A trained part still at its initial value (an expert no batch drew): its exported file
    changes nothing. Where the denoiser is several models, how many batches each drew."""
    if run.config is None or not run.checkpoints:
        return
    step = max(run.checkpoints)
    path = run.checkpoints[step]
    try:
        drawn = json.loads((path / PROGRESS_FILE).read_text()).get("drawn") or {}
    except (OSError, ValueError, AttributeError):
        drawn = {}
    family = get_family(run.config.model.model_family, run.config)
    method = get_method(run.config, family)
    if method.zero_factors:  # else nothing tells an untrained update (and the file is large)
        yield from untrained_findings(family, method, exported_weights(path), drawn, step)


def untrained_findings(
    family: Family, method: Method, weights: dict[str, Any], drawn: dict[str, int], step: int
) -> list[Finding]:
    """What `untrained` says of a checkpoint's weights at `step` and the batches each part drew
    (`drawn`: part → batches); the end of training prints the same."""
    parts = family.denoiser_files(weights) if method.low_rank else {"": weights}
    counts = (
        ["batches each part drew: " + ", ".join(f"{p} {drawn.get(p, 0)}" for p in parts if p)]
        if drawn
        else []
    )
    found = [
        Finding(
            "untrained_part",
            "warning",
            f"the {part + ' ' if part else ''}adapter is still at its initial value at step "
            f"{step}: its exported file changes nothing",
            [*counts, "every module keeps an update factor that starts at zero all zero"],
            "train more steps (each batch trains one expert, the one its timestep falls on), "
            "or train the one that drew none alone (train_experts)"
            if part
            else "check the learning rate and that the trained modules get gradients",
        )
        for part in untrained_parts(method, family, weights)
    ]
    if counts and not found:
        found.append(Finding("parts_drawn", "info", counts[0], [f"at step {step}"], ""))
    return found


CHECKS = (nonfinite_loss, run_stopped, loss_trend, resume_jump, memory_rising, untrained)
"""This module's checks, in report order."""
