"""Class images for a prior dataset, drawn by the base model before training (DreamBooth's
prior preservation).

A `datasets` entry of role `prior` with `generate: {"count": N, "prompt": ...}` gets N images
drawn into its `image_dir`, each with its prompt as caption, and a record of how they were drawn
(`.class-images.json`). From then on they are images like any other: scanned, bucketed and
cached. Images already drawn with the same settings are kept, so a larger count only draws the
rest; a record that disagrees with the config stops the run, as the folder would otherwise mix
two different priors. Only the main process draws; the others wait for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kit.config import Config, GenerateConfig
from kit.data.datasets import DatasetView, views
from kit.data.scan import caption_path
from kit.errors import KitError
from kit.families import Family
from kit.families.base import ImageSpec
from kit.families.identity import public_name
from kit.families.loading import load_base
from kit.io import write_json, write_text, write_with

RECORD = ".class-images.json"


def class_image_name(i: int) -> str:
    """The stem of class image `i` (drawn with seed `generate.seed + i`)."""
    return f"class_{i:05d}"


def wanted(cfg: Config) -> list[tuple[DatasetView, GenerateConfig, list[int]]]:
    """Each dataset with class images still to draw, and their numbers."""
    out = []
    for v in views(cfg.data):
        g = v.entry.generate if v.entry is not None else None
        if g is None or not g.count:
            continue
        folder = Path(v.data.image_dir)
        _check_record(folder, g, cfg, v)
        missing = [
            i for i in range(g.count) if not (folder / f"{class_image_name(i)}.png").is_file()
        ]
        if missing:
            out.append((v, g, missing))
    return out


def _settings(g: GenerateConfig, cfg: Config) -> dict[str, Any]:
    return {
        "prompt": g.prompt,
        "negative_prompt": g.negative_prompt,
        "seed": g.seed,
        "base_model": public_name(cfg.model.pretrained_model),
    }


def _check_record(folder: Path, g: GenerateConfig, cfg: Config, v: DatasetView) -> None:
    path = folder / RECORD
    if not path.is_file():
        return
    try:
        drawn = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KitError(f"{path}: unreadable record of the class images ({e})") from None
    now = _settings(g, cfg)
    differ = [k for k in now if drawn.get(k) != now[k]]
    if differ:
        k = differ[0]
        raise KitError(
            f"{v.where}: the class images in {folder} were drawn with {k} {drawn.get(k)!r}, "
            f"the config's generate says {now[k]!r}; move them away to draw new ones, or set "
            f"generate.{k if k != 'base_model' else 'prompt'} back"
        )


def draw_class_images(
    cfg: Config,
    family: Family,
    device: torch.device | str,
    dtype: torch.dtype,
    print_fn: Any = print,
) -> int:
    """Draw every missing class image (see the module docstring); return how many were drawn."""
    todo = wanted(cfg)
    if not todo:
        return 0
    _, comps = load_base(cfg, dtype=dtype, family=family)
    for m in comps.frozen_modules():
        m.to(device)
    pipe = family.pipeline(comps)
    pipe.set_progress_bar_config(disable=True)
    drawn = 0
    for v, g, numbers in todo:
        folder = Path(v.data.image_dir)
        folder.mkdir(parents=True, exist_ok=True)
        side = v.data.resolution // family.bucket_step * family.bucket_step or family.bucket_step
        steps = g.num_inference_steps or family.inference_steps()
        guidance = family.default_guidance_scale if g.guidance_scale is None else g.guidance_scale
        print_fn(f"{v.where}: drawing {len(numbers)} class image(s) of {g.prompt!r} into {folder}")
        # The record first: an interrupted draw resumes only with the same settings.
        write_json(folder / RECORD, {**_settings(g, cfg), "count": g.count})
        for i in numbers:
            spec = ImageSpec(
                prompt=g.prompt,
                negative_prompt=g.negative_prompt,
                seed=g.seed + i,
                num_inference_steps=steps,
                guidance_scale=guidance,
                width=side,
                height=side,
            )
            image = family.sample(pipe, spec)[0]
            path = folder / f"{class_image_name(i)}.png"
            # The caption first: an image is only ever there with its caption.
            write_text(caption_path(path, v.data), g.prompt + "\n")
            write_with(path, lambda tmp, im=image: im.save(tmp, format="PNG"))
            drawn += 1
    del pipe, comps
    return drawn
