"""What one run holds once prepared, and what it returns: `prepare` builds it, `fit` advances it."""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.data.cache import CachedDataset
from kit.data.scan import ScanReport
from kit.families import Components, Family
from kit.families.training_adapter import TrainingAdapter
from kit.precision import torch_dtype
from kit.run.folder import RunDir
from kit.train.objective import EMA, FixedLoss

Callback = Callable[[dict[str, Any]], None]


class StopTraining(Exception):
    """Raised by a callback to end training early: a checkpoint is saved, as after Ctrl-C."""


@dataclass
class TrainResult:
    """Where a run ended and what it wrote."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    interrupted: bool = False
    validation_grids: list[Path] = field(default_factory=list)

    def __str__(self) -> str:
        """One sentence for a person (a notebook cell's result, a log line)."""
        how = "stopped" if self.interrupted else "finished"
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else "; no checkpoint"
        grids = len(self.validation_grids)
        return (
            f"training {how} at step {self.step} in {self.run_dir}{saved}; "
            f"{grids} validation grid{'s' if grids != 1 else ''} drawn"
        )

    def _repr_html_(self) -> str:
        return f"<p>{html.escape(str(self))}</p>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))  # IPython's plain-text form too, not the dataclass repr


@dataclass
class TrainState:
    """One run, ready to step: what it trains, on what data, and how far it has got."""

    cfg: Config
    run: RunDir
    accelerator: Any
    precision: str
    """The mixed precision actually used (`resolve_precision`)."""
    family: Family
    comps: Components
    method: Any
    """What is trained (`kit.methods.get_method`)."""
    summary: Any
    """What `method.attach` reported: the trained parts and their sizes."""
    params: list[torch.nn.Parameter]
    denoiser: Any
    """The denoiser, as `accelerator.prepare` returned it when it trains (wrapped under DDP or
    DeepSpeed)."""
    trained: list[Any]
    """The modules that hold trained parameters, as `accelerator.prepare` returned them."""
    optimizer: Any
    scheduler: Any
    ema: EMA | None
    data: CachedDataset
    fixed: FixedLoss
    fixed_holdout: FixedLoss | None
    empty_text: dict[str, torch.Tensor]
    """The empty caption's embedding, for caption dropout (empty without dropout)."""
    report: ScanReport
    """The data report: every file left out or changed, with why."""
    prompts: list[str]
    embedded_prompts: bool
    """The grids' prompts are cached with the captions and drawn from their embeddings
    (`kit.sample.embedded`): validation needs no text encoder."""
    training_adapter: TrainingAdapter | None
    """The LoRA run inside a step-distilled base while training (`training_adapter`)."""
    emit: Callable[..., None]
    """Sends an event (`kind=...`) to every callback."""
    started_at: float
    """Wall clock at the start, for the run archive."""
    result: TrainResult
    resume_from: Path | None
    generator: torch.Generator
    """The stream saved in checkpoints: the seed's, then that of the last batch drawn."""
    regular: Any = None
    """Output preservation and base-prediction targets (`kit.train.preserve.Preserver`), when
    the run has either; None trains on the plain denoising loss."""
    step: int = 0
    epoch: int = 0
    position: int = 0
    """The next batch of this epoch (every process's share counted)."""
    cursor: tuple[int, int] = (0, 0)
    """(epoch, position) of the last finished optimizer step: where a resume starts reading."""
    drawn: dict[str, int] = field(default_factory=dict)
    """Batches each part of a denoiser of several drew (a Wan 2.2 expert: `NoiseDraw.part`)."""

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the frozen base's weights."""
        return torch_dtype(self.precision)

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.state.deepspeed_plugin is not None

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process
