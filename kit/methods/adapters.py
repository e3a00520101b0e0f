"""Adapters on the denoiser through peft: LoRA, DoRA, LoHa and LoKr; everything else frozen.

One place decides which modules are adapted. The same code builds the preview (`kit network`),
the memory estimate and the real run, so what the preview lists is what trains.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from kit.config import Config
from kit.errors import ConfigError
from kit.families import Components, Family
from kit.io import write_with
from kit.methods import register
from kit.methods.base import (
    Apply,
    Method,
    NetworkSummary,
    freeze_all,
    load_lora,
    trainable_count,
    unwrap,
)
from kit.methods.lycoris import merge_into, to_lycoris


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


def summarize(module: nn.Module, kind: str) -> NetworkSummary:
    """Which modules carry an adapter and how many parameters train in each."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    per_module = {
        name: trainable_count(m)
        for name, m in module.named_modules()
        if isinstance(m, BaseTunerLayer)
    }
    total = sum(p.numel() for p in module.parameters())
    return NetworkSummary(kind, sorted(per_module), per_module, trainable_count(module), total)


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights in peft naming (no adapter name in the keys)."""
    from peft.utils import get_peft_model_state_dict

    return {
        k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module).items()
    }


def load_adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights back into an adapted module, refusing any mismatch."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigError(f"checkpoint holds adapter weights this network lacks: {unexpected[:3]}")


def merge_lycoris(family: Family) -> Apply:
    """Apply a LyCORIS-style file by merging it with the kit's own reader (`lycoris.py`)."""

    def apply(pipe: Any, path: Path) -> Any:
        denoiser = getattr(pipe, family.lora_layers_kwarg.removesuffix("_lora_layers"))
        merge_into(load_file(str(path)), denoiser, family.kohya_prefix)
        return pipe

    return apply


