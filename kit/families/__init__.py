"""Model families, registered by name: one file per architecture.

Importing this package is cheap: the registry (`kit.families.registry`) knows every family's
name and plain facts without importing torch, so scans and bucket plans stay light. A family's
module, and with it torch, is imported by `get_family`; `Family`, `Components` and `NoiseDraw`
are imported the first time they are asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kit.families.registry import (
    FamilyFacts,
    FamilyInfo,
    family_class,
    family_info,
    family_names,
    get_family,
    register,
)

if TYPE_CHECKING:
    from kit.families.base import Components, Family
    from kit.families.noise import NoiseDraw

_LAZY = {"Components": "base", "Family": "base", "NoiseDraw": "noise"}
"""Names this package re-exports from a module that imports torch: module of each."""


def __getattr__(name: str) -> Any:
    """`from kit.families import Family` imports the torch-based module only then."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Components",
    "Family",
    "FamilyFacts",
    "FamilyInfo",
    "NoiseDraw",
    "family_class",
    "family_info",
    "family_names",
    "get_family",
    "register",
]
