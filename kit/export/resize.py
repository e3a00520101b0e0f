"""Shrink a trained LoRA's rank, or turn a DoRA, LoHa or LoKr adapter into a plain LoRA.

Each adapted module's update ΔW is replaced by its truncated SVD. By Eckart–Young that is the
best approximation of that rank in the Frobenius norm, so no smaller LoRA keeps more of what
training learned; the share of ‖ΔW‖² it keeps (the kept energy, Σ kept σ² / Σ σ²) says per module
how much was lost. The factors get √σ on each side and alpha = rank, so every client applies them
at scale 1 whatever it assumes about alpha.

A LoRA's ΔW = (alpha / r)·B·A is decomposed from its factors without being formed. DoRA, LoHa and
LoKr updates are not low-rank products: their ΔW is the merged weight minus the base weight,
merged by peft itself on the loaded base model, so the extracted LoRA approximates exactly what
the trained adapter does.

The result is a run folder of its own (config, a checkpoint of the reduced LoRA, validation
images redrawn with it) exported through the normal path, so `kit export`, `kit push` and the
export's verification work on it unchanged.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from kit.config import Config, load_config
from kit.errors import KitError
from kit.export.writer import ExportResult, export
from kit.families import Family, get_family
from kit.families.loading import load_base
from kit.io import atomic_dir, write_json
from kit.methods import get_method, unread_keys
from kit.methods.adapters import Lora
from kit.methods.base import Method
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir, open_run
from kit.sample.validate import load_trained, read_sidecar, run_validation

RESIZE_RECORD = "resize.json"
"""In a resized run folder: what it was made from, and the kept energy of every module."""

DOWN, UP = ".lora_A.weight", ".lora_B.weight"


@dataclass
class Truncation:
    """Factors of one module's reduced update: ΔW ≈ up @ down, with alpha = rank."""

    up: torch.Tensor
    """(out, rank): `lora_B` flattened."""
    down: torch.Tensor
    """(rank, in): `lora_A` flattened."""
    energy: float
    """Σ kept σ² / Σ σ² (1.0 for an update that is zero)."""


@dataclass
class ResizeResult:
    """A resized run: where it is, what it kept, and its exports."""

    run_dir: Path
    source: Path
    """The checkpoint folder it was made from."""
    step: int
    source_method: str
    """The trained adapter's kind, as prose names it (LoRA, DoRA, LoHa, LoKr)."""
    trained_rank: int
    rank: int
    energy: dict[str, float]
    """Module (peft naming) → the share of its update's Σσ² the reduced LoRA keeps."""
    exports: list[ExportResult] = field(default_factory=list)

    @property
    def min_energy(self) -> float:
        return min(self.energy.values())

    @property
    def mean_energy(self) -> float:
        return sum(self.energy.values()) / len(self.energy)

    def lines(self) -> list[str]:
        """What the command line prints."""
        worst = min(self.energy, key=self.energy.get)
        out = [
            f"{self.source_method} rank {self.trained_rank} → LoRA rank {self.rank} (step "
            f"{self.step}): kept energy mean "
            f"{self.mean_energy:.4f}, min {self.min_energy:.4f} ({worst}) over "
            f"{len(self.energy)} modules",
            f"run folder: {self.run_dir}",
        ]
        for r in self.exports:
            v = r.verification
            check = f"verified, max pixel difference {v.max_abs_diff}" if v else "not verified"
            check = v.describe() if v and v.untrained else check
            out.append(f"{r.format}: {r.path} ({check})")
        return out


# ------------------------------------------------------------------ the arithmetic


def _split(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int) -> Truncation:
    """Keep the `rank` largest singular triplets, √σ on each side, zero-padded to `rank`."""
    k = min(rank, s.numel())
    total = float((s.double() ** 2).sum())
    kept = float((s[:k].double() ** 2).sum())
    root = s[:k].sqrt()
    up = torch.zeros(u.shape[0], rank, dtype=u.dtype)
    down = torch.zeros(rank, vh.shape[1], dtype=vh.dtype)
    up[:, :k] = (u[:, :k] * root).cpu()
    down[:k] = (root[:, None] * vh[:k]).cpu()
    return Truncation(up, down, kept / total if total > 0 else 1.0)


def truncate(delta: torch.Tensor, rank: int) -> Truncation:
    """The best rank-`rank` factors of a 2-D update (rows are outputs), by a full SVD."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    u, s, vh = torch.linalg.svd(delta.to(device, torch.float32), full_matrices=False)
    return _split(u, s, vh, rank)


def truncate_factors(up: torch.Tensor, down: torch.Tensor, scale: float, rank: int) -> Truncation:
    """The same for ΔW = scale · up @ down, without forming ΔW: a QR of each factor leaves an
    r × r core whose SVD is ΔW's (exact, and cheap for any layer size)."""
    qu, ru = torch.linalg.qr(up.double())
    qd, rd = torch.linalg.qr(down.double().T)
    u, s, vh = torch.linalg.svd(scale * ru @ rd.T)
    t = _split(qu @ u, s, vh @ qd.T, rank)
    return Truncation(t.up.float(), t.down.float(), t.energy)


