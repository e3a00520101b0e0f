"""What is trained: adapters attached through peft (LoRA, DoRA, LoHa, LoKr), everything else frozen.

One place decides which parameters train. The same code builds the preview (`kit network`),
the memory estimate and the real run, so what the preview lists is what trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.errors import ConfigError
from kit.families import Components, Family

ADAPTERS = ("lora", "dora", "loha", "lokr")


@dataclass
class NetworkSummary:
    """The adapted modules, with trainable parameters per module, and the totals."""

    kind: str
    modules: list[str]
    per_module: dict[str, int]
    trainable: int
    total: int

    def rows(self) -> list[dict[str, Any]]:
        """One row per adapted module: name and trainable parameters (for tables)."""
        return [{"module": m, "trainable": self.per_module[m]} for m in self.modules]


def adapter_kind(cfg: Config) -> str:
    """`lora`, `dora`, `loha` or `lokr` (`use_dora` turns LoRA into DoRA)."""
    kind = cfg.network.network_type
    return "dora" if kind == "lora" and cfg.network.use_dora else kind


def _matches(name: str, targets: list[str]) -> bool:
    # peft's rule: a target is the full name or a dotted suffix of it.
    return any(name == t or name.endswith("." + t) for t in targets)


def target_modules(cfg: Config, family: Family, denoiser: nn.Module) -> list[str]:
    """Full names of the modules to adapt, after the substring filters (ignore wins)."""
    net = cfg.network
    targets = net.lora_target_modules or list(family.default_lora_targets)
    names = []
    for name, module in denoiser.named_modules():
        if not isinstance(module, nn.Linear | nn.Conv2d) or not _matches(name, targets):
            continue
        if net.only_if_contains and not any(s in name for s in net.only_if_contains):
            continue
        if any(s in name for s in net.ignore_if_contains):
            continue
        names.append(name)
    if not names:
        raise ConfigError(
            f"no module of the {family.name} denoiser matches lora_target_modules={targets} "
            f"with only_if_contains={net.only_if_contains} and "
            f"ignore_if_contains={net.ignore_if_contains}"
        )
    return names


def adapter_config(cfg: Config, family: Family, denoiser: nn.Module) -> Any:
    """The peft config of the configured adapter kind, on the filtered modules."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    net = cfg.network
    kind = adapter_kind(cfg)
    targets = target_modules(cfg, family, denoiser)
    alpha = net.lora_alpha if net.lora_alpha is not None else net.lora_rank
    if kind in ("lora", "dora"):
        return LoraConfig(
            r=net.lora_rank,
            lora_alpha=alpha,
            lora_dropout=net.lora_dropout,
            target_modules=targets,
            use_dora=kind == "dora",
            init_lora_weights=True,
        )
    if kind == "loha":
        return LoHaConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            target_modules=targets,
        )
    if kind == "lokr":
        return LoKrConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            decompose_factor=net.lokr_factor,
            decompose_both=net.lokr_decompose_both,
            target_modules=targets,
        )
    raise ConfigError(f"network_type '{net.network_type}' is not an adapter (one of {ADAPTERS})")


def alpha_and_rank(peft_config: Any) -> tuple[float, int]:
    """(alpha, rank) of any of the peft adapter configs."""
    alpha = getattr(peft_config, "lora_alpha", None)
    if alpha is None:
        alpha = peft_config.alpha
    return float(alpha), int(peft_config.r)


def attach(cfg: Config, family: Family, comps: Components) -> NetworkSummary:
    """Add the configured adapter to the denoiser; freeze all else."""
    for m in comps.frozen_modules():
        m.requires_grad_(False)
    comps.denoiser.add_adapter(adapter_config(cfg, family, comps.denoiser))
    return summarize(comps.denoiser, adapter_kind(cfg))


def preview(cfg: Config) -> NetworkSummary:
    """The modules the configured adapter would adapt, built on the meta device (no weights)."""
    from kit.families import get_family

    family = get_family(cfg.model.model_family, cfg)
    denoiser = family.empty_parts(cfg.model.pretrained_model)["denoiser"]
    denoiser.requires_grad_(False)
    denoiser.add_adapter(adapter_config(cfg, family, denoiser))
    return summarize(denoiser, adapter_kind(cfg))


def trainable_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that receive gradients, in a fixed order."""
    return (p for p in module.parameters() if p.requires_grad)


def summarize(module: nn.Module, kind: str = "lora") -> NetworkSummary:
    """Which modules carry an adapter and how many parameters train in each."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    per_module = {
        name: sum(p.numel() for p in m.parameters() if p.requires_grad)
        for name, m in module.named_modules()
        if isinstance(m, BaseTunerLayer)
    }
    trainable = sum(p.numel() for p in trainable_parameters(module))
    total = sum(p.numel() for p in module.parameters())
    return NetworkSummary(kind, sorted(per_module), per_module, trainable, total)


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
