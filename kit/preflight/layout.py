"""How a run splits its memory over several GPUs: the layouts `kit accelerate-config` launches
(DDP, DeepSpeed ZeRO-1/2, FSDP2) as per-GPU rules the estimator applies to its components.

The rules are the ZeRO paper's (Rajbhandari et al., 2020: stage 1 partitions the optimizer
state, stage 2 the gradients too, stage 3 the parameters as well, which FSDP's FULL_SHARD does)
with what the libraries the kit launches add on top: DDP's gradient buckets, DeepSpeed's reduce
bucket and half-precision copy of the trained weights, FSDP's gathered units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kit.config import Config
from kit.errors import ConfigError, KitError
from kit.families import get_family
from kit.families.shipped import config_source
from kit.methods import Method, get_method

GIB = 2**30
LAYOUTS = ("ddp", "zero1", "zero2", "fsdp")
ZERO_BUCKET = 500_000_000
"""DeepSpeed's `reduce_bucket_size` (elements), which the kit's accelerate config leaves as is."""


@dataclass(frozen=True)
class Layout:
    """How a run is split over `processes` GPUs, as `kit accelerate-config` launches it; every
    component of the estimate is then one GPU's. The rules (ZeRO, Rajbhandari et al. 2020:
    stage 1 splits the optimizer state, stage 2 the gradients too, stage 3 / FSDP FULL_SHARD
    the weights as well) applied to what the kit trains:

    - `ddp`: everything on every GPU, plus DDP's gradient buckets: accelerate leaves
      `gradient_as_bucket_view` off, so the buckets are a second copy of every trained gradient
      (torch's DistributedDataParallel docs: the view "saves memory equal to the total
      gradients size"), however small `bucket_cap_mb` (25 MB) makes each bucket.
    - `zero1`, `zero2` (DeepSpeed): the engine casts the trained weights to the mixed precision
      dtype (kept on every GPU, so autocast copies nothing) and the optimizer keeps a
      1/N fp32 master copy and 1/N of the optimizer state; stage 2 keeps 1/N of the
      gradients too, stage 1 all of them. Both hold a reduce bucket of `ZERO_BUCKET` elements.
    - `fsdp` (FSDP2, `reshard_after_forward`): 1/N of the denoiser's weights, trained and frozen
      (accelerate shards the whole module it prepares), gradients and optimizer state; while a
      unit computes, it is all-gathered whole in the compute dtype, and the next one with it
      (torch prefetches one unit), the root unit's leftovers stay gathered through the step,
      and one unit's gradients wait whole for their reduce-scatter. With gradient accumulation
      accelerate turns gradient sync off between optimizer steps, and FSDP2 then keeps every
      unit's whole gradient (`set_requires_gradient_sync(False)`), in the reduce dtype.

    Only what is trained is sharded under ZeRO; an adapter's frozen base, the VAE and the text
    encoders are on every GPU whole (accelerate shards only what it prepares, and the kit
    prepares the trained modules). Under FSDP the VAE and the text encoders go to CPU memory
    once the cache is filled, as no validation images are drawn there; they count in the
    setup phase only. One process is the single-GPU estimate."""

    kind: str = "ddp"
    processes: int = 1
    units: dict[str, int] | None = None
    """`fsdp_units` of the model (FSDP only)."""

    @property
    def split(self) -> str:
        """The layout in effect: `single` on one process."""
        return self.kind if self.processes > 1 else "single"

    def check(self, cfg: Config, quantization: str, swap: int, method: Method) -> None:
        """Refuse what the launch refuses (kit.train.distributed, kit.train.prepare), so the
        estimate never prices a run that would not start."""
        if self.processes < 1:
            raise KitError(f"--processes: {self.processes} must be at least 1")
        if self.kind == "zero3":
            raise KitError(
                "--layout: zero3 is not supported: the kit shards the weights with FSDP, whose "
                "checkpoints resume exactly and whose export gathers them; use --layout fsdp"
            )
        if self.kind not in LAYOUTS:
            raise KitError(f"--layout: {self.kind!r} is not one of {', '.join(LAYOUTS)}")
        if self.processes == 1:
            return
        why = []
        if swap:
            why.append(f"blocks_to_swap: {swap} runs on one process; set it to 0")
        zero = self.kind.startswith("zero")
        models = int(method.trains_denoiser) + len(method.trained_text_encoders())
        if zero and models > 1:
            why.append(f"network_type {method.name} trains {models} models; DeepSpeed trains one")
        if self.kind == "fsdp" and (models != 1 or not method.trains_denoiser):
            why.append(f"network_type {method.name}: FSDP shards the denoiser, trained alone")
        if self.kind in ("fsdp", "zero1", "zero2") and quantization != "none":
            why.append(f"base_quantization: {quantization} cannot be sharded; set none")
        if self.kind == "fsdp" and cfg.objective.ema_decay > 0:
            why.append(f"ema_decay: {cfg.objective.ema_decay} is not sharded; set 0")
        if why:
            raise ConfigError(f"{self.kind} on {self.processes} processes: " + "; ".join(why))


def wrapped_units(cfg: Config) -> dict[str, int]:
    """accelerate's TRANSFORMER_BASED_WRAP on FSDP2 shards, children before parents, every
    module whose class the model names in `_no_split_modules` (its blocks), each with the
    parameters no smaller unit took; the root unit holds the rest (embedders, final layers)."""
    family = get_family(cfg.model.model_family, cfg)
    parts = family.empty_parts(config_source(family.model_source(cfg.model.pretrained_model)))
    get_method(cfg, family).mark_trainable(parts)
    denoiser = parts["denoiser"]
    names = set(getattr(denoiser, "_no_split_modules", None) or ())
    taken: set[int] = set()
    units = []

    def visit(module: Any, root: bool) -> None:
        for child in module.children():
            visit(child, False)
        if root or type(module).__name__ not in names:
            return
        params = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        units.append(
            (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
        )

    visit(denoiser, True)
    rest = [p for p in denoiser.parameters() if id(p) not in taken]
    return {
        "units": len(units),
        "largest": max((u[0] for u in units), default=0),
        "largest_trained": max((u[1] for u in units), default=0),
        "root": sum(p.numel() for p in rest),
    }


def part(n: int, processes: int) -> int:
    """One process's part of `n` bytes split `processes` ways (the largest part)."""
    return -(-n // processes)


def layout_note(
    layout: Layout, comps: dict[str, int], casts: int, gathered: int, accumulating: bool
) -> str:
    """What the layout divided per GPU, and what it added."""
    n, kind = layout.processes, layout.split
    gib = {k: f"{v / GIB:.2f} GiB" for k, v in comps.items()}
    on_every = "the VAE and the text encoders"
    if kind == "ddp":
        return (
            f"DDP on {n} GPUs: nothing is divided; each GPU holds everything, plus DDP's gradient "
            f"buckets ({gib['gradient_buckets']}, a copy of every trained gradient)"
        )
    divided = "the optimizer state and the fp32 master weights"
    if kind == "zero2":
        divided += " and the gradients"
    if kind == "fsdp":
        divided = "the denoiser's weights (trained and frozen), its gradients and optimizer state"
        on_every_gpu = f"{on_every} encode the cache, then leave the GPU"
        note = (
            f"FSDP on {n} GPUs: {divided} are divided by {n}; {on_every_gpu}; each GPU "
            f"gathers whole units as they compute ({gathered / GIB:.2f} GiB: the largest "
            f"of {layout.units.get('units', 0) if layout.units else 0} units and the next, "
            "the root unit, one unit's gradients)"
        )
        if accumulating:
            note += (
                "; with gradient accumulation every unit's whole gradient stays on each GPU "
                "between optimizer steps (accelerate turns gradient sync off)"
            )
    else:
        note = (
            f"DeepSpeed ZeRO-{kind[-1]} on {n} GPUs: {divided} are divided by {n}; the trained "
            f"weights are kept in the compute dtype on every GPU, and {on_every} and any frozen "
            f"base stay whole; plus the reduce bucket ({gib['gradient_buckets']})"
        )
    if casts:
        note += f"; no autocast copies of the trained weights ({casts / GIB:.2f} GiB less)"
    return note


__all__ = ["LAYOUTS", "ZERO_BUCKET", "Layout", "layout_note", "part", "wrapped_units"]
