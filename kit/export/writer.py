"""Export what a run trained in a client's layout and prove it by redrawing with that client.

Each method writes its own formats (`Method.write_export`); this module picks the checkpoint,
converts the dtype, and verifies the result against the kit's own validation images.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from kit.config import Config, load_config
from kit.errors import KitError
from kit.export.conformance import ClientCheck, as_records, check_file
from kit.export.metadata import shared_metadata
from kit.families import Family, get_family
from kit.families.samplers import ImageSpec, draw
from kit.io import write_json
from kit.methods import get_method
from kit.methods.base import Apply, load_lora, untrained_parts
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
    clients: list[dict[str, Any]] = field(default_factory=list)
    """How each client that reads the file loads it (`kit.export.conformance`)."""
    notes: list[str] = field(default_factory=list)
    """What a user should know: clients that cannot represent the result, checks not run."""
    use_in: list[str] = field(default_factory=list)
    """The clients this file is for (those whose loading rules it passed), and where to look
    for the others."""
    part: str = ""
    """The model of the denoiser this file is for, where it is several (`denoiser_files`)."""
    untrained: str = ""
    """Why this file changes nothing (its adapter is still at its initial value), or ""."""
    drawn: dict[str, int] = field(default_factory=dict)
    """The batches each model of a denoiser of several drew in training."""

    def describe(self) -> str:
        """One line for the console."""
        parts = []
        if self.images:
            parts.append(
                f"{self.images} image(s) redrawn, max pixel difference {self.max_abs_diff}"
            )
        if self.clients:
            exact = [_named(c) for c in self.clients if c["exact"]]
            parts.append(f"exact in {', '.join(exact) or 'no client'}")
        checked = "; ".join(parts) or "nothing checked"
        if self.untrained:
            return f"UNTRAINED: {self.untrained}; checked: {checked}"
        return "verified: " + checked

    def for_file(self, part: str, family: Family, fmt: str, formats: tuple[str, ...]):
        """This verification as one file's record: only its own model's client checks, the
        clients it is for, and whether it is untrained."""
        clients = [c for c in self.clients if c.get("part", "") == part] if part else self.clients
        v = replace(self, clients=clients, part=part)
        v.use_in = use_in(fmt, v, formats, family)
        return v


def _named(check: dict[str, Any]) -> str:
    return f"{check['client']} ({check['part']})" if check.get("part") else check["client"]


@dataclass
class ExportResult:
    """One exported file (or folder) and its verification."""

    format: str
    path: Path
    step: int
    verification: Verification | None
    files: dict[str, Path] = field(default_factory=dict)
    """Each file by its part where the denoiser is several models (`Family.denoiser_files`):
    one file per model, `path` the first; empty for one file."""
    verifications: dict[str, Verification] = field(default_factory=dict)
    """Each of those files' own record (its verify.json): its model's checks, its clients."""


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
    progress = json.loads((source / "progress.json").read_text())
    step = progress["step"]
    weights = {k: v.to(DTYPES[dtype]) for k, v in ckpt.exported_weights(source).items()}
    meta = shared_metadata(run, cfg, family, method, step)
    out = Path(out_dir) if out_dir else run.exports / fmt
    out.mkdir(parents=True, exist_ok=True)
    # An adapter file adapts one model: a denoiser of several gets one file per model (the
    # whole-model formats hold them all).
    parts = family.denoiser_files(weights) if method.low_rank else {"": weights}
    written = {
        part: method.write_export(
            fmt, w, {**meta, "kit.expert": part, **family.part_metadata(part)}, step, out, part
        )
        if part
        else method.write_export(fmt, w, meta, step, out)
        for part, w in parts.items()
    }
    path, apply = next(iter(written.values()))
    files = {part: p for part, (p, _) in written.items() if part}
    if len(written) > 1:
        applies = [(a, p) for p, a in written.values()]
        apply = None if any(a is None for a, _ in applies) else _apply_all(applies)
    verification = None
    reports = [
        Path(f"{file}.verify.json" if file.is_dir() else file.with_suffix(".verify.json"))
        for file, _ in written.values()
    ]
    for report in reports if not verify else []:
        report.unlink(missing_ok=True)  # an earlier export's record is not this file's
    if verify:
        verification = (
            verify_export(run, path, step, tolerance=tolerance, apply=apply)
            if apply is not None
            else Verification(0, 0, 0.0, True)
        )
        if fmt == "kohya":
            trained = ckpt.exported_weights(source)
            trained = family.denoiser_files(trained) if method.low_rank else {"": trained}
            checks = [
                check
                for part, (file, _) in written.items()
                for check in check_clients(cfg, family, method, file, trained[part], part)
            ]
            verification.clients = as_records(checks)
            verification.passed = verification.passed and all(c.passed for c in checks)
            if not checks and apply is None:
                verification.passed = False
                verification.notes.append(
                    f"nothing can check {family.name}'s kohya files: no client is modelled"
                )
            verification.notes += [
                f"{c.client}{f' ({c.part})' if c.part else ''}: {c.known_gap or c.skipped}"
                for c in checks
                if c.known_gap or c.skipped
            ]
        verification.drawn = dict(progress.get("drawn") or {})
        untrained = untrained_parts(method, family, weights)
        files_of = {part: verification.for_file(part, family, fmt, allowed) for part in written}
        for part in untrained:
            files_of[part].untrained = _untrained(part, verification.drawn, step)
        verification.use_in = use_in(fmt, verification, allowed, family)
        verification.untrained = "; ".join(files_of[p].untrained for p in untrained)
        for part, report in zip(written, reports, strict=True):
            write_json(report, files_of[part].__dict__)
        if not verification.passed:
            failing = [c for c in verification.clients if not c["passed"]]
            what = (
                f"{path} does not load right in {', '.join(_named(c) for c in failing)}: "
                + "; ".join(_failure(c) for c in failing)
                if failing
                else f"{path} does not reproduce the kit's images (max pixel difference "
                f"{verification.max_abs_diff} > {tolerance})"
            )
            moved = [
                reject(run, fmt, file, report)
                for (file, _), report in zip(written.values(), reports, strict=True)
            ]
            raise KitError(
                f"{what}; the export is not trustworthy: moved to {', '.join(map(str, moved))}"
            )
    per_file = {part: files_of[part] for part in files} if verify else {}
    return ExportResult(fmt, path, step, verification, files, per_file)


def _untrained(part: str, drawn: dict[str, int], step: int) -> str:
    """Why file `part` changes nothing, for its record and the console."""
    what = f"the {part} adapter" if part else "the adapter"
    steps = f"{step} step{'s' if step != 1 else ''}"
    batches = f"; it drew {drawn.get(part, 0)} batches in {steps}" if drawn else ""
    return f"{what} is still at its initial value at step {step}, so it changes nothing{batches}"


def _apply_all(applies: list[tuple[Apply, Path]]) -> Apply:
    """Apply every file of a denoiser of several models, each with its own loader call."""

    def apply(pipe: Any, _path: Path) -> Any:
        for each, file in applies:
            pipe = each(pipe, file)
        return pipe

    return apply


def use_in(
    fmt: str, v: Verification, formats: tuple[str, ...], family: Family | None = None
) -> list[str]:
    """Which clients a file of `fmt` is for, as the console, verify.json and the card say:
    the clients whose rules it passed (kohya), each with the release its support starts at
    and the model the file goes on; diffusers for its own format, with the loader's arguments
    for that model; and the kohya file pointed to for the clients that read none of a
    diffusers file's names. Without `family`, clients are named plainly."""
    label = family.client_label if family else str
    title = family.part_title if family else str
    if fmt == "kohya":
        return [
            label(c["client"]) + (f" on {title(c['part'])}" if c.get("part") else "")
            for c in v.clients
            if c["passed"]
        ] or ["no client checked"]
    if fmt == "diffusers":
        kwargs = family.lora_load_kwargs(v.part) if family else {}
        extra = "".join(f", {k}={val}" for k, val in kwargs.items())
        load = f"pipe.load_lora_weights(file{extra})" if extra else "pipe.load_lora_weights"
        on = f" into {title(v.part)}" if v.part else ""
        rest = [
            "other clients: use the kohya file"
            if "kohya" in formats
            else "ComfyUI, A1111 and Forge: no file of this run loads there exactly (they read "
            "none of this file's names, or skip what it trained)"
        ]
        return [f"diffusers ({load}){on}", *rest]
    return [f"{fmt} clients"]


