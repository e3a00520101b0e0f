"""Wan 2.2 A14B's two experts: one transformer for the noisy steps, one for the late ones.

`WanPipeline` holds them as `transformer` (high noise) and `transformer_2` (low noise) and, at
each step, runs `transformer` when the timestep t >= boundary_ratio · num_train_timesteps and
`transformer_2` otherwise (`boundary_ratio` in the pipeline's model_index.json: 0.875 for the
T2V release). Training follows the same rule, through one function (`WanExperts.expert_of`)
that both the noise draw and the forward use:

* `train_experts: high` / `low` trains one expert and draws only its timesteps: σ from the
  configured distribution conditioned on the expert's side of the boundary (rejection, so the
  shape inside the range is the configured one).
* `both` trains an adapter on each. Every batch goes to ONE expert: the step's first σ, drawn
  from the whole configured distribution, picks it, and the batch's σ are then drawn on its
  side. So each expert sees its timesteps with the distribution's own weight, no batch is ever
  split between experts (only one expert's weights are needed for a step, which is what lets
  the other wait in CPU memory), and the expert of a sample is the pipeline's for its timestep.

One optimizer holds both experts' adapters. The step that trains one expert leaves the other's
gradients None, and AdamW (torch's and bitsandbytes') skips a parameter without a gradient and
keeps its step count per parameter, so each expert's moments and bias correction advance only
with its own steps: the same updates as one optimizer per expert. The learning-rate schedule
counts the run's steps, and with gradient accumulation spanning both experts the clipping norm
is taken over both.

The denoiser the kit trains is a `WanExperts` module holding both transformers; the trained
ones are its submodules `high` / `low` (so peft adapts only those, and adapter keys start with
`high.` / `low.`), the other is held beside them, frozen, for validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.errors import ConfigError, KitError
from kit.families import tiny

EXPERTS = ("high", "low")
"""The experts by their module names in `WanExperts`, high-noise first."""
PIPELINE_NAMES = {"high": "transformer", "low": "transformer_2"}
"""Each expert's component (and subfolder) name in `WanPipeline`."""
FILE_SUFFIX = {"high": "high_noise", "low": "low_noise"}
"""What an exported file's name (and its `kit.expert` metadata) carries for its expert."""
EXPERT_OF_FILE = {v: k for k, v in FILE_SUFFIX.items()}


@dataclass(frozen=True)
class ExpertsInfo:
    """What a base's model_index.json says about its experts."""

    boundary_ratio: float


def read_experts(source: str) -> ExpertsInfo | None:
    """The base's two-expert layout (transformer_2 present, `boundary_ratio` set), else None."""
    from diffusers import WanPipeline

    try:
        index = WanPipeline.load_config(source)
    except (OSError, ValueError):
        return None  # no model_index.json (a shipped config without one): one transformer
    second = index.get("transformer_2")
    if not second or second[0] is None or index.get("boundary_ratio") is None:
        return None
    return ExpertsInfo(float(index["boundary_ratio"]))


def trained_experts(setting: str, info: ExpertsInfo | None, base: str) -> tuple[str, ...]:
    """The experts a run trains: `train_experts` checked against the base ("" is both)."""
    if info is None:
        if setting:
            raise ConfigError(
                f"train_experts: {setting}: the base {base} has one transformer (no "
                "transformer_2 and boundary_ratio in its model_index.json; Wan 2.1 and TI2V-5B "
                "are such); remove train_experts"
            )
        return ()
    return EXPERTS if setting in ("", "both") else (setting,)


class WanExperts(nn.Module):
    """Both transformers of a two-expert base as one denoiser that routes by timestep."""

    def __init__(
        self,
        high: nn.Module,
        low: nn.Module,
        boundary_ratio: float,
        num_train_timesteps: int,
        trained: tuple[str, ...] = EXPERTS,
    ) -> None:
        super().__init__()
        self.boundary_ratio = boundary_ratio
        self.num_train_timesteps = num_train_timesteps
        self.boundary = boundary_ratio * num_train_timesteps  # as WanPipeline computes it
        self.trained = tuple(trained)
        for name, module in zip(EXPERTS, (high, low), strict=True):
            if name in self.trained:
                setattr(self, name, module)  # a submodule: adapted, saved, placed
            else:
                self.__dict__[name] = module  # held beside: never adapted or trained

    def expert(self, name: str) -> nn.Module:
        """The transformer of expert `name` (`high` or `low`)."""
        return getattr(self, name)

    def expert_of(self, timesteps: torch.Tensor) -> torch.Tensor:
        """True where a timestep is the high-noise expert's (WanPipeline's test, t >= boundary)."""
        return timesteps >= self.boundary

    def _apply(self, fn: Any, recurse: bool = True) -> WanExperts:
        # `.to(...)` moves the held expert with the trained one (validation draws with both).
        super()._apply(fn, recurse)
        for name in EXPERTS:
            if name not in self.trained:
                self.__dict__[name]._apply(fn, recurse)
        return self

    @property
    def config(self) -> Any:
        return self.expert("high").config  # both experts share one architecture

    @property
    def dtype(self) -> torch.dtype:
        return self.expert("high").dtype

    @property
    def device(self) -> torch.device:
        return self.expert("high").device

    def enable_gradient_checkpointing(self) -> None:
        for name in self.trained:
            self.expert(name).enable_gradient_checkpointing()

    def add_adapter(self, config: Any, adapter_name: str = "default") -> None:
        """Inject a peft adapter into the trained experts (as diffusers' `add_adapter` does)."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, self, adapter_name=adapter_name)
        self.peft_config = {adapter_name: config}

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs: Any) -> Any:
        """The forward of the expert the batch's timesteps select (all the same expert)."""
        high = self.expert_of(timestep)
        if bool(high.any()) != bool(high.all()):
            raise KitError(
                "a batch with timesteps on both sides of the experts' boundary: each batch "
                "trains one expert (the draw keeps them on one side)"
            )
        name = "high" if bool(high.all()) else "low"
        if name not in self.trained:
            raise KitError(
                f"timestep {timestep.tolist()} belongs to the {name}-noise expert, which this "
                "run does not train"
            )
        return self.expert(name)(hidden_states=hidden_states, timestep=timestep, **kwargs)


def accept_for(experts: WanExperts, name: str) -> Any:
    """The timestep test of expert `name` (for `flow_noise_and_target`'s `accept`)."""
    if name == "high":
        return experts.expert_of
    return lambda t: ~experts.expert_of(t)


def split_state(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Adapter weights keyed `high.…` / `low.…` → expert → its weights without the prefix."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if head not in EXPERTS:
            raise KitError(f"'{key}': not a weight of either Wan 2.2 expert")
        out.setdefault(head, {})[rest] = value
    return out


def make_tiny_experts(
    transformer: Any, build_transformer: Any, out_dir: str | Path, pipe_parts: dict[str, Any]
) -> Path:
    """A tiny two-expert WanPipeline: `transformer` as the high-noise expert, a second one
    from `build_transformer()` as the low-noise expert, Wan 2.2's boundary 0.875."""
    from diffusers import WanPipeline

    pipe = WanPipeline(
        **pipe_parts,
        transformer=transformer,
        transformer_2=build_transformer(),
        boundary_ratio=0.875,
    )
    return tiny.save_pipeline(pipe, out_dir)
