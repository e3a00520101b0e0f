"""Validation images: fixed prompts and seeds, a grid per step, a JSON sidecar per image."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families.base import Family, ImageSpec
from kit.families.loading import load_base
from kit.io import write_json, write_with
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.run.folder import open_run


def default_prompts(cfg: Config, captions: list[str], n: int = 2) -> list[str]:
    """The configured prompts, else the first few distinct training captions."""
    if cfg.validation.validation_prompt:
        return list(cfg.validation.validation_prompt)
    seen: list[str] = []
    for c in captions:
        if c and c not in seen:
            seen.append(c)
        if len(seen) == n:
            break
    return seen or ["a photo"]


def image_specs(
    cfg: Config, family: Family, prompts: list[str], adapter_scale: float = 1.0
) -> list[ImageSpec]:
    """One spec per prompt and seed, prompts as rows; guidance as configured, else the family's."""
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    return [
        ImageSpec(
            prompt=p,
            negative_prompt=v.validation_negative_prompt,
            seed=s,
            num_inference_steps=v.validation_num_inference_steps,
            guidance_scale=family.guidance_scale(),
            width=side,
            height=side,
            adapter_scale=adapter_scale,
        )
        for p in prompts
        for s in v.validation_seeds
    ]


def frame_strip(frames: list[Image.Image]) -> Image.Image:
    """Frames side by side (a single image stays as it is)."""
    if len(frames) == 1:
        return frames[0]
    w, h = frames[0].size
    strip = Image.new("RGB", (w * len(frames), h))
    for i, f in enumerate(frames):
        strip.paste(f, (i * w, 0))
    return strip


def save_frames(frames: list[Image.Image], stem: Path) -> Path:
    """`stem.png` (the image, or a frame strip) and, for clips, `stem.gif`; atomic."""
    png = stem.with_suffix(".png")
    strip = frame_strip(frames)
    write_with(png, lambda tmp: strip.save(tmp, format="PNG"))
    if len(frames) > 1:
        write_with(
            stem.with_suffix(".gif"),
            lambda tmp: frames[0].save(
                tmp, format="GIF", save_all=True, append_images=frames[1:], duration=125, loop=0
            ),
        )
    return png


def make_grid(images: list[Image.Image], cols: int, labels: list[str] | None = None) -> Image.Image:
    """Images in rows of `cols`, each row under its label."""
    w, h = images[0].size
    rows = (len(images) + cols - 1) // cols
    label_h = 14 if labels else 0
    grid = Image.new("RGB", (cols * w, rows * (h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        y = r * (h + label_h)
        if labels and c == 0:
            draw.text((2, y + 1), labels[r][: max(8, cols * w // 6)], fill="black")
        grid.paste(im, (c * w, y + label_h))
    return grid


def run_validation(
    family: Any,
    pipe: Any,
    specs: list[ImageSpec],
    out_dir: Path,
    cols: int,
    meta: dict[str, Any],
) -> Path:
    """Draw every spec, save images with sidecars and a grid; return the grid's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.set_progress_bar_config(disable=True)
    images = []
    scheduler = {"class": type(pipe.scheduler).__name__, "config": dict(pipe.scheduler.config)}
    for i, spec in enumerate(specs):
        frames = family.sample(pipe, spec)
        images.append(frame_strip(frames))
        stem = f"{i // cols:02d}_seed{spec.seed}"
        save_frames(frames, out_dir / stem)
        write_json(
            out_dir / f"{stem}.json",
            {
                **asdict(spec),
                "pipeline": type(pipe).__name__,
                "pipeline_kwargs": family.pipeline_kwargs,
                "call_kwargs": family.call_kwargs(spec),
                "scheduler": scheduler,
                **meta,
            },
        )
    labels = [f"[scale {s.adapter_scale:g}] {s.prompt}" for s in specs[::cols]]
    grid = make_grid(images, cols, labels)
    path = out_dir / "grid.png"
    write_with(path, lambda tmp: grid.save(tmp, format="PNG"))
    return path


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
    """
    run, cfg, family, comps, source = load_trained(run_dir, checkpoint)
    if prompts is None:
        captions = [r["caption"] for r in json.loads(run.manifest.read_text())]
        prompts = default_prompts(cfg, captions)
    specs = [s for p in prompts for scale in scales for s in image_specs(cfg, family, [p], scale)]
    return run_validation(
        family,
        family.pipeline(comps),
        specs,
        run.validation_scales(source.name),
        cols=len(cfg.validation.validation_seeds),
        meta={"base_model": cfg.model.pretrained_model, "checkpoint": str(source)},
    )