def reject(run: RunDir, fmt: str, path: Path, report: Path) -> Path:
    """Move an export that failed its check (and its verify.json) out of the folder users take
    files from, to `exports/rejected/<fmt>/`; return where it went."""
    where = run.rejected_exports / fmt
    where.mkdir(parents=True, exist_ok=True)
    for f in (path, report):
        if f.exists():
            target = where / f.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(f, target)
    return where / path.name


def _failure(check: dict[str, Any]) -> str:
    if check["unconsumed"]:
        return f"{_named(check)} reads no {check['unconsumed'][0]}"
    if check["missed"]:
        return f"{_named(check)} leaves {check['missed'][0]} unchanged"
    return f"{_named(check)} is off by {check['max_relative_error']:.2g} (relative)"


def check_clients(
    cfg: Config, family: Family, method: Any, path: Path, trained: dict[str, Any], part: str = ""
) -> list[ClientCheck]:
    """Load the exported file with each client's rules onto a fresh base and compare it with
    peft's merge of what was trained. `part`: the file's model, where the denoiser is several
    (`Family.denoiser_files`); the checks then name it beside the client."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    base = family.load(cfg.model.pretrained_model, revision=cfg.model.revision)
    base = replace(base, denoiser=family.denoiser_part(base.denoiser, part))
    checks = check_file(load_file(str(path)), metadata, family, method, base, trained)
    for c in checks:
        c.part = part
    return checks


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
    cfg = load_config(run.config)
    family = get_family(cfg.model.model_family, cfg)
    refs, notes = _references(run, cfg, step)
    # Plain diffusers on the configured base (a single file and `vae_model` included), in the
    # fp32 the kit's reference images are redrawn in.
    pipe = apply(family.base_pipeline(), path)
    pipe.set_progress_bar_config(disable=True)
    diffs = []
    for spec, png in refs:
        # With the sampler the sidecar names, built from the plain pipeline's own scheduler.
        # In the saved image's mode: a pipeline whose VAE decodes alpha draws RGBA.
        saved = Image.open(png)
        mode = "RGBA" if saved.mode == "RGBA" else "RGB"
        ours = np.asarray(frame_strip(draw(family, pipe, spec)[0]).convert(mode), dtype=np.int16)
        theirs = np.asarray(saved.convert(mode), dtype=np.int16)
        diffs.append(np.abs(ours - theirs))
    max_diff = int(max(d.max() for d in diffs))
    mean_diff = float(np.mean([d.mean() for d in diffs]))
    return Verification(
        images=len(refs),
        max_abs_diff=max_diff,
        mean_abs_diff=round(mean_diff, 4),
        passed=max_diff <= tolerance,
        # Named within the run folder: the record travels with the exports.
        files=[p.relative_to(run.root).as_posix() for _, p in refs],
        notes=notes,
    )


def _references(
    run: RunDir, cfg: Config, step: int
) -> tuple[list[tuple[ImageSpec, Path]], list[str]]:
    """The images an export must reproduce, and what to say about them.

    Those training drew at `step`, else the kit's own redraw of that checkpoint. A client loads
    the export on the full-precision base and draws in fp32, as this check does. A run that
    trained otherwise, on a quantized base (`base_quantization`) or in half precision (a bf16
    image differs from the fp32 one by more than the tolerance), is compared with the kit's own
    fp32 redraw of the checkpoint, and the note says how far the images training drew are
    from it.
    """
    trained = reference_images(run, step)
    ran = _trained_as(cfg, ckpt.checkpoint_dir(run.root, step))
    if ran is None:
        return trained or _draw_references(run, step), []
    redrawn = _draw_references(run, step)
    note = (
        f"training ran {ran}: compared with the kit's fp32 images of this checkpoint on the "
        "full-precision base, which clients load the export on"
    )
    by_name = {png.name: png for _, png in trained}
    pairs = [(by_name[png.name], png) for _, png in redrawn if png.name in by_name]
    if pairs:
        gap = max(int(np.abs(_pixels(a) - _pixels(b)).max()) for a, b in pairs)
        note += f"; the validation images training drew differ from those by up to {gap}"
    return redrawn, [note]


def _trained_as(cfg: Config, checkpoint: Path) -> str | None:
    """How training ran where that is not as a client draws (in fp32 on the full-precision
    base); None where it is. The precision is the one the checkpoint says was used (a bf16
    config on hardware without bf16 trains in fp32), else, for older checkpoints, the
    config's."""
    try:
        progress = json.loads((checkpoint / ckpt.PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        progress = {}
    precision = progress.get("precision", cfg.train.mixed_precision)
    how = []
    if cfg.model.base_quantization != "none":
        how.append(f"on the base stored {cfg.model.base_quantization}")
    if precision not in ("no", "fp32"):
        how.append(f"in {precision}")
    return " and ".join(how) or None


def _pixels(png: Path) -> np.ndarray:
    return np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)


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
