"""Checkpoints during training: on the main process, or on every process under DeepSpeed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from kit.run import checkpoint as ckpt
from kit.train.accel import save_sharded
from kit.train.resume import fingerprint
from kit.train.state import TrainState


def save(s: TrainState, step: int) -> Path | None:
    """Save the checkpoint of `step`; its path on the process that wrote it, else None."""
    if not s.deepspeed:
        return write_checkpoint(s, step) if s.main else None
    # Each process writes its part of the optimizer state, then the main process moves the
    # whole into the checkpoint before marking it complete.
    staged = s.run.staged_checkpoint_part(step, ckpt.SHARDED_DIR)
    if s.main:
        shutil.rmtree(staged, ignore_errors=True)
    s.accelerator.wait_for_everyone()
    save_sharded(s.trained[0], staged)  # the DeepSpeed engine
    s.accelerator.wait_for_everyone()
    path = write_checkpoint(s, step, staged) if s.main else None
    s.accelerator.wait_for_everyone()  # no process goes on before the checkpoint is complete
    return path


def write_checkpoint(s: TrainState, step: int, staged: Path | None = None) -> Path:
    """Write the checkpoint folder (weights, optimizer unless `staged` holds it, schedule, random
    streams, position) and tell the callbacks."""
    # The data position of the last finished optimizer step: batches of a step that an
    # interrupt cut short are trained again after a resume.
    epoch, position = s.cursor
    progress = {"step": step, "epoch": epoch, "position": position, **fingerprint(s.cfg, s.data)}
    extras: dict[str, Any] = {}
    if s.ema is not None:
        extras["ema"] = s.ema.state_dict()
    if s.accelerator.scaler is not None:
        extras["scaler"] = s.accelerator.scaler.state_dict()
    path = ckpt.save_checkpoint(
        s.run.root,
        step,
        s.method.state_dict(s.comps),
        None if staged else s.optimizer,
        s.scheduler,
        s.generator,
        progress,
        keep=s.cfg.train.checkpoints_total_limit,
        extras=extras,
        ema_weights=ema_weights(s),
        folders={ckpt.SHARDED_DIR: staged} if staged else None,
    )
    s.result.checkpoint = path
    s.emit(kind="checkpoint", step=step, path=path)
    return path


def ema_weights(s: TrainState) -> dict[str, torch.Tensor] | None:
    """The averaged weights in the trained weights' saved form, or None without EMA."""
    if s.ema is None:
        return None
    with s.ema.swapped_in(s.params):
        return s.method.state_dict(s.comps)
