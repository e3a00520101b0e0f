"""The method seam: what a run trains, how it is saved, estimated, planned and exported.

A method answers a small fixed set of questions (attach, parameters, state, upkeep, memory model,
learning rate, export formats and writers, which families it can finish on). The training loop,
the estimator, the planner and export call these and never branch on a method's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.families import Components, Family

Apply = Callable[[Any, Path], Any]
"""(fresh base pipeline, exported path) → a pipeline that draws with the export applied."""


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


class Method:
    """One training method. Subclass, set the class attributes, register with `@register`."""

    name: str = ""
    """The method's name: a `network_type` value (or `dora`, which `use_dora` also selects)."""
    title: str = ""
    """How prose names it (the planner's reasons)."""
    base_learning_rate: float = 1e-4
    """The planner's starting rate at an effective batch of 8 (update scale alpha/rank = 1)."""
    live_text = False
    """True when gradients reach the text encoders: captions are encoded every step, not cached."""
    trains_denoiser = True
    """The denoiser holds trained parameters (an adapter or its own weights): accelerate wraps
    it, so its gradients are averaged across processes."""
    whole_denoiser = False
    """Every weight of the denoiser trains: it stays fp32 instead of taking the half dtype."""
    leaves_unused = False
    """A step may leave some trained parameters without a gradient (DDP must then look for them)."""
    low_rank = False
    """The method trains a low-rank update of the denoiser's weights (the adapter kinds):
    what `kit resize` can shrink, whose rank and alpha the model card reports."""
    rank_bounded = False
    """Its update's rank is at most the configured rank (plain LoRA: ΔW = B·A), so resizing
    to that rank or above would change nothing."""
    size_per_rank = False
    """What it trains grows in proportion to `lora_rank` (LoRA and DoRA: r·(in + out) per
    module; LoHa twice that), so its size at any rank follows from two small ranks'."""
    embeddings = False
    """The method trains new token embeddings: prompts must use its placeholder tokens."""
    hub_tags: tuple[str, ...] = ()
    """The model card's tags that say what kind of file this is (`lora`, `lycoris`, …)."""
    modelspec_adapter: str = ""
    """The adapter kind appended to `modelspec.architecture` (`lora`, `textual-inversion`);
    empty for a whole model."""

    own_keys: tuple[str, ...] = ()
    """Network keys only this method (and the others that list them) reads: set away from
    their defaults on another method, they are refused (`get_method`), never ignored."""
    zero_factors: tuple[str, ...] = ()
    """Names of the update's factors (weight-name parts) that start at zero: while any of a
    module's is still all zero, its update is zero and the module unchanged (`untrained`)."""

    switchable = False
    """What trains is an adapter beside the frozen base that can be switched off
    (`adapter_off`), so the base model's own prediction is there to compare with (output
    preservation, base-prediction targets)."""

    def __init__(self, cfg: Config, family: Family) -> None:
        self.cfg = cfg
        self.family = family

    def untrained(self, weights: dict[str, torch.Tensor]) -> bool:
        """Whether these trained weights (one file's) still change nothing: every adapted
        module keeps a factor that starts at zero all zero, as before its first step."""
        zero: dict[str, bool] = {}
        for key, value in weights.items():
            for factor in self.zero_factors:
                head, sep, _ = f"{key}.".partition(f".{factor}.")
                if sep:
                    zero[head] = zero.get(head, False) or not bool(value.any())
        return bool(zero) and all(zero.values())

    # ------------------------------------------------------------ which families

    @classmethod
    def unsupported(cls, family: Family) -> str | None:
        """Why this method cannot be trained and exported on `family`; None when it can."""
        return None

    # ------------------------------------------------------------ training

    def attach(self, comps: Components) -> NetworkSummary:
        """Freeze the base model, then make the trained parts trainable."""
        raise NotImplementedError

    def parameters(self, comps: Components) -> list[nn.Parameter]:
        """The trained parameters, in a fixed order."""
        return [p for m in comps.frozen_modules() for p in m.parameters() if p.requires_grad]

    def quantization_refusal(self, kind: str) -> str | None:
        """Why this method cannot train on a base stored as `kind` (`base_quantization`), and
        what to do instead; None when it can. A method that trains the whole denoiser cannot,
        nor any method where the family refuses it for the configured base."""
        if self.whole_denoiser:
            return (
                "the denoiser's own weights train, and quantized weights cannot take gradient "
                "steps; set base_quantization: none, or train an adapter (network_type: lora)"
            )
        return self.family.quantization_refusal(kind)

    def param_groups(self, comps: Components) -> list[dict[str, Any]]:
        """The trained parameters as optimizer groups, in `parameters`' order; a group's `lr`,
        where given, overrides the configured learning rate."""
        return [{"params": self.parameters(comps)}]

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        """The trained weights, as saved in checkpoints and read by export."""
        raise NotImplementedError

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        """Put saved trained weights back."""
        raise NotImplementedError

    def trained_text_encoders(self) -> tuple[int, ...]:
        """Indices of the text encoders that train: kept fp32, wrapped by accelerate (none here)."""
        return ()

    def before_clip(self, comps: Components) -> None:
        """Upkeep of the gradients before they are clipped and measured (nothing by default)."""

    def after_step(self, comps: Components) -> None:
        """Upkeep after each optimizer step (nothing by default)."""

    def adapter_off(self, comps: Components) -> AbstractContextManager[None]:
        """Within the block the model predicts as the base alone (only where `switchable`)."""
        raise NotImplementedError(f"{self.name} has no adapter to switch off")

    def adapter_scaled(self, comps: Components, scale: float) -> AbstractContextManager[None]:
        """Within the block the adapter acts at `scale` (only where `switchable`)."""
        raise NotImplementedError(f"{self.name} has no adapter to scale")

    # ------------------------------------------------------------ memory model

    def mark_trainable(self, parts: dict[str, nn.Module]) -> NetworkSummary:
        """On the family's meta-device parts (`empty_parts`), make trainable what would train.

        The estimator reads the trained tensors' shapes from the parts afterwards; the summary's
        `trainable` is the number of values that learn.
        """
        raise NotImplementedError

    # ------------------------------------------------------------ export

    def client_gaps(self) -> dict[str, str]:
        """Client name → why that client cannot reproduce what this method trains (its files
        are still checked and the difference reported); none by default."""
        return {}

    def export_formats(self) -> tuple[str, ...]:
        """The export formats of this method on its family."""
        raise NotImplementedError

    def write_export(
        self,
        fmt: str,
        weights: dict[str, torch.Tensor],
        meta: dict[str, str],
        step: int,
        out: Path,
    ) -> tuple[Path, Apply]:
        """Write checkpoint `weights` in `fmt` under `out`: the path, and how a client applies it."""
        raise NotImplementedError


