"""Export a trained adapter (diffusers or kohya naming) and prove it by reloading it."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from kit import checkpoint as ckpt
from kit.config import load_config
from kit.errors import KitError
from kit.families import get_family
from kit.io import write_json, write_with
from kit.network import adapter_config, alpha_and_rank
from kit.runs import RunDir, open_run
from kit.validate import ImageSpec, frame_strip, read_sidecar

FORMATS = ("diffusers", "kohya")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    """One exported file and its verification."""

    format: str
    path: Path
    step: int
    verification: Verification | None


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
    """Write the adapter of a run's checkpoint in `fmt`; reload it and compare images."""
    if fmt not in FORMATS:
        raise KitError(f"unknown export format '{fmt}' (choose from {', '.join(FORMATS)})")
    if dtype not in DTYPES:
        raise KitError(f"unknown export dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    run = open_run(run_dir)
    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    if fmt not in family.export_formats:
        raise KitError(
            f"{family.name} models export as {', '.join(family.export_formats)}, not '{fmt}'"
        )
    source = Path(checkpoint) if checkpoint else ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"{run.root} has no complete checkpoint to export")
    step = json.loads((source / "progress.json").read_text())["step"]
    adapter = {k: v.to(DTYPES[dtype]) for k, v in ckpt.exported_weights(source).items()}
    lcfg = adapter_config(cfg, family, family.empty_parts(cfg.model.pretrained_model)["denoiser"])
    alpha, rank = alpha_and_rank(lcfg)
    meta = {
        "kit.base_model": cfg.model.pretrained_model,
        "kit.model_family": family.name,
        "kit.network_type": cfg.network.network_type,
        "kit.rank": str(rank),
        "kit.alpha": str(alpha),
        "kit.trigger_words": json.dumps(cfg.data.trigger_words),
        "kit.steps": str(step),
        "kit.resolution": str(cfg.data.resolution),
    }
    out = Path(out_dir) if out_dir else run.exports / fmt
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "diffusers":
        path = _write_diffusers(family, adapter, lcfg, meta, out)
    else:
        path = _write_kohya(family, adapter, alpha, rank, meta, cfg, step, out)
    verification = None
    if verify:
        verification = verify_export(run, path, step, tolerance=tolerance)
        write_json(path.with_suffix(".verify.json"), verification.__dict__)
        if not verification.passed:
            raise KitError(
                f"{path} does not reproduce the kit's images (max pixel difference "
                f"{verification.max_abs_diff} > {tolerance}); the export is not trustworthy"
            )
    return ExportResult(fmt, path, step, verification)


def _write_diffusers(family, adapter, lcfg, meta, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        written = family.save_diffusers_lora(adapter, lcfg.to_dict(), Path(tmp))
        with safe_open(str(written), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = {**(f.metadata() or {}), **meta}
        path = out / written.name
        write_with(path, lambda t: save_file(tensors, str(t), metadata=metadata))
    return path


def _write_kohya(family, adapter, alpha, rank, meta, cfg, step: int, out: Path) -> Path:
    tensors = family.kohya_state_dict(adapter, alpha)
    name = Path(cfg.train.output_dir).name or "lora"
    metadata = {
        **meta,
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
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
    from kit.validate import draw_checkpoint

    grid = draw_checkpoint(run.root, ckpt.checkpoint_dir(run.root, step))
    return [
        (read_sidecar(sc)[0], sc.with_suffix(".png"))
        for sc in sorted(grid.parent.glob("*.json"))
    ]


def verify_export(run: RunDir, lora_file: Path, step: int, tolerance: int = 2) -> Verification:
    """Load `lora_file` into a fresh diffusers pipeline; redraw the kit's images; compare."""
    import diffusers

    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    refs = reference_images(run, step) or _draw_references(run, step)
    pipe_cls = getattr(diffusers, family.pipeline_class)
    pipe = pipe_cls.from_pretrained(cfg.model.pretrained_model, **family.pipeline_kwargs)
    pipe.load_lora_weights(str(lora_file.parent), weight_name=lora_file.name)
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


__all__ = ["FORMATS", "ExportResult", "Verification", "describe", "export", "verify_export", "shutil"]
