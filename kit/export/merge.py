"""Merge what a run trained into its base model: one checkpoint that loads without an adapter.

`single_file` writes the one `.safetensors` file in the original layout that A1111, Forge and
ComfyUI load (`kit.families.ldm`); `diffusers` writes a pipeline folder. Either is read back by
diffusers' own loader and compared, weight by weight, with the merged model in memory: a
checkpoint counts as written only when every weight comes back exactly.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families import Components, Family, get_family
from kit.families.identity import public_name
from kit.families.loading import load_base
from kit.io import atomic_dir, save_tensors, write_json
from kit.methods import get_method
from kit.precision import DTYPES
from kit.run import checkpoint as ckpt
from kit.run.folder import open_run
from kit.train.resume import base_change, base_record

MERGE_FORMATS = ("single_file", "diffusers")


@dataclass
class MergeResult:
    """A merged checkpoint and how it was proven."""

    path: Path
    format: str
    step: int
    modules: list[str] = field(default_factory=list)
    """The adapted modules merged (part-qualified), or the parts a full fine-tune trained."""
    max_abs_diff: float = 0.0
    """The largest difference between a weight read back and the merged model's (0 when the
    file holds the model exactly, which verification demands)."""
    rounding: float = 0.0
    """The largest change of a merged fp32 weight by the cast to the checkpoint's dtype."""


def merge(
    run_dir: str | Path,
    *,
    out: str | Path,
    scale: float = 1.0,
    fmt: str = "single_file",
    checkpoint: str | Path | None = None,
    dtype: str = "fp16",
    base: str | Path | None = None,
    force: bool = False,
) -> MergeResult:
    """Merge a run's checkpoint (the latest by default; its EMA weights when it has them) into
    the base model at adapter strength `scale`, write it in `fmt` and verify it.

    `out` is the `.safetensors` file (or the folder to put it in) for `single_file`, the
    pipeline folder for `diffusers`. `base` merges into another copy of the architecture (a
    fine-tune of the run's base); a base of another architecture is refused. A run's own base
    that is no longer the one it trained on (other weights or configs) is refused unless
    `force`.
    """
    if fmt not in MERGE_FORMATS:
        raise KitError(f"unknown merge format '{fmt}' (choose from {', '.join(MERGE_FORMATS)})")
    if dtype not in DTYPES:
        raise KitError(f"unknown merge dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    run = open_run(run_dir)
    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)
    source = Path(checkpoint) if checkpoint else ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"{run.root} has no complete checkpoint to merge")
    step = int(json.loads((source / ckpt.PROGRESS_FILE).read_text())["step"])
    base_cfg = cfg if base is None else with_base(cfg, family, str(base))
    out = Path(out)
    if fmt == "single_file" and out.suffix != ".safetensors":
        out = out / f"{_title(cfg)}-step{step}.safetensors"
    m = base_cfg.model
    refuse_inputs(out, fmt, run.root, [m.pretrained_model, m.model_config, m.vae_model, source])
    _, comps = load_base(base_cfg, family=family)
    progress = json.loads((source / ckpt.PROGRESS_FILE).read_text())
    changed = base_change(progress.get("base"), base_record(base_cfg, comps.identity))
    if changed and base is None and not force:
        raise KitError(
            f"cannot merge {source}: {changed}; it was trained on another base (pass --force "
            "to merge into this one anyway)"
        )
    if changed:
        warnings.warn(
            f"merging into another base than the one trained on ({changed})", stacklevel=2
        )
    if fmt == "single_file":
        family.single_file_state_dict(comps)  # refuses here, before any work, without a layout

    tokens = [len(t) for t in comps.tokenizers]
    summary = method.attach(comps)
    if [len(t) for t in comps.tokenizers] != tokens:
        raise KitError(
            f"network_type {cfg.network.network_type} trains new tokens "
            f"({', '.join(cfg.network.placeholder_tokens)}): a merged checkpoint cannot carry a "
            "token its clients' tokenizers do not know; export the embedding instead "
            f"(kit export {run.root} --format embedding)"
        )
    method.load_state_dict(comps, ckpt.exported_weights(source))
    modules = merge_adapters(comps, scale, family.text_subfolders)
    if not modules and scale != 1.0:
        raise KitError(
            f"scale {scale:g} applies to adapters; network_type {cfg.network.network_type} "
            "trained the weights themselves, which merge as trained (scale 1)"
        )
    rounding = cast(comps, DTYPES[dtype])
    # A single-file base is read back with its configs from `model_config`.
    config_source = family.model_source(base_cfg.model.pretrained_model)
    record = merge_record(cfg, family, step, scale, dtype, base_cfg.model.pretrained_model)
    path = out
    if fmt == "single_file":
        state = family.single_file_state_dict(comps)
        meta = {**model_spec(cfg, family), **record}
        save_tensors(path, state, meta)
        del state
        reloaded = family.single_file_pipeline(path, config_source)
    else:
        with atomic_dir(path) as tmp:
            family.pipeline(comps).save_pretrained(tmp, safe_serialization=True)
            write_json(tmp / "kit_merge.json", record)
        reloaded = read_pipeline(family, path)
    try:
        diff = compare(family.pipeline(comps).components, reloaded.components, path)
        if diff > 0:
            raise KitError(
                f"{path} does not hold the merged model: a weight read back differs by "
                f"{diff:g}; the checkpoint was removed"
            )
    except KitError:
        # A checkpoint that does not read back is not left where a user would take it.
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        raise
    merged = modules or list(summary.modules)
    return MergeResult(path, fmt, step, merged, diff, rounding)


