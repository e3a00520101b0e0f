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

Memory: only one expert is on the accelerator at a time: the step's (or, training one, the
trained one). The other's frozen weights wait in CPU memory and the two change places when a
batch's timesteps (or validation's steps) fall on the other side (`WanExperts.place`; the
adapters themselves, small, stay on the accelerator once there). Host RAM holds the waiting
expert throughout, as the estimate says. Changing places copies one expert each way (some
seconds for 14B in bf16 over PCIe), so `both` pays that on the steps whose expert changes.

With `base_quantization` both experts' frozen Linear layers are stored quantized, the waiting
(or held) one first and sent back to CPU memory at once (`quantized_parts`), so host RAM holds
it at its quantized size; a quantized layer moves through its module (its library's tensor
keeps codes and scales together). With `blocks_to_swap` kit.train.offload swaps the same last
blocks of each expert, one swap per expert whose hooks run with it; the experts' own moves skip
those weights (`swapped_params`), which stay in CPU memory between their blocks' uses.

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
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.errors import ConfigError, KitError
from kit.families import tiny
from kit.families.quantize import is_quantized
from kit.families.shipped import config_source

EXPERTS = ("high", "low")
"""The experts by their module names in `WanExperts`, high-noise first."""
PIPELINE_NAMES = {"high": "transformer", "low": "transformer_2"}
"""Each expert's component (and subfolder) name in `WanPipeline`."""
FILE_SUFFIX = {"high": "high_noise", "low": "low_noise"}
"""What an exported file's name (and its `kit.expert` metadata) carries for its expert."""
EXPERT_OF_FILE = {v: k for k, v in FILE_SUFFIX.items()}
PART_TITLES = {
    "high_noise": "the high-noise expert (diffusers' `transformer`, ComfyUI's high_noise model)",
    "low_noise": "the low-noise expert (diffusers' `transformer_2`, ComfyUI's low_noise model)",
}
"""How prose names the model each expert's file is loaded on."""


@dataclass(frozen=True)
class ExpertsInfo:
    """What a base's model_index.json says about its experts."""

    boundary_ratio: float


@lru_cache(maxsize=32)
def read_index(source: str) -> dict[str, Any]:
    """The base's model_index.json ({} where there is none); a hub id the kit ships configs
    for reads the shipped copy (offline, as the estimate does)."""
    from diffusers import WanPipeline

    try:
        return dict(WanPipeline.load_config(config_source(source)))
    except (OSError, ValueError):
        return {}


