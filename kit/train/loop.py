"""The training loop: `train` prepares a run, then `fit` steps it to the end.

Read top to bottom: `fit` walks the epochs' batches and calls `micro_step` (kit/train/step.py)
on each; when an optimizer step is complete, `end_of_step` logs it and checkpoints and validates
when due. Setting up is in prepare.py, resuming in resume.py, accelerate in accel.py.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kit.config import Config
from kit.data.buckets import epoch_batches
from kit.errors import KitError
from kit.report.archive import write_archive
from kit.report.doctor import write_report
from kit.report.plots import plot_metrics
from kit.train.evaluate import fixed_losses, validate
from kit.train.log import audit, log_grid, log_row, progress_bar, step_row, weights_digest
from kit.train.prepare import prepare
from kit.train.save import save
from kit.train.state import Callback, StopTraining, TrainResult, TrainState
from kit.train.step import guard_finite, micro_step

__all__ = ["StopTraining", "TrainResult", "fit", "train"]


def train(
    cfg: Config,
    *,
    resume: str | None = None,
    force: bool = False,
    overwrite: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> TrainResult:
    """Train the configured network; `resume="latest"` continues the newest checkpoint."""
    s = prepare(cfg, resume=resume, force=force, overwrite=overwrite, callbacks=callbacks)
    return fit(s)


def fit(s: TrainState) -> TrainResult:
    """Step to `max_train_steps`; a checkpoint at the end, and on Ctrl-C or `StopTraining`."""
    t, acc = s.cfg.train, s.accelerator
    s.emit(
        kind="start", step=s.step, max_steps=t.max_train_steps, network=s.summary, data=s.data.stats
    )
    bar = progress_bar(acc, s.step, t.max_train_steps)
    losses: list[float] = []  # of the micro-steps of the optimizer step under way
    started = time.perf_counter()
    restore_signals = _sigterm_as_interrupt()
    try:
        while s.step < t.max_train_steps:
            # Each process takes every world-th batch (the tail that cannot go to every process
            # is already left out), so all processes step together.
            batches = epoch_batches(s.data.plan, t.train_batch_size, t.seed, s.epoch, s.world)
            if not batches:
                raise KitError(
                    f"fewer batches per epoch than the {s.world} processes that share them; "
                    "lower train_batch_size or use fewer processes (see `kit buckets`)"
                )
            while s.position < len(batches) and s.step < t.max_train_steps:
                mine = s.position + s.rank
                if s.world > 1:
                    audit(
                        s.run, s.rank, {"epoch": s.epoch, "batch": mine, "samples": batches[mine]}
                    )
                s.position += s.world
                loss, grad_norm = micro_step(s, batches[mine], mine)
                losses.append(loss)
                if acc.sync_gradients:
                    end_of_step(s, losses, grad_norm, bar, started)
            if s.position >= len(batches):
                s.epoch, s.position = s.epoch + 1, 0
                if not losses:
                    s.cursor = (s.epoch, s.position)
        save(s, s.step)
        if s.world > 1:
            digest = weights_digest(s.method.state_dict(s.comps))
            audit(s.run, s.rank, {"final_step": s.step, "weights_sha256": digest})
        acc.wait_for_everyone()
    except (KeyboardInterrupt, StopTraining):
        _on_interrupt(s)
    finally:
        restore_signals()
        bar.close()
        acc.end_training()
        if s.main:
            # Also when training stopped on an error: the report then explains it.
            write_report(s.run.root, error=sys.exc_info()[1])
            # The archive must never replace the run's own error with one of its own.
            with contextlib.suppress(Exception):
                write_archive(
                    s.run.root,
                    started=s.started_at,
                    error=sys.exc_info()[1],
                    interrupted=s.result.interrupted,
                )
    s.result.step = s.step
    if s.main:
        plot_metrics(s.run.read_metrics(), s.run.loss_plot)
    s.emit(kind="end", step=s.step, result=s.result)
    return s.result


def end_of_step(
    s: TrainState, losses: list[float], grad_norm: float | None, bar: Any, started: float
) -> None:
    """After an optimizer step: upkeep, the metrics row, and a checkpoint or images when due."""
    t, acc = s.cfg.train, s.accelerator
    s.step += 1
    s.cursor = (s.epoch, s.position)
    s.method.after_step(s.comps)
    if s.ema is not None:
        s.ema.step(s.params)
    loss = sum(losses) / len(losses)
    losses.clear()
    scale = acc.scaler.get_scale() if acc.scaler is not None else None
    guard_finite(loss, grad_norm, s.step, s.precision, scale, s.result.checkpoint)
    row = step_row(s, loss, grad_norm, scale, started)
    last = s.step == t.max_train_steps
    if t.stable_loss_steps and (s.step % t.stable_loss_steps == 0 or last):
        row.update(fixed_losses(s))
    if s.step % t.logging_steps == 0 or last or "stable_loss" in row:
        log_row(acc, s.run, row)
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}")
    s.emit(kind="step", **row)
    if t.checkpointing_steps and s.step % t.checkpointing_steps == 0 and not last:
        save(s, s.step)
    every = s.cfg.validation.validation_steps
    if s.main and (last or (every and s.step % every == 0)):
        grid = validate(s, s.step)
        s.result.validation_grids.append(grid)
        log_grid(s.accelerator, s.step, grid)  # to the tracker too, where it takes images


def _on_interrupt(s: TrainState) -> None:
    """Stopped by the user: keep what was learned, then stop cleanly."""
    last = s.result.checkpoint
    saved = last is not None and last.name == s.run.checkpoint(s.step).name
    if s.deepspeed and s.step > 0 and not saved:
        # A DeepSpeed checkpoint needs every process at the same point, which an interrupt
        # does not promise: the last periodic checkpoint is the one to resume from.
        s.accelerator.print("under DeepSpeed no checkpoint is saved on an interrupt")
    elif s.main and s.step > 0 and not saved:
        save(s, s.step)
    s.result.interrupted = True
    s.accelerator.print(f"interrupted at step {s.step}; checkpoint: {s.result.checkpoint}")


def _sigterm_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM stop training like Ctrl-C (checkpoint, then exit); return the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals can only be handled on the main thread

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)
