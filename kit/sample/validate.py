"""Validation images: fixed prompts and seeds, a grid per step, a JSON sidecar per image."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from kit.config import Config, load_config
from kit.config.sections import ValidationPrompt
from kit.errors import KitError
from kit.families.base import Family
from kit.families.loading import load_base
from kit.families.samplers import DEFAULT, ImageSpec, draw_batch
from kit.io import write_json, write_with
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.run import threads
from kit.run.folder import open_run
from kit.sample import clips


def default_prompts(cfg: Config, captions: list[str], n: int = 2) -> list[str]:
    """The configured prompts, else (when no `validation_prompts` entry is given either) the
    first few distinct training captions."""
    v = cfg.validation
    if v.validation_prompt:
        return list(v.validation_prompt)
    if v.validation_prompts:
        return []  # the entries are the prompts: captions would only crowd the grid
    seen: list[str] = []
    for c in captions:
        if c and c not in seen:
            seen.append(c)
        if len(seen) == n:
            break
    return seen or ["a photo"]


def pair_prompts(
    cfg: Config, family: Family, samples: list[Any], n: int = 2, folder: Path | None = None
) -> list[Any]:
    """An edit model's default grid: when no validation prompt is configured, the first `n`
    training pairs of distinct captions as `validation_prompts` entries (caption + controls),
    so every grid shows control → result; [] otherwise. A family whose prompts are read with
    their controls (`Family.prompt_controls`) draws each configured `validation_prompt` on the
    first training pair's controls: without them it would not be the edit it is trained for.
    Controls from a source (a dataset's column, a shard's member) are written into `folder`
    (the run's `validation_controls`) first: an entry names its controls by file."""
    v = cfg.validation
    if not family.control_images or v.validation_prompts:
        return []
    if v.validation_prompt:
        first = next((s for s in samples if s.controls), None)
        if not family.prompt_controls or first is None:
            return []
        control = _control_files(first, folder)
        return [ValidationPrompt(prompt=p, control=control) for p in v.validation_prompt]
    entries: list[ValidationPrompt] = []
    for sample in samples:
        if sample.controls and sample.caption not in {e.prompt for e in entries}:
            control = _control_files(sample, folder)
            entries.append(ValidationPrompt(prompt=sample.caption or "a photo", control=control))
        if len(entries) == n:
            break
    return entries


def _control_files(sample: Any, folder: Path | None) -> list[str]:
    """A pair's controls as files: its own, or its source's bytes written once into `folder`,
    each named by its digest and format (`3f2a....png`)."""
    if not sample.control_blobs:
        return [str(c) for c in sample.controls]
    if folder is None:
        raise KitError(f"{sample.image}: its controls come from its source; give a folder")
    out = []
    for blob in sample.control_blobs:
        data = blob.read()
        with Image.open(io.BytesIO(data)) as im:
            ext = (im.format or "png").lower().replace("jpeg", "jpg")
        path = folder / f"{blob.digest[:16]}.{ext}"
        if not path.is_file():
            write_with(path, lambda tmp, data=data: tmp.write_bytes(data))
        out.append(str(path))
    return out


def prompt_rows(
    cfg: Config,
    family: Family,
    prompts: list[str],
    adapter_scale: float = 1.0,
    entries: list[ValidationPrompt] | None = None,
) -> list[list[ImageSpec]]:
    """The grid's rows: one per prompt (the simple form's, then each `validation_prompts`
    entry), one spec per seed in it.

    A simple prompt takes the section's negative prompt, steps, size and guidance (else the
    family's default guidance) and a column per `validation_seeds`; an entry overrides any of
    them, and with its own `seed` draws that one image. `entries` defaults to the config's.
    """
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    simple = ImageSpec(
        prompt="",
        negative_prompt=v.validation_negative_prompt,
        seed=0,
        num_inference_steps=family.inference_steps(),
        guidance_scale=family.guidance_scale(),
        width=side,
        height=side,
        adapter_scale=adapter_scale,
    )
    rows = [[replace(simple, prompt=p, seed=s) for s in v.validation_seeds] for p in prompts]
    for e in v.validation_prompts if entries is None else entries:
        spec = replace(
            simple,
            prompt=e.prompt,
            negative_prompt=_given(e.negative_prompt, simple.negative_prompt),
            num_inference_steps=_given(e.num_inference_steps, simple.num_inference_steps),
            guidance_scale=float(_given(e.guidance_scale, simple.guidance_scale)),
            width=e.width or side,
            height=e.height or side,
            sampler=e.scheduler or DEFAULT,
            control=tuple(e.control),
        )
        seeds = [e.seed] if e.seed is not None else v.validation_seeds
        rows.append([replace(spec, seed=s) for s in seeds])
    return [row for row in rows if row]


def _given(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def image_specs(
    cfg: Config,
    family: Family,
    prompts: list[str],
    adapter_scale: float = 1.0,
    entries: list[ValidationPrompt] | None = None,
) -> list[ImageSpec]:
    """Every spec of `prompt_rows`, row after row (prompts as rows, seeds as columns)."""
    return [s for row in prompt_rows(cfg, family, prompts, adapter_scale, entries) for s in row]


def grid_rows(specs: list[ImageSpec], cols: int) -> list[list[ImageSpec]]:
    """Specs cut into the grid's rows: a row holds consecutive specs that differ only in their
    seed, at most `cols` of them (0: no limit) and each seed once.

    So the simple form's prompt × seed specs make the rows they always made, and an entry's
    own size, guidance or sampler starts a row of its own.
    """
    rows: list[list[ImageSpec]] = []
    for spec in specs:
        row = rows[-1] if rows else None
        if (
            row is None
            or (cols > 0 and len(row) >= cols)
            or replace(spec, seed=row[0].seed) != row[0]
            or any(s.seed == spec.seed for s in row)
        ):
            rows.append([spec])
        else:
            row.append(spec)
    return rows


def frame_strip(frames: list[Image.Image]) -> Image.Image:
    """Frames side by side (a single image stays as it is)."""
    if len(frames) == 1:
        return frames[0]
    w, h = frames[0].size
    strip = Image.new("RGB", (w * len(frames), h))
    for i, f in enumerate(frames):
        strip.paste(f, (i * w, 0))
    return strip


def save_drawn(frames: list[Image.Image], stem: Path, fps: int = clips.FPS) -> dict[str, str]:
    """`stem.png` (the image, or a clip's frame strip) and, for a clip, its animated WebP and
    MP4 at `fps` (`kit.sample.clips`); every file atomic. Their names by kind: image, clip,
    video."""
    png = stem.with_suffix(".png")
    strip = frame_strip(frames)
    write_with(png, lambda tmp: strip.save(tmp, format="PNG"))
    out = {"image": png.name}
    if len(frames) > 1:
        out.update(clips.save_clip(frames, stem, fps))
    return out


def save_frames(frames: list[Image.Image], stem: Path) -> Path:
    """`save_drawn`, returning the PNG's path."""
    return stem.parent / save_drawn(frames, stem)["image"]


def make_grid(images: list[Image.Image], cols: int, labels: list[str] | None = None) -> Image.Image:
    """Images in rows of `cols`, each row under its label (`rows_grid` with equal rows)."""
    rows = [images[i : i + cols] for i in range(0, len(images), cols)]
    return rows_grid(rows, labels)


def rows_grid(rows: list[list[Image.Image]], labels: list[str] | None = None) -> Image.Image:
    """Rows of images, each under its label; a row's cells take the size of its largest image,
    so rows of different sizes (or lengths) share one grid, padded with white."""
    label_h = 14 if labels else 0
    sizes = [(max(im.width for im in row), max(im.height for im in row)) for row in rows]
    width = max(w * len(row) for (w, _), row in zip(sizes, rows, strict=True))
    grid = Image.new("RGB", (width, sum(h + label_h for _, h in sizes)), "white")
    draw = ImageDraw.Draw(grid)
    y = 0
    for r, (row, (w, h)) in enumerate(zip(rows, sizes, strict=True)):
        if labels:
            draw.text((2, y + 1), labels[r][: max(8, width // 6)], fill="black")
        for c, im in enumerate(row):
            grid.paste(im, (c * w, y + label_h))
        y += h + label_h
    return grid


_ROW_TAGS: tuple[tuple[Any, Any], ...] = (
    (lambda s: s.guidance_scale, lambda s: f"cfg {s.guidance_scale:g}"),
    (lambda s: s.num_inference_steps, lambda s: f"{s.num_inference_steps} steps"),
    (lambda s: s.sampler, lambda s: s.sampler),
    (lambda s: (s.width, s.height), lambda s: f"{s.width}x{s.height}"),
    (lambda s: s.negative_prompt, lambda s: f"neg: {s.negative_prompt}"),
)
"""(what a row is told apart by, how its label says it)."""


def _cell(file: str, spec: ImageSpec) -> Image.Image:
    """A control image fitted into a cell of the spec's size (white around it)."""
    from PIL import ImageOps

    cell = Image.new("RGB", (spec.width, spec.height), "white")
    im = ImageOps.contain(Image.open(file).convert("RGB"), (spec.width, spec.height))
    cell.paste(im, ((spec.width - im.width) // 2, (spec.height - im.height) // 2))
    return cell


def row_labels(rows: list[list[ImageSpec]]) -> list[str]:
    """Each row's adapter scale and prompt, and whichever settings differ between rows
    (guidance, steps, sampler, size, negative prompt), so a grid shows what it compares."""
    firsts = [row[0] for row in rows]
    shown = [say for key, say in _ROW_TAGS if len({key(s) for s in firsts}) > 1]
    return [
        f"[{', '.join([f'scale {s.adapter_scale:g}', *(say(s) for say in shown)])}] "
        + ("control -> " if s.control else "")  # the drawing font has no arrow
        + s.prompt
        for s in firsts
    ]


def run_validation(
    family: Any,
    pipe: Any,
    specs: list[ImageSpec],
    out_dir: Path,
    cols: int,
    meta: dict[str, Any],
    batch: int = 1,
) -> Path:
    """Draw every spec with its sampler, save images with sidecars and a grid (a row per
    `grid_rows` row); return the grid's path.

    Each sidecar holds the spec, the pipeline call's keyword arguments, the sampler's name,
    the scheduler's class and config as drawn with, and the σ shift used (flow models).
    `batch` above 1 draws up to that many specs per pipeline call (`draw_batch`): the same
    images, faster where a call's own cost dominates (small images), at that many times the
    activation memory.
    """
    if not specs:
        raise KitError(
            "nothing to draw: validation_seeds is empty and no validation_prompts entry "
            "has a seed of its own"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.set_progress_bar_config(disable=True)
    rows = grid_rows(specs, cols)
    drawn = iter(draw_in_batches(family, pipe, [spec for row in rows for spec in row], batch))
    images: list[list[Image.Image]] = []
    for r, row in enumerate(rows):
        # An edit prompt's row starts with its control image(s): control → result.
        images.append([_cell(c, row[0]) for c in row[0].control])
        for spec in row:
            frames, sampling = next(drawn)
            images[-1].append(frame_strip(frames))
            stem = f"{r:02d}_seed{spec.seed}"
            # A clip plays at its model's own rate (TI2V-5B: 24 fps).
            fps = family.clip_fps() if len(frames) > 1 else clips.FPS
            save_drawn(frames, out_dir / stem, fps)
            write_json(
                out_dir / f"{stem}.json",
                {
                    **asdict(spec),
                    "pipeline": type(getattr(pipe, "wrapped", pipe)).__name__,
                    "pipeline_kwargs": family.pipeline_kwargs,
                    "call_kwargs": family.call_kwargs(spec),
                    **strict_json(sampling),
                    "frames": len(frames),
                    **({"fps": fps} if len(frames) > 1 else {}),
                    **meta,
                },
            )
    grid = rows_grid(images, row_labels(rows))
    path = out_dir / "grid.png"
    write_with(path, lambda tmp: grid.save(tmp, format="PNG"))
    return path


def draw_in_batches(
    family: Any, pipe: Any, specs: list[ImageSpec], batch: int = 1
) -> Iterator[tuple[list[Image.Image], dict[str, Any]]]:
    """`draw` each spec, in order, up to `batch` consecutive specs of one sampler per call."""
    start = 0
    while start < len(specs):
        end = start + 1
        while (
            end < len(specs) and end - start < batch and specs[end].sampler == specs[start].sampler
        ):
            end += 1
        yield from draw_batch(family, pipe, specs[start:end])
        start = end


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float written as the string "inf", "-inf" or "nan": a
    scheduler config may hold one (DPM-Solver's `lambda_min_clipped: -inf`), which Python's
    JSON writes as a bare `-Infinity` that strict readers (browsers, jq) refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def read_sidecar(path: str | Path) -> tuple[ImageSpec, dict[str, Any]]:
    """A sidecar JSON back as its spec plus the rest of its record."""
    record = json.loads(Path(path).read_text())
    fields = ImageSpec.__dataclass_fields__
    return ImageSpec(**{k: record[k] for k in fields if k in record}), record


def load_trained(run_dir: str | Path, checkpoint: str | Path | None = None) -> tuple[Any, ...]:
    """(run, config, family, components, checkpoint folder): the base with a checkpoint's
    trained weights (the EMA average when there is one) in place; the latest by default."""
    run = open_run(run_dir)
    cfg = load_config(run.config)
    source = Path(checkpoint) if checkpoint else ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"{run.root} has no complete checkpoint")
    # Drawing takes the run's fair share of the CPUs, as training does: beside other work,
    # torch's one thread per CPU would spin waiting for busy cores (see kit.run.threads).
    threads.for_run(cfg.train.cpu_threads, None)
    family, comps = load_base(cfg)
    net = get_method(cfg, family)
    net.attach(comps)
    net.load_state_dict(comps, ckpt.exported_weights(source))
    return run, cfg, family, comps, source


def draw_checkpoint(
    run_dir: str | Path,
    checkpoint: str | Path | None = None,
    scales: tuple[float, ...] | list[float] = (1.0,),
    prompts: list[str] | None = None,
) -> Path:
    """Draw a checkpoint's validation images at each adapter scale (0 = the base model alone).

    Writes `validation/<checkpoint>-scales/`; rows are prompt × scale, columns are seeds.
    Without `prompts`, the config's validation prompts and `validation_prompts` entries.
    """
    run, cfg, family, comps, source = load_trained(run_dir, checkpoint)
    asked = prompts
    if prompts is None:
        captions = [r["caption"] for r in json.loads(run.manifest.read_text())]
        prompts = default_prompts(cfg, captions)
    rows = prompt_rows(cfg, family, prompts, entries=None if asked is None else [])
    specs = [replace(s, adapter_scale=scale) for row in rows for scale in scales for s in row]
    grid = run_validation(
        family,
        family.pipeline(comps),
        specs,
        run.validation_scales(source.name),
        cols=len(cfg.validation.validation_seeds),
        meta={"base_model": cfg.model.pretrained_model, "checkpoint": str(source)},
    )
    clips.index_run(run)
    return grid
