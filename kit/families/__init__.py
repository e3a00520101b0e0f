"""Model families, registered by name: one file per architecture."""

from __future__ import annotations

import difflib

from kit.errors import ConfigError
from kit.families.base import Components, Family

_REGISTRY: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family selectable by its `name`."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"family name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def get_family(name: str) -> Family:
    """The family registered as `name`."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"model_family: unknown family '{name}' (known: {known}){hint}")
    return _REGISTRY[name]()


def family_names() -> list[str]:
    """Every registered family name."""
    return sorted(_REGISTRY)


# Importing a family module registers it.
from kit.families import sd15  # noqa: E402,F401

__all__ = ["Components", "Family", "family_names", "get_family", "register"]
