"""What a run reports as it goes: metrics rows, trackers, the progress bar, events, process logs."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from kit.config import Config
from kit.run.folder import RunDir
from kit.train.state import Callback, TrainState


def scalar_config(cfg: Config) -> dict[str, Any]:
    """The flat config with lists as strings (trackers take scalars only)."""
    out = {}
    for k, v in cfg.to_dict(flat=True).items():
        out[k] = v if isinstance(v, int | float | str | bool) else json.dumps(v)
    return out


def start_trackers(accelerator: Any, cfg: Config) -> None:
    """Open the configured trackers (`report_to`), if any."""
    if accelerator.log_with:
        accelerator.init_trackers("kit", config=scalar_config(cfg))


def step_row(
    s: TrainState, loss: float, grad_norm: float | None, scale: float | None, started: float
) -> dict[str, Any]:
    """The metrics of the step just taken."""
    row = {
        "step": s.step,
        "epoch": s.epoch,
        "loss": loss,
        "lr": s.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "time": round(time.perf_counter() - started, 3),
    }
    if scale is not None:
        row["loss_scale"] = scale
    if torch.cuda.is_available():
        row["memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    return row


def log_row(accelerator: Any, run: RunDir, row: dict[str, Any]) -> None:
    """Append a row to the metrics file and send its numbers to the trackers (main process)."""
    if not accelerator.is_main_process:
        return
    with open(run.metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    if accelerator.log_with:
        scalars = {k: v for k, v in row.items() if isinstance(v, int | float) and k != "step"}
        accelerator.log(scalars, step=row["step"])


def progress_bar(accelerator: Any, start: int, total: int) -> Any:
    """The step bar, shown by the first process of each machine only."""
    return tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )


def emitter(callbacks: list[Callback] | tuple[Callback, ...]) -> Callable[..., None]:
    """A function that sends one event, given as keywords, to every callback."""

    def emit(**event: Any) -> None:
        for cb in callbacks:
            cb(event)

    return emit


def audit(run: RunDir, rank: int, record: dict[str, Any]) -> None:
    """Per-process record of a multi-process run: which samples it saw, what it ended with."""
    run.logs.mkdir(parents=True, exist_ok=True)
    with open(run.process_log(rank), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of trained weights, to check that every process ended with the same ones."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
