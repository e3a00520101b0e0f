"""An edit run's examples: each validation row's control image(s), the base model's result
(adapter scale 0, where `draw_checkpoint` drew it) and the adapter's result at each step, read
back from the sidecars; and the figure the model card and notebook 05 show of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

from kit.run.folder import RunDir
from kit.sample.validate import read_sidecar

ARROW_WIDTH = 24
"""Pixels between the controls and what follows them, where the arrow goes."""


@dataclass
class EditExample:
    """One validation row of an edit run: an instruction, its controls and what was drawn."""

    prompt: str
    seed: int
    controls: list[Path]
    base: Path | None = None
    """The base model's image (adapter scale 0) for the same prompt, seed and controls."""
    results: dict[int, Path] = field(default_factory=dict)
    """The adapter's image at each validation step."""


def _key(spec) -> tuple[str, int, tuple[str, ...]]:
    return spec.prompt, spec.seed, tuple(str(c) for c in spec.control)


def edit_examples(run: RunDir, steps: Sequence[int] | None = None) -> list[EditExample]:
    """The validation rows with controls at `steps` (default: every validation step), in the
    order drawn, each with the base model's image where one was drawn."""
    folders = run.validation_steps()
    chosen = sorted(folders) if steps is None else [s for s in steps if s in folders]
    base: dict[tuple[str, int, tuple[str, ...]], Path] = {}
    for folder in run.scale_folders():
        for sidecar in sorted(folder.glob("*.json")):
            spec, _ = read_sidecar(sidecar)
            if spec.adapter_scale == 0 and spec.control and sidecar.with_suffix(".png").is_file():
                base.setdefault(_key(spec), sidecar.with_suffix(".png"))
    rows: dict[tuple[str, int, tuple[str, ...]], EditExample] = {}
    for step in chosen:
        for sidecar in sorted(folders[step].glob("*.json")):
            spec, _ = read_sidecar(sidecar)
            image = sidecar.with_suffix(".png")
            if not spec.control or not image.is_file():
                continue
            key = _key(spec)
            row = rows.setdefault(
                key,
                EditExample(spec.prompt, spec.seed, [Path(c) for c in spec.control], base.get(key)),
            )
            row.results[step] = image
    return list(rows.values())


def fitted(image: str | Path | Image.Image, height: int) -> Image.Image:
    """An image (or a file) scaled to `height` pixels, its aspect ratio kept."""
    im = image if isinstance(image, Image.Image) else Image.open(image)
    im = ImageOps.exif_transpose(im).convert("RGB")
    return im.resize((max(1, round(im.width * height / im.height)), height))


def strip(images: list[Image.Image], arrow_before: int, label: str = "") -> Image.Image:
    """Images side by side on white, an arrow before image `arrow_before` (none when 0), and a
    label above them."""
    label_h = 14 if label else 0
    gaps = [0 if i == 0 else ARROW_WIDTH if i == arrow_before else 4 for i in range(len(images))]
    width = sum(im.width for im in images) + sum(gaps)
    out = Image.new("RGB", (width, max(im.height for im in images) + label_h), "white")
    draw = ImageDraw.Draw(out)
    if label:
        draw.text((2, 1), label[: max(8, width // 6)], fill="black")
    x = 0
    for im, gap in zip(images, gaps, strict=True):
        if gap == ARROW_WIDTH:
            y = label_h + im.height // 2
            draw.line((x + 4, y, x + gap - 5, y), fill="black", width=2)
            draw.polygon([(x + gap - 4, y), (x + gap - 10, y - 5), (x + gap - 10, y + 5)], "black")
        x += gap
        out.paste(im, (x, label_h))
        x += im.width
    return out


def stack(rows: list[Image.Image]) -> Image.Image:
    """Rows one under the other, left-aligned on white."""
    out = Image.new("RGB", (max(r.width for r in rows), sum(r.height + 4 for r in rows)), "white")
    y = 0
    for r in rows:
        out.paste(r, (0, y))
        y += r.height + 4
    return out


def edit_figure(examples: list[EditExample], height: int = 128) -> Image.Image | None:
    """A row per example: control(s) → the base's result (when drawn) · the result at each
    step, under the instruction and the columns' names; None without examples."""
    rows = []
    for e in examples:
        steps = sorted(e.results)
        images = [fitted(c, height) for c in e.controls]
        names = ["base"] if e.base is not None else []
        images += [fitted(e.base, height)] if e.base is not None else []
        images += [fitted(e.results[s], height) for s in steps]
        names += [f"step {s}" for s in steps]
        label = f"{e.prompt} [control -> {', '.join(names)}]"  # the drawing font has no arrow
        rows.append(strip(images, len(e.controls), label))
    return stack(rows) if rows else None