def read_experts(source: str) -> ExpertsInfo | None:
    """The base's two-expert layout (transformer_2 present, `boundary_ratio` set), else None."""
    index = read_index(source)
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
        # One expert at a time on the accelerator (see the module's text): the other waits in
        # CPU memory, also the one held beside for validation when one trains.
        self.offload = True
        self.active = self.trained[0]
        self.move = _move  # how a tensor changes device (a test records the moves instead)
        # Parameters whose weights `blocks_to_swap` keeps in CPU memory (kit.train.offload sets
        # them): the swap brings each in while its block runs, so the experts' moves skip them.
        self.swapped_params: set[int] = set()
        for name, module in zip(EXPERTS, (high, low), strict=True):
            if name in self.trained:
                setattr(self, name, module)  # a submodule: adapted, saved, placed
            else:
                self.__dict__[name] = module.requires_grad_(False)  # held beside, never trained
            if self.offload:
                # WanPipeline calls the experts themselves (validation): each places itself.
                # A bound method, so a deep copy of this module hooks the copy.
                module.register_forward_pre_hook(self._before_expert, with_kwargs=True)

    def _before_expert(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        states = kwargs.get("hidden_states", args[0] if args else None)
        if states is not None and states.device.type != "meta":
            self.place("high" if module is self.expert("high") else "low", states.device)

    def expert(self, name: str) -> nn.Module:
        """The transformer of expert `name` (`high` or `low`)."""
        return getattr(self, name)

    def expert_of(self, timesteps: torch.Tensor) -> torch.Tensor:
        """True where a timestep is the high-noise expert's (WanPipeline's test, t >= boundary)."""
        return timesteps >= self.boundary

    def quantized_parts(self) -> list[tuple[str, nn.Module, Any]]:
        """`base_quantization` (kit.families.quantize) stores both experts' frozen weights
        quantized, the trained and the held one alike: (name, expert, what to do once it is
        quantized). The waiting expert goes first and back to CPU memory, quantized, as soon
        as it is done, so the two are never on the accelerator together."""
        waiting = [e for e in EXPERTS if e != self.active]
        cpu = torch.device("cpu")
        return [
            (name, self.expert(name), lambda name=name: self._relocate(name, cpu, False))
            for name in waiting
        ] + [(self.active, self.expert(self.active), lambda: None)]

    def _apply(self, fn: Any, recurse: bool = True) -> WanExperts:
        # `.to(...)` moves the held expert with the trained one (validation draws with both).
        # Offloading, the waiting expert takes the dtype and stays in CPU memory: it never
        # reaches the accelerator beside the active one, not even while the base is placed.
        def to_cpu(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)  # a meta tensor (the estimate's parts) stays one
            return out if t.device.type == "meta" else out.to("cpu")

        for name in EXPERTS:
            module = self.expert(name)
            if self.offload and name != self.active:
                quantized = _quantized_layers(module)
                for layer in quantized:  # their own tensor types: moved by the module
                    layer._apply(to_cpu, recurse=False)
                inside = _tensor_ids(quantized)
                for t in [*module.parameters(), *module.buffers()]:
                    if id(t) not in inside:
                        t.data = to_cpu(t.data)
            else:
                module._apply(fn, recurse)
        return self

    def _relocate(self, name: str, device: torch.device, frozen_only: bool) -> None:
        """Expert `name`'s tensors (only the frozen ones with `frozen_only`) onto `device`.
        A quantized layer's weight (optimum-quanto's or bitsandbytes' own tensor type, codes
        and scales) moves through its module, as `.to` moves it; plain tensors keep their
        identity (the optimizer holds the trained ones) and only their `.data` moves."""
        module = self.expert(name)
        quantized = _quantized_layers(module)
        for layer in quantized:
            layer._apply(lambda t: self.move(t, device), recurse=False)
        skip = _tensor_ids(quantized) | self.swapped_params
        tensors = (
            _frozen_tensors(module) if frozen_only else [*module.parameters(), *module.buffers()]
        )
        for t in tensors:
            if id(t) not in skip:
                t.data = self.move(t.data, device)

    def waiting_models(self) -> list[nn.Module]:
        """The experts waiting in CPU memory (kit.train.offload's `place` leaves them there)."""
        return [self.expert(e) for e in EXPERTS if self.offload and e != self.active]

    def place(self, name: str, device: torch.device) -> None:
        """Expert `name` (all its weights) on `device`; the other expert's frozen weights in
        CPU memory, its trained ones left where they are. Nothing moves on a CPU run."""
        if not self.offload or (name == self.active and self.expert(name).device == device):
            return
        other = next(e for e in EXPERTS if e != name)
        self._relocate(other, torch.device("cpu"), True)
        self._relocate(name, device, False)
        self.active = name

    @property
    def config(self) -> Any:
        return self.expert("high").config  # both experts share one architecture

    @property
    def dtype(self) -> torch.dtype:
        return self.expert("high").dtype

    @property
    def device(self) -> torch.device:
        return self.expert("high").device

    def enable_gradient_checkpointing(self, *args: Any, **kwargs: Any) -> None:
        for name in self.trained:
            self.expert(name).enable_gradient_checkpointing(*args, **kwargs)

    def add_adapter(self, config: Any, adapter_name: str = "default") -> None:
        """Inject a peft adapter into the trained experts (as diffusers' `add_adapter` does)."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, self, adapter_name=adapter_name)
        self.peft_config = {adapter_name: config}

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs: Any) -> Any:
        """The forward of the expert the batch's timesteps select (all the same expert)."""
        if timestep.device.type == "meta":  # the estimate's trace: one expert's step
            return self.expert(self.active)(
                hidden_states=hidden_states, timestep=timestep, **kwargs
            )
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


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


def _frozen_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters that do not train, and its buffers."""
    return [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())


def _quantized_layers(module: nn.Module) -> list[nn.Module]:
    """The layers whose own weight is stored quantized (base_quantization); not the adapter
    layers wrapping them, which only show their base layer's weight."""
    return [m for m in module.modules() if "weight" in m._parameters and is_quantized(m)]


def _tensor_ids(layers: list[nn.Module]) -> set[int]:
    """The ids of the layers' own parameters and buffers."""
    return {
        id(t) for m in layers for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    }


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


def timestep_range(info: ExpertsInfo | None, name: str) -> dict[str, str]:
    """The metadata naming the timesteps expert `name`'s file denoises: ModelSpec's
    `modelspec.timestep_range` ("min,max" of the 1000 training timesteps, as musubi-tuner
    writes it for a run limited to some); {} for a base with one transformer."""
    if info is None:
        return {}
    boundary = round(info.boundary_ratio * 1000)
    return {"modelspec.timestep_range": f"{boundary},1000" if name == "high" else f"0,{boundary}"}


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
