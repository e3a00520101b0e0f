"""Advice: the cheapest settings that fit a memory budget, searched with the estimate.

Every suggestion is a set of config keys with values the config accepts (`set`, and the same as
`kit train -s key=value` arguments in `changes`), so a row can be applied as it is printed. Rows
are ranked by predicted time per sample; those that change what is learned (a lower resolution,
leaving T5 out) come after every row that does not.

Where no setting fits one card, the same search runs per GPU under the multi-GPU layouts
(kit.preflight.layout), fewest GPUs first: the row then carries the launch that makes it
(`kit accelerate-config --processes N --fsdp`) beside its config keys.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.methods import Method, get_method
from kit.preflight.estimate import (
    GIB,
    GPUS,
    NO_BF16,
    Estimate,
    Storage,
    bucket_size,
    cached_trace,
    estimate,
    from_trace,
    fsdp_units,
)
from kit.preflight.layout import Layout
from kit.preflight.storage import QUANT_SLOWDOWN, check_quant, swap_choices, swap_slowdown
from kit.preflight.trace import Shape

CHECKPOINTING_SLOWDOWN = 1.3  # recomputing the forward pass in the backward
TEXT_QUANT_COST = 1.01
"""A quantized text encoder costs no step time (it only fills the cache), but its embeddings
move a little from the full-precision encoder's: tried only after what changes nothing."""
FP32_SLOWDOWN = 2.0  # fp32 matmuls against bf16 / fp16 ones
OPTIMIZER_SLOWDOWN = {
    "adamw": 1.0,
    "adamw8bit": 1.02,
    "adafactor": 1.05,
    "prodigy": 1.1,
    "lion": 1.02,
    "came": 1.08,
    "schedulefree": 1.02,
}
GRADED = ("train_batch_size", "gradient_accumulation_steps", "blocks_to_swap", "resolution")
"""Keys whose every further step costs more: a row that only goes further on them than a row
already found is no alternative to it."""
SMALLER_BATCH_SLOWDOWN = 0.075
"""Extra time per sample for each halving of the batch: smaller matmuls use the card less well."""
GPU_COUNTS = (2, 4, 8, 16)
"""GPUs the multi-GPU advice tries, fewest first: up to one machine of 8, then two."""
MACHINE_GPUS = 8
LAYOUT_SLOWDOWN = {"ddp": 1.0, "zero2": 1.05, "fsdp": 1.15}
"""Time per sample on each GPU relative to one card's run: ZeRO-2 reduce-scatters and gathers
the weights after the step; FSDP gathers every unit twice per step and waits on what overlap
does not hide."""
LAUNCH_FLAGS = {"ddp": "", "zero2": " --deepspeed-stage 2", "fsdp": " --fsdp"}
LAYOUT_TITLES = {"ddp": "DDP", "zero2": "DeepSpeed ZeRO-2", "fsdp": "FSDP"}


@dataclass(frozen=True)
class Option:
    """One value the advice may give a setting: the config keys it sets, its predicted time per
    sample relative to the config, and how far it moves from what the config learns."""

    name: str
    value: Any
    cost: float
    keys: dict[str, Any] = field(default_factory=dict)
    """Config key → value this option sets."""
    penalty: int = 0
    """Steps away from what the config learns (each lower resolution, leaving T5 out)."""


def _relative(costs: dict[Any, float], now: Any) -> dict[Any, float]:
    base = costs.get(now, 1.0)
    return {k: v / base for k, v in costs.items()}


def _drops_t5(cfg: Config) -> bool:
    """Whether `use_t5: false` is accepted by the family and leaves a text encoder out."""
    if not cfg.model.use_t5:
        return False
    try:
        without = get_family(cfg.model.model_family, cfg.replace(use_t5=False))
    except ConfigError:
        return False
    with_t5 = get_family(cfg.model.model_family, cfg)
    return len(without.text_subfolders) < len(with_t5.text_subfolders)


def _accepted(kind: str, method: Method) -> bool:
    """Whether training takes `base_quantization: kind` with this method (on a CUDA GPU)."""
    try:
        check_quant(kind, method)
    except ConfigError:
        return False
    return True


