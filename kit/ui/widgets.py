"""What the notebooks show: tables, figures, image grids, live training plots and editors.

Everything here also works headlessly (papermill): widgets simply render as their text form.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kit.config import Config, load_config
from kit.data import video
from kit.data.captions import has_word, save_caption
from kit.data.scan import Sample, caption_path
from kit.families import get_family
from kit.logs import quiet_libraries
from kit.preflight.estimate import GIB, GPUS, estimate
from kit.report.plots import metrics_figure
from kit.run.folder import RunDir

quiet_libraries()


def load(config_path: str | Path, output_dir: str = "", **overrides: Any) -> Config:
    """The notebook's config: the file, with `output_dir` and other overrides (None: keep) applied."""
    extra = {k: v for k, v in overrides.items() if v is not None}
    if output_dir:
        extra["output_dir"] = str(Path(output_dir).resolve())
    return load_config(config_path, extra)


def table(rows: Iterable[dict[str, Any]], max_rows: int = 50) -> Any:
    """An HTML table of dict rows."""
    from IPython.display import HTML

    rows = list(rows)
    if not rows:
        return HTML("<i>(nothing to show)</i>")
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
        for r in rows[:max_rows]
    )
    more = f"<p><i>… {len(rows) - max_rows} more rows</i></p>" if len(rows) > max_rows else ""
    return HTML(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def show_images(paths: Iterable[str | Path | Sample], width: int = 160) -> Any:
    """A row of images with their file names; a sample from a dataset, shard or bucket (see
    `kit.data.sources`) is read from there."""
    import base64

    from IPython.display import HTML

    cells = []
    for p in paths:
        if isinstance(p, Sample) and p.blob is not None and p.clip:  # a shard's video member
            with video.as_file(p.blob.read(), p.blob.name) as copy:
                p, raw = p.image, _png_bytes(copy, width)
        elif isinstance(p, Sample):
            p, raw = p.image, (p.blob.read() if p.blob is not None else Path(p.image).read_bytes())
        else:
            raw = _png_bytes(p, width) if video.is_clip(Path(p)) else Path(p).read_bytes()
        data = base64.b64encode(raw).decode()
        cells.append(
            f"<figure style='display:inline-block;margin:4px'><img width={width} "
            f"src='data:image/png;base64,{data}'/><figcaption>{html.escape(Path(p).name)}"
            "</figcaption></figure>"
        )
    return HTML("".join(cells))


CLIP_TYPES = {".webp": "image/webp", ".gif": "image/gif"}
"""Animated image files a notebook plays in an <img> tag, by suffix; an .mp4 plays in <video>."""


def show_clips(paths: Iterable[str | Path], width: int = 256) -> Any:
    """Clips playing in a loop, each under its file name: an animated WebP (or GIF) inline as
    the image it is, an MP4 in a muted, looping <video>; embedded, so the saved notebook
    still plays them."""
    import base64

    from IPython.display import HTML

    cells = []
    for p in map(Path, paths):
        data = base64.b64encode(p.read_bytes()).decode()
        kind = CLIP_TYPES.get(p.suffix.lower())
        if kind:
            tag = f"<img width={width} src='data:{kind};base64,{data}'/>"
        else:
            tag = (
                f"<video width={width} autoplay loop muted playsinline controls "
                f"src='data:video/mp4;base64,{data}'></video>"
            )
        cells.append(
            f"<figure style='display:inline-block;margin:4px'>{tag}<figcaption>"
            f"{html.escape(p.name)}</figcaption></figure>"
        )
    return HTML("".join(cells))


def bucket_figure(plan: Any, samples: list[Any]):
    """Images per bucket, and the spread of the images' aspect ratios."""
    import matplotlib.pyplot as plt

    counts = sorted(plan.counts().items())
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
    a.bar([f"{w}x{h}" for (w, h), _ in counts], [n for _, n in counts])
    a.set_title("images per bucket")
    a.tick_params(axis="x", rotation=45)
    b.hist([s.width / s.height for s in samples], bins=20)
    b.set_title("image aspect ratio (width / height)")
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's result
    return fig


def vram_figure(est: Any, budget_gib: float | None = None, cards: bool = True):
    """The estimated peak as one stacked bar of its components, with card and budget lines."""
    import matplotlib.pyplot as plt

    parts = [(n, v / GIB) for n, v in est.components.items() if v > 0]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    colors = plt.get_cmap("tab20").colors
    for i, (name, gib) in enumerate(parts):
        ax.barh([0], [gib], left=left, color=colors[i % len(colors)], label=f"{name} {gib:.2f}")
        left += gib
    top = max(left, budget_gib or 0) * 1.08
    if cards:
        for name, gib in GPUS.items():
            if gib <= top * 1.5:
                ax.axvline(gib, color="grey", linewidth=0.8, linestyle=":")
                ax.text(gib, 0.45, name, rotation=90, fontsize=7, va="top", ha="right")
    if budget_gib:
        ax.axvline(budget_gib, color="red", linestyle="--")
        ax.text(budget_gib, -0.45, f"budget {budget_gib} GiB", color="red", fontsize=8)
    s = est.settings
    ax.set_title(
        f"peak {est.total_bytes / GIB:.2f} GiB — {s['height']}x{s['width']}, batch "
        f"{s['batch_size']}, {s['mixed_precision']}, {s['optimizer']}, checkpointing "
        f"{'on' if s['gradient_checkpointing'] else 'off'}",
        fontsize=9,
    )
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_xlim(0, max(top, left * 1.05))
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's result
    return fig


def estimates_on(cfg: Config, models: Iterable[tuple[str, str, int]]) -> dict[str, Any]:
    """The config's estimate on other architectures: (family, model, resolution) each.

    A shipped hub id (kit.families.shipped) needs no download: only its architecture is built.
    Another family's model is adapted where that family's LoRA goes by default, and its text
    encoders train only where a LoRA can be loaded into them (the label says when they do not).
    """
    out = {}
    for family, model, resolution in models:
        other = cfg.replace(model_family=family, pretrained_model=model, resolution=resolution)
        label = f"{model.rsplit('/', 1)[-1]} at {resolution} px"
        if family != cfg.model.model_family:
            # Module names differ between architectures: the other family's default targets.
            other = other.replace(
                lora_target_modules=[], only_if_contains=[], ignore_if_contains=[]
            )
            if other.network.train_text_encoder and not get_family(family).kohya_text_prefixes:
                other = other.replace(train_text_encoder=False, text_encoders=[])
                label += ", text encoders frozen"
        out[label] = estimate(other)
    return out


def vram_comparison(estimates: dict[str, Any], budget_gib: float | None = None):
    """Estimates side by side: one stacked bar per estimate, a colour per component."""
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for e in estimates.values() for n in e.components))
    colors = dict(zip(names, plt.get_cmap("tab20").colors, strict=False))
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(estimates) + 1.6))
    labels = list(estimates)
    for row, label in enumerate(labels):
        left = 0.0
        for name, value in estimates[label].components.items():
            gib = value / GIB
            if gib > 0:
                ax.barh([row], [gib], left=left, color=colors[name], label=name)
                left += gib
        ax.text(left, row, f"  {left:.2f} GiB", va="center", fontsize=8)
    if budget_gib:
        ax.axvline(budget_gib, color="red", linestyle="--")
        ax.text(budget_gib, len(labels) - 0.5, f" budget {budget_gib} GiB", color="red", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("estimated peak GiB")
    handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    ax.legend(
        handles.values(),
        handles.keys(),
        fontsize=7,
        ncol=4,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
    )
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's result
    return fig


class LivePlot:
    """A training callback that redraws the metrics figure every `every` steps."""

    def __init__(self, metrics_path: Path, every: int = 10) -> None:
        from IPython.display import display

        self.metrics_path = Path(metrics_path)
        self.every = every
        self.handle = display("training starts…", display_id=True)

    def __call__(self, event: dict[str, Any]) -> None:
        if event["kind"] == "step" and event["step"] % self.every == 0 or event["kind"] == "end":
            self.redraw()

    def redraw(self) -> None:
        """Draw the figure from the metrics logged so far."""
        import matplotlib.pyplot as plt

        rows = RunDir(self.metrics_path.parent.parent).read_metrics()
        if rows:
            fig = metrics_figure(rows)
            self.handle.update(fig)
            plt.close(fig)


def caption_editor(cfg: Config, samples: list[Any]) -> Any:
    """Thumbnail, caption box, previous / next, a tag filter and save: edits are written atomically."""
    return CaptionEditor(cfg, samples).widget


class CaptionEditor:
    """The widgets of `caption_editor` and what its buttons do (also callable without a browser)."""

    def __init__(self, cfg: Config, samples: list[Any]) -> None:
        import ipywidgets as W

        self.cfg, self.samples = cfg, samples
        self.shown = list(range(len(samples)))  # indices that pass the tag filter
        self.pos = 0
        self.on_disk = ""  # the caption file's text when shown, to catch edits made meanwhile
        self.image = W.Image(format="png", width=256)
        self.text = W.Textarea(layout=W.Layout(width="60%", height="80px"))
        self.filter = W.Text(placeholder="filter by tag", layout=W.Layout(width="180px"))
        self.status = W.Label()
        prev_b = W.Button(description="◀ previous")
        next_b = W.Button(description="next ▶")
        save_b = W.Button(description="save", button_style="primary")
        prev_b.on_click(lambda _: self.move(-1))
        next_b.on_click(lambda _: self.move(1))
        save_b.on_click(lambda _: self.save())
        self.filter.observe(lambda change: self.set_filter(change["new"]), names="value")
        self.buttons = (prev_b, next_b, save_b)
        self.widget = W.VBox(
            [
                W.HBox([self.image, self.text]),
                W.HBox([prev_b, next_b, save_b, self.filter]),
                self.status,
            ]
        )
        self.show()

    def current(self) -> Any:
        """The sample on screen, or None when the filter leaves none."""
        return self.samples[self.shown[self.pos]] if self.shown else None

    def show(self) -> None:
        """Put the current sample's thumbnail and caption on screen."""
        s = self.current()
        if s is None:
            self.image.value, self.text.value = b"", ""
            self.status.value = f"no caption matches '{self.filter.value}'"
            return
        self.image.value = _png_bytes(s.image)
        path = _caption_file(s.image, self.cfg)
        self.on_disk = _disk_text(path)
        if path and path.is_file():
            s.caption = self.on_disk.strip()  # the file wins: a bulk edit may have changed it
        self.text.value = s.caption
        self.status.value = f"{self.pos + 1}/{len(self.shown)}  {Path(s.image).name}"

    def move(self, step: int) -> None:
        """Go `step` samples on (wrapping round), among those the filter shows."""
        if self.shown:
            self.pos = (self.pos + step) % len(self.shown)
        self.show()

    def set_filter(self, tag: str) -> None:
        """Show only samples whose caption holds `tag` as a whole word; empty shows all."""
        tag = tag.strip()
        self.shown = [i for i, s in enumerate(self.samples) if not tag or has_word(s.caption, tag)]
        self.pos = 0
        self.show()

    def save(self) -> Path | None:
        """Write the caption box to the current sample's caption file, unless it changed on disk."""
        s = self.current()
        if s is None:
            return None
        path = _caption_file(s.image, self.cfg)
        if path and _disk_text(path) != self.on_disk:
            # Saving now would silently undo a bulk edit or another editor's save.
            self.status.value = (
                f"not saved: {path.name} changed on disk; move on and back to reload"
            )
            return None
        s.caption = self.text.value.strip()
        path = save_caption(s.image, s.caption, self.cfg.data)
        self.on_disk = path.read_text(encoding="utf-8")
        self.status.value = f"saved {path.name}"
        return path


def _disk_text(path: Path | None) -> str:
    """A caption file's text now ("" when there is none)."""
    return path.read_text(encoding="utf-8", errors="replace") if path and path.is_file() else ""


def _caption_file(image: str | Path, cfg: Config) -> Path | None:
    """The caption file of an image, or None when captions do not come from files."""
    if cfg.data.caption_strategy != "textfile":
        return None
    return caption_path(Path(image), cfg.data)


def _png_bytes(path: str | Path, size: int = 256) -> bytes:
    import io

    from PIL import Image

    if video.is_clip(Path(path)):
        im = video.read_frames(Path(path), [0])[0]  # a clip shows its first frame
    else:
        with Image.open(path) as im:
            im = im.convert("RGB")
    im.thumbnail((size, size))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()
