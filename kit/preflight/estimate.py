"""VRAM estimate: peak training memory by component, from one traced step and arithmetic.

`trace` (kit.preflight.trace) runs the configured step on the meta device; weights, gradients,
optimizer state and EMA follow from the trained parameters' shapes, and a quantized base or
swapped blocks from the trace's inventory of the frozen weights (kit.preflight.storage). Host RAM
is estimated beside VRAM, since a base that fits the card can still overflow the machine while it
loads. Traces are remembered in this process and on disk, keyed by what they depend on.

Under several processes (`processes`, `layout`) every component is what one GPU holds; the
rules of each layout are in `Layout`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.config.preservation import denoiser_rows
from kit.data.buckets import assign_bucket, make_buckets
from kit.families import Family, get_family
from kit.families.identity import fingerprint
from kit.families.shipped import config_source
from kit.families.source import check_base
from kit.methods import Method, get_method
from kit.preflight.layout import LAYOUTS, ZERO_BUCKET, Layout, layout_note, part, wrapped_units
from kit.preflight.storage import (
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT,
    Storage,
    check_quant,
    check_swap,
    frozen_by_dtype,
    on_accelerator,
    setup_phase,
    stored,
    swap_plan,
)
from kit.preflight.trace import Shape, trace
from kit.sample.embedded import draws_from_embeddings

GIB = 2**30
# Memory each card reports to PyTorch (`total_memory`), in GiB: a little under the label.
GPUS = {
    "T4 16GB": 14.6,
    "RTX 3060 12GB": 11.7,
    "RTX 4080 16GB": 15.6,
    "RTX 4090 24GB": 23.6,
    "L4 24GB": 22.0,
    "A100 40GB": 39.4,
    "A100 80GB": 79.1,
    "H100 80GB": 79.1,
}
NO_BF16 = {"T4 16GB"}  # cards without bf16: mixed precision there means fp16
HOST_PROCESS = int(2.5 * GIB)  # Python, PyTorch and the CUDA libraries in host memory
VERSION = 7  # bump when the trace changes: keys the on-disk cache

PERSISTENT = (
    "_weights",
    "swap_buffers",
    "trainable_weights",
    "optimizer_state",
    "ema",
    "gradient_buckets",
)
"""Endings of the components that stay through the whole run."""

# ---------------------------------------------------------------- the result


@dataclass
class Estimate:
    """Peak memory of a training step by component, in bytes (the components add up to the
    total), with the setup before the first step (`setup_bytes`) and host RAM (`host`)."""

    components: dict[str, int]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    """Finer breakdowns: activations by module group, frozen weights by dtype, peak phase."""
    host: dict[str, int] = field(default_factory=dict)
    """Peak host RAM by component, in bytes: the process, and either the base as it loads or
    (when larger) what stays in training: swapped blocks, batches read from the cache, an EMA
    kept on the CPU. The components of the other phase are 0."""
    layout: str = "single"
    """How the run is split over GPUs (`Layout`): `single`, `ddp`, `zero1`, `zero2`, `fsdp`;
    the components are then one GPU's, and host RAM one process's."""
    processes: int = 1

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def setup_bytes(self) -> int:
        """GPU memory while the cache fills, before the first step (see `details["setup"]`)."""
        return int(self.details.get("setup_bytes", 0))

    @property
    def peak_bytes(self) -> int:
        """The run's peak: the step's, or the setup's where that is larger."""
        return max(self.total_bytes, self.setup_bytes)

    @property
    def floor_bytes(self) -> int:
        """What no smaller batch, checkpointing or resolution brings the peak below: the
        setup, and what the step keeps whatever the image size and batch (weights, swap
        buffers, trained weights, optimizer state, EMA, the CUDA context)."""
        c = self.components
        kept = c.get("cuda_context", 0) + sum(v for k, v in c.items() if k.endswith(PERSISTENT))
        return max(kept, self.setup_bytes)

    @property
    def host_bytes(self) -> int:
        """Peak host RAM: the sum of `host`."""
        return sum(self.host.values())

    def fits_host(self, ram_gib: float) -> bool:
        """True when the host RAM peak is within `ram_gib`."""
        return self.host_bytes <= ram_gib * GIB

    @property
    def allocated_bytes(self) -> int:
        """The peak of live tensors: what `torch.cuda.max_memory_allocated` reports."""
        c = self.components
        return self.total_bytes - c.get("allocator_reserve", 0) - c.get("cuda_context", 0)

    def fits(self, budget_gib: float) -> bool:
        """True when the run's peak (the step's, or the setup's) is within `budget_gib`."""
        return self.peak_bytes <= budget_gib * GIB

    def cards(self) -> list[dict[str, Any]]:
        """One row per common card: its memory, whether the run fits, and the headroom."""
        return [
            {
                "card": name,
                "GiB": gib,
                "fits": self.fits(gib),
                "headroom_gib": round(gib - self.peak_bytes / GIB, 2),
            }
            for name, gib in GPUS.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the card table."""
        return {
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GIB, 3),
            "allocated_bytes": self.allocated_bytes,
            "setup_bytes": self.setup_bytes,
            "peak_bytes": self.peak_bytes,
            "components": dict(self.components),
            "host_ram_bytes": self.host_bytes,
            "host_ram_gib": round(self.host_bytes / GIB, 3),
            "host_ram": dict(self.host),
            "details": self.details,
            "settings": self.settings,
            "fits": {name: self.fits(gib) for name, gib in GPUS.items()},
            "layout": self.layout,
            "processes": self.processes,
            "notes": self.notes,
        }


# ---------------------------------------------------------------- cache


def _cache_dir() -> Path:
    base = os.environ.get("KIT_VRAM_CACHE") or Path.home() / ".cache" / "kit" / "vram"
    return Path(base)


def _trace_key(cfg: Config, shape: Shape | None) -> str:
    family = get_family(cfg.model.model_family, cfg)
    source = config_source(family.model_source(cfg.model.pretrained_model))
    configs = {}
    if Path(source).is_dir():
        for f in sorted(Path(source).glob("*/config.json")):
            configs[f.parent.name] = json.loads(f.read_text())
    m, d = cfg.model, cfg.data
    return fingerprint(
        {
            "v": VERSION,
            "family": m.model_family,
            "source": source if not configs else "",
            "configs": configs,
            "model": [m.max_sequence_length, m.use_t5]
            + ([m.train_experts] if m.train_experts else []),
            "frames": [d.num_frames, d.frame_stride],
            "network": cfg.to_dict()["network"],
            # Only a run that preserves output keys its rows, so other keys stay as they were.
            **({"rows": denoiser_rows(cfg)} if denoiser_rows(cfg) != (1, 0) else {}),
            "shape": shape.__dict__ if shape else None,
        }
    )


_MEMO: dict[str, dict[str, Any]] = {}


def cached_trace(cfg: Config, shape: Shape) -> dict[str, Any]:
    """`trace`, remembered in this process and on disk (a repeat costs a file read)."""
    return _remembered(_trace_key(cfg, shape), lambda: trace(cfg, shape))


def fsdp_units(cfg: Config) -> dict[str, int]:
    """The denoiser's FSDP units as the kit's FSDP launch wraps them (`Layout`), remembered like
    the traces: their count, the parameters of the largest (and how many of them train), and
    what is left to the root unit."""
    return _remembered("units-" + _trace_key(cfg, None), lambda: wrapped_units(cfg))


def _remembered(key: str, compute: Any) -> dict[str, Any]:
    if key in _MEMO:
        return _MEMO[key]
    path = _cache_dir() / f"{key}.json"
    if path.is_file():
        with contextlib.suppress(ValueError, OSError):
            _MEMO[key] = json.loads(path.read_text())
            return _MEMO[key]
    result = compute()
    _MEMO[key] = result
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return result


# ---------------------------------------------------------------- the estimate


def bucket_size(cfg: Config, resolution: int) -> tuple[int, int]:
    """(height, width) of the bucket the estimate traces at this resolution.

    The buckets are those training generates (kit.data.buckets): with `area` buckets, which all
    hold about the same pixels, the square one; with `pixel` buckets, the one with the most pixels.
    """
    d = cfg.data
    step = d.bucket_step or get_family(cfg.model.model_family, cfg).bucket_step
    buckets = make_buckets(resolution, d.resolution_type, step, d.max_aspect_ratio)
    if cfg.data.resolution_type == "area":
        width, height = assign_bucket(1, 1, buckets)
    else:
        width, height = max(buckets, key=lambda b: (b[0] * b[1], b[0]))
    return height, width


def forget_traces() -> None:
    """Forget the traces remembered in this process (the disk cache stays)."""
    _MEMO.clear()


def estimate(
    cfg: Config,
    *,
    resolution: int | None = None,
    batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = None,
    gradient_accumulation_steps: int | None = None,
    base_quantization: str | None = None,
    blocks_to_swap: int | None = None,
    use_t5: bool | None = None,
    text_encoder_quantization: str | None = None,
    bucket: tuple[int, int] | None = None,
    processes: int = 1,
    layout: str = "ddp",
) -> Estimate:
    """Estimate peak VRAM and host RAM of the configured run; keyword arguments override the
    config fields of the same names (`batch_size` is `train_batch_size`). With `processes`
    above 1, the memory of one of that many GPUs under `layout` (see `Layout`)."""
    t, m = cfg.train, cfg.model
    if use_t5 is not None and use_t5 != m.use_t5:
        cfg = cfg.replace(use_t5=use_t5)
    res = resolution or cfg.data.resolution
    height, width = (bucket[1], bucket[0]) if bucket else bucket_size(cfg, res)
    ckpt = t.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
    precision = mixed_precision or t.mixed_precision
    precision = "no" if precision == "fp32" else precision
    accum = gradient_accumulation_steps or t.gradient_accumulation_steps
    family = get_family(cfg.model.model_family, cfg)
    # The method decides what trains, and refuses a pair it cannot finish, before any trace.
    method = get_method(cfg, family)
    source = family.model_source(m.pretrained_model)
    if config_source(source) == source and not Path(source).exists():  # configs from the hub
        check_base(family, source, m.revision)  # unreachable or missing: one line, at once
    storage = Storage(
        base_quantization or m.base_quantization,
        t.blocks_to_swap if blocks_to_swap is None else blocks_to_swap,
        text_encoder_quantization or m.text_encoder_quantization,
    )
    check_quant(storage.quantization, method)
    split = Layout(layout, processes)
    split.check(cfg, storage.quantization, storage.swap, method)
    if split.kind == "fsdp":
        split = Layout(layout, processes, fsdp_units(cfg))
    shape = Shape(height, width, batch_size or t.train_batch_size, bool(ckpt), precision, accum > 1)
    return from_trace(
        cfg,
        cached_trace(cfg, shape),
        shape,
        storage,
        resolution=res,
        optimizer=optimizer or t.optimizer,
        accumulation=accum,
        method=method,
        family=family,
        layout=split,
    )


def from_trace(
    cfg: Config,
    tr: dict[str, Any],
    shape: Shape,
    storage: Storage,
    *,
    resolution: int,
    optimizer: str,
    accumulation: int,
    method: Method,
    family: Family,
    layout: Layout | None = None,
) -> Estimate:
    """The estimate from one trace: arithmetic only, so the advice can try many settings on it."""
    layout = layout or Layout()
    inv = tr["storage"]
    quant, swap = storage.quantization, storage.swap
    layout.check(cfg, quant, swap, method)
    check_swap(swap, inv["blocks"], family.name, method.whole_denoiser, quant)
    plan = swap_plan(inv["blocks"], swap)
    comps: dict[str, int] = {}
    kept: dict[str, int] = {}
    for name, by_dtype in tr["frozen"].items():
        kept[name] = stored(
            storage.kind(name, family), sum(by_dtype.values()), inv["quantized"].get(name)
        )
        comps[f"{name}_weights"] = kept[name] - (plan["host"] if name == "denoiser" else 0)
    comps["swap_buffers"] = plan["staging"]
    embedded = draws_from_embeddings(family, method)
    if layout.split == "fsdp":
        # FSDP draws no validation images while training: once the cache is filled, the
        # encoders and the VAE go to CPU memory (the setup phase still holds them).
        for name in tr["frozen"]:
            if name != "denoiser":
                comps[f"{name}_weights"] = 0
    elif embedded:
        # The grids draw from cached prompt embeddings: the text encoders are gone once the
        # cache is filled (`kit.train.prepare`); the setup phase counts them.
        for name in tr["frozen"]:
            if name not in ("denoiser", "vae"):
                comps[f"{name}_weights"] = 0
    trained = tr["trained_bytes"]
    optim = tr["optimizer"][optimizer]
    half = 4 if shape.precision == "no" else 2
    procs, split = layout.processes, layout.split
    sharded = split in ("zero1", "zero2", "fsdp")
    low = trained * half // 4  # the trained weights (or their gradients) in the compute dtype
    if split == "fsdp" and "denoiser_weights" in comps:
        comps["denoiser_weights"] = part(comps["denoiser_weights"], procs)
    comps["trainable_weights"] = trained
    comps["optimizer_state"] = optim["state"]
    if sharded:
        master = part(trained, procs)
        comps["trainable_weights"] = master + (low if split != "fsdp" else 0)
        comps["optimizer_state"] = part(optim["state"], procs)
    o = cfg.objective
    comps["ema"] = trained if o.ema_decay > 0 and not o.ema_on_cpu else 0
    if split != "single":
        zero_bucket = ZERO_BUCKET * half if split != "fsdp" else 0
        comps["gradient_buckets"] = trained if split == "ddp" else zero_bucket
    persistent = sum(comps.values())

    # A quantized layer is unpacked into the compute dtype for its matmul (and again for its
    # backward), one layer at a time.
    largest = max(
        (q["largest"] for n, q in inv["quantized"].items() if storage.kind(n, family) != "none"),
        default=0,
    )
    dequant = 2 * largest * half if quant != "none" else 0
    peak = dict(tr["peak"])
    casts = 0
    if sharded and half == 2:
        # The trace counts autocast's half-precision copies of the fp32 trained weights; here
        # the weights are already in half precision when they compute, and nothing is copied.
        casts = low
        for k in sorted(peak, key=lambda k: (k != "backward", -peak[k])):
            if k not in ("batch", "loss", "gradients"):
                took = min(casts, peak[k])
                peak[k] -= took
                casts -= took
        casts = low - casts
    traced_grads = peak.get("gradients", 0)
    peak["gradients"] = {
        "zero1": traced_grads * half // 4,
        "zero2": part(traced_grads * half // 4, procs),
        "fsdp": part(traced_grads, procs),
    }.get(split, traced_grads)
    gathered = 0
    if split == "fsdp":
        u = layout.units or {}
        gathered = (2 * u.get("largest", 0) + u.get("root", 0) + u.get("largest_trained", 0)) * half
    fsdp_gathered = gathered
    step_peak = sum(peak.values()) + dequant + gathered
    grads_always = trained if shape.grads_persist else 0
    if sharded and shape.grads_persist:
        grads_always = part(low, procs) if split == "zero2" else low
    # The optimizer step: every gradient, plus the optimizer's temporaries (and EMA's move-in).
    ema_move = trained if o.ema_decay > 0 and o.ema_on_cpu else 0
    step_grads = part(trained, procs) if sharded else trained
    step_temp = part(optim["step"], procs) if sharded else optim["step"]
    at_step = step_grads + max(step_temp, ema_move)
    groups = {k: v for k, v in peak.items() if k not in ("batch", "loss", "backward", "gradients")}
    if step_peak + grads_always >= at_step:
        phase = "backward" if peak.get("backward", 0) or peak.get("gradients", 0) else "forward"
        comps["gradients"] = grads_always + peak.get("gradients", 0)
        comps["batch"] = peak.get("batch", 0) + peak.get("loss", 0)
        comps["activations"] = sum(groups.values())
        comps["dequant_buffers"] = dequant
        comps["backward_buffers"] = peak.get("backward", 0)
    else:
        phase = "optimizer step"
        groups = {}
        gathered = 0
        comps["gradients"] = step_grads
        comps["batch"] = 0
        comps["activations"] = 0
        comps["dequant_buffers"] = 0
        comps["backward_buffers"] = at_step - step_grads
    if split == "fsdp":
        comps["gathered_weights"] = gathered
    allocated = sum(comps.values())
    comps["allocator_reserve"] = int(allocated * ALLOCATOR_RESERVE)
    comps["cuda_context"] = CUDA_CONTEXT
    setup = setup_phase(tr, storage, family, half)

    # Host RAM has two phases (kit.train.prepare): the base is loaded into host memory and then
    # moved to the GPU, in two loads (the text encoders and the VAE that fill the cache, then
    # the denoiser); afterwards the swapped blocks' copies, the batches read from the cache
    # and an EMA kept on the CPU stay. The peak is the larger phase.
    # Every frozen part loads in the run's dtype, but the VAE, which encodes the cache, in fp32.
    read = {n: sum(v.values()) * (4 // half if n == "vae" else 1) for n, v in tr["frozen"].items()}
    # A model of the denoiser kept off the GPU, stored as the denoiser is (quantized too).
    waiting = {
        label: stored(storage.kind("denoiser", family), size, inv.get("waiting", {}).get(label))
        for label, size in tr.get("host_resident", {}).items()
    }
    for_cache = sum(v for n, v in read.items() if n != "denoiser")
    # Both experts load in the run's dtype and are quantized afterwards, layer by layer.
    loaded_waiting = sum(tr.get("host_resident", {}).values())
    for_training = (
        read.get("denoiser", 0) + loaded_waiting + (trained if method.whole_denoiser else 0)
    )
    loaded = max(for_cache, for_training)
    loading = {"loaded_weights": loaded}
    training = {
        "waiting_model": sum(waiting.values()),
        "swapped_blocks": plan["host"],
        "cached_batch": 2 * tr["inputs_bytes"],  # the entries read, and the batch stacked
        "ema": ema_move,
    }
    host_phase = "load" if sum(loading.values()) >= sum(training.values()) else "training"
    host = {"process": HOST_PROCESS}
    for phase_name, phase_part in (("load", loading), ("training", training)):
        host.update({k: v if phase_name == host_phase else 0 for k, v in phase_part.items()})

    notes = [
        f"the peak falls in the {phase}; persistent state is {persistent / GIB:.2f} GiB",
        "activations come from one traced training step on the meta device; attention is "
        "counted as flash / memory-efficient kernels keep it (output and log-sum-exp)",
    ]
    on_gpu = on_accelerator(cfg) if waiting else None
    notes += [
        f"one denoiser model at a time on the GPU: {on_gpu} "
        f"({comps.get('denoiser_weights', 0) / GIB:.2f} GiB); {label} waits in host RAM "
        f"({size / GIB:.2f} GiB{f', stored {quant} as on the GPU' if quant != 'none' else ''})"
        for label, size in waiting.items()
    ]
    encoders = sum(comps[f"{n}_weights"] for n in tr["frozen"] if n != "denoiser")
    if split == "fsdp":
        notes.append(
            "under FSDP the text encoders and the VAE leave the GPU once the cache is filled "
            "(no validation images are drawn while training)"
        )
    elif embedded:
        notes.append(
            "the text encoders leave the GPU and host RAM once the cache is filled: the "
            "validation prompts are cached with the captions and drawn from their embeddings"
        )
    elif not method.live_text and encoders:
        notes.append(
            f"text encoders and VAE stay on the GPU ({encoders / GIB:.2f} GiB) once the cache "
            "is filled: validation draws with them"
        )
    for kind, key in ((quant, "base_quantization"), (storage.text, "text_encoder_quantization")):
        names = [n for n in inv["quantized"] if kind != "none" and storage.kind(n, family) == kind]
        if key == "base_quantization" and storage.text != "none":
            names = [n for n in names if n == "denoiser" or n not in tr["frozen"]]
        if not names:
            continue
        before = sum(sum(tr["frozen"][n].values()) for n in names if n in tr["frozen"])
        after = sum(kept[n] for n in names if n in kept)
        note = (
            f"{key} {kind}: {', '.join(names)} take {after / GIB:.2f} GiB, not {before / GIB:.2f}"
        )
        if kind == "nf4":
            note += "; nf4 needs a CUDA GPU (bitsandbytes)"
        notes.append(note)
    if swap:
        notes.append(
            f"blocks_to_swap {swap}: {swap} of the denoiser's {len(inv['blocks'])} transformer "
            f"blocks ({plan['host'] / GIB:.2f} GiB) stay in host RAM and are copied in for each "
            f"forward and backward, {plan['staging'] / GIB:.2f} GiB of them on the GPU at a time"
        )
    step_total = sum(comps.values())
    if setup["total"] > step_total:
        notes.append(
            f"setting up needs more than the step: {setup['total'] / GIB:.2f} GiB while the "
            f"cache fills, with {setup['why']}"
        )
    if host_phase == "load":
        notes.append(
            f"host RAM peaks near {sum(host.values()) / GIB:.2f} GiB while the base loads: the "
            f"text encoders and VAE that fill the cache ({for_cache / GIB:.2f} GiB), then the "
            f"denoiser ({for_training / GIB:.2f} GiB), are read in the run's dtype before they "
            "move to the GPU"
        )
    else:
        notes.append(
            f"host RAM peaks near {sum(host.values()) / GIB:.2f} GiB in training: the swapped "
            f"blocks ({plan['host'] / GIB:.2f} GiB) stay there, pinned"
            + (" and the waiting model with them" if waiting else "")
        )
    if shape.precision == "no":
        notes.append("fp32 training: bf16 mixed precision roughly halves activations")
    if split != "single":
        notes.append(layout_note(layout, comps, casts, fsdp_gathered, shape.grads_persist))
    settings = {
        "resolution": resolution,
        "height": shape.height,
        "width": shape.width,
        "batch_size": shape.batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_checkpointing": shape.checkpointing,
        "mixed_precision": shape.precision,
        "optimizer": optimizer,
        "base_quantization": quant,
        "text_encoder_quantization": storage.text,
        "blocks_to_swap": swap,
        "use_t5": cfg.model.use_t5,
        "trainable_params": tr["learned"],
        "processes": procs,
        "layout": split,
    }
    details = {
        "activations_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "frozen_weights_by_dtype": frozen_by_dtype(tr["frozen"]),
        "frozen_weights_stored": kept,
        "peak_phase": phase,
        "allocated_bytes": allocated,
        "setup": setup["components"],
        "setup_bytes": setup["total"],
        "on_accelerator": on_gpu,
        "waiting_in_host_ram": dict(waiting),
        "host_phase": host_phase,
        "host_by_phase": {"load": sum(loading.values()), "training": sum(training.values())},
        "host_loads": {"cache": for_cache, "denoiser": for_training},
        "swap": plan,
        "swappable_blocks": len(inv["blocks"]),
        "cache_bytes_per_sample": tr["inputs_bytes"] // max(1, shape.batch),
    }
    return Estimate(comps, settings, notes, details, host, split, procs)


__all__ = [
    "GIB",
    "GPUS",
    "NO_BF16",
    "LAYOUTS",
    "Estimate",
    "Layout",
    "Storage",
    "bucket_size",
    "cached_trace",
    "estimate",
    "forget_traces",
    "from_trace",
    "fsdp_units",
]
