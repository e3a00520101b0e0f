"""Checkpoints during training: on the main process, or on every process under DeepSpeed and FSDP."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from kit.run import checkpoint as ckpt
from kit.train.accel import full_weights, is_fsdp, save_fsdp, save_sharded
from kit.train.resume import fingerprint
from kit.train.state import TrainState


def per_process(s: TrainState) -> bool:
    """Whether every process takes part in a checkpoint (DeepSpeed, FSDP), not the main one alone."""
    return s.deepspeed or is_fsdp(s.accelerator)


def trained_weights(s: TrainState) -> dict[str, torch.Tensor]:
    """The trained weights whole, as checkpoints save them. Under FSDP a collective: every
    process calls it, and every process gets the gathered weights."""
    state = s.method.state_dict(s.comps)
    return full_weights(state) if is_fsdp(s.accelerator) else state


def save(s: TrainState, step: int) -> Path | None:
    """Save the checkpoint of `step`; its path on the process that wrote it, else None.

    Under DeepSpeed and FSDP every process must call it at the same step.
    """
    if not per_process(s):
        return write_checkpoint(s, step) if s.main else None
    fsdp = is_fsdp(s.accelerator)
    # Each process writes its part of the optimizer state, then the main process moves the
    # whole into the checkpoint before marking it complete.
    part = ckpt.FSDP_DIR if fsdp else ckpt.SHARDED_DIR
    staged = s.run.staged_checkpoint_part(step, part)
    if s.main:
        shutil.rmtree(staged, ignore_errors=True)
    # Gathered on every process (a collective), written by the main one.
    weights = trained_weights(s) if fsdp else None
    s.accelerator.wait_for_everyone()
    if fsdp:
        save_fsdp(s.trained[0], s.optimizer, staged)
    else:
        save_sharded(s.trained[0], staged)  # the DeepSpeed engine
    s.accelerator.wait_for_everyone()
    path = write_checkpoint(s, step, {part: staged}, weights) if s.main else None
    s.accelerator.wait_for_everyone()  # no process goes on before the checkpoint is complete
    return path


def write_checkpoint(
    s: TrainState,
    step: int,
    staged: dict[str, Path] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the checkpoint folder (weights, optimizer unless `staged` holds it, schedule, random
    streams, position) and tell the callbacks. `staged`: the per-process state every process
    wrote (checkpoint folder name → where), which holds the optimizer's. `weights`: the trained weights already gathered
    (FSDP); else the method's own."""
    # The data position of the last finished optimizer step: batches of a step that an
    # interrupt cut short are trained again after a resume.
    epoch, position = s.cursor
    progress = {
        "step": step,
        "epoch": epoch,
        "position": position,
        "cpu_threads": torch.get_num_threads(),  # a resume keeps it (kit.run.threads)
        "precision": s.precision,  # used, not asked for: the export check reads it
        "drawn": dict(s.drawn),  # batches per expert: the doctor and the export report them
        **fingerprint(s.cfg, s.data, s.comps.identity),
    }
    extras: dict[str, Any] = {}
    if s.ema is not None:
        extras["ema"] = s.ema.state_dict()
    if s.accelerator.scaler is not None:
        extras["scaler"] = s.accelerator.scaler.state_dict()
    path = ckpt.save_checkpoint(
        s.run.root,
        step,
        s.method.state_dict(s.comps) if weights is None else weights,
        None if staged else s.optimizer,
        s.scheduler,
        s.generator,
        progress,
        keep=s.cfg.train.checkpoints_total_limit,
        extras=extras,
        ema_weights=ema_weights(s),
        folders=staged,
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
