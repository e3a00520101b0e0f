"""What a run reports as it goes: metrics rows, trackers, the progress bar, events, process logs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kit.config import Config
from kit.errors import KitError
from kit.families.identity import public_name
from kit.io import append_line, note_written
from kit.optim import learning_rate
from kit.run.folder import RunDir
from kit.train.state import Callback, TrainState


def scalar_config(cfg: Config) -> dict[str, Any]:
    """The flat config with lists as strings (trackers take scalars only)."""
    out = {}
    for k, v in cfg.to_dict(flat=True).items():
        out[k] = v if isinstance(v, int | float | str | bool) else json.dumps(v)
    return out


TENSORBOARD_PROJECT = "kit"
"""TensorBoard's folder under the run's `logs/`."""

WANDB_SETTINGS = {
    # No record of the machine (the program's and Python's paths, the working folder, the
    # command line), of the git checkout or of the code: a run on W&B is often shared, and
    # these would show the user's folder layout. Metrics, images and the config still go.
    "x_disable_meta": True,
    "disable_git": True,
    "save_code": False,
    # The kit prints paths (checkpoints, resumes) and its progress bar: the run's console
    # stays on the user's screen, not in W&B's copy of it.
    "console": "off",
}
"""`wandb.init` settings of every kit run (wandb 0.19 names)."""


def shareable_config(cfg: Config) -> dict[str, Any]:
    """The flat config for a tracker whose data leaves the machine (W&B): `scalar_config` with
    every local path cut to its last part, as exports name the base model and the dataset."""
    out = {}
    for k, v in scalar_config(cfg).items():
        if isinstance(v, str) and v.startswith(("[", "{")):
            with contextlib.suppress(ValueError):  # a list or table, as `scalar_config` wrote it
                v = json.dumps(_no_paths(json.loads(v)))
        out[k] = _no_paths(v)
    return out


def _no_paths(value: Any) -> Any:
    """`value` with every local path in it (in lists and tables too) replaced by its name."""
    if isinstance(value, list):
        return [_no_paths(x) for x in value]
    if isinstance(value, dict):
        return {k: _no_paths(v) for k, v in value.items()}
    return public_name(value) if isinstance(value, str) and value else value


def start_trackers(accelerator: Any, cfg: Config) -> None:
    """Open the configured trackers (`report_to`), if any.

    W&B: the project is `WANDB_PROJECT`, else the run folder's name, which also names the run;
    its files go under `WANDB_DIR`, else the run's `logs/`. The API key is wandb's own affair
    (`WANDB_API_KEY` or `wandb login`): the kit config never holds one.
    """
    if not accelerator.log_with:
        return
    if cfg.train.report_to != "wandb":
        accelerator.init_trackers(TENSORBOARD_PROJECT, config=scalar_config(cfg))
        return
    _start_wandb(accelerator, cfg)


def note_tracker_files(run: RunDir, cfg: Config) -> None:
    """List the files a tracker wrote into the run's `logs/` in the run's ledger: the library
    writes them itself, past the kit's writers, and `--overwrite` removes only listed files."""
    if cfg.train.report_to == "none":
        return
    folder = run.logs / ("wandb" if cfg.train.report_to == "wandb" else TENSORBOARD_PROJECT)
    if folder.is_dir():
        note_written(folder)


def _start_wandb(accelerator: Any, cfg: Config) -> None:
    """Open the W&B run (see `start_trackers`) and say where it is."""
    import wandb.errors

    run = RunDir(Path(cfg.train.output_dir))
    name = run.root.name
    init: dict[str, Any] = {
        "name": name,
        # Given to `wandb.init`, not to `init_trackers`: accelerate would put it into wandb's
        # global config, which another run open in the same process (a notebook) may own.
        "config": shareable_config(cfg),
        "settings": dict(WANDB_SETTINGS),
    }
    # Both given each time: wandb reads its environment once per process, and a notebook
    # kernel may change them between runs.
    init["dir"] = os.environ.get("WANDB_DIR") or str(run.logs)
    Path(init["dir"]).mkdir(parents=True, exist_ok=True)
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        init["mode"] = os.environ["WANDB_MODE"]
    # W&B refuses these characters in a project name; a folder name may hold them.
    project = os.environ.get("WANDB_PROJECT") or re.sub(r"[/\\#?%:]", "-", name)
    try:
        accelerator.init_trackers(project, init_kwargs={"wandb": init})
    except wandb.errors.Error as e:
        raise KitError(
            f"report_to: wandb: W&B did not start the run ({e}); set WANDB_API_KEY or run "
            "`wandb login`, or set WANDB_MODE=offline to keep the run on this machine"
        ) from e
    if not accelerator.is_main_process:
        return
    wb = accelerator.get_tracker("wandb", unwrap=True)
    # wandb itself is kept silent (kit.logs.quiet_libraries): this line says where the run is.
    if wb.url:
        accelerator.print(f"W&B run: {wb.url}")
    elif wb.settings.mode == "offline":
        accelerator.print(
            f"W&B run saved offline in {wb.settings.sync_dir} (`wandb sync` uploads it)"
        )


