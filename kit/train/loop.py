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
from kit.optim import eval_weights, final_weights
from kit.report.archive import write_archive
from kit.report.doctor import write_report
from kit.report.doctor.training import untrained_findings
from kit.report.plots import plot_metrics
from kit.run.checkpoint import exported_weights
from kit.run.lock import hold_run, lead_process
from kit.train.accel import is_fsdp
from kit.train.evaluate import fixed_losses, validate
from kit.train.log import (
    RunTimer,
    audit,
    log_grid,
    log_row,
    note_tracker_files,
    progress_bar,
    step_row,
    weights_digest,
)
from kit.train.prefetch import Prefetcher
from kit.train.prepare import prepare
from kit.train.resume import check_output_dir
from kit.train.save import per_process, save, trained_weights
from kit.train.state import Callback, StopTraining, TrainResult, TrainState
from kit.train.step import guard_finite, micro_step, step_numbers

__all__ = ["StopTraining", "TrainResult", "fit", "train"]


def train(
    cfg: Config,
    *,
    resume: str | None = None,
    force: bool = False,
    overwrite: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> TrainResult:
    """Train the configured network; `resume="latest"` continues the newest checkpoint.

    The run folder is locked for the run's life (`kit.run.lock`): a second `kit train` or a
    resume on it while this one runs is refused, naming this process."""
    check_output_dir(cfg)
    held = hold_run(cfg.train.output_dir, "train") if lead_process() else contextlib.nullcontext()
    with held:
        s = prepare(cfg, resume=resume, force=force, overwrite=overwrite, callbacks=callbacks)
        return fit(s)


def fit(s: TrainState) -> TrainResult:
    """Step to `max_train_steps`; a checkpoint at the end, and on Ctrl-C or `StopTraining`."""
    t, acc = s.cfg.train, s.accelerator
    s.emit(
        kind="start", step=s.step, max_steps=t.max_train_steps, network=s.summary, data=s.data.stats
    )
    bar = progress_bar(acc, s.step, t.max_train_steps)
    losses: list[Any] = []  # of the micro-steps of the optimizer step under way (tensors)
    timer = RunTimer(s.run, s.main)
    # On a CPU the reads would start a second OpenMP team beside the step's, and two teams
    # spinning on the same cores slow each other many times over; the device is the CPU, so
    # there is nothing to hide the reads behind anyway.
    prefetch = Prefetcher(s.data, t.seed, enabled=s.device.type != "cpu")
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
                # The next batch is read in the background while this one trains.
                prefetch.ahead(*_next_batch(s, batches))
                loss, grad_norm = micro_step(s, batches[mine], mine, prefetch.loader(s.epoch, mine))
                losses.append(loss)
                if acc.sync_gradients:
                    end_of_step(s, losses, grad_norm, bar, started, timer)
            if s.position >= len(batches):
                s.epoch, s.position = s.epoch + 1, 0
                if not losses:
                    s.cursor = (s.epoch, s.position)
        final_weights(s.optimizer)  # what is kept: a schedule-free optimizer's average
        save(s, s.step)
        if s.world > 1:
            digest = weights_digest(trained_weights(s))
            audit(s.run, s.rank, {"final_step": s.step, "weights_sha256": digest})
        acc.wait_for_everyone()
    except (KeyboardInterrupt, StopTraining):
        _on_interrupt(s)
    finally:
        restore_signals()
        prefetch.close()
        bar.close()
        acc.end_training()
        timer.warmup(s.step)  # a run of two steps still reports its first one
        if s.main:
            note_tracker_files(s.run, s.cfg)
            # Also when training stopped on an error: the report then explains it.
            with timer.phase("doctor"):
                write_report(s.run.root, error=sys.exc_info()[1])
            # The archive must never replace the run's own error with one of its own.
            with contextlib.suppress(Exception), timer.phase("archive"):
                write_archive(
                    s.run.root,
                    started=s.started_at,
                    error=sys.exc_info()[1],
                    interrupted=s.result.interrupted,
                )
    s.result.step = s.step
    if s.main:
        with contextlib.suppress(Exception):  # a finished run never fails on its warning
            _warn_untrained(s)  # after the progress bar's last line
        with timer.phase("plot"):
            plot_metrics(s.run.read_metrics(), s.run.loss_plot)
        spent = timer.summary(("final_sample", "doctor", "archive", "plot"))
        if spent:
            acc.print(spent)
    s.emit(kind="end", step=s.step, result=s.result)
    return s.result


def end_of_step(
    s: TrainState,
    losses: list[Any],
    grad_norm: Any,
    bar: Any,
    started: float,
    timer: RunTimer | None = None,
) -> None:
    """After an optimizer step: upkeep, the metrics row, and a checkpoint or images when due.

    The loss and gradient norm stay on the device until a step that needs them as numbers:
    one that is logged, checkpointed or sampled (its row, the finite-loss guard). Other steps
    never wait for the device; the `step` event goes to the callbacks with each logged row.
    """
    t, acc = s.cfg.train, s.accelerator
    s.step += 1
    s.cursor = (s.epoch, s.position)
    s.method.after_step(s.comps)
    last = s.step == t.max_train_steps
    stable = bool(t.stable_loss_steps) and (s.step % t.stable_loss_steps == 0 or last)
    checkpoint = bool(t.checkpointing_steps) and s.step % t.checkpointing_steps == 0 and not last
    every = s.cfg.validation.validation_steps
    sample = last or bool(every and s.step % every == 0)
    logged = s.step % t.logging_steps == 0 or last or stable
    # The EMA, the fixed losses, checkpoints and images take the weights to keep (a
    # schedule-free optimizer's average, not the point it takes gradients at), on every process.
    with eval_weights(s.optimizer, s.ema is not None or stable or checkpoint or sample):
        if s.ema is not None:
            s.ema.step(s.params)
        bar.update(1)
        if timer is not None:
            _report_warmup(s, timer.step_done(s.step))
        if logged or checkpoint or sample:
            # The same decision on every process: the loss average is a collective.
            loss, norm = step_numbers(acc, losses, grad_norm)
            scale = acc.scaler.get_scale() if acc.scaler is not None else None
            guard_finite(loss, norm, s.step, s.precision, scale, s.result.checkpoint)
            row = step_row(s, loss, norm, scale, started)
            if stable:
                row.update(fixed_losses(s))
            logged = logged or "stable_loss" in row
            if logged:
                log_row(acc, s.run, row)
                bar.set_postfix(loss=f"{loss:.4f}")
                s.emit(kind="step", **row)
        losses.clear()
        if checkpoint:
            save(s, s.step)
        if s.main and sample and not is_fsdp(acc):
            phase = "final_sample" if last else "sample"
            with timer.phase(phase, step=s.step) if timer else contextlib.nullcontext():
                grid = validate(s, s.step)
            s.result.validation_grids.append(grid)
            log_grid(s.accelerator, s.step, grid)  # to the tracker too, where it takes images


def _warn_untrained(s: TrainState) -> None:
    """Say so where a trained part (an expert no batch drew) ends at its initial value, and
    how many batches each part of a denoiser of several drew."""
    if not s.method.zero_factors or s.result.checkpoint is None:
        return
    weights = exported_weights(s.result.checkpoint)
    for f in untrained_findings(s.family, s.method, weights, s.drawn, s.step):
        s.accelerator.print(f"{f.severity}: {f.title} ({'; '.join(f.evidence)})")


def _report_warmup(s: TrainState, row: dict[str, Any] | None) -> None:
    """Say on the console what the first step cost beyond a later one (a compile's warm-up)."""
    if row is None or not s.cfg.train.compile:
        return
    s.accelerator.print(
        f"compile: the first step took {row['seconds']:.1f} s, a later one "
        f"{row['later_step_seconds']:.2f} s: a warm-up of {row['warmup_seconds']:.1f} s"
    )


def _next_batch(s: TrainState, batches: list[list[int]]) -> tuple[int, int, list[int]]:
    """(epoch, index, samples) of this process's batch after the one now starting: later in
    this epoch, or the first of the next (whose order is as fixed as this one's)."""
    t = s.cfg.train
    if s.position < len(batches):
        return s.epoch, s.position + s.rank, batches[s.position + s.rank]
    following = epoch_batches(s.data.plan, t.train_batch_size, t.seed, s.epoch + 1, s.world)
    if s.rank >= len(following):
        return s.epoch + 1, s.rank, []
    return s.epoch + 1, s.rank, following[s.rank]


def _on_interrupt(s: TrainState) -> None:
    """Stopped by the user: keep what was learned, then stop cleanly."""
    last = s.result.checkpoint
    saved = last is not None and last.name == s.run.checkpoint(s.step).name
    if per_process(s) and s.step > 0 and not saved:
        # A DeepSpeed or FSDP checkpoint needs every process at the same point, which an
        # interrupt does not promise: the last periodic checkpoint is the one to resume from.
        s.accelerator.print("under DeepSpeed or FSDP no checkpoint is saved on an interrupt")
    elif s.main and s.step > 0 and not saved:
        final_weights(s.optimizer)
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
