"""Export what a run trained in a client's layout and prove it by redrawing with that client.

Each method writes its own formats (`Method.write_export`); this module picks the checkpoint,
converts the dtype, and verifies the result against the kit's own validation images.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from safetensors import safe_open

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families import Family, get_family
from kit.families.base import ImageSpec
from kit.io import write_json
from kit.methods import get_method
from kit.methods.base import Apply, load_lora
from kit.precision import DTYPES
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir, open_run
from kit.sample.validate import draw_checkpoint, frame_strip, read_sidecar

FORMATS = ("diffusers", "kohya", "embedding")


@dataclass
class Verification:
    """How an exported file's images compare with the kit's own."""

    images: int
    max_abs_diff: int
    mean_abs_diff: float
    passed: bool
    files: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    """One exported file (or folder) and its verification."""

    format: str
    path: Path
    step: int
    verification: Verification | None


def formats_for(cfg: Config, family: Family) -> tuple[str, ...]:
    """The export formats of this run's method on this family (refused pairs raise)."""
    return get_method(cfg, family).export_formats()


def export(
    run_dir: str | Path,
    fmt: str = "diffusers",
    *,
    checkpoint: str | Path | None = None,
    out_dir: str | Path | None = None,
    dtype: str = "fp32",
    verify: bool = True,
    tolerance: int = 2,
) -> ExportResult:
    """Write what a run's checkpoint trained in `fmt`; reload it into plain diffusers and compare."""
    if dtype not in DTYPES:
        raise KitError(f"unknown export dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    run = open_run(run_dir)
    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)
    allowed = method.export_formats()
    if fmt not in allowed:
        raise KitError(
            f"unknown export format '{fmt}' for {cfg.network.network_type} on {family.name} "
            f"(choose from {', '.join(allowed) or 'none'})"
        )
    source = Path(checkpoint) if checkpoint else ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"{run.root} has no complete checkpoint to export")
    step = json.loads((source / "progress.json").read_text())["step"]
    weights = {k: v.to(DTYPES[dtype]) for k, v in ckpt.exported_weights(source).items()}
    meta = {
        "kit.base_model": cfg.model.pretrained_model,
        "kit.model_family": family.name,
        "kit.network_type": cfg.network.network_type,
        "kit.trigger_words": json.dumps(cfg.data.trigger_words),
        "kit.steps": str(step),
        "kit.resolution": str(cfg.data.resolution),
    }
    out = Path(out_dir) if out_dir else run.exports / fmt
    out.mkdir(parents=True, exist_ok=True)
    path, apply = method.write_export(fmt, weights, meta, step, out)
    verification = None
    if verify:
        verification = verify_export(run, path, step, tolerance=tolerance, apply=apply)
        write_json(
            Path(f"{path}.verify.json" if path.is_dir() else path.with_suffix(".verify.json")),
            verification.__dict__,
        )
        if not verification.passed:
            raise KitError(
                f"{path} does not reproduce the kit's images (max pixel difference "
                f"{verification.max_abs_diff} > {tolerance}); the export is not trustworthy"
            )
    return ExportResult(fmt, path, step, verification)


def reference_images(run: RunDir, step: int) -> list[tuple[ImageSpec, Path]]:
    """The validation images training drew at `step`, with their specs."""
    folder = run.validation_step(step)
    return [
        (read_sidecar(sc)[0], sc.with_suffix(".png"))
        for sc in sorted(folder.glob("*.json"))
        if sc.with_suffix(".png").is_file()
    ]


def _draw_references(run: RunDir, step: int) -> list[tuple[ImageSpec, Path]]:
    """Draw reference images with the kit's own in-process path when training drew none."""
    grid = draw_checkpoint(run.root, ckpt.checkpoint_dir(run.root, step))
    return [
        (read_sidecar(sc)[0], sc.with_suffix(".png")) for sc in sorted(grid.parent.glob("*.json"))
    ]


def verify_export(
    run: RunDir, path: Path, step: int, tolerance: int = 2, apply: Apply = load_lora
) -> Verification:
    """Apply an export to a fresh diffusers pipeline; redraw the kit's images; compare."""
    import diffusers

    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    refs = reference_images(run, step) or _draw_references(run, step)
    pipe_cls = getattr(diffusers, family.pipeline_class)
    pipe = apply(
        pipe_cls.from_pretrained(cfg.model.pretrained_model, **family.pipeline_kwargs), path
    )
    pipe.set_progress_bar_config(disable=True)
    diffs = []
    for spec, png in refs:
        ours = np.asarray(frame_strip(family.sample(pipe, spec)), dtype=np.int16)
        theirs = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
        diffs.append(np.abs(ours - theirs))
    max_diff = int(max(d.max() for d in diffs))
    mean_diff = float(np.mean([d.mean() for d in diffs]))
    return Verification(
        images=len(refs),
        max_abs_diff=max_diff,
        mean_abs_diff=round(mean_diff, 4),
        passed=max_diff <= tolerance,
        files=[str(p) for _, p in refs],
    )


def describe(path: str | Path) -> dict[str, Any]:
    """Key count, a few key names and the metadata of an exported file."""
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        return {"keys": len(keys), "sample_keys": keys[:4], "metadata": f.metadata() or {}}


__all__ = [
    "FORMATS",
    "ExportResult",
    "Verification",
    "describe",
    "export",
    "formats_for",
    "verify_export",
]
