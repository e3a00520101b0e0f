"""Loading a configured base model (a local folder, a hub id or one checkpoint file), only the
parts a caller needs, each straight in the dtype it runs in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.errors import KitError, explain
from kit.families import Components, Family, get_family
from kit.families.base import PARTS
from kit.families.identity import DtypeSpec, single_file
from kit.families.source import check_base, hub_error


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
    pretrained = cfg.model.pretrained_model
    check_base(family, pretrained, cfg.model.revision)
    try:
        comps = family.load(
            pretrained,
            revision=cfg.model.revision,
            variant=cfg.model.variant,
            dtype=dtype,
            parts=parts,
        )
    except KitError:
        raise
    except Exception as e:
        raise KitError(load_error(e, pretrained, cfg.model.model_config, cfg.model.revision)) from e
    return family, comps


def damaged_weights(folder: Path) -> list[str]:
    """The weight files under `folder` that cannot be read: a safetensors header that does not
    parse or promises more bytes than the file has (a truncated download or copy)."""
    bad = []
    for f in sorted(folder.rglob("*.safetensors")) if folder.is_dir() else [folder]:
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
            if f.stat().st_size < 8 + size + end:
                bad.append(f"{f} (truncated: {f.stat().st_size} of {8 + size + end} bytes)")
        except (OSError, ValueError, KeyError, TypeError, MemoryError):
            bad.append(f"{f} (its header does not read)")
    return bad


def load_error(e: BaseException, pretrained: str, model_config: str, revision: str | None) -> str:
    """One line for a failure to load the base, naming the file and the fix: a damaged weight
    file, a hub failure, or the library's own first line."""
    where = f" (model_config '{model_config}')" if model_config else ""
    source = Path(pretrained).expanduser()
    bad = damaged_weights(source) if source.exists() else []
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        return (
            f"pretrained_model '{pretrained}'{where}: damaged weight file {bad[0]}{more}; "
            "copy or download the model again"
        )
    names = {c.__name__ for c in type(e).__mro__}
    if any(n.endswith(("RepoError", "NotFoundError", "OfflineModeIsEnabled")) for n in names):
        return hub_error(e, pretrained, revision)
    explained = explain(e)
    if explained:
        return f"cannot load pretrained_model '{pretrained}'{where}: {explained}"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:400]
    return f"cannot load pretrained_model '{pretrained}'{where}: {first}"


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
