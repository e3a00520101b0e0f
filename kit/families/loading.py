"""Loading a configured base model (a local folder, a hub id or one checkpoint file), only the
parts a caller needs, each straight in the dtype it runs in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.errors import KitError
from kit.families import Components, Family, get_family
from kit.families.base import PARTS
from kit.families.identity import DtypeSpec, single_file


def load_base(
    cfg: Config,
    dtype: DtypeSpec = torch.float32,
    parts: tuple[str, ...] = PARTS,
    family: Family | None = None,
) -> tuple[Family, Components]:
    """The configured family and its loaded base model (only `parts` of it, see `PARTS`).

    `dtype` is one dtype, or one per part (`kit.families.identity.part_dtype`): a frozen part
    loads in the half dtype it runs in rather than in fp32 and then cast, which would hold
    twice its size in memory meanwhile. `family` is the configured one when the caller has
    already built it.
    """
    if family is None:
        family = get_family(cfg.model.model_family, cfg)
    try:
        comps = family.load(
            cfg.model.pretrained_model,
            revision=cfg.model.revision,
            variant=cfg.model.variant,
            dtype=dtype,
            parts=parts,
        )
    except (OSError, ValueError) as e:
        where = f" (model_config '{cfg.model.model_config}')" if cfg.model.model_config else ""
        raise KitError(
            f"cannot load pretrained_model '{cfg.model.pretrained_model}'{where}: {e}"
        ) from None
    return family, comps


def ensure_base_model(cfg: Any, create_tiny: bool = False) -> str:
    """Say where the base model comes from; write a tiny one if asked and the folder is missing."""
    source = cfg.model.pretrained_model
    local = Path(source)
    if single_file(source):
        if not local.is_file():
            raise KitError(f"pretrained_model file not found: {local}")
        family = get_family(cfg.model.model_family, cfg)
        return f"single-file base model: {local} (configs from {family.model_source(source)})"
    if local.is_dir():
        return f"local base model: {local}"
    if local.is_absolute() and create_tiny:
        get_family(cfg.model.model_family, cfg).make_tiny(local)
        return f"wrote a tiny random-init {cfg.model.model_family} base model to {local}"
    if local.is_absolute():
        raise KitError(f"pretrained_model folder not found: {local}")
    return f"hub model: {source} (downloaded on first use)"
