"""The documentation: generated pages match the code, every key and family has its place, links
resolve, and the README stays one screenful. The site build itself runs in `make docs`."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _gen_docs()
docs_config = sys.modules["docs_config"]  # the config reference's half, imported by gen_docs


def test_generated_pages_are_current():
    stale = [str(p.relative_to(ROOT)) for p in gen_docs.stale()]
    assert not stale, f"out of date: {stale}; run python scripts/gen_docs.py"


def _section(page: str, heading: str) -> str:
    """The text of `page` from `heading` to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = page.index(f"\n{heading}\n")
    rest = page[start + len(heading) + 2 :]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
    return rest[: ends[0]] if ends else rest


def test_every_config_key_has_its_line():
    from kit.config import SECTIONS

    page = (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    seen = list(SECTIONS.values())
    for cls in SECTIONS.values():
        docs_config.records(cls, seen)
    headings = {cls: f"## {sec}" for sec, cls in SECTIONS.items()}
    headings.update({cls: f"### {cls.__name__}" for cls in seen[len(SECTIONS) :]})
    assert len(headings) > len(SECTIONS), "the nested entries (datasets, prompts) are listed too"
    for cls, heading in headings.items():
        text = _section(page, heading)
        for f in dataclasses.fields(cls):
            line = re.search(rf"^\| `{f.name}` \| (.+)$", text, re.M)
            assert line, f"{heading}: no line for {f.name}"
            cells = [c.strip() for c in line.group(1).split(" | ")]
            assert cells[-1].rstrip(" |"), f"{f.name}: no description"


def test_a_key_without_a_docstring_stops_the_reference():
    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: int = 2

    with pytest.raises(docs_config.DocsError, match=r"bare .*no docstring"):
        docs_config.field_rows(Section, {}, "section")


def test_ranges_are_the_ones_the_checks_enforce():
    from kit.config import DataConfig, ObjectiveConfig, TrainConfig

    assert docs_config.probed_range(DataConfig, {}, "resolution", int) == "≥ 32"
    assert docs_config.probed_range(DataConfig, {}, "tag_dropout", float) == "≥ 0, < 1"
    assert docs_config.probed_range(TrainConfig, {}, "learning_rate", float) == "> 0"
    assert docs_config.probed_range(ObjectiveConfig, {}, "max_timestep", int) == "≥ 1, ≤ 1000"
    assert docs_config.probed_range(TrainConfig, {}, "seed", int) == ""


def test_every_family_has_a_page_in_the_menu_and_the_readme():
    from kit.families import family_names

    menu = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in family_names():
        page = DOCS / "families" / f"{name}.md"
        assert page.is_file(), f"no page for family {name}"
        assert f"# {name}\n" in page.read_text(encoding="utf-8")
        assert f"families/{name}.md" in menu, f"{name} is not in the site's menu"
        assert f"](docs/families/{name}.md)" in readme, f"{name} is not in the README's table"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return LINK.findall(text)


def _anchors(path: Path) -> set[str]:
    """The ids MkDocs gives the headings of a page (lowercase, punctuation dropped)."""
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return out


def _resolves(source: Path, target: str) -> str | None:
    """Why the relative link `target` of `source` points nowhere, or None."""
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    # The executed notebooks are copied in by `make docs`; their sources are in notebooks/.
    if not dest.exists() and dest.parent == (DOCS / "notebooks").resolve():
        dest = ROOT / "notebooks" / dest.name
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        return f"no heading #{anchor}"
    return None


def test_relative_links_of_the_readme_and_the_docs_resolve():
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            why = _resolves(page, target)
            if why:
                broken.append(f"{page.relative_to(ROOT)}: {target} ({why})")
    assert not broken, broken


def test_the_site_menu_names_pages_that_exist():
    menu = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    entries = re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.(?:md|ipynb))\s*$", menu, re.M)
    assert len(entries) > 20
    missing = [e for e in entries if _resolves(DOCS / "index.md", e)]
    assert not missing, missing


def test_the_readme_is_one_screenful():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_the_readme_picture_is_small():
    picture = DOCS / "assets" / "demo.png"
    assert picture.stat().st_size < 150_000
