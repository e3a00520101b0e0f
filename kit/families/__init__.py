"""Model families, registered by name: one file per architecture."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from kit.errors import ConfigError, did_you_mean
from kit.families.base import Components, Family
from kit.families.noise import NoiseDraw

if TYPE_CHECKING:
    from kit.config import Config

_REGISTRY: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family selectable by its `name`."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"family name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def get_family(name: str, cfg: Config | None = None) -> Family:
    """The family registered as `name`, set up with the run's config (defaults when None)."""
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        hint = did_you_mean(name, list(_REGISTRY))
        raise ConfigError(f"model_family: unknown family '{name}' (known: {known}){hint}")
    return _REGISTRY[name](cfg)


def family_names() -> list[str]:
    """Every registered family name."""
    return sorted(_REGISTRY)


# Modules of this package that are shared machinery, not a family.
_SHARED = {
    "adapter_keys",
    "base",
    "flux_layout",
    "identity",
    "ldm",
    "loading",
    "noise",
    "quantize",
    "sd3_layout",
    "shipped",
    "tiny",
    "wan_layout",
}
"""Modules of this package that are not families: shared code and the original layouts."""


def _import_all() -> None:
    """Import every family file of this package: each registers itself on import."""
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in _SHARED:
            importlib.import_module(f"{__name__}.{mod.name}")


_import_all()

__all__ = ["Components", "Family", "NoiseDraw", "family_names", "get_family", "register"]
