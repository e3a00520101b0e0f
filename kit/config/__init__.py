"""The run configuration: nested dataclasses, strict on load, one docstring per field.

A config file may be flat (`{"lora_rank": 16, ...}`) or sectioned (`{"network": {"lora_rank": 16}}`);
field names are unique across sections, so both mean the same.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from kit.config.model import DEFAULT_BASES, ModelConfig
from kit.config.preservation import PreservationConfig, SliderConfig
from kit.config.sections import (
    DataConfig,
    DatasetConfig,
    GenerateConfig,
    NetworkConfig,
    ObjectiveConfig,
    TrainConfig,
    ValidationConfig,
    ValidationPrompt,
)
from kit.config.sources import URL as _URL

__all__ = [
    "Config",
    "DataConfig",
    "DatasetConfig",
    "GenerateConfig",
    "ModelConfig",
    "NetworkConfig",
    "ObjectiveConfig",
    "PreservationConfig",
    "SliderConfig",
    "TrainConfig",
    "ValidationConfig",
    "ValidationPrompt",
]
from kit.errors import ConfigError, did_you_mean
from kit.io import absolute_path, read_json_or_yaml, write_json


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def to_dict(self, flat: bool = False) -> dict[str, Any]:
        """The config as plain data, sectioned or flat."""
        d = dataclasses.asdict(self)
        return flat_config(d) if flat else d

    def get(self, name: str) -> Any:
        """A field by its unique name, whatever its section."""
        return getattr(getattr(self, field_section(name)), name)

    def replace(self, **changes: Any) -> Config:
        """A copy with fields changed by name (checked like a file's keys). A base left at its
        family's own follows a change of `model_family`."""
        current = self.to_dict(flat=True)
        m = self.model
        if "pretrained_model" not in changes and m.pretrained_model == DEFAULT_BASES.get(
            m.model_family
        ):
            current["pretrained_model"] = ""
        return from_dict({**current, **changes})

    def save(self, path: str | Path) -> None:
        """Write the config as sectioned JSON (atomic)."""
        write_json(path, self.to_dict())


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)
}


@cache
def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (sec, f)
    return index


def field_section(name: str) -> str:
    """The section that holds field `name`."""
    try:
        return _field_index()[name][0]
    except KeyError:
        raise ConfigError(_unknown(name, list(_field_index()))) from None


@cache
def field_docs() -> dict[str, str]:
    """Field name → its docstring, read from this module's source."""
    docs: dict[str, str] = {}
    # A section's fields may come from a base it shares (the data section's RemoteFields).
    classes = {k for cls in SECTIONS.values() for k in cls.__mro__ if dataclasses.is_dataclass(k)}
    for cls in classes:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


SECRET_KEYS = {
    "token",
    "hf_token",
    "hub_token",
    "huggingface_token",
    "access_token",
    "auth_token",
    "api_key",
    "wandb_api_key",
}
"""Keys refused with a pointer to the environment: a config is saved into the run folder."""