def _as_lora(name: str, t: Truncation, down_shape: torch.Size, out: dict, dtype) -> None:
    """Store a truncation under peft's names, shaped like the module's LoRA (conv kernels too)."""
    rank = t.down.shape[0]
    out[name + DOWN] = t.down.reshape(rank, *down_shape[1:]).to(dtype).contiguous()
    up_shape = (t.up.shape[0], rank, *([1] * (len(down_shape) - 2)))
    out[name + UP] = t.up.reshape(up_shape).to(dtype).contiguous()


def reduce_lora(
    weights: dict[str, torch.Tensor], scale: float, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """LoRA weights in peft naming (`<module>.lora_A.weight` / `.lora_B.weight`, any part) →
    the rank-`rank` LoRA with alpha = rank, and each module's kept energy."""
    modules = sorted(k[: -len(DOWN)] for k in weights if k.endswith(DOWN))
    other = [k for k in weights if not k.endswith((DOWN, UP))]
    if other or len(modules) * 2 != len(weights):
        raise KitError(f"not plain LoRA weights (unexpected keys such as {other[:2]})")
    out: dict[str, torch.Tensor] = {}
    energy = {}
    for name in modules:
        a, b = weights[name + DOWN], weights[name + UP]
        t = truncate_factors(b.flatten(1), a.flatten(1), scale, rank)
        _as_lora(name, t, a.shape, out, a.dtype)
        energy[name] = t.energy
    return out, energy


def _tuned_parts(method: Method, family: Family, comps) -> dict[str, torch.nn.Module]:
    """Key prefix → a loaded part that carries adapters, named as the checkpoint names them."""
    subs = family.text_subfolders
    parts = {"": comps.denoiser}
    parts.update({f"{subs[i]}.": comps.text_encoders[i] for i in method.trained_text_encoders()})
    return parts


def tuned_layers(
    cfg: Config, method: Method, family: Family, weights: dict[str, torch.Tensor]
) -> list[tuple[str, torch.nn.Module]]:
    """The base model loaded with the trained adapter in place: each adapted layer (a peft
    tuner layer) under the name the checkpoint gives its weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    parts = ("denoiser", "text_encoders") if method.trained_text_encoders() else ("denoiser",)
    _, comps = load_base(cfg, parts=parts, family=family)
    method.attach(comps)
    method.load_state_dict(comps, weights)
    return [
        (prefix + name, layer)
        for prefix, part in _tuned_parts(method, family, comps).items()
        for name, layer in part.named_modules()
        if isinstance(layer, BaseTunerLayer)
    ]


def full_rank(layer: torch.nn.Module) -> int:
    """The largest rank an update of this layer's weight can have."""
    weight = layer.get_base_layer().weight
    return min(weight.shape[0], weight[0].numel())


@torch.no_grad()
def merged_update(layer: torch.nn.Module) -> torch.Tensor:
    """The update a trained peft layer makes to its weight: merged by peft, minus the base.

    For DoRA this is m·(W + sBA)/‖W + sBA‖ − W row by row; for LoHa and LoKr their products.
    The layer stays merged (it is read once).
    """
    base = layer.get_base_layer()
    before = base.weight.detach().float().clone()
    layer.merge()
    return base.weight.detach().float() - before


def extract_lora(
    layers: list[tuple[str, torch.nn.Module]], rank: int, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Trained layers → a rank-`rank` LoRA (alpha = rank) in peft naming, and the kept energy;
    one full update in memory at a time."""
    out: dict[str, torch.Tensor] = {}
    energy = {}
    for name, layer in layers:
        delta = merged_update(layer)
        t = truncate(delta.flatten(1), rank)
        _as_lora(name, t, torch.Size((rank, *delta.shape[1:])), out, dtype)
        energy[name] = t.energy
    return out, energy


# ------------------------------------------------------------------ the resized run


def _check(method: Method, cfg: Config, rank: int, run: RunDir) -> int:
    """The trained rank; refuses what cannot be resized to `rank`."""
    if rank < 1:
        raise KitError(f"resize: --rank must be at least 1, got {rank}")
    if not method.low_rank:
        raise KitError(
            f"resize: {run.root} trained {method.title}, which has no low-rank update to "
            "shrink; resize works on LoRA, DoRA, LoHa and LoKr runs"
        )
    trained = int(cfg.network.lora_rank)
    plain = method.rank_bounded
    if plain and rank >= trained:
        raise KitError(
            f"resize: --rank {rank} is not below the trained rank {trained} of {run.root}: a "
            f"LoRA's update has rank at most {trained}, so nothing would shrink "
            f"(choose 1 to {trained - 1})"
        )
    return trained


def _prepare_out(out: Path, run: RunDir) -> RunDir:
    """The resized run's folder: new, or an earlier resize's (replaced); never anything else."""
    if out.resolve() == run.root.resolve():
        raise KitError(f"resize: --out {out} is the run itself; choose another folder")
    if out.exists():
        if not (out / RESIZE_RECORD).is_file() and any(out.iterdir()):
            raise KitError(
                f"resize: {out} exists and is not a resized run (no {RESIZE_RECORD}); "
                "choose another --out or remove it"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return RunDir(out)


def _validation_specs(run: RunDir, step: int) -> list:
    """The specs training drew at `step` (else at its latest validation), to redraw them."""
    steps = run.validation_steps()
    folder = steps.get(step) or (steps[max(steps)] if steps else None)
    if folder is None:
        return []
    return [read_sidecar(sc)[0] for sc in sorted(folder.glob("*.json"))]


def _write_checkpoint(new: RunDir, step: int, weights, progress: dict) -> Path:
    with atomic_dir(new.checkpoint(step)) as tmp:
        save_file(weights, str(tmp / ckpt.ADAPTER_FILE))
        write_json(tmp / ckpt.PROGRESS_FILE, progress)
        (tmp / ckpt.MARKER).write_text(str(step))
    return new.checkpoint(step)


def resize(
    run_dir: str | Path,
    rank: int,
    *,
    checkpoint: str | Path | None = None,
    out_dir: str | Path | None = None,
    fmt: str | list[str] | tuple[str, ...] | None = None,
    dtype: str = "fp32",
    verify: bool = True,
) -> ResizeResult:
    """Write a rank-`rank` LoRA made from a run's adapter as a run folder of its own, export it.

    `out_dir` defaults to `<run>-rank<rank>` beside the run; `fmt` to every format a LoRA has
    on the family. The validation images training drew are redrawn with the reduced LoRA, and
    each export is verified against them.
    """
    run = open_run(run_dir)
    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)
    trained = _check(method, cfg, rank, run)
    source = Path(checkpoint) if checkpoint else ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"resize: {run.root} has no complete checkpoint")
    progress = json.loads((source / ckpt.PROGRESS_FILE).read_text())
    step = int(progress["step"])
    weights = ckpt.exported_weights(source)
    if method.rank_bounded:
        reduced, energy = reduce_lora(weights, float(method.alpha()) / trained, rank)
    else:
        layers = tuned_layers(cfg, method, family, weights)
        largest = max(full_rank(layer) for _, layer in layers)
        if rank > largest:
            raise KitError(
                f"resize: --rank {rank} is above the largest rank any adapted weight of "
                f"{run.root} can have ({largest}); choose 1 to {largest}"
            )
        reduced, energy = extract_lora(layers, rank, next(iter(weights.values())).dtype)
        del layers  # free that base model before the resized run loads its own

    out = Path(out_dir) if out_dir else run.root.parent / f"{run.root.name}-rank{rank}"
    new = _prepare_out(out, run)
    record = {
        "source_run": run.root.name,
        "source_checkpoint": source.name,
        "source_method": method.title,
        "trained_rank": trained,
        "rank": rank,
        "step": step,
        "mean_energy": sum(energy.values()) / len(energy),
        "min_energy": min(energy.values()),
        "energy": energy,
    }
    write_json(new.root / RESIZE_RECORD, record)
    new_cfg = cfg.replace(
        **unread_keys(cfg, Lora.name),  # what only the old kind read (LoKr's factor...)
        network_type=Lora.name,
        use_dora=False,
        lora_rank=rank,
        lora_alpha=float(rank),
        output_dir=str(new.root.resolve()),  # the saved config reads paths from its folder
    )
    new_cfg.save(new.config)
    if run.manifest.is_file():
        shutil.copyfile(run.manifest, new.manifest)
    written = _write_checkpoint(new, step, reduced, progress)
    specs = _validation_specs(run, step)
    if specs:
        _, _, fam, comps, _ = load_trained(new.root, written)
        run_validation(
            fam,
            fam.pipeline(comps),
            specs,
            new.validation_step(step),
            cols=max(1, len(new_cfg.validation.validation_seeds)),
            meta={"base_model": new_cfg.model.pretrained_model, "step": step},
        )
    formats = (
        [fmt] if isinstance(fmt, str) else list(fmt or get_method(new_cfg, family).export_formats())
    )
    exports = [export(new.root, f, dtype=dtype, verify=verify) for f in formats]
    return ResizeResult(new.root, source, step, method.title, trained, rank, energy, exports)


__all__ = [
    "RESIZE_RECORD",
    "ResizeResult",
    "Truncation",
    "extract_lora",
    "full_rank",
    "merged_update",
    "reduce_lora",
    "resize",
    "truncate",
    "truncate_factors",
    "tuned_layers",
]
