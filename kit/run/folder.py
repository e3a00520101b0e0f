"""The layout of a run folder, shared by training, validation, export and the notebooks."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.errors import KitError

_STEP_NAME = re.compile(r"step-(\d+)")


def step_of(folder: Path) -> int | None:
    """The step a `step-N` folder (a checkpoint or a validation grid) is named for, else None."""
    m = _STEP_NAME.fullmatch(folder.name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run folder."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def manifest(self) -> Path:
        return self.root / "dataset_manifest.json"

    @property
    def data_report(self) -> Path:
        """Every dataset file skipped or changed, with why (a JSON list of file and reason)."""
        return self.root / "data_report.json"

    @property
    def metrics(self) -> Path:
        return self.root / "logs" / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def validation(self) -> Path:
        return self.root / "validation"

    @property
    def validation_controls(self) -> Path:
        """The controls of an edit run's default grid that came from a dataset or shards (its
        pairs' control images, written as files: a grid's entry names its controls by file)."""
        return self.validation / "controls"

    @property
    def exports(self) -> Path:
        return self.root / "exports"

    @property
    def rejected_exports(self) -> Path:
        """Exports that failed their check, kept (with the reason) away from `exports/<fmt>`."""
        return self.exports / "rejected"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def checkpoints(self) -> Path:
        """The folder of every checkpoint, `step-NNNNNN` each."""
        return self.root / "checkpoints"

    @property
    def doctor_report(self) -> Path:
        return self.root / "doctor.json"

    @property
    def archive(self) -> Path:
        return self.root / "archive.json"

    @property
    def lock(self) -> Path:
        """The lock file held while a command works in the run (`kit.run.lock`)."""
        return self.root / ".kit.lock"

    @property
    def error_log(self) -> Path:
        """The full traceback of each command that failed in this run, newest last."""
        return self.logs / "error.log"

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of `step` lives."""
        return self.checkpoints / f"step-{step:06d}"

    def staged_checkpoint(self, step: int) -> Path:
        """A hidden folder where the checkpoint of `step` is written before it is renamed."""
        return self.checkpoints / f".step-{step:06d}.tmp"

    def staged_checkpoint_part(self, step: int, part: str) -> Path:
        """A hidden folder where every process writes its share of `part` before the checkpoint
        of `step` is assembled (multi-process sharded state)."""
        return self.checkpoints / f".step-{step:06d}.{part}.tmp"

    def process_log(self, rank: int) -> Path:
        """Per-process record of a multi-process run."""
        return self.logs / f"process-{rank}.jsonl"

    def validation_step(self, step: int) -> Path:
        """Folder of the validation images drawn at `step`."""
        return self.validation / f"step-{step:06d}"

    def validation_with_adapter(self, step: int) -> Path:
        """Folder of the images drawn at `step` with the training adapter on (the base as
        training sees it), beside the step's own images, which are drawn without it."""
        return self.validation_step(step) / "with-training-adapter"

    def validation_steps(self) -> dict[int, Path]:
        """Every folder written by `validation_step`, by step."""
        if not self.validation.is_dir():
            return {}
        found = {}
        for d in self.validation.iterdir():
            step = step_of(d)
            if step is not None and d.is_dir():
                found[step] = d
        return dict(sorted(found.items()))

    def validation_scales(self, checkpoint_name: str) -> Path:
        """Folder of a checkpoint's images drawn at several adapter scales."""
        return self.validation / f"{checkpoint_name}-scales"

    def scale_folders(self) -> list[Path]:
        """Every folder written by `validation_scales`, in name order."""
        return sorted(self.validation.glob("*-scales")) if self.validation.is_dir() else []

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every logged row of the metrics file."""
        if not self.metrics.is_file():
            return []
        rows = []
        for line in self.metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        return rows


def open_run(path: str | Path) -> RunDir:
    """A run folder that training has written, or a clear error."""
    run = RunDir(Path(path))
    if not run.config.is_file():
        raise KitError(f"not a run folder (no config.json): {path}")
    return run
