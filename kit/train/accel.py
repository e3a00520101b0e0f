"""accelerate for one run: the precision this machine can run, the Accelerator, DeepSpeed state."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.errors import KitError
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir

# Set to 1 to train fp16 (autocast and gradient scaler) on a CPU: slow and of no use for real
# training, but it runs the fp16 path (scaler, overflow skips, NaN stop) where no GPU is.
CPU_FP16_ENV = "KIT_ALLOW_CPU_FP16"

SHARDED_TAG = "zero"
"""The DeepSpeed engine's name for its state inside a checkpoint's `ckpt.SHARDED_DIR`."""


def resolve_precision(requested: str) -> str:
    """The mixed precision this machine can run: the request, or fp32 with a warning."""
    if requested == "no":
        return "no"
    if not torch.cuda.is_available():
        if requested == "fp16" and os.environ.get(CPU_FP16_ENV) == "1":
            return "fp16"
        warnings.warn(
            f"mixed_precision={requested!r} needs a CUDA GPU; none found, training in fp32",
            stacklevel=2,
        )
        return "no"
    if requested == "bf16" and not torch.cuda.is_bf16_supported():
        warnings.warn(
            "this GPU lacks bf16; training in fp32 (try mixed_precision=fp16)", stacklevel=2
        )
        return "no"
    return requested


def check_tracker(report_to: str) -> None:
    """Refuse a tracker that is not installed before anything loads (accelerate would drop it
    with a log line, and the run would go untracked)."""
    if report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise KitError(
            "report_to: wandb needs the wandb package, which is not installed: pip install wandb "
            "(or the kit's extra: pip install -e '.[wandb]'), or set report_to: tensorboard"
        )


def deepspeed_launch() -> bool:
    """Whether `accelerate launch` started this process with a DeepSpeed config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def make_accelerator(
    cfg: Config, run: RunDir, *, unused_parameters: bool = False
) -> tuple[Any, str]:
    """accelerate's Accelerator for this run, and the precision actually used.

    `unused_parameters`: a step may leave trained parameters without a gradient (the method's
    `leaves_unused`), which DDP must be told or it fails on the next step.
    """
    # accelerate is imported here: it is slow to import, and only training needs it.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import (
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProjectConfiguration,
    )

    t = cfg.train
    check_tracker(t.report_to)
    precision = resolve_precision(t.mixed_precision)
    handlers = []
    if precision == "fp16":
        handlers.append(
            GradScalerKwargs(
                init_scale=t.grad_scaler_init_scale,
                growth_factor=t.grad_scaler_growth_factor,
                backoff_factor=t.grad_scaler_backoff_factor,
                growth_interval=t.grad_scaler_growth_interval,
            )
        )
    if unused_parameters:
        # Costs a walk of the autograd graph per step, so only when the method needs it.
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    on_cpu = not torch.cuda.is_available()
    deepspeed = deepspeed_launch()
    if on_cpu and deepspeed:
        # accelerate drops DeepSpeed when told `cpu=True`; without it, it must be told that the
        # processes talk over gloo, or each one takes itself for the only process.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision") != precision:
        # accelerate keeps one precision per process; a later run in the same process (a
        # notebook kernel, a test session) may ask for another. The process group is kept.
        AcceleratorState._reset_state()
    accelerator = Accelerator(
        # Without a GPU, `cpu=True` is what makes accelerate join a multi-process (gloo) launch.
        cpu=on_cpu and not deepspeed,
        mixed_precision=precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=None if t.report_to == "none" else t.report_to,
        project_config=ProjectConfiguration(project_dir=str(run.root), logging_dir=str(run.logs)),
        kwargs_handlers=handlers,
    )
    if precision == "fp16" and accelerator.device.type == "cpu":
        # accelerate builds neither autocast nor a scaler for fp16 on a CPU; torch has both,
        # and accelerate uses them once they are set, before `prepare`.
        accelerator.scaler = torch.amp.GradScaler("cpu", **handlers[0].to_kwargs())
        accelerator.native_amp = True
    if accelerator.state.deepspeed_plugin is not None:
        # Batches are not given to `prepare` as a DataLoader, so DeepSpeed is told their size.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = t.train_batch_size
    return accelerator, precision


def save_sharded(engine: Any, folder: Path) -> None:
    """Write this process's part of the optimizer state (and the trained weights) under DeepSpeed."""
    engine.save_checkpoint(str(folder), tag=SHARDED_TAG, exclude_frozen_parameters=True)


def load_sharded(engine: Any, checkpoint: Path) -> None:
    """Load this process's part of the optimizer state (and the trained weights) under DeepSpeed."""
    folder = checkpoint / ckpt.SHARDED_DIR
    if not (folder / SHARDED_TAG).is_dir():
        raise KitError(
            f"{checkpoint} was not saved under DeepSpeed (no {ckpt.SHARDED_DIR}/ folder): its "
            "optimizer state cannot be split across processes; resume it without DeepSpeed"
        )
    # Only the trained weights were saved: the frozen base is not in the file. The schedule is
    # accelerate's, not the engine's, and comes back from the checkpoint's scheduler.pt.
    loaded, _ = engine.load_checkpoint(
        str(folder), tag=SHARDED_TAG, load_module_strict=False, load_lr_scheduler_states=False
    )
    if loaded is None:
        raise KitError(f"DeepSpeed could not load the state in {folder}")
