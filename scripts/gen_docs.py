"""Write the documentation pages that are read off the code: one per model family, the config
reference, and the families table of the README.

    python scripts/gen_docs.py               # (re)write the pages under docs/ and the README table
    python scripts/gen_docs.py --check       # exit 1, naming the pages, when any is out of date
    python scripts/gen_docs.py --estimates   # also recompute docs/families/estimates.json (slow)

Families are read through the registry and their class attributes, shipped architectures
through `kit.families.shipped`, the config through its dataclasses and the docstring under
each field: nothing here names a family or a key. A config key without a docstring stops the
script, naming it. The memory estimates take a traced step per shipped architecture (minutes
each on a small CPU), so they are computed only on request and kept in `estimates.json`, which
the pages are drawn from.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ESTIMATES = DOCS / "families" / "estimates.json"
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
NAV_START = "# families: written by scripts/gen_docs.py"
NAV_END = "# end of families"
TABLE_START = "<!-- families table: written by scripts/gen_docs.py -->"
TABLE_END = "<!-- end of families table -->"
GENERATED = "<!-- Written by scripts/gen_docs.py from the code; edit the code, then rerun it. -->"

# The run the estimate tables describe: the settings LoRA memory figures are usually quoted for.
ESTIMATE_SETTINGS = {
    "network_type": "lora",
    "lora_rank": 16,
    "train_batch_size": 1,
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
    "optimizer": "adamw",
}
ESTIMATE_CARDS = ("RTX 4090 24GB", "RTX 4080 16GB")


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


# ---------------------------------------------------------------------------- families


def family_summary(cls: type) -> str:
    """The family's one-line description: its module's docstring, else its class's."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip() or (cls.__doc__ or "").strip()
    return first_sentence(doc) if doc else cls.name


def shipped_of(name: str) -> list[Any]:
    from kit.families.shipped import ARCHITECTURES

    return [a for a in ARCHITECTURES.values() if a.family == name]


def method_support(family: Any) -> list[tuple[str, str]]:
    """(method, "" or why it is refused) for every registered method on `family`."""
    from kit.config import from_dict
    from kit.errors import ConfigError
    from kit.methods import get_method, method_names

    out = []
    for method in method_names():
        try:
            get_method(from_dict({"network_type": method}), family)
        except ConfigError as e:
            why = str(e).split(": ", 1)[-1].split("; choose another")[0]
            out.append((method, why))
            continue
        out.append((method, ""))
    return out


def shipped_defaults(name: str, hub_id: str) -> tuple[str, float, int, str]:
    """(variant, validation guidance, validation steps, distillation note) of a shipped base."""
    from kit.config import from_dict
    from kit.families import get_family

    fam = get_family(name, from_dict({"model_family": name, "pretrained_model": hub_id}))
    return (
        fam.variant_of(hub_id),
        fam.default_guidance_scale,
        fam.default_num_inference_steps,
        fam.distillation(hub_id),
    )


def read_estimates() -> dict[str, Any]:
    return json.loads(ESTIMATES.read_text(encoding="utf-8")) if ESTIMATES.is_file() else {}


def size_text(billions: tuple[float, float]) -> str:
    low, high = billions
    return f"{low:g} B" if low == high else f"{low:g}–{high:g} B"


