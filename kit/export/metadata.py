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
    """kohya's `ss_tag_frequency`: each dataset folder's name → each comma-separated caption
    tag and how many trained samples carry it (read from the run's dataset manifest)."""
    counts: dict[str, Counter[str]] = {}
    for row in _rows(run):
        tags = {t.strip() for t in str(row.get("caption", "")).split(",") if t.strip()}
        counts.setdefault(_dataset_name(row, cfg), Counter()).update(tags)
    if not counts:
        counts[_dataset_name({}, cfg)] = Counter()
    return {name: dict(c.most_common()) for name, c in counts.items()}


def dataset_counts(run: RunDir, cfg: Config) -> dict[str, dict[str, int]]:
    """kohya's `ss_dataset_dirs`: each dataset folder's name → its repeats and image count."""
    out: dict[str, dict[str, int]] = {}
    for row in _rows(run):
        d = out.setdefault(
            _dataset_name(row, cfg), {"n_repeats": int(row.get("repeats", 1)), "img_count": 0}
        )
        d["img_count"] += 1
    return out


def _rows(run: RunDir) -> list[dict]:
    return json.loads(run.manifest.read_text()) if run.manifest.is_file() else []


def _dataset_name(row: dict, cfg: Config) -> str:
    """A dataset's name (its folder's name, or the name given it): never a path."""
    return str(row.get("dataset") or Path(cfg.data.image_dir).name or "images")


def _train_counts(rows: list[dict]) -> tuple[int, int]:
    """Instance and prior images with repeats, as kohya counts `ss_num_train_images` and
    `ss_num_reg_images`."""
    train = sum(int(r.get("repeats", 1)) for r in rows if r.get("role") != "prior")
    prior = sum(int(r.get("repeats", 1)) for r in rows if r.get("role") == "prior")
    return train, prior


def shared_metadata(
    run: RunDir, cfg: Config, family: Family, method: Method, step: int
) -> dict[str, str]:
    """The metadata of every file exported from `run` at `step` (all values strings)."""
    base = public_name(cfg.model.pretrained_model)
    rows = _rows(run)
    train, prior = _train_counts(rows)
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
        "ss_num_train_images": str(train),
        "ss_num_reg_images": str(prior),
        "ss_tag_frequency": json.dumps(tag_frequency(run, cfg), ensure_ascii=False),
        "ss_dataset_dirs": json.dumps(dataset_counts(run, cfg), ensure_ascii=False),
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