def refuse_inputs(path: Path, fmt: str, run_root: Path, inputs: list[Any]) -> None:
    """Refuse a merge output that would overwrite or hold what the merge reads (the base
    model, its configs, the VAE, the run or its checkpoint), or a file or folder the kit did
    not write: a merged checkpoint never replaces anything of the user's."""
    where = path.expanduser().resolve()
    run = run_root.resolve()
    for given in inputs:
        if not given or not Path(str(given)).expanduser().exists():
            continue  # a hub id, or nothing configured
        src = Path(str(given)).expanduser().resolve()
        if where == src or src in where.parents or where in src.parents:
            raise KitError(
                f"--out {path}: it is or holds {given}, which the merge reads; write the merged "
                "model to a new file or folder of its own"
            )
    if run == where or where in run.parents:
        raise KitError(f"--out {path} holds the run folder {run_root}; choose a new path")
    if fmt == "single_file" and where.is_file() and "kit.steps" not in _metadata(where):
        raise KitError(
            f"--out {path} already exists and is not a checkpoint the kit merged; choose a new "
            "file name (nothing was written)"
        )
    if fmt == "single_file" and where.is_dir():
        raise KitError(f"--out {path} is a folder; give a .safetensors file name")
    if fmt == "diffusers" and where.exists():
        if not where.is_dir() or (
            any(where.iterdir()) and not (where / "kit_merge.json").is_file()
        ):
            raise KitError(
                f"--out {path} already exists and is not a model the kit merged; choose a new "
                "folder (nothing was written)"
            )


def _metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata ({} for a file that is not one)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 (any file that cannot be read as one holds no record)
        return {}


def with_base(cfg: Config, family: Family, base: str) -> Config:
    """The run's config with `base` as its base model, once `base` is shown to be the same
    architecture (every weight of the same name and shape); else a KitError naming both."""
    ours = cfg.model.pretrained_model
    if base == ours:
        return cfg
    mine = weight_shapes(family, ours)
    try:
        theirs = weight_shapes(family, base)
    except (OSError, ValueError, KeyError) as e:
        raise KitError(
            f"base '{base}' cannot be read as a {family.name} model ({e}); "
            f"the run trained on '{ours}'"
        ) from None
    if mine != theirs:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k} {mine.get(k)} vs {theirs.get(k)}" for k in differ[:3])
        raise KitError(
            f"base '{base}' is not the architecture of the run's base '{ours}' "
            f"({len(differ)} weights differ, e.g. {shown}); trained weights merge only into "
            "the architecture they were trained on"
        )
    other = copy.deepcopy(cfg)
    other.model.pretrained_model = base
    other.model.revision = None
    other.model.variant = None
    return other


def weight_shapes(family: Family, pretrained: str) -> dict[str, tuple[int, ...]]:
    """Every weight's shape of a base model, read from its configs (no weights loaded)."""
    parts = family.empty_parts(pretrained)
    return {
        f"{part}.{k}": tuple(v.shape)
        for part, module in parts.items()
        for k, v in module.state_dict().items()
    }