def _unknown(key: str, valid: list[str], where: str = "") -> str:
    if key.lower().replace("-", "_") in SECRET_KEYS:
        return (
            f"config key '{key}'{where} is refused: access tokens never go in a config file, "
            "which is copied into the run folder; set the HF_TOKEN environment variable instead "
            "(or run `hf auth login`)"
        )
    return f"unknown config key '{key}'{where}{did_you_mean(key, valid)}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[-1] if len(errors) == 1 else f"{key}: {value!r} has the wrong type"
        )
    if dataclasses.is_dataclass(tp):
        return _coerce_record(key, value, tp)
    if origin is Literal:
        if value not in args:
            hint = did_you_mean(str(value), [str(a) for a in args])
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {value!r} is not one of {choices}{hint}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {type(value).__name__} {value!r}")
        kt, vt = args
        return {_coerce(key, k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}
    if origin is list:
        (inner,) = args
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]  # a single prompt or seed stands for a list of one
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            # NaN passes every `<` check a section makes, and then trains on nothing.
            raise ConfigError(f"{key}: {value!r} is not a finite number; give a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _coerce_record(key: str, value: Any, tp: type) -> Any:
    """An entry of a list of records (a dataset, a validation prompt) from its object: strict
    keys and types like the config's own, and its checks' messages prefixed by where it is."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected an object of fields, got {type(value).__name__} {value!r}"
        )
    names = [f.name for f in dataclasses.fields(tp)]
    hints = typing.get_type_hints(tp)
    where = key + (
        f" ({value['name']})" if isinstance(value.get("name"), str) and value.get("name") else ""
    )
    vals = {}
    for sub, v in value.items():
        if sub.startswith("_"):
            continue
        if sub not in names:
            raise ConfigError(_unknown(sub, names, f" in {where}"))
        vals[sub] = _coerce(f"{where}.{sub}", v, hints[sub])
    try:
        return tp(**vals)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _resolve_paths(value: Any, base_dir: str | Path) -> Any:
    """A record (or list of records) with its path fields made absolute from `base_dir`."""
    if isinstance(value, list):
        return [_resolve_paths(v, base_dir) for v in value]
    if not dataclasses.is_dataclass(value):
        return value
    changes = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if f.metadata.get("path") and v:
            changes[f.name] = _resolve_field(f, v, base_dir)
        elif dataclasses.is_dataclass(v) or isinstance(v, list):
            changes[f.name] = _resolve_paths(v, base_dir)
    return dataclasses.replace(value, **changes) if changes else value


def _resolve_field(f: dataclasses.Field, value: Any, base_dir: str | Path) -> Any:
    """The one rule for every path key: a relative path is taken from the config file's folder
    (`base_dir`), never the current one; a URL stays, and so does a hub id where one is allowed."""
    if f.metadata.get("path") == "hub_or_path" and not value.endswith(_FILE_SUFFIXES):
        return resolve_model_path(value, base_dir)
    # A file by its suffix is a path even when missing: its error then names where it looked.
    return _absolute(value, base_dir)


_FILE_SUFFIXES = (".parquet", ".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".sft")
"""Endings of a file (never of a hub id) that a key taking a hub id or a path may name."""


def _absolute(value: str | list[str], base_dir: str | Path) -> str | list[str]:
    """A path field's value (a path, or a list of paths) made absolute from `base_dir`."""
    if isinstance(value, list):
        return [v if _URL.match(v) else str(absolute_path(v, base_dir)) for v in value]
    return value if _URL.match(value) else str(absolute_path(value, base_dir))


def flat_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config's plain data, sectioned or flat, as one flat mapping, taking every key as it is:
    unlike loading, it reads a config saved by another version of the kit."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge sectioned and flat keys into one flat dict, refusing unknown and doubled keys."""
    index = _field_index()
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(SECTIONS[key])]
            for sub, v in value.items():
                if sub.startswith("_"):
                    continue  # comments
                if sub not in names:
                    if sub in index:
                        raise ConfigError(
                            f"config key '{sub}' belongs in section '{index[sub][0]}', not '{key}'"
                        )
                    raise ConfigError(_unknown(sub, names, f" in section '{key}'"))
                if sub in flat:
                    raise ConfigError(f"config key '{sub}' is given twice")
                flat[sub] = v
        elif key in SECTIONS:
            raise ConfigError(
                f"config section '{key}' must be an object of fields, got {type(value).__name__}"
            )
        elif key in index:
            if key in flat:
                raise ConfigError(f"config key '{key}' is given twice")
            flat[key] = value
        elif key.startswith("_") or key == "$schema":
            continue  # comments such as "_comment" are allowed
        else:
            raise ConfigError(_unknown(key, list(index) + list(SECTIONS)))
    return flat


def from_dict(raw: dict[str, Any], base_dir: str | Path | None = None) -> Config:
    """Build a checked Config from a flat or sectioned dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    flat = _flatten(raw)
    index = _field_index()
    hints = {sec: typing.get_type_hints(cls) for sec, cls in SECTIONS.items()}
    per_section: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
    for key, value in flat.items():
        sec, f = index[key]
        value = _coerce(key, value, hints[sec][key])
        if base_dir is not None and f.metadata.get("path") and value:
            value = _resolve_field(f, value, base_dir)
        elif base_dir is not None and isinstance(value, list):
            value = _resolve_paths(value, base_dir)
        per_section[sec][key] = value
    return Config(**{sec: SECTIONS[sec](**vals) for sec, vals in per_section.items()})


def resolve_model_path(value: str, base_dir: str | Path) -> str:
    """A local path (made absolute) when the value names one, else the hub id unchanged."""
    looks_local = value.startswith((".", "/", "~")) or (Path(base_dir) / value).exists()
    return str(absolute_path(value, base_dir)) if looks_local else value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Read a JSON (or YAML) config file; relative paths are taken from the file's folder."""
    path = Path(path)
    raw = read_json_or_yaml(path)
    try:
        raw = _flatten(raw) if isinstance(raw, dict) else raw
        if overrides:
            for key in overrides:
                field_section(key)
            raw = {**raw, **overrides}
        return from_dict(raw, base_dir=path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a command-line `key=value`; the value is JSON when it parses, else a string."""
    if "=" not in text:
        raise ConfigError(f"expected key=value, got '{text}'")
    key, value = text.split("=", 1)
    field_section(key.strip())
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