def untrained_parts(method: Method, family: Family, weights: dict[str, torch.Tensor]) -> list[str]:
    """The exported files (`Family.denoiser_files` parts, "" for one file) whose trained weights
    still change nothing (`Method.untrained`): an expert no step drew, an adapter never stepped."""
    parts = family.denoiser_files(weights) if method.low_rank else {"": weights}
    return [part for part, w in parts.items() if method.untrained(w)]


def freeze_all(modules: list[nn.Module] | Any) -> None:
    """No gradients for any of these modules' parameters."""
    for m in modules:
        if m is not None:
            m.requires_grad_(False)


def trainable_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that receive gradients, in a fixed order."""
    return (p for p in module.parameters() if p.requires_grad)


def trainable_count(module: nn.Module) -> int:
    """How many values of `module` receive gradients."""
    return sum(p.numel() for p in trainable_parameters(module))


def unwrap(module: nn.Module) -> nn.Module:
    """The module itself when accelerate wrapped it (DDP keeps the weights in `.module`)."""
    return getattr(module, "module", module)


def load_lora(pipe: Any, path: Path, **kwargs: Any) -> Any:
    """Apply a LoRA file as diffusers users do: `load_lora_weights` (with `kwargs`, e.g. the
    model of a pipeline with several that the file is for)."""
    pipe.load_lora_weights(str(path.parent), weight_name=path.name, **kwargs)
    return pipe


def text_encoder_parts(parts: dict[str, nn.Module]) -> list[nn.Module]:
    """The text encoders among a family's `empty_parts`, in the family's order."""
    return [m for n, m in parts.items() if n.startswith("text_encoder")]


__all__ = [
    "Apply",
    "Method",
    "NetworkSummary",
    "freeze_all",
    "load_lora",
    "text_encoder_parts",
    "trainable_count",
    "trainable_parameters",
    "unwrap",
]
