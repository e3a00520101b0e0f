"""The config reference page, read off the config's dataclasses: every key with its type,
default, range or choices, and the docstring under it (scripts/gen_docs.py writes it).

A key without a docstring is an error that names it. Ranges are found by building the section
with trial values, so they are the ones its own checks enforce.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any, Literal

GENERATED = "<!-- Written by scripts/gen_docs.py from the code; edit the code, then rerun it. -->"


class DocsError(Exception):
    """Something the pages cannot be written without (a key with no docstring)."""


# ---------------------------------------------------------------------------- text helpers


def one_line(text: str) -> str:
    """A docstring as one line of a table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph."""
    para = " ".join(text.strip().split("\n\n")[0].split())
    m = re.search(r"(?<=\.)\s", para)
    return para[: m.start()] if m else para


def code(value: Any) -> str:
    """A value as inline code in a table cell."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return f"`{text}`".replace("|", "\\|") if text != "" else '`""`'


# ---------------------------------------------------------------------------- config reference


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name → the docstring under it, over `cls` and the dataclasses it extends."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def type_text(tp: Any) -> str:
    """An annotation as a reader of a config file thinks of it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in inner)
        return f"{text} or empty" if type(None) in args else text
    if origin is Literal:
        return "choice"
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"object ({type_text(args[0])} → {type_text(args[1])})"
    if dataclasses.is_dataclass(tp):
        return f"object ([{tp.__name__}](#{tp.__name__.lower()}))"
    names = {bool: "bool", int: "int", float: "float", str: "string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def choices(tp: Any) -> list[Any]:
    """The values a Literal annotation (or an optional one) allows; [] for any other."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [c for a in typing.get_args(tp) for c in choices(a)]
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else []


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return None if dataclasses.is_dataclass(value) else value
    return dataclasses.MISSING


def default_text(f: dataclasses.Field) -> str:
    value = default_of(f)
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "empty"
    return code(value)


def _accepts(cls: type, base: dict[str, Any], name: str, value: Any) -> bool:
    try:
        cls(**{**base, name: value})
    except Exception:
        return False
    return True


def probed_range(cls: type, base: dict[str, Any], name: str, tp: Any) -> str:
    """The numbers the section's own checks accept for a numeric field, found by trying values:
    the range is the one the code enforces, whatever the docstring says."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    inner = [a for a in typing.get_args(tp) if a is not type(None)] if optional else [tp]
    if len(inner) != 1 or inner[0] not in (int, float):
        return ""
    kind = inner[0]
    ok = lambda v: _accepts(cls, base, name, kind(v))  # noqa: E731
    probes = [-(10**6), -1, 0, 1, 2, 8, 32]
    accepted = [p for p in probes if ok(p)]
    if not accepted:
        return ""
    low = ""
    lo = accepted[0]
    if lo != probes[0]:
        below = probes[probes.index(lo) - 1]
        if kind is float and lo - below == 1 and ok(below + 1e-9):
            low = f"> {below}"  # open below: every value above `below` passes
        else:
            low = f"≥ {lo}"
    high = ""
    if not ok(10**9):
        top = max(accepted)
        if kind is float and ok(0.5) and not ok(1.0):
            high = "< 1"
        else:
            a, b = top, 10**9  # a passes, b does not
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if ok(mid) else (a, mid)
            high = f"≤ {a}"
    if low and high:
        return f"{low}, {high}"
    return low or high


def records(cls: type, seen: list[type]) -> list[type]:
    """The dataclasses nested in `cls`'s fields (a list of datasets, a preservation block),
    past those in `seen`."""
    for tp in typing.get_type_hints(cls).values():
        for arg in (
            tp,
            *typing.get_args(tp),
            *(a for t in typing.get_args(tp) for a in typing.get_args(t)),
        ):
            if dataclasses.is_dataclass(arg) and arg not in seen:
                seen.append(arg)
                records(arg, seen)
    return seen


def probe_base(cls: type) -> dict[str, Any] | None:
    """Field values with which `cls` builds, to vary one field at a time; None when none found."""
    hints = typing.get_type_hints(cls)
    strings = {n: "x" for n, t in hints.items() if t is str}
    dicts = {n: {"x": "y"} for n, t in hints.items() if typing.get_origin(t) is dict}
    tries = [{**dicts, **strings}, *({n: v} for n, v in strings.items()), dicts, {}]
    for kwargs in tries:
        try:
            cls(**kwargs)
        except Exception:
            continue
        return kwargs
    return None


def field_rows(cls: type, mirrors: dict[str, str], where: str) -> list[str]:
    """One table row per field of `cls`; a field without a docstring is an error, unless it
    stands for a field of the same name elsewhere (`mirrors`: name → its section)."""
    docs = field_docstrings(cls)
    hints = typing.get_type_hints(cls)
    base = probe_base(cls)
    rows = []
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name)
        if doc is None:
            if f.name not in mirrors:
                raise DocsError(
                    f"config key {where}.{f.name} ({cls.__module__}.{cls.__name__}) has no "
                    "docstring: write one under the field"
                )
            doc = f"As `{f.name}` of the {mirrors[f.name]} section, for this entry; empty takes it."
        tp = hints[f.name]
        allowed = choices(tp)
        if allowed:
            limits = ", ".join(code(c) for c in allowed)
        else:
            limits = probed_range(cls, base, f.name, tp) if base is not None else ""
        cells = [f"`{f.name}`", type_text(tp), default_text(f), limits, one_line(doc)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


TABLE_HEAD = ["| key | type | default | range or choices | what it does |", "|---|---|---|---|---|"]


def config_page() -> str:
    from kit.config import SECTIONS

    top = {f.name: sec for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    out = [
        GENERATED,
        "",
        "# Config reference",
        "",
        "Every key a config file may hold, read off the config's dataclasses (`kit/config/`).",
        'A file may be flat or sectioned (`{"model": {...}, "data": {...}}`): key names are',
        "unique across sections, so both mean the same. An unknown key or a wrong type is an error",
        "that names the key and suggests the closest valid one. Ranges are those the config's",
        'own checks accept when the file is read; "empty" is `null` or leaving the key out.',
        "",
    ]
    for sec, cls in SECTIONS.items():
        out += [f"## {sec}", "", *TABLE_HEAD, *field_rows(cls, {}, sec), ""]
    seen = list(SECTIONS.values())
    for cls in SECTIONS.values():
        records(cls, seen)
    nested = seen[len(SECTIONS) :]
    if nested:
        out += [
            "## Entries and blocks",
            "",
            "Keys of the objects that some keys above hold (a `datasets` entry, a validation",
            "prompt, a preservation block).",
            "",
        ]
    for cls in nested:
        doc = inspect.getdoc(cls) or ""
        own = doc if doc and not doc.startswith(f"{cls.__name__}(") else ""
        out += [f"### {cls.__name__}", ""]
        if own:
            out += [one_line(own), ""]
        out += [*TABLE_HEAD, *field_rows(cls, top, cls.__name__), ""]
    return "\n".join(out).rstrip() + "\n"