def options(
    cfg: Config, card: str | None, inventory: dict[str, Any] | None = None
) -> dict[str, list[Option]]:
    """Setting → the values the advice tries for it (on `card`, when named).

    `inventory` is a trace's inventory of the frozen weights (kit.preflight.storage): with it,
    `base_quantization` is tried where there are weights to quantize and `blocks_to_swap` where
    the denoiser has a stack of transformer blocks.
    """
    t, m = cfg.train, cfg.model
    res = cfg.data.resolution
    family = get_family(m.model_family, cfg)
    step = cfg.data.bucket_step or family.bucket_step
    effective = t.train_batch_size * t.gradient_accumulation_steps
    batches = sorted({b for b in (t.train_batch_size, 4, 2, 1) if b <= t.train_batch_size})
    batch_cost = {b: 1.0 + SMALLER_BATCH_SLOWDOWN * (t.train_batch_size / b - 1) for b in batches}
    half = "fp16" if card in NO_BF16 else "bf16"
    precision_cost = {t.mixed_precision: 1.0}
    if t.mixed_precision == "no":  # half precision on the card: faster, and half the memory
        precision_cost = {half: 1.0 / FP32_SLOWDOWN, "no": 1.0}
    ckpt_cost = _relative({False: 1.0, True: CHECKPOINTING_SLOWDOWN}, t.gradient_checkpointing)
    optimizers = [
        t.optimizer,
        *(o for o in ("adamw8bit", "adafactor", "adamw") if o != t.optimizer),
    ]
    opt_cost = _relative({o: OPTIMIZER_SLOWDOWN[o] for o in optimizers}, t.optimizer)
    out: dict[str, list[Option]] = {
        "batch": [
            Option(
                "batch",
                b,
                batch_cost[b],
                {"train_batch_size": b, "gradient_accumulation_steps": -(-effective // b)},
            )
            for b in batches
        ],
        "gradient_checkpointing": [
            Option("gradient_checkpointing", v, c, {"gradient_checkpointing": v})
            for v, c in ckpt_cost.items()
        ],
        "mixed_precision": [
            Option("mixed_precision", v, c, {"mixed_precision": v})
            for v, c in precision_cost.items()
        ],
        "optimizer": [Option("optimizer", v, c, {"optimizer": v}) for v, c in opt_cost.items()],
    }
    inv = inventory or {"quantized": {}, "blocks": []}
    method = get_method(cfg, family)
    quants = [m.base_quantization]
    if any(q["none"] for q in inv["quantized"].values()):
        quants += [q for q in ("int8", "nf4") if q != m.base_quantization and _accepted(q, method)]
    quant_cost = _relative({q: QUANT_SLOWDOWN[q] for q in quants}, m.base_quantization)
    out["base_quantization"] = [
        Option("base_quantization", q, c, {"base_quantization": q}) for q, c in quant_cost.items()
    ]
    # The text encoders quantized: only the setup (and a run that keeps them) holds less;
    # the cached embeddings move a little from the full-precision encoder's.
    texts = [m.text_encoder_quantization]
    if any(n not in ("denoiser", "vae") for n in inv["quantized"]):
        texts += [q for q in ("int8", "nf4") if q != texts[0]]
    out["text_encoder_quantization"] = [
        Option(
            "text_encoder_quantization",
            q,
            1.0 if q == texts[0] else TEXT_QUANT_COST,
            {"text_encoder_quantization": q},
        )
        for q in texts
    ]
    blocks = [] if method.whole_denoiser else inv["blocks"]
    swaps = sorted({t.blocks_to_swap, *swap_choices(blocks)})
    swap_cost = _relative({n: swap_slowdown(n, blocks) for n in swaps}, t.blocks_to_swap)
    out["blocks_to_swap"] = [
        Option("blocks_to_swap", n, c, {"blocks_to_swap": n}) for n, c in swap_cost.items()
    ]
    out["use_t5"] = [Option("use_t5", m.use_t5, 1.0, {"use_t5": m.use_t5})]
    if _drops_t5(cfg):
        out["use_t5"].append(Option("use_t5", False, 1.0, {"use_t5": False}, penalty=1))
    # Lower resolutions in steps of two buckets, down to half (and never below four buckets).
    lower = range(res - step * 2, max(step * 4, res // 2) - 1, -step * 2)
    out["resolution"] = [
        Option("resolution", r, (r / res) ** 2, {"resolution": r}, penalty=i)
        for i, r in enumerate([res, *lower])
    ]
    return out


def format_changes(changes: dict[str, Any]) -> str:
    """`key=value, …` as `kit train -s key=value` takes them (JSON values, bare strings)."""
    return ", ".join(
        f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in changes.items()
    )


class _Traces:
    """The traces and per-resolution setup the search reuses, so each try is arithmetic."""

    def __init__(self, cfg: Config, max_traces: int) -> None:
        self.cfg = cfg
        self.max_traces = max_traces
        self.traced: dict[tuple, dict[str, Any]] = {}
        self.setups: dict[tuple, tuple] = {}

    def setup(self, resolution: int, use_t5: bool) -> tuple:
        key = (resolution, use_t5)
        if key not in self.setups:
            cfg = self.cfg if use_t5 == self.cfg.model.use_t5 else self.cfg.replace(use_t5=use_t5)
            family = get_family(cfg.model.model_family, cfg)
            method = get_method(cfg, family)
            self.setups[key] = (cfg, family, method, bucket_size(cfg, resolution))
        return self.setups[key]

    def has(self, shape: Shape, use_t5: bool) -> bool:
        return (shape, use_t5) in self.traced

    def get(self, cfg: Config, shape: Shape, use_t5: bool) -> dict[str, Any] | None:
        key = (shape, use_t5)
        if key not in self.traced:
            if len(self.traced) >= self.max_traces:
                return None
            self.traced[key] = cached_trace(cfg, shape)
        return self.traced[key]


def advise(
    cfg: Config,
    budget_gib: float,
    *,
    card: str | None = None,
    top: int = 3,
    max_traces: int = 24,
    host_gib: float | None = None,
    multi_gpu: bool = True,
) -> list[dict[str, Any]]:
    """The `top` cheapest settings that fit `budget_gib` (and `host_gib` of host RAM, when
    given), cheapest first, with their peaks.

    Candidates are tried in order of (steps away from what the config learns, predicted time
    per sample), so only the traces that might fit are run; a candidate that only adds changes
    to a row already found is skipped, so the rows are real alternatives. Where no setting fits
    one card and `multi_gpu` is on, the rows are those of the fewest GPUs of `budget_gib` each
    that hold the run (`multi_gpu_advice`).
    """
    search = _Search(cfg, max_traces, card)
    found = search.rows(budget_gib, top, host_gib, Layout())
    if found or not multi_gpu:
        return found
    return search.multi_gpu(budget_gib, top, host_gib)


def multi_gpu_advice(
    cfg: Config,
    budget_gib: float,
    *,
    card: str | None = None,
    top: int = 3,
    max_traces: int = 24,
    host_gib: float | None = None,
) -> list[dict[str, Any]]:
    """Rows for the fewest GPUs (of `GPU_COUNTS`) of `budget_gib` each that hold the run, under
    DDP, ZeRO-2 or FSDP, cheapest first: each with its launch (`launch`: processes, layout and
    the `kit accelerate-config` command) and its per-GPU peak."""
    return _Search(cfg, max_traces, card).multi_gpu(budget_gib, top, host_gib)


class _Search:
    """The search over settings of one config, sharing its traces between layouts."""

    def __init__(self, cfg: Config, max_traces: int, card: str | None) -> None:
        t = cfg.train
        self.cfg = cfg
        self.traces = _Traces(cfg, max_traces)
        base_cfg, _, _, (height, width) = self.traces.setup(cfg.data.resolution, cfg.model.use_t5)
        self.precision = "no" if t.mixed_precision == "fp32" else t.mixed_precision
        self.base_shape = Shape(
            height,
            width,
            t.train_batch_size,
            t.gradient_checkpointing,
            self.precision,
            t.gradient_accumulation_steps > 1,
        )
        self.base_trace = self.traces.get(base_cfg, self.base_shape, cfg.model.use_t5)
        self.opts = options(cfg, card, self.base_trace["storage"])

    def multi_gpu(
        self, budget_gib: float, top: int, host_gib: float | None
    ) -> list[dict[str, Any]]:
        # More GPUs before anything that changes what is learned (a lower resolution, no T5).
        for learning in (False, True):
            for n in GPU_COUNTS:
                found = []
                for kind in ("zero2", "fsdp"):  # DDP holds more than one card: never the way
                    found += self.rows(budget_gib, 1, host_gib, Layout(kind, n), learning)
                if found:
                    return sorted(found, key=lambda r: r["slowdown"])[:top]
        return []

    def rows(
        self,
        budget_gib: float,
        top: int,
        host_gib: float | None,
        layout: Layout,
        learning: bool = True,
    ) -> list[dict[str, Any]]:
        """Up to `top` rows under `layout`; `learning`: also rows that change what is learned."""
        cfg, traces, base_trace, base_shape = (
            self.cfg,
            self.traces,
            self.base_trace,
            self.base_shape,
        )
        opts = self.opts
        if layout.split != "single":  # what no launch of several processes takes
            opts = {**opts, "blocks_to_swap": [o for o in opts["blocks_to_swap"] if not o.value]}
        if layout.split in ("zero2", "fsdp"):
            opts["base_quantization"] = [o for o in opts["base_quantization"] if o.value == "none"]
        if not all(opts.values()):
            return []
        combos = []
        for combo in itertools.product(*opts.values()):
            cost = functools.reduce(lambda a, o: a * o.cost, combo, 1.0)
            combos.append((sum(o.penalty for o in combo), cost, combo))
        combos.sort(key=lambda c: (c[0], c[1]))
        current = cfg.to_dict(flat=True)
        effective = cfg.train.train_batch_size * cfg.train.gradient_accumulation_steps
        found: list[dict[str, Any]] = []
        for penalty, cost, combo in combos:
            if penalty and not learning:
                break
            s = {k: v for o in combo for k, v in o.keys.items()}
            if layout.processes > 1:  # the same effective batch, over every GPU's batches
                per_step = s["train_batch_size"] * layout.processes
                s["gradient_accumulation_steps"] = max(1, -(-effective // per_step))
            changes = {k: v for k, v in s.items() if current[k] != v}
            if any(_signature(r["set"]) <= _signature(changes) for r in found):
                continue
            if s["base_quantization"] != "none" and s["blocks_to_swap"]:
                continue  # training swaps no quantized weights (kit.train.offload)
            run_cfg, family, method, (height, width) = traces.setup(s["resolution"], s["use_t5"])
            shape = Shape(
                height,
                width,
                s["train_batch_size"],
                s["gradient_checkpointing"],
                s["mixed_precision"],
                s["gradient_accumulation_steps"] > 1,
            )
            split = layout
            if layout.kind == "fsdp" and layout.split != "single":
                split = Layout(layout.kind, layout.processes, fsdp_units(run_cfg))
            setup = (run_cfg, family, method, split)
            try:
                same_parts = (
                    s["mixed_precision"] == self.precision and s["use_t5"] == cfg.model.use_t5
                )
                if same_parts and not traces.has(shape, s["use_t5"]):
                    # The weights, the setup and the optimizer state do not depend on the traced
                    # shape: a candidate whose floor alone exceeds the budget needs no trace.
                    floor = _assemble(setup, s, base_trace, base_shape).floor_bytes
                    if floor > budget_gib * GIB:
                        continue
                tr = traces.get(run_cfg, shape, s["use_t5"])
                if tr is None:
                    continue
                est = _assemble(setup, s, tr, shape)
            except ConfigError:
                continue  # a pair this layout's launch refuses (kit.preflight.layout)
            if est.fits(budget_gib) and (host_gib is None or est.fits_host(host_gib)):
                found.append(_advice_row(est, changes, cost, penalty))
                if len(found) >= top:
                    break
        return found


def _assemble(setup: tuple, s: dict[str, Any], tr: dict[str, Any], shape: Shape) -> Estimate:
    """The estimate of settings `s` (config key → value) on a trace of `shape`."""
    cfg, family, method, layout = setup
    return from_trace(
        cfg,
        tr,
        shape,
        Storage(s["base_quantization"], s["blocks_to_swap"], s["text_encoder_quantization"]),
        resolution=s["resolution"],
        optimizer=s["optimizer"],
        accumulation=s["gradient_accumulation_steps"],
        method=method,
        family=family,
        layout=layout,
    )


def _launch_command(n: int, kind: str) -> str:
    """The `kit accelerate-config` line of a launch on `n` GPUs (8 to a machine)."""
    machines = -(-n // MACHINE_GPUS)
    command = f"kit accelerate-config CONFIG --processes {n}{LAUNCH_FLAGS[kind]}"
    if machines > 1:
        command += f" --machines {machines} --machine-rank RANK --main-process-ip IP"
    return command


def _signature(changes: dict[str, Any]) -> set[tuple[str, Any]]:
    return {(k, None if k in GRADED else v) for k, v in changes.items()}


def _advice_row(
    est: Estimate, changes: dict[str, Any], cost: float, penalty: int
) -> dict[str, Any]:
    s = est.settings
    n, kind = est.processes, est.layout
    row: dict[str, Any] = {}
    if kind != "single":
        cost *= LAYOUT_SLOWDOWN[kind]
        row["launch"] = {
            "processes": n,
            "layout": kind,
            "per_gpu_gib": round(est.peak_bytes / GIB, 2),
            "command": _launch_command(n, kind),
            "summary": f"{LAYOUT_TITLES[kind]} on {n} GPUs: {est.peak_bytes / GIB:.1f} GiB per GPU",
        }
    return {
        **row,
        "changes": format_changes(changes) or "(as configured)",
        "set": changes,
        "peak_gib": round(est.peak_bytes / GIB, 2),
        "host_ram_gib": round(est.host_bytes / GIB, 2),
        "slowdown": round(cost, 2),
        "changes_learning": penalty > 0,
        "settings": {
            k: s[k]
            for k in s
            if k not in ("height", "width", "trainable_params", "layout", "processes")
        },
        "estimate": est,
    }


def fit_table(
    cfg: Config, variants: list[dict[str, Any]], cards: list[str]
) -> list[dict[str, Any]]:
    """One row per variant (config key → value, applied to `cfg`): the VRAM and host-RAM peaks
    and whether it fits each of `cards` (names from `GPUS`)."""
    rows = []
    for variant in variants:
        est = estimate(cfg.replace(**variant) if variant else cfg)
        row: dict[str, Any] = {
            "settings": format_changes(variant) or "(as configured)",
            "peak_gib": round(est.total_bytes / GIB, 1),
            "setup_gib": round(est.setup_bytes / GIB, 1),
            "host_ram_gib": round(est.host_bytes / GIB, 1),
        }
        row.update({card: est.fits(GPUS[card]) for card in cards})
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """`fit_table` rows as a Markdown table (fits: yes / no)."""
    if not rows:
        return ""
    head = list(rows[0])
    titles = {
        "settings": "settings",
        "peak_gib": "step GiB",
        "setup_gib": "setup GiB",
        "host_ram_gib": "host RAM GiB",
    }
    lines = [
        "| " + " | ".join(titles.get(h, f"fits {h}") for h in head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for r in rows:
        cells = []
        for h in head:
            v = r[h]
            cells.append(
                ("yes" if v else "no")
                if isinstance(v, bool)
                else f"`{v}`"
                if h == "settings"
                else str(v)
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = [
    "GPU_COUNTS",
    "LAYOUT_SLOWDOWN",
    "Option",
    "advise",
    "fit_table",
    "format_changes",
    "markdown_table",
    "multi_gpu_advice",
    "options",
]
