"""What is trained, registered by name: adapters, full fine-tuning, textual inversion.

Resolving the method from the config (`network_type`, and `use_dora` turning LoRA into DoRA)
happens here and nowhere else; so does refusing a method on a family it cannot finish on.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch

from kit.config import Config, DataConfig, NetworkConfig, ObjectiveConfig
from kit.errors import ConfigError, did_you_mean
from kit.families import Family, get_family
from kit.families.facts import CLIP_KEYS
from kit.families.noise import DRAW_KEYS, OBJECTIVES
from kit.families.source import check_base
from kit.methods.base import Method, NetworkSummary

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method selectable by its `name`."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"method name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def method_name(cfg: Config) -> str:
    """The configured method's name: `network_type`, with `use_dora` turning LoRA into DoRA."""
    net = cfg.network
    return "dora" if net.network_type == "lora" and net.use_dora else net.network_type


def method_names() -> list[str]:
    """Every registered method name."""
    return sorted(_REGISTRY)


def supported(family: Family) -> list[str]:
    """The methods a family can train and export."""
    return [n for n in method_names() if _REGISTRY[n].unsupported(family) is None]


def get_method(cfg: Config, family: Family) -> Method:
    """The configured method on `family`; a ConfigError when the pair cannot be finished."""
    name = method_name(cfg)
    if name not in _REGISTRY:
        hint = did_you_mean(name, list(_REGISTRY))
        raise ConfigError(
            f"network_type: unknown method '{name}' (known: {', '.join(method_names())}){hint}"
        )
    cls = _REGISTRY[name]
    _refuse_unread(cfg, family, cls)
    why = cls.unsupported(family)
    if why is not None:
        others = ", ".join(supported(family)) or "none"
        raise ConfigError(
            f"network_type {name} on {family.name}: {why}; choose another network_type "
            f"({family.name} supports: {others}) or another model_family"
        )
    return cls(cfg, family)


def unread_keys(cfg: Config, name: str) -> dict[str, Any]:
    """The network keys `cfg` sets that method `name` never reads, each at its default: what
    a change of method (a plan, a resize) resets along with `network_type`."""
    net, default = cfg.network, NetworkConfig()
    others = {k for c in _REGISTRY.values() for k in c.own_keys} - set(_REGISTRY[name].own_keys)
    return {
        k: getattr(default, k) for k in sorted(others) if getattr(net, k) != getattr(default, k)
    }


def _refuse_unread(cfg: Config, family: Family, cls: type[Method]) -> None:
    """Refuse a key set for another method or family than the configured one: it would be
    accepted and then do nothing."""
    for key in unread_keys(cfg, cls.name):
        readers = ", ".join(n for n, c in sorted(_REGISTRY.items()) if key in c.own_keys)
        raise ConfigError(
            f"{key}: {cfg.get(key)!r} does nothing for network_type {cls.name} (only {readers} "
            f"read it); remove it, or choose one of those"
        )
    # A base of two experts is the only kind whose family answers which experts train.
    if cfg.model.train_experts and not callable(getattr(family, "experts", None)):
        raise ConfigError(
            f"train_experts: {cfg.model.train_experts!r} does nothing for model_family "
            f"{family.name}, whose bases have one denoiser; remove it"
        )
    if not family.video:
        _refuse_clip_keys(cfg, family)
    _refuse_other_draw(cfg, family)


def _refuse_other_draw(cfg: Config, family: Family) -> None:
    """Refuse an objective key that only another kind of draw than the family's reads
    (`DRAW_KEYS`), set away from its default."""
    o, default = cfg.objective, ObjectiveConfig()
    for kind, keys in DRAW_KEYS.items():
        for key in keys if kind != family.objective else ():
            if getattr(o, key) != getattr(default, key):
                raise ConfigError(
                    f"{key}: {getattr(o, key)!r} does nothing for model_family {family.name}, "
                    f"which trains by {OBJECTIVES[family.objective]}; remove it"
                )


def _refuse_clip_keys(cfg: Config, family: Family) -> None:
    """Refuse a frame key (`CLIP_KEYS`), the data section's or a dataset's own, set away from
    its default for a family that trains on images: no clip is ever read."""
    data, default = cfg.data, DataConfig()
    found = [(k, getattr(data, k)) for k in CLIP_KEYS if getattr(data, k) != getattr(default, k)]
    for i, ds in enumerate(data.datasets):  # a dataset's own frame keys are empty unless set
        own = ((k, getattr(ds, k, None)) for k in CLIP_KEYS)
        found += [(f"datasets[{i}].{k}", v) for k, v in own if v is not None]
    if found:
        key, value = found[0]
        raise ConfigError(
            f"{key}: {value!r} does nothing for model_family {family.name}, which trains on "
            "images; remove it"
        )


def preview(cfg: Config) -> NetworkSummary:
    """What the configured method would train, built on the meta device (no weights). A base
    that is missing, gated or unreachable is refused in one line first, as `kit train` does."""
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)
    check_base(family, cfg.model.pretrained_model, cfg.model.revision)
    parts = family.empty_parts(cfg.model.pretrained_model)
    with torch.device("meta"):  # peft makes an adapter's layers on the CPU otherwise
        return method.mark_trainable(parts)


# Modules of this package that are shared machinery, not a method.
_SHARED = {"base", "lycoris"}


def _import_all() -> None:
    """Import every method file of this package: each registers itself on import."""
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in _SHARED:
            importlib.import_module(f"{__name__}.{mod.name}")


_import_all()

__all__ = [
    "Method",
    "NetworkSummary",
    "get_method",
    "method_name",
    "method_names",
    "preview",
    "register",
    "supported",
    "unread_keys",
]