class Adapter(Method):
    """A peft adapter on the denoiser. Subclasses give the peft config and the kohya layout."""

    kohya_module = "networks.lora"
    """`ss_network_module` of the kohya file."""

    def peft_config(self, targets: list[str], alpha: float) -> Any:
        """The peft config of this adapter on `targets`."""
        raise NotImplementedError

    def adapter_config(self, denoiser: nn.Module) -> Any:
        """The peft config on the modules the config's filters select in `denoiser`."""
        return self.peft_config(target_modules(self.cfg, self.family, denoiser), self.alpha())

    def alpha(self) -> float:
        """The update scale's numerator: `lora_alpha`, or the rank when unset (as configured)."""
        net = self.cfg.network
        return net.lora_alpha if net.lora_alpha is not None else net.lora_rank

    # ------------------------------------------------------------ training

    def attach(self, comps: Components) -> NetworkSummary:
        freeze_all(comps.frozen_modules())
        comps.denoiser.add_adapter(self.adapter_config(comps.denoiser))
        return summarize(comps.denoiser, self.name)

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        return adapter_state_dict(unwrap(comps.denoiser))

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        load_adapter_state_dict(unwrap(comps.denoiser), state)

    def mark_trainable(self, parts: dict[str, nn.Module]) -> NetworkSummary:
        freeze_all(parts.values())
        denoiser = parts["denoiser"]
        denoiser.add_adapter(self.adapter_config(denoiser))
        return summarize(denoiser, self.name)

    # ------------------------------------------------------------ export

    def export_formats(self) -> tuple[str, ...]:
        return self.family.export_formats

    def kohya_tensors(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights in the kohya / LyCORIS key layout that A1111, Forge and ComfyUI load."""
        return self.family.kohya_state_dict(weights, float(self.alpha()))

    def kohya_apply(self) -> Apply:
        """How the kohya file is applied when it is verified."""
        return load_lora

    def kohya_network_args(self) -> dict[str, str]:
        """`ss_network_args` of the kohya file."""
        return {}

    def write_export(self, fmt, weights, meta, step, out) -> tuple[Path, Apply]:
        family = self.family
        denoiser = family.empty_parts(self.cfg.model.pretrained_model)["denoiser"]
        peft_config = self.adapter_config(denoiser)
        alpha, rank = float(self.alpha()), int(self.cfg.network.lora_rank)
        meta = {**meta, "kit.rank": str(rank), "kit.alpha": str(alpha)}
        if fmt == "diffusers":
            return _write_diffusers(family, weights, peft_config, meta, out), load_lora
        path = self._write_kohya(self.kohya_tensors(weights), alpha, rank, meta, step, out)
        return path, self.kohya_apply()

    def _write_kohya(self, tensors, alpha: float, rank: int, meta, step: int, out: Path) -> Path:
        cfg, family = self.cfg, self.family
        name = Path(cfg.train.output_dir).name or "lora"
        metadata = {
            **meta,
            "ss_network_module": self.kohya_module,
            "ss_network_dim": str(rank),
            "ss_network_alpha": str(alpha),
            "ss_network_args": json.dumps(self.kohya_network_args()),
            "ss_base_model_version": family.base_model_version,
            "ss_steps": str(step),
            "ss_output_name": name,
            "ss_resolution": f"({cfg.data.resolution}, {cfg.data.resolution})",
            "modelspec.sai_model_spec": "1.0.0",
            "modelspec.architecture": family.modelspec_architecture,
            "modelspec.implementation": "diffusers",
            "modelspec.title": name,
            "modelspec.trigger_phrase": ", ".join(cfg.data.trigger_words),
        }
        path = out / f"{name}.safetensors"
        write_with(path, lambda t: save_file(tensors, str(t), metadata=metadata))
        return path


def _write_diffusers(family: Family, adapter, peft_config, meta, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        written = family.save_diffusers_lora(adapter, peft_config.to_dict(), Path(tmp))
        with safe_open(str(written), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = {**(f.metadata() or {}), **meta}
        path = out / written.name
        write_with(path, lambda t: save_file(tensors, str(t), metadata=metadata))
    return path


@register
class Lora(Adapter):
    """Low-rank update of each adapted weight (LoRA)."""

    name = "lora"
    title = "LoRA"
    base_learning_rate = 1e-4
    dora = False

    def peft_config(self, targets, alpha):
        from peft import LoraConfig

        net = self.cfg.network
        return LoraConfig(
            r=net.lora_rank,
            lora_alpha=alpha,
            lora_dropout=net.lora_dropout,
            target_modules=targets,
            use_dora=self.dora,
            init_lora_weights=True,
        )


@register
class Dora(Lora):
    """LoRA with a learned per-row magnitude (DoRA); `use_dora` turns LoRA into this."""

    name = "dora"
    title = "DoRA"
    dora = True

    def kohya_apply(self) -> Apply:
        # diffusers drops kohya DoRA magnitudes, so DoRA is checked with the kit's own reader.
        return merge_lycoris(self.family)


class Lycoris(Adapter):
    """LoHa and LoKr: exported only as LyCORIS keys in the kohya naming."""

    kohya_module = "lycoris.kohya"
    base_learning_rate = 2e-4

    @classmethod
    def unsupported(cls, family: Family) -> str | None:
        if "kohya" in family.export_formats:
            return None
        return (
            f"{cls.title} is exported only as LyCORIS weights in the kohya naming, and "
            f"{family.name} has no kohya export (its formats: {', '.join(family.export_formats)})"
        )

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        # A dropped module's factors get no gradient that step; DDP must be told to expect it.
        self.leaves_unused = cfg.network.module_dropout > 0

    def export_formats(self) -> tuple[str, ...]:
        return tuple(f for f in self.family.export_formats if f == "kohya")

    def kohya_tensors(self, weights):
        rank = int(self.cfg.network.lora_rank)
        return to_lycoris(weights, float(self.alpha()), rank, self.family.kohya_prefix)

    def kohya_apply(self) -> Apply:
        return merge_lycoris(self.family)

    def kohya_network_args(self) -> dict[str, str]:
        return {"algo": self.name}


@register
class LoHa(Lycoris):
    """Hadamard product of two low-rank products (LoHa)."""

    name = "loha"
    title = "LoHa"

    def peft_config(self, targets, alpha):
        from peft import LoHaConfig

        net = self.cfg.network
        return LoHaConfig(
            r=net.lora_rank, alpha=alpha, module_dropout=net.module_dropout, target_modules=targets
        )


@register
class LoKr(Lycoris):
    """Kronecker product of two factors, one optionally low-rank (LoKr)."""

    name = "lokr"
    title = "LoKr"

    def peft_config(self, targets, alpha):
        from peft import LoKrConfig

        net = self.cfg.network
        return LoKrConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            decompose_factor=net.lokr_factor,
            decompose_both=net.lokr_decompose_both,
            target_modules=targets,
        )
