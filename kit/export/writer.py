"""Export a trained adapter (diffusers or kohya naming) and prove it by reloading it."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families import Family, get_family
from kit.families.base import ImageSpec
from kit.io import write_json, write_with
from kit.methods.lycoris import merge_into, to_lycoris
from kit.methods.network import ADAPTERS, adapter_config, adapter_kind, alpha_and_rank
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir, open_run
from kit.sample.validate import frame_strip, read_sidecar

FORMATS = ("diffusers", "kohya", "embedding")
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
    """One exported file (or folder) and its verification."""

    format: str
    path: Path
    step: int
    verification: Verification | None


def formats_for(cfg: Config, family: Family) -> tuple[str, ...]:
    """The export formats of this run's network on this family.

    LoRA and DoRA: the family's formats (diffusers; kohya where the family has that naming).
    LoHa and LoKr: `kohya` (the LyCORIS keys, in the kohya naming). Full: a diffusers folder.
    Textual inversion: an embedding file.
    """
    kind = adapter_kind(cfg) if cfg.network.network_type in ADAPTERS else cfg.network.network_type
    if kind in ("lora", "dora"):
        return family.export_formats
    if kind in ("loha", "lokr"):
        return tuple(f for f in family.export_formats if f == "kohya")
    return {"full": ("diffusers",), "textual_inversion": ("embedding",)}[kind]


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
    allowed = formats_for(cfg, family)
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
    writer = _WRITERS[
        cfg.network.network_type
        if cfg.network.network_type in ("full", "textual_inversion")
        else "adapter"
    ]
    path, apply = writer(cfg, family, weights, meta, fmt, step, out)
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


Apply = Callable[[Any, Path], Any]
"""(fresh base pipeline, exported path) → a pipeline that draws with the export applied."""


def _load_lora(pipe: Any, path: Path) -> Any:
    pipe.load_lora_weights(str(path.parent), weight_name=path.name)
    return pipe


def _adapter_writer(cfg, family, weights, meta, fmt, step, out) -> tuple[Path, Apply]:
    denoiser = family.empty_parts(cfg.model.pretrained_model)["denoiser"]
    peft_config = adapter_config(cfg, family, denoiser)
    alpha, rank = alpha_and_rank(peft_config)
    meta = {**meta, "kit.rank": str(rank), "kit.alpha": str(alpha)}
    kind = adapter_kind(cfg)
    if fmt == "diffusers":
        return _write_diffusers(family, weights, peft_config, meta, out), _load_lora
    if kind in ("loha", "lokr"):
        tensors = to_lycoris(weights, alpha, rank, family.kohya_prefix)
        path = _write_kohya(
            family, tensors, alpha, rank, meta, cfg, step, out, "lycoris.kohya", kind
        )
        return path, _merge_lycoris(family)
    tensors = family.kohya_state_dict(weights, alpha)
    path = _write_kohya(family, tensors, alpha, rank, meta, cfg, step, out, "networks.lora", kind)
    # diffusers drops kohya DoRA magnitudes, so DoRA is checked with the kit's own reader.
    return path, _merge_lycoris(family) if kind == "dora" else _load_lora


def _merge_lycoris(family: Family) -> Apply:
    def apply(pipe: Any, path: Path) -> Any:
        from safetensors.torch import load_file

        denoiser = getattr(pipe, family.lora_layers_kwarg.removesuffix("_lora_layers"))
        merge_into(load_file(str(path)), denoiser, family.kohya_prefix)
        return pipe

    return apply


def _write_diffusers(family, adapter, peft_config, meta, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        written = family.save_diffusers_lora(adapter, peft_config.to_dict(), Path(tmp))
        with safe_open(str(written), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = {**(f.metadata() or {}), **meta}
        path = out / written.name
        write_with(path, lambda t: save_file(tensors, str(t), metadata=metadata))
    return path


def _write_kohya(
    family, tensors, alpha, rank, meta, cfg, step: int, out: Path, module: str, kind: str
) -> Path:
    name = Path(cfg.train.output_dir).name or "lora"
    metadata = {
        **meta,
        "ss_network_module": module,
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_network_args": json.dumps({"algo": kind} if module.startswith("lycoris") else {}),
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


def _full_writer(cfg, family, weights, meta, fmt, step, out) -> tuple[Path, Apply]:
    """A complete diffusers pipeline folder with the trained weights in it."""
    from kit.families.loading import load_base
    from kit.io import atomic_dir
    from kit.methods.network import build_network

    _, comps = load_base(cfg)
    net = build_network(cfg, family)
    net.attach(comps)
    net.load_state_dict(comps, weights)
    pipe = family.pipeline(comps).to(weights[next(iter(weights))].dtype)
    folder = out / "pipeline"
    with atomic_dir(folder) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        write_json(tmp / "kit_export.json", meta)

    def apply(base_pipe: Any, path: Path) -> Any:
        return type(base_pipe).from_pretrained(path, **family.pipeline_kwargs)

    return folder, apply


def _embedding_writer(cfg, family, weights, meta, fmt, step, out) -> tuple[Path, Apply]:
    """One file per placeholder token, in the layout A1111, ComfyUI and diffusers load."""
    encoders = sorted({int(k.split(":", 1)[0]) for k in weights})
    names = family.embedding_names
    tokens = cfg.network.placeholder_tokens
    files = {}
    for token in tokens:
        if len(encoders) == 1:
            tensors = {token: weights[f"0:{token}"][None]}
        else:
            tensors = {names[i]: weights[f"{i}:{token}"][None] for i in encoders}
        path = out / f"{_file_stem(token)}.safetensors"
        write_with(
            path,
            lambda t, tensors=tensors, token=token: save_file(
                tensors, str(t), metadata={**meta, "kit.token": token}
            ),
        )
        files[token] = path

    def apply(pipe: Any, folder: Path) -> Any:
        attrs = list(family.load_tokenizers(cfg.model.pretrained_model))
        for token, path in files.items():
            if len(encoders) == 1:
                pipe.load_textual_inversion(str(path), token=token)
                continue
            from safetensors.torch import load_file

            state = load_file(str(path))
            for i in encoders:
                pipe.load_textual_inversion(
                    state[names[i]][0],
                    token=token,
                    text_encoder=getattr(pipe, attrs[i]),
                    tokenizer=getattr(pipe, attrs[i].replace("text_encoder", "tokenizer")),
                )
        return pipe

    return out, apply


def _file_stem(token: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in token).strip("_")
    return stem or "embedding"


_WRITERS: dict[str, Callable[..., tuple[Path, Apply]]] = {
    "adapter": _adapter_writer,
    "full": _full_writer,
    "textual_inversion": _embedding_writer,
}


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
    from kit.sample.validate import draw_checkpoint

    grid = draw_checkpoint(run.root, ckpt.checkpoint_dir(run.root, step))
    return [
        (read_sidecar(sc)[0], sc.with_suffix(".png")) for sc in sorted(grid.parent.glob("*.json"))
    ]


def verify_export(
    run: RunDir, path: Path, step: int, tolerance: int = 2, apply: Apply = _load_lora
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
