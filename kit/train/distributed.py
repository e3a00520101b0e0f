"""Training on several devices: accelerate config files (DDP, DeepSpeed ZeRO) and notebook launches.

`write_accelerate_config` writes the YAML that `accelerate launch --config_file` reads, with the
kit config's gradient accumulation and clipping, so the two never disagree. DeepSpeed itself is
needed only by the machine that launches with that file, not to write it.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from kit.config import Config, load_config
from kit.errors import KitError
from kit.io import write_with
from kit.run.folder import RunDir
from kit.train.loop import train

ZERO_STAGES = (1, 2)
"""ZeRO stages the kit supports; stage 3 splits the weights themselves, which its checkpoints
do not gather."""
PRECISIONS = ("no", "fp16", "bf16")


def accelerate_config(
    cfg: Config | None = None,
    processes: int = 1,
    deepspeed_stage: int | None = None,
    offload_optimizer: bool = False,
    mixed_precision: str | None = None,
) -> Any:
    """accelerate's own `ClusterConfig` for one machine: plain, DDP, or DeepSpeed ZeRO."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    if processes < 1:
        raise KitError(f"--processes: {processes} must be at least 1")
    if deepspeed_stage is not None and deepspeed_stage not in ZERO_STAGES:
        raise KitError(
            f"--deepspeed-stage: {deepspeed_stage} is not supported (choose {' or '.join(map(str, ZERO_STAGES))}); "
            "stage 3 splits the weights across devices, which the kit's checkpoints do not gather"
        )
    if offload_optimizer and deepspeed_stage is None:
        raise KitError("--offload-optimizer needs DeepSpeed: add --deepspeed-stage 2")
    if mixed_precision is None:
        mixed_precision = cfg.train.mixed_precision if cfg is not None else "no"
    mixed_precision = "no" if mixed_precision == "fp32" else mixed_precision
    if mixed_precision not in PRECISIONS:
        raise KitError(
            f"--mixed-precision: {mixed_precision!r} must be one of {', '.join(PRECISIONS)}"
        )
    accumulation = cfg.train.gradient_accumulation_steps if cfg is not None else 1
    deepspeed: dict[str, Any] = {}
    if deepspeed_stage is not None:
        kind = DistributedType.DEEPSPEED
        deepspeed = {
            "zero_stage": deepspeed_stage,
            "offload_optimizer_device": "cpu" if offload_optimizer else "none",
            "offload_param_device": "none",
            "gradient_accumulation_steps": accumulation,
            "zero3_init_flag": False,
        }
        if cfg is not None and cfg.train.max_grad_norm > 0:
            # DeepSpeed clips inside its own step; accelerate's clip_grad_norm_ only reads the norm.
            deepspeed["gradient_clipping"] = cfg.train.max_grad_norm
    else:
        kind = DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO
    return ClusterConfig(
        compute_environment=ComputeEnvironment.LOCAL_MACHINE,
        distributed_type=kind,
        mixed_precision=mixed_precision,
        use_cpu=False,
        debug=False,
        num_processes=processes,
        num_machines=1,
        machine_rank=0,
        gpu_ids="all",
        main_training_function="main",
        deepspeed_config=deepspeed,
    )


def write_accelerate_config(out: str | Path, cfg: Config | None = None, **options: Any) -> Path:
    """Write the accelerate config file (YAML) for `cfg` and `options` (see `accelerate_config`)."""
    out = Path(out)
    if out.suffix.lower() not in (".yaml", ".yml"):
        raise KitError(f"accelerate config file {out} must end in .yaml (accelerate reads YAML)")
    config = accelerate_config(cfg, **options)
    write_with(out, lambda tmp: config.to_yaml_file(str(tmp)))
    return out


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_process(cfg: Config, resume: str | None, kw: dict[str, Any]) -> None:
    """What each launched process runs: the ordinary training loop."""
    train(cfg, resume=resume, **kw)


def launch_in_notebook(
    config: Config | str | Path,
    num_processes: int,
    resume: str | None = "latest",
    port: int | None = None,
    **kw: Any,
) -> RunDir:
    """Train in `num_processes` processes from a notebook (accelerate's notebook_launcher).

    The processes are forked from the notebook, so nothing may have touched the GPU before this
    call (no Accelerator made, no model moved to CUDA): restart the kernel if one has. `kw` goes
    to `kit.train.loop.train` (`force`, `overwrite`, `callbacks`); results are read from the run folder.
    """
    import torch
    from accelerate import notebook_launcher
    from accelerate.state import AcceleratorState

    cfg = config if isinstance(config, Config) else load_config(config)
    if num_processes < 1:
        raise KitError(f"num_processes: {num_processes} must be at least 1")
    if num_processes > 1 and AcceleratorState._shared_state:
        raise KitError(
            "this notebook already trained or made an Accelerator in its own process; "
            "restart the kernel and launch before anything else touches the GPU"
        )
    precision = cfg.train.mixed_precision
    precision = precision if precision in ("fp16", "bf16") and torch.cuda.is_available() else "no"
    try:
        notebook_launcher(
            _train_process,
            args=(cfg, resume, kw),
            num_processes=num_processes,
            mixed_precision=precision,
            use_port=str(port or free_port()),
        )
    except RuntimeError as e:
        raise KitError(f"the {num_processes}-process launch failed: {e}") from None
    return RunDir(Path(cfg.train.output_dir))
