"""Training on several devices: accelerate config files (DDP, DeepSpeed ZeRO, FSDP) and notebook
launches.

`write_accelerate_config` writes the YAML that `accelerate launch --config_file` reads, with the
kit config's gradient accumulation and clipping, so the two never disagree. DeepSpeed itself is
needed only by the machine that launches with that file, not to write it. The same file carries
the machines of a multi-node launch (`machines`, `machine_rank`, `main_process_ip`): each node
gets its own file, differing only in `machine_rank`.
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
"""ZeRO stages the kit supports. Stage 3 splits the weights themselves; the kit shards them with
FSDP instead (`--fsdp`), whose checkpoints it saves per process and gathers for export."""
FSDP_VERSIONS = (2,)
"""FSDP versions the kit trains with: FSDP2 (`fully_shard`) keeps each parameter a tensor of its
own, so adapters beside frozen weights, per-process checkpoints and the gathered export all work
on it. FSDP1 flattens parameters into one buffer per wrapped module."""
PRECISIONS = ("no", "fp16", "bf16")


def accelerate_config(
    cfg: Config | None = None,
    processes: int = 1,
    deepspeed_stage: int | None = None,
    offload_optimizer: bool = False,
    mixed_precision: str | None = None,
    fsdp: bool = False,
    fsdp_version: int = 2,
    fsdp_offload: bool = False,
    machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> Any:
    """accelerate's own `ClusterConfig`: plain, DDP, DeepSpeed ZeRO or FSDP, on one machine or
    several.

    `processes` counts the processes of every machine together (accelerate's `num_processes`),
    so two nodes of four GPUs are `processes=8, machines=2`.
    """
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    if processes < 1:
        raise KitError(f"--processes: {processes} must be at least 1")
    if deepspeed_stage == 3:
        raise KitError(
            "--deepspeed-stage: stage 3 is not supported: ZeRO-3 splits the weights across "
            "devices, and the kit shards them with FSDP instead, whose checkpoints resume "
            "exactly and whose export gathers the full weights; use --fsdp"
        )
    if deepspeed_stage is not None and deepspeed_stage not in ZERO_STAGES:
        raise KitError(
            f"--deepspeed-stage: {deepspeed_stage} is not supported (choose "
            f"{' or '.join(map(str, ZERO_STAGES))}, or --fsdp to shard the weights too)"
        )
    if fsdp and deepspeed_stage is not None:
        raise KitError("--fsdp and --deepspeed-stage exclude each other: choose one")
    if offload_optimizer and deepspeed_stage is None:
        raise KitError("--offload-optimizer needs DeepSpeed: add --deepspeed-stage 2")
    if fsdp_offload and not fsdp:
        raise KitError("--fsdp-offload needs FSDP: add --fsdp")
    if fsdp and fsdp_version not in FSDP_VERSIONS:
        raise KitError(
            f"--fsdp-version: {fsdp_version} is not supported (choose "
            f"{' or '.join(map(str, FSDP_VERSIONS))}): FSDP1 flattens each wrapped module's "
            "parameters into one buffer, which adapters beside frozen weights and the kit's "
            "per-process checkpoints do not read"
        )
    if machines < 1:
        raise KitError(f"--machines: {machines} must be at least 1")
    if not 0 <= machine_rank < machines:
        raise KitError(f"--machine-rank: {machine_rank} must be between 0 and {machines - 1}")
    if machines > 1 and not main_process_ip:
        raise KitError(
            "--main-process-ip is needed with --machines above 1: the address of machine 0, "
            "which every machine can reach"
        )
    if processes % machines:
        raise KitError(
            f"--processes: {processes} (all machines together) must be a multiple of "
            f"--machines {machines}"
        )
    if mixed_precision is None:
        mixed_precision = cfg.train.mixed_precision if cfg is not None else "no"
    mixed_precision = "no" if mixed_precision == "fp32" else mixed_precision
    if mixed_precision not in PRECISIONS:
        raise KitError(
            f"--mixed-precision: {mixed_precision!r} must be one of {', '.join(PRECISIONS)}"
        )
    accumulation = cfg.train.gradient_accumulation_steps if cfg is not None else 1
    deepspeed: dict[str, Any] = {}
    fsdp_config: dict[str, Any] = {}
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
    elif fsdp:
        kind = DistributedType.FSDP
        fsdp_config = {
            "fsdp_version": fsdp_version,
            # One shard group per block the model names as unsplittable (diffusers'
            # `_no_split_modules`): only one block is gathered whole at a time.
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": fsdp_offload,
            # Checkpoints hold each process's shard; the kit gathers the trained weights itself.
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
    else:
        kind = DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO
    # Accumulation and clipping stay the kit config's (the training loop reads them there).
    extra: dict[str, Any] = {}
    if machines > 1:
        extra = {"main_process_ip": main_process_ip, "same_network": True, "rdzv_backend": "static"}
        extra["main_process_port"] = main_process_port or 29500
    elif main_process_port:
        extra["main_process_port"] = main_process_port
    return ClusterConfig(
        compute_environment=ComputeEnvironment.LOCAL_MACHINE,
        distributed_type=kind,
        mixed_precision=mixed_precision,
        use_cpu=False,
        debug=False,
        num_processes=processes,
        num_machines=machines,
        machine_rank=machine_rank,
        gpu_ids="all",
        main_training_function="main",
        deepspeed_config=deepspeed,
        fsdp_config=fsdp_config,
        **extra,
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