def log_grid(accelerator: Any, step: int, grid: Path) -> None:
    """Send a validation grid to the trackers that take images (W&B), main process only.

    TensorBoard is left out: the grids are in the run's `validation/` folder already.
    """
    if not accelerator.is_main_process or "wandb" not in [t.name for t in accelerator.trackers]:
        return
    from PIL import Image

    with Image.open(grid) as im:
        image = im.convert("RGB")
    accelerator.get_tracker("wandb").log_images({"validation": [image]}, step=step)


def step_row(
    s: TrainState, loss: float, grad_norm: float | None, scale: float | None, started: float
) -> dict[str, Any]:
    """The metrics of the step just taken."""
    row = {
        "step": s.step,
        "epoch": s.epoch,
        "loss": loss,
        "lr": learning_rate(s.optimizer, s.scheduler),
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
    append_line(run.metrics, json.dumps(row))
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
    append_line(run.process_log(rank), json.dumps(record))


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of trained weights, to check that every process ended with the same ones."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


TIMING_FILE = "timing.jsonl"
"""The run's timing rows, in its `logs/` folder: one JSON object per timed phase."""


class RunTimer:
    """Where a run's time went: the first steps (a compile's warm-up) and the phases after the
    last step (the final sample, the doctor report, the archive, the plot).

    Each phase is a row `{"kind": "timing", "phase": ..., "seconds": ...}` appended to
    `logs/timing.jsonl` as soon as it is measured (main process only), so that a run that
    stops later still has the rows measured before; `summary()` is the line the console shows.
    The metrics file keeps its one row per logged step.
    """

    FIRST_STEPS = 3
    """Steps timed one by one from the start: the first, and what later steps take."""

    def __init__(self, run: RunDir, main: bool = True) -> None:
        self.path = run.logs / TIMING_FILE
        self.main = main
        self.rows: list[dict[str, Any]] = []
        self.step_seconds: list[float] = []
        self._last = time.perf_counter()

    def add(self, phase: str, seconds: float, **extra: Any) -> dict[str, Any]:
        """Record one phase (and write its row)."""
        row = {"kind": "timing", "phase": phase, "seconds": round(seconds, 3), **extra}
        self.rows.append(row)
        if self.main:
            append_line(self.path, json.dumps(row))
        return row

    @contextlib.contextmanager
    def phase(self, name: str, **extra: Any):
        """Time the block as phase `name`; also when it raises (then with `"error": true`)."""
        start = time.perf_counter()
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            more = {**extra, "error": True} if failed else extra
            self.add(name, time.perf_counter() - start, **more)

    def restart(self) -> None:
        """The first step starts now (after the setup before the loop)."""
        self._last = time.perf_counter()

    def step_done(self, step: int) -> dict[str, Any] | None:
        """Note the end of optimizer step `step`; after the first few, the warm-up row: the first
        step's seconds, a later step's (the fastest of the next ones) and the difference."""
        now = time.perf_counter()
        if len(self.step_seconds) >= self.FIRST_STEPS:
            return None
        self.step_seconds.append(now - self._last)
        self._last = now
        if len(self.step_seconds) < self.FIRST_STEPS:
            return None
        return self.warmup(step)

    def warmup(self, step: int) -> dict[str, Any] | None:
        """The warm-up row from the steps timed so far (None before a second step)."""
        if len(self.step_seconds) < 2 or any(r["phase"] == "first_step" for r in self.rows):
            return None
        first, later = self.step_seconds[0], min(self.step_seconds[1:])
        return self.add(
            "first_step",
            first,
            later_step_seconds=round(later, 3),
            warmup_seconds=round(max(first - later, 0.0), 3),
            step=step,
        )

    def summary(self, phases: tuple[str, ...] = ()) -> str:
        """`time: final sample 1.20 s, doctor 0.31 s, ...` for the named (or all) phases."""
        parts = [
            f"{r['phase'].replace('_', ' ')} {r['seconds']:.2f} s"
            for r in self.rows
            if not phases or r["phase"] in phases
        ]
        return "time: " + ", ".join(parts) if parts else ""