def _parts(comps: Components, text_names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    named = [("denoiser", comps.denoiser)]
    for i, enc in enumerate(comps.text_encoders):
        named.append((text_names[i] if i < len(text_names) else f"text_encoder_{i}", enc))
    return [(n, m) for n, m in named if m is not None]


def merge_adapters(
    comps: Components, scale: float = 1.0, text_names: tuple[str, ...] = ()
) -> list[str]:
    """Fold every peft adapter layer (LoRA, DoRA, LoHa, LoKr) of the denoiser and the text
    encoders into its base weight at strength `scale`, then put the plain layer back in its
    place, so the model saves and loads as the base architecture.

    Returns the merged modules, each under its part: `denoiser.` or the text encoder's name in
    `text_names` (the family's subfolders).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = []
    for part, module in _parts(comps, text_names):
        tuners = [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]
        for name, layer in tuners:
            layer.scale_layer(scale)
            layer.merge()
            parent, _, child = name.rpartition(".")
            setattr(
                module.get_submodule(parent) if parent else module, child, layer.get_base_layer()
            )
            merged.append(f"{part}.{name}")
        # What diffusers' `add_adapter` and peft's injection record: without an adapter left,
        # `save_pretrained` must write the whole model, not an adapter.
        if hasattr(module, "peft_config"):
            del module.peft_config
        if getattr(module, "_hf_peft_config_loaded", False):
            module._hf_peft_config_loaded = False
    return merged


@torch.no_grad()
def cast(comps: Components, dtype: torch.dtype) -> float:
    """Cast every loaded part to `dtype` in place; the largest change of a weight by the cast.

    A weight too large for the dtype (fp16 tops out at 65504) would become infinite: that is
    refused, naming the weight, rather than written.
    """
    worst = 0.0
    for module in comps.frozen_modules():
        for name, t in module.state_dict().items():
            if not t.is_floating_point() or t.dtype == dtype or not t.numel():
                continue
            rounded = t.to(dtype)
            if not torch.isfinite(rounded).all() and torch.isfinite(t).all():
                raise KitError(
                    f"weight {name} ({t.abs().max().item():g} at most) does not fit in "
                    f"{dtype}; merge with dtype fp32 or bf16"
                )
            worst = max(worst, (rounded.float() - t.float()).abs().max().item())
        module.to(dtype)
    return worst


@torch.no_grad()
def compare(ours: dict[str, Any], theirs: dict[str, Any], path: Path) -> float:
    """The largest difference between the weights of two pipelines' models; a KitError when a
    model, a weight or a shape did not come back."""
    worst = 0.0
    for name, module in ours.items():
        if not isinstance(module, nn.Module):
            continue
        other = theirs.get(name)
        if not isinstance(other, nn.Module):
            raise KitError(f"{path}: {name} did not load back")
        mine, read = module.state_dict(), other.state_dict()
        odd = sorted(set(mine) ^ set(read))
        if odd:
            raise KitError(f"{path}: {name} loads back with other weights ({', '.join(odd[:3])})")
        for key, value in mine.items():
            back = read[key]
            if back.shape != value.shape:
                raise KitError(
                    f"{path}: {name}.{key} loads back as {tuple(back.shape)}, "
                    f"not {tuple(value.shape)}"
                )
            if value.numel():
                d = (back.double().cpu() - value.double().cpu()).abs().max().item()
                worst = max(worst, d)
    return worst


def read_pipeline(family: Family, folder: Path) -> Any:
    """A diffusers pipeline folder read back as diffusers users read it."""
    import diffusers

    cls = getattr(diffusers, family.pipeline_class)
    return cls.from_pretrained(str(folder), **family.pipeline_kwargs)


def _title(cfg: Config) -> str:
    return Path(cfg.train.output_dir).name or "merged"


def merge_record(
    cfg: Config, family: Family, step: int, scale: float, dtype: str, base: str
) -> dict[str, str]:
    """What the kit merged, as metadata: no local path (a checkpoint is shared)."""
    return {
        "kit.base_model": public_name(base),
        "kit.model_family": family.name,
        "kit.network_type": cfg.network.network_type,
        "kit.trigger_words": json.dumps(cfg.data.trigger_words),
        "kit.steps": str(step),
        "kit.merge_scale": f"{scale:g}",
        "kit.dtype": dtype,
    }


def model_spec(cfg: Config, family: Family) -> dict[str, str]:
    """The ModelSpec fields of a single-file checkpoint that clients show and sort by: the
    family's own (architecture, prediction type), in the original layout's implementation."""
    side = cfg.data.resolution
    version = family.version_metadata()
    return {
        **{k: v for k, v in version.items() if k.startswith("modelspec.")},
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.implementation": family.single_file_implementation
        or family.modelspec_implementation,
        "modelspec.title": _title(cfg),
        "modelspec.resolution": f"{side}x{side}",
        "modelspec.trigger_phrase": ", ".join(cfg.data.trigger_words),
    }


__all__ = [
    "MERGE_FORMATS",
    "MergeResult",
    "cast",
    "compare",
    "merge",
    "merge_adapters",
    "merge_record",
    "model_spec",
    "read_pipeline",
    "weight_shapes",
    "with_base",
]
