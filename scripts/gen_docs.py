"""Write the documentation pages that are read off the code: one per model family, the config
reference, and the families table of the README.

    python scripts/gen_docs.py               # (re)write the pages under docs/ and the README table
    python scripts/gen_docs.py --check       # exit 1, naming the pages, when any is out of date
    python scripts/gen_docs.py --estimates   # also recompute docs/families/estimates.json (slow)

Families are read through the registry and their class attributes, shipped architectures
through `kit.families.shipped`, the config through its dataclasses and the docstring under
each field: nothing here names a family or a key. A config key without a docstring stops the
script, naming it. The memory estimates take a traced step and the advice's
searches per shipped architecture (about five minutes for all of them on two busy cores), so
they are computed only on request and kept in `estimates.json`, which the pages are drawn from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs_config, beside this script

from docs_config import (  # noqa: E402
    GENERATED,
    DocsError,
    config_page,
    first_sentence,
    one_line,
)

DOCS = ROOT / "docs"
ESTIMATES = DOCS / "families" / "estimates.json"
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
NAV_START = "# families: written by scripts/gen_docs.py"
NAV_END = "# end of families"
TABLE_START = "<!-- families table: written by scripts/gen_docs.py -->"
TABLE_END = "<!-- end of families table -->"

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


def compute_estimates(folders: list[str] | None = None) -> dict[str, Any]:
    """`kit estimate` and its advice for the shipped architectures `folders` (all by default;
    slow: a trace each)."""
    from kit.config import from_dict
    from kit.families import family_info
    from kit.families.shipped import ARCHITECTURES
    from kit.preflight.advice import advise
    from kit.preflight.estimate import GIB, GPUS, estimate

    out = {}
    for folder, arch in ARCHITECTURES.items():
        if folders is not None and folder not in folders:
            continue
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
        from kit.families.shipped import ARCHITECTURES

        # A new shipped architecture gets its row here; --estimates recomputes every row.
        known = {} if args.estimates else read_estimates()
        missing = [f for f in ARCHITECTURES if f not in known]
        if missing:
            ESTIMATES.parent.mkdir(parents=True, exist_ok=True)
            rows = {**known, **compute_estimates(missing)}
            ESTIMATES.write_text(
                json.dumps(rows, indent=1, sort_keys=True) + "\n", encoding="utf-8"
            )
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
