"""The metadata every exported file carries: what clients display and filter on, nothing local.

Three vocabularies: the kit's own (`kit.*`), kohya's training fields (`ss_*`, which A1111's
and ComfyUI's LoRA browsers show) and Stability's model spec (`modelspec.*`). Paths never
appear: the base model is named by its hub id or its folder's or file's name, the dataset by
its folder's name.
"""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

from kit.config import Config
from kit.families import Family
from kit.families.identity import public_name
from kit.methods.base import Method
from kit.run.folder import RunDir


def tag_frequency(run: RunDir, cfg: Config) -> dict[str, dict[str, int]]:
    """kohya's `ss_tag_frequency`: the dataset folder's name → each comma-separated caption
    tag and how many trained samples carry it (read from the run's dataset manifest)."""
    rows = json.loads(run.manifest.read_text()) if run.manifest.is_file() else []
    counts: Counter[str] = Counter()
    for row in rows:
        counts.update({t.strip() for t in str(row.get("caption", "")).split(",") if t.strip()})
    return {Path(cfg.data.image_dir).name or "images": dict(counts.most_common())}


def shared_metadata(
    run: RunDir, cfg: Config, family: Family, method: Method, step: int
) -> dict[str, str]:
    """The metadata of every file exported from `run` at `step` (all values strings)."""
    base = public_name(cfg.model.pretrained_model)
    rows = json.loads(run.manifest.read_text()) if run.manifest.is_file() else []
    res = cfg.data.resolution
    version = family.version_metadata()
    if method.modelspec_adapter:
        version["modelspec.architecture"] += f"/{method.modelspec_adapter}"
    meta = {
        "kit.base_model": base,
        "kit.model_family": family.name,
        "kit.network_type": cfg.network.network_type,
        "kit.trigger_words": json.dumps(cfg.data.trigger_words),
        "kit.steps": str(step),
        "kit.resolution": str(res),
        "ss_sd_model_name": base,
        "ss_num_train_images": str(len(rows)),
        "ss_tag_frequency": json.dumps(tag_frequency(run, cfg), ensure_ascii=False),
        "ss_learning_rate": str(cfg.train.learning_rate),
        "ss_max_train_steps": str(cfg.train.max_train_steps),
        "ss_seed": str(cfg.train.seed),
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.resolution": f"{res}x{res}",
        "modelspec.date": datetime.date.today().isoformat(),
        "modelspec.trigger_phrase": ", ".join(cfg.data.trigger_words),
        **version,
    }
    return {k: v for k, v in meta.items() if v}
