"""accelerate for one run: the precision this machine can run, the Accelerator, the sharded state
of DeepSpeed and FSDP."""

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
from kit.run.env import cpu_bf16
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
        if requested == "bf16" and cpu_bf16():
            return "bf16"  # autocast on the CPU, in its bf16 instructions
        also = " or a CPU with bf16 instructions (AVX512-BF16, AMX)" if requested == "bf16" else ""
        warnings.warn(
            f"mixed_precision={requested!r} needs a CUDA GPU{also}; none found, training in fp32",
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


def fsdp_launch() -> bool:
    """Whether `accelerate launch` started this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def is_fsdp(accelerator: Any) -> bool:
    """Whether this run's trained modules are sharded with FSDP."""
    return getattr(accelerator.state, "fsdp_plugin", None) is not None


def _fsdp_plugin() -> Any:
    """accelerate's FSDP plugin as the launch configured it (read from the environment), after
    checking that the kit can train with it."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise KitError(
            f"fsdp_version: {plugin.fsdp_version} in the accelerate config is not supported: the "
            "kit trains with FSDP2, which keeps every parameter a tensor of its own (adapters "
            "beside frozen weights, per-process checkpoints); set fsdp_version: 2 (kit "
            "accelerate-config --fsdp writes it)"
        )
    return plugin


def _fsdp_on_cpu(accelerator: Any) -> None:
    """Shard with FSDP in a CPU (gloo) launch, where accelerate keeps to plain data parallelism.

    accelerate turns FSDP on only for accelerator devices; torch's FSDP2 runs on CPU tensors over
    gloo as well. Marking the state FSDP before `prepare` sends the models through accelerate's
    own FSDP2 path, the one a GPU launch takes, so a CPU run tests that same path.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    accelerator.state.fsdp_plugin = _fsdp_plugin()
    accelerator.state.distributed_type = DistributedType.FSDP


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
    if on_cpu and precision == "bf16" and (deepspeed or fsdp_launch()):
        how = "DeepSpeed" if deepspeed else "FSDP"
        raise KitError(
            f"mixed_precision: bf16 on CPUs under {how} is not supported by the kit (it runs "
            f"{how} on CPUs in fp32 only, to test launches); set mixed_precision: no, or train "
            "on GPUs"
        )
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
    if fsdp_launch():
        if precision == "fp16" and accelerator.device.type == "cpu":
            raise KitError(
                f"mixed_precision: fp16 with FSDP on a CPU ({CPU_FP16_ENV}=1) is not supported: "
                "the CPU gradient scaler does not read sharded gradients; set mixed_precision: no"
            )
        if is_fsdp(accelerator):
            _fsdp_plugin()  # checks the version the launch asked for
        else:
            _fsdp_on_cpu(accelerator)
        accelerator.print(
            "FSDP: the denoiser is sharded across the processes, so no validation images are "
            "drawn during training; every checkpoint holds the whole weights (kit export and "
            "kit sample draw from them)"
        )
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


def full_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every FSDP shard gathered into its whole tensor, on every process.

    A collective: every process calls it with the same keys, in the same order (the method's
    `state_dict` of the same model gives them). Tensors that are not sharded pass unchanged.
    """
    from torch.distributed.tensor import DTensor

    return {
        k: v.full_tensor().detach().cpu().clone() if isinstance(v, DTensor) else v
        for k, v in state.items()
    }


def _fsdp_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], Any]:
    """The sharded model and optimizer state of this process, frozen weights left out (they
    come from the base model again at a resume)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    weights, moments = get_state_dict(model, optimizer, options=options)
    return {"model": weights, "optimizer": moments}, options


def save_fsdp(model: Any, optimizer: Any, folder: Path) -> None:
    """Write this process's shard of the trained weights and optimizer state under FSDP (torch's
    distributed checkpoint format: one `.distcp` file per process and a `.metadata` index).

    Called by every process together; `folder` is the same path on all of them (a folder every
    node can write to, as the run's own output folder must be).
    """
    import torch.distributed.checkpoint as dcp

    state, _ = _fsdp_state(model, optimizer)
    dcp.save(state, checkpoint_id=str(folder))


def load_fsdp(model: Any, optimizer: Any, checkpoint: Path) -> None:
    """Load this process's shard of the trained weights and optimizer state under FSDP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    folder = checkpoint / ckpt.FSDP_DIR
    if not (folder / ".metadata").is_file():
        raise KitError(
            f"{checkpoint} was not saved under FSDP (no {ckpt.FSDP_DIR}/.metadata): its weights "
            "and optimizer state are not sharded; resume it with the accelerate config it was "
            "trained with"
        )
    state, _ = _fsdp_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as e:  # torch raises its own CheckpointException, naming every rank's error
        raise KitError(f"could not load the FSDP state in {folder}: {e}") from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        # The frozen weights are not in the file: they stay the base model's.
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
