"""Reading a run folder for the checks: each part read once, only when a check asks, and never
an exception for a part that is missing or half-written."""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from kit.config import Config, flat_config, load_config
from kit.optim import make_scheduler
from kit.run.checkpoint import complete_checkpoints
from kit.run.folder import RunDir

# Pixel differences are mean absolute differences of images scaled to [0, 1] and shrunk to
# THUMB pixels a side.
THUMB = 64


def finite(x: Any) -> bool:
    """A real number that is neither NaN nor infinite (a bool is not a number here)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class RunRecord:
    """What a run folder holds, each part read once and only when a check asks."""

    def __init__(self, root: Path, error: str | None = None) -> None:
        self.root = root
        self.dir = RunDir(root)
        self.error = error

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        return [r for r in self.dir.read_metrics() if isinstance(r.get("step"), int)]

    @cached_property
    def config(self) -> Any:
        """The checked Config, or None when it cannot be read."""
        try:
            return load_config(self.dir.config)
        except Exception:
            return None

    @cached_property
    def flat(self) -> dict[str, Any]:
        """The flat config: the checked one, else the raw file over the defaults."""
        if self.config is not None:
            return self.config.to_dict(flat=True)
        out = Config().to_dict(flat=True)
        try:
            out.update(flat_config(json.loads(self.dir.config.read_text())))
        except Exception:
            pass
        return out

    @cached_property
    def manifest(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.dir.manifest.read_text())
            return [r for r in data if isinstance(r, dict)]
        except Exception:
            return []

    @cached_property
    def captions(self) -> list[str]:
        return [str(r.get("caption", "")) for r in self.manifest]

    @cached_property
    def checkpoints(self) -> dict[int, Path]:
        """Complete checkpoints by step."""
        return complete_checkpoints(self.root)

    @cached_property
    def validation(self) -> dict[int, dict[tuple[str, int, str], np.ndarray]]:
        """Validation images by step, each keyed by (prompt, seed, settings)."""
        out = {}
        for step, folder in self.dir.validation_steps().items():
            images = read_images(folder)
            if images:
                out[step] = {k: v for k, (_, v) in images.items()}
        return out

    @cached_property
    def base_images(self) -> dict[tuple[str, int, str], np.ndarray]:
        """The base model's own images (adapter scale 0), where `draw_checkpoint` drew them."""
        out: dict[tuple[str, int, str], np.ndarray] = {}
        for folder in self.dir.scale_folders():
            for key, (scale, img) in read_images(folder, with_scale=True).items():
                if scale == 0:
                    out[key[:3]] = img
        return out

    def reference(self) -> tuple[str, dict[tuple[str, int, str], np.ndarray]] | None:
        """What later images are compared against: the base model's images, else the first grid."""
        if self.base_images:
            return "the base model (adapter scale 0)", self.base_images
        if len(self.validation) >= 2:
            step, images = next(iter(self.validation.items()))
            return f"the first validation grid (step {step}), standing in for the base", images
        return None

    @cached_property
    def expected_lr(self) -> dict[int, float] | None:
        """The configured schedule's learning rate at each logged step (one process)."""
        if self.config is None or not self.rows:
            return None
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=self.config.train.learning_rate)
        try:
            sched = make_scheduler(opt, self.config.train)
        except Exception:
            return None
        logged, out = {r["step"] for r in self.rows}, {}
        for s in range(1, max(logged) + 1):
            opt.step()
            sched.step()
            if s in logged:
                out[s] = sched.get_last_lr()[0]
        return out

    @cached_property
    def triggers(self) -> list[str]:
        return [t for t in self.flat.get("trigger_words") or [] if t]


_DRAWN_WITH = (
    "negative_prompt",
    "guidance_scale",
    "num_inference_steps",
    "width",
    "height",
    "sampler",
)
"""Sidecar fields besides prompt and seed that make two validation images different images."""


def read_images(folder: Path, with_scale: bool = False) -> dict[tuple, tuple[float, np.ndarray]]:
    """A validation folder's images (not its grid), small, in [0, 1], keyed by prompt, seed and
    the other settings they were drawn with (as a JSON string)."""
    out: dict[tuple, tuple[float, np.ndarray]] = {}
    for png in sorted(folder.glob("*.png")):
        if png.name == "grid.png":
            continue
        try:
            meta = json.loads(png.with_suffix(".json").read_text())
            # Prompts of `validation_prompts` may repeat with other settings: those key too.
            drawn = {k: meta.get(k) for k in _DRAWN_WITH}
            key: tuple = (str(meta["prompt"]), int(meta["seed"]), json.dumps(drawn, sort_keys=True))
            scale = float(meta.get("adapter_scale", 1.0))
        except Exception:
            key, scale = (png.stem, 0, ""), 1.0
        if with_scale:
            key = (*key, scale)
        try:
            with Image.open(png) as im:
                im = im.convert("RGB").resize((THUMB, THUMB), Image.Resampling.BILINEAR)
                out[key] = (scale, np.asarray(im, dtype=np.float32) / 255.0)
        except Exception:
            continue
    return out


def fmt_steps(steps: list[int]) -> str:
    """At most eight steps, comma-separated, with an ellipsis when there are more."""
    return ", ".join(str(s) for s in steps[:8]) + (" …" if len(steps) > 8 else "")
