"""The family registry: every family by name, and what the data commands need of one.

Scanning, bucketing, caption reports and planning ask a family only a few plain facts (its
bucket alignment, whether it reads clips and which frame counts it accepts, its native size and
hub repository). Answering them must not cost the import of torch (about a second, more than a
scan of thousands of images), so each family folder's `__init__` declares its `FACTS`, and the
registry finds the families by those folders; a family's class (`<folder>/family.py`) is
imported only when `get_family` is asked for it. A new family is a new folder: nothing here
names one.

The facts are written twice (`FACTS` and the class's attributes), so `register` checks that the
two agree whenever a family's module is imported: a mismatch fails on the first import.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from kit.config.model import DEFAULT_BASES
from kit.errors import ConfigError, KitError, did_you_mean
from kit.families.facts import FamilyFacts, FamilyInfo
from kit.families.shipped import ARCHITECTURES, SHIPPED

if TYPE_CHECKING:
    from kit.config import Config
    from kit.families.base import Family


def _discover() -> dict[str, FamilyInfo]:
    """Every family folder of this package, by the `FACTS` its `__init__` declares."""
    found: dict[str, FamilyInfo] = {}
    for folder in sorted(Path(__file__).parent.iterdir()):
        if not (folder / "__init__.py").is_file():
            continue
        facts = getattr(importlib.import_module(f"{__package__}.{folder.name}"), "FACTS", None)
        if not isinstance(facts, FamilyInfo) or facts.name != folder.name:
            raise ValueError(
                f"{__package__}.{folder.name} is a family folder: its __init__ must set FACTS to "
                f"a FamilyInfo named {folder.name!r}"
            )
        found[facts.name] = facts
    return found


FAMILIES: dict[str, FamilyInfo] = _discover()
"""This package's families, found from their folders; each class repeats these facts."""

DEFAULT_BASES.update({name: info.hub_id for name, info in FAMILIES.items()})

CHECKED = ("bucket_step", "native_resolution", "hub_id", "video", "audio", "image_alpha")
"""The facts `register` compares between a class and its entry in `FAMILIES`."""

_CLASSES: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family selectable by its `name`.

    A family of this package must have an entry in `FAMILIES` whose facts match the class's
    attributes; a family defined elsewhere (a user's own module) needs none, as its module is
    already imported when it registers.
    """
    if not cls.name or cls.name in _CLASSES:
        raise ValueError(f"family name {cls.name!r} is empty or taken")
    info = FAMILIES.get(cls.name)
    if info is None and cls.__module__.startswith(f"{__package__}."):
        raise ValueError(
            f"family {cls.name!r} ({cls.__module__}) has no entry in {__name__}.FAMILIES: "
            "add one with its bucket step, native resolution, hub id and video facts"
        )
    if info is not None:
        if info.module != cls.__module__:
            raise ValueError(
                f"family {cls.name!r} is registered by {cls.__module__}, but {__name__}.FAMILIES "
                f"names {info.module}"
            )
        for key in CHECKED:
            if getattr(cls, key) != getattr(info, key):
                raise ValueError(
                    f"family {cls.name!r}: {key} is {getattr(cls, key)!r} in {cls.__module__} "
                    f"but {getattr(info, key)!r} in {__name__}.FAMILIES; make them agree"
                )
    _CLASSES[cls.name] = cls
    DEFAULT_BASES.setdefault(cls.name, cls.hub_id)
    return cls


def family_names() -> list[str]:
    """Every family name: this package's and any registered from elsewhere."""
    return sorted(set(FAMILIES) | set(_CLASSES))


def _unknown(name: str) -> ConfigError:
    names = family_names()
    return ConfigError(
        f"model_family: unknown family '{name}' (known: {', '.join(names)})"
        f"{did_you_mean(name, names)}"
    )


def family_info(name: str) -> FamilyFacts:
    """The facts of family `name` without importing it: what scans and bucket plans need.

    A family registered from outside this package has no entry; its (already imported) class
    answers instead.
    """
    info = FAMILIES.get(name)
    if info is not None:
        return info
    if name in _CLASSES:
        return _CLASSES[name]()
    raise _unknown(name)


def family_class(name: str) -> type[Family]:
    """The class of family `name`, importing its module (and torch) the first time."""
    if name not in _CLASSES:
        info = FAMILIES.get(name)
        if info is None:
            raise _unknown(name)
        importlib.import_module(info.module)
        if name not in _CLASSES:
            raise KitError(f"model_family: {info.module} did not register a family '{name}'")
    return _CLASSES[name]


def get_family(name: str, cfg: Config | None = None) -> Family:
    """The family registered as `name`, set up with the run's config (defaults when None) as
    a config of `name`: an empty `pretrained_model`, or one left at another family's default,
    is this family's own base; a base the kit knows as another family's is refused."""
    cls = family_class(name)
    if cfg is not None and cfg.model.model_family != name:
        cfg = cfg.replace(model_family=name)  # a base left at the other family's follows
    if cfg is not None and not cfg.model.pretrained_model:
        cfg = cfg.replace(pretrained_model=cls.hub_id)
    if cfg is not None:
        check_base(name, cfg.model.pretrained_model, cfg.model.model_config)
    return cls(cfg)


def check_base(name: str, pretrained: str, model_config: str = "") -> None:
    """Refuse a base (or `model_config`) that the kit ships as another family's model."""
    for key, value in (("pretrained_model", pretrained), ("model_config", model_config)):
        arch = ARCHITECTURES.get(SHIPPED.get(value, ""))
        if arch is not None and arch.family != name:
            own = FAMILIES[name].hub_id if name in FAMILIES else _CLASSES[name].hub_id
            raise ConfigError(
                f"{key}: {value} is a {arch.family} model ({arch.title}), but model_family is "
                f"{name}; set model_family: {arch.family}, or {key} to a {name} base such as "
                f"{own}"
            )
