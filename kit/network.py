"""What is trained: adapters attached through peft, everything else frozen."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kit.config import Config
from kit.errors import ConfigError
from kit.families import Components, Family


@dataclass
class NetworkSummary:
    """The adapted modules and the trainable parameter count."""

    modules: list[str]
    trainable: int
    total: int


def lora_config(cfg: Config, family: Family):
    """The peft LoraConfig the run uses."""
    from peft import LoraConfig

    net = cfg.network
    targets = net.lora_target_modules or list(family.default_lora_targets)
    return LoraConfig(
        r=net.lora_rank,
        lora_alpha=net.lora_alpha if net.lora_alpha is not None else net.lora_rank,
        lora_dropout=net.lora_dropout,
        target_modules=targets,
        init_lora_weights=True,
    )


def attach(cfg: Config, family: Family, comps: Components) -> NetworkSummary:
    """Add the configured adapter to the denoiser; freeze all else."""
    for m in comps.frozen_modules():
        m.requires_grad_(False)
    config = lora_config(cfg, family)
    try:
        comps.denoiser.add_adapter(config)
    except ValueError as e:
        raise ConfigError(f"lora_target_modules: {e}") from None
    return summarize(comps.denoiser)


def trainable_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that receive gradients, in a fixed order."""
    return (p for p in module.parameters() if p.requires_grad)


def summarize(module: nn.Module) -> NetworkSummary:
    """Which modules carry an adapter and how many parameters train."""
    adapted = sorted(
        {name.rsplit(".lora_A", 1)[0] for name, _ in module.named_modules() if ".lora_A" in name}
    )
    trainable = sum(p.numel() for p in trainable_parameters(module))
    total = sum(p.numel() for p in module.parameters())
    return NetworkSummary(adapted, trainable, total)


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights in peft naming (no adapter name in the keys)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module).items()}


def load_adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights back into an adapted module, refusing any mismatch."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigError(f"checkpoint holds adapter weights this network lacks: {unexpected[:3]}")