def family_page(name: str, estimates: dict[str, Any]) -> str:
    from kit.families import family_class, get_family

    cls = family_class(name)
    fam = get_family(name)
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    controls = (
        "none"
        if not cls.control_images
        else f"up to {cls.control_images} per target, "
        + ("required (an edit model)" if cls.needs_control else "optional")
    )
    facts = [
        ("`model_family`", f"`{name}`"),
        ("variants", ", ".join(cls.variants) or "one"),
        ("base model the planner picks", f"`{cls.hub_id}`"),
        ("native resolution", f"{cls.native_resolution} px"),
        ("bucket sides", f"multiples of {cls.bucket_step} px"),
        ("drawn sizes", f"multiples of {fam.size_multiple} px"),
        ("trains on", "clips (video)" if cls.video else "images"),
        ("control images", controls),
        ("diffusers pipeline", f"`{fam.pipeline_class}`"),
        ("validation guidance (default)", f"{fam.default_guidance_scale:g}"),
        ("validation steps (default)", str(fam.default_num_inference_steps)),
        ("samplers", ", ".join(f"`{s}`" for s in fam.samplers)),
        ("default adapter targets", ", ".join(f"`{t}`" for t in fam.default_lora_targets)),
        ("text encoders (subfolders)", ", ".join(f"`{t}`" for t in fam.text_subfolders)),
    ]
    out = [
        GENERATED,
        "",
        f"# {name}",
        "",
        " ".join(doc.split("\n\n")[0].split()) if doc else "",
        "",
    ]
    out += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in facts], ""]

    out += ["## Training methods", "", "| method | on this family |", "|---|---|"]
    for method, why in method_support(fam):
        out.append(f"| `{method}` | {'yes' if not why else 'refused: ' + one_line(why)} |")
    out += [""]

    out += [
        "## Exports",
        "",
        "The formats `kit export` writes for this family, as the family declares them. Which",
        "client loads which file, and how each file is checked, is in",
        "[Exports and clients](../guides/exports.md).",
        "",
        "| format | what the family declares |",
        "|---|---|",
    ]
    for fmt in fam.export_formats:
        if fmt == "diffusers":
            text = f"`pytorch_lora_weights.safetensors`, saved and loaded by `{fam.pipeline_class}`"
        elif fmt == "kohya":
            bits = [f"denoiser keys under `{fam.kohya_prefix}_`"]
            if fam.kohya_text_prefixes:
                bits.append(
                    "text encoders under " + ", ".join(f"`{p}_`" for p in fam.kohya_text_prefixes)
                )
            else:
                bits.append("no text-encoder keys")
            reads = "yes" if fam.diffusers_reads_kohya else "no"
            bits.append(f"export check redraws it through diffusers' `load_lora_weights`: {reads}")
            bits.append("DoRA can be written" if fam.kohya_dora else "no DoRA in this layout")
            text = "; ".join(bits)
        else:
            text = ""
        out.append(f"| `{fmt}` | {text} |")
    out += [""]

    shipped = shipped_of(name)
    out += ["## Shipped configs", ""]
    if not shipped:
        out += ["None: `kit estimate` needs the base model's own configs for this family.", ""]
    else:
        out += [
            "Architectures whose configs ship with the kit (no weights), so that `kit estimate`,",
            "`kit network` and notebook 03 answer for them without a download. Any of the names",
            "selects one as `pretrained_model`.",
            "",
            "| config | model | names | denoiser | variant | guidance | steps |",
            "|---|---|---|---|---|---|---|",
        ]
        notes = []
        for a in shipped:
            variant, guidance, steps, distilled = shipped_defaults(name, a.hub_id)
            names = ", ".join(f"`{n}`" for n in a.names)
            out.append(
                f"| `{a.folder}` | {a.title} | {names} | {size_text(a.denoiser_billions)} | "
                f"{variant or '-'} | {guidance:g} | {steps} |"
            )
            if distilled:
                notes.append(f"- **{a.title}**: {one_line(distilled)}")
        out += [""]
        if notes:
            out += ["Step-distilled bases:", "", *notes, ""]

        out += ["## Memory", ""]
        rows = [(a, estimates.get(a.folder)) for a in shipped]
        if not any(r for _, r in rows):
            out += ["No estimate recorded yet: `python scripts/gen_docs.py --estimates`.", ""]
        else:
            settings = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in ESTIMATE_SETTINGS.items())
            frames = next(iter(r for _, r in rows if r)).get("num_frames")
            out += [
                f"`kit estimate` on each shipped config at its family's native resolution ({settings}"
                + (f"; clips of {frames} frames" if fam.video else "")
                + "):",
                "the training step's peak on the GPU, the cache filling's (text encoders and VAE),",
                "host RAM, and the cheapest settings the advice finds for two cards.",
                "",
                "| model | step GiB | setup GiB | host RAM GiB | "
                + " | ".join(ESTIMATE_CARDS)
                + " |",
                "|---|---|---|---|" + "---|" * len(ESTIMATE_CARDS),
            ]
            for a, r in rows:
                if not r:
                    out.append(f"| {a.title} | not estimated | | |" + " |" * len(ESTIMATE_CARDS))
                    continue
                cards = [f"`{r[c]}`" if "=" in r[c] else r[c] for c in ESTIMATE_CARDS]
                out.append(
                    f"| {a.title} | {r['step_gib']} | {r['setup_gib']} | {r['host_gib']} | "
                    + " | ".join(cards)
                    + " |"
                )
            out += [""]
    return "\n".join(out).rstrip() + "\n"


def families_index() -> str:
    out = [
        GENERATED,
        "",
        "# Model families",
        "",
        "One config and one dataset layout serve every family; a family is one folder of",
        "`kit/families/`, registered by existing, and its page here is generated from it.",
        "`kit families` prints the same list.",
        "",
        *families_table("").splitlines(),
    ]
    return "\n".join(out).rstrip() + "\n"


