"""A training adapter: a LoRA that runs inside a step-distilled base while another LoRA trains on
top of it, and that is left out of everything the run exports.

A LoRA trained straight on a step-distilled base (Z-Image Turbo, FLUX.2 klein) learns to undo
the distillation along with the concept, and comes out weak or grainy at the base's few steps.
A de-distilling LoRA made for that base, run beneath the trained one, takes that part of the
work; at inference the distilled base runs without it, with the trained LoRA alone.

The file is read by the family's own diffusers pipeline (`load_lora_weights`, with its
converters for kohya, ComfyUI and other trainers' layouts) into the denoiser, whose LoRA
layers give each adapted module's down and up matrices and scale; the layers are then taken
out again, and each module's output gets `scale · up(down(x))` added by a forward hook. Kept
apart from the weights, the adapter never touches the base's weights (no rounding is merged
into them), it survives quantizing or swapping the base, and validation can switch it off to
draw what the exported LoRA gives.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kit.errors import KitError

NAME = "training_adapter"
"""The adapter's name while diffusers loads it."""


@dataclass
class TrainingAdapter:
    """The training adapter's layers on a denoiser: module name → (down, up, scale)."""

    source: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    enabled: bool = True
    handles: list[Any] = field(default_factory=list)

    def attach(self, denoiser: nn.Module, device: torch.device | str) -> None:
        """Add the adapter's output to each adapted module of `denoiser` (a forward hook)."""
        modules = dict(denoiser.named_modules())
        for name, (down, up, scale) in self.layers.items():
            if name not in modules:
                raise KitError(
                    f"training_adapter {self.source}: adapts '{name}', which the denoiser "
                    "does not have; is it made for this base model?"
                )
            self.layers[name] = (down.to(device), up.to(device), scale)
            self.handles.append(modules[name].register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def add(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if not self.enabled:
                return output
            down, up, scale = self.layers[name]
            x = args[0]
            delta = nn.functional.linear(nn.functional.linear(x, down.to(x)), up.to(x))
            return output + (scale * delta).to(output.dtype)

        return add

    @contextlib.contextmanager
    def switched_off(self) -> Iterator[None]:
        """The base without the adapter: what the exported LoRA is used with."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def remove(self) -> None:
        """Take the hooks out."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def read_training_adapter(family: Any, denoiser: nn.Module, source: str) -> TrainingAdapter:
    """The LoRA at `source` (a file, folder or hub id) as the family's pipeline loads it into
    `denoiser`; the denoiser is left as it was."""
    import diffusers
    from peft.tuners.lora import LoraLayer

    cls = getattr(diffusers, family.pipeline_class)
    params = inspect.signature(cls.__init__).parameters
    parts: dict[str, Any] = {
        n: None
        for n, p in params.items()
        if n != "self"
        and p.default is inspect.Parameter.empty
        and p.kind == p.POSITIONAL_OR_KEYWORD
    }
    slot = "transformer" if "transformer" in params else "unet"
    parts[slot] = denoiser
    if hasattr(cls, "update_components"):  # a modular pipeline: its parts are components
        pipe = cls()
        pipe.update_components(transformer=denoiser)
    else:
        pipe = cls(**parts)
    try:
        pipe.load_lora_weights(source, adapter_name=NAME)
    except Exception as e:  # the hub, a missing file, a layout no converter reads
        raise KitError(
            f"training_adapter: cannot load '{source}' as a {family.name} LoRA "
            f"({type(e).__name__}: {e}); give a LoRA file, folder or hub id made for this base"
        ) from None
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    try:
        for name, module in denoiser.named_modules():
            if not isinstance(module, LoraLayer) or NAME not in module.lora_A:
                continue
            if module.use_dora.get(NAME) or not isinstance(module.lora_A[NAME], nn.Linear):
                raise KitError(
                    f"training_adapter {source}: '{name}' is a DoRA or convolution layer; only "
                    "plain LoRA on linear layers is run as a training adapter"
                )
            down = module.lora_A[NAME].weight.detach().clone()
            up = module.lora_B[NAME].weight.detach().clone()
            layers[name] = (down, up, float(module.scaling[NAME]))
    finally:
        pipe.unload_lora_weights()
    if not layers:
        raise KitError(f"training_adapter {source}: no LoRA layer of this denoiser in the file")
    return TrainingAdapter(source, layers)