def families_table(prefix: str) -> str:
    """The table of families; `prefix` leads each page link (`docs/families/` from the README)."""
    from kit.families import family_class, family_names

    lines = ["| `model_family` | what it is | variants | shipped configs |", "|---|---|---|---|"]
    for name in family_names():
        cls = family_class(name)
        shipped = ", ".join(a.title for a in shipped_of(name)) or "-"
        lines.append(
            f"| [`{name}`]({prefix}{name}.md) | {one_line(family_summary(cls))} | "
            f"{', '.join(cls.variants) or '-'} | {shipped} |"
        )
    return "\n".join(lines) + "\n"


def readme_with_table(text: str) -> str:
    """The README with the families table between its markers written anew."""
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise DocsError(f"README.md: the markers {TABLE_START!r} … {TABLE_END!r} are missing")
    head = text[: start + len(TABLE_START)]
    return head + "\n" + families_table("docs/families/") + text[end:]


def mkdocs_with_nav(text: str) -> str:
    """mkdocs.yml with the site menu's family pages, between its markers, written anew."""
    from kit.families import family_names

    start, end = text.find(NAV_START), text.find(NAV_END)
    if start < 0 or end < start:
        raise DocsError(f"mkdocs.yml: the markers {NAV_START!r} … {NAV_END!r} are missing")
    indent = text[text.rfind("\n", 0, start) + 1 : start]
    entries = "".join(f"{indent}- {name}: families/{name}.md\n" for name in family_names())
    return text[: start + len(NAV_START)] + "\n" + entries + indent + text[end:]


# ---------------------------------------------------------------------------- estimates


def compute_estimates() -> dict[str, Any]:
    """`kit estimate` and its advice for every shipped architecture (slow: a trace each)."""
    from kit.config import from_dict
    from kit.families import family_info
    from kit.families.shipped import ARCHITECTURES
    from kit.preflight.advice import advise
    from kit.preflight.estimate import GIB, GPUS, estimate

    out = {}
    for folder, arch in ARCHITECTURES.items():
        resolution = family_info(arch.family).native_resolution
        cfg = from_dict(
            {
                "model_family": arch.family,
                "pretrained_model": arch.hub_id,
                "resolution": resolution,
                **ESTIMATE_SETTINGS,
            }
        )
        print(f"estimating {folder} at {resolution} px", file=sys.stderr, flush=True)
        est = estimate(cfg)
        row: dict[str, Any] = {
            "resolution": resolution,
            "num_frames": cfg.data.num_frames,
            "step_gib": round(est.total_bytes / GIB, 1),
            "setup_gib": round(est.setup_bytes / GIB, 1),
            "host_gib": round(est.host_bytes / GIB, 1),
        }
        for card in ESTIMATE_CARDS:
            if est.fits(GPUS[card]):
                row[card] = "fits as is"
                continue
            found = advise(cfg, GPUS[card], card=card, top=1)
            row[card] = found[0]["changes"] if found else "no single-card setting"
        out[folder] = row
    return out


# ---------------------------------------------------------------------------- all pages


def pages() -> dict[Path, str]:
    """Every generated file (path → text), the README's table included."""
    from kit.families import family_names

    estimates = read_estimates()
    out: dict[Path, str] = {
        DOCS / "reference" / "config.md": config_page(),
        DOCS / "families" / "index.md": families_index(),
    }
    for name in family_names():
        out[DOCS / "families" / f"{name}.md"] = family_page(name, estimates)
    out[README] = readme_with_table(README.read_text(encoding="utf-8"))
    out[MKDOCS] = mkdocs_with_nav(MKDOCS.read_text(encoding="utf-8"))
    return out


def stale() -> list[Path]:
    """The generated files whose committed text differs from what the code gives now."""
    return [
        p for p, text in pages().items() if not p.is_file() or p.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    parser.add_argument(
        "--estimates", action="store_true", help="recompute docs/families/estimates.json first"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            old = stale()
            for p in old:
                print(f"out of date: {p.relative_to(ROOT)}")
            if old:
                print("run: python scripts/gen_docs.py")
            return 1 if old else 0
        if args.estimates:
            ESTIMATES.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(compute_estimates(), indent=1, sort_keys=True) + "\n"
            ESTIMATES.write_text(text, encoding="utf-8")
        for p, text in pages().items():
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.is_file() or p.read_text(encoding="utf-8") != text:
                p.write_text(text, encoding="utf-8")
                print(f"wrote {p.relative_to(ROOT)}")
    except DocsError as e:
        print(f"gen_docs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
