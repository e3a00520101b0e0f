"""Notebooks on Colab and headless: a badge per notebook, one Colab install cell, `headless` injected."""

from __future__ import annotations

import re

import pytest

from kit.ui.notebooks import (
    COLAB_INSTALL,
    COLAB_NOTE,
    COLAB_TAG,
    NOTEBOOKS,
    REPOSITORY,
    notebook_dir,
    run_notebooks,
    sync_colab_cells,
)
from tests.conftest import lazy_module

nbformat = lazy_module("nbformat")

BADGE = re.compile(
    r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
    r"\(https://colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/main/notebooks/"
    r"([\w]+)\.ipynb\)"
)


def _read(name: str):
    return nbformat.read(notebook_dir() / f"{name}.ipynb", as_version=4)


def test_every_notebook_opens_itself_in_colab_from_one_repository():
    repos = set()
    for name in NOTEBOOKS:
        match = BADGE.search(_read(name).cells[0].source)
        assert match, f"{name}: no Colab badge in the first cell"
        assert match.group(2) == name
        repos.add(match.group(1))
    assert repos == {REPOSITORY}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_installs_the_kit_on_colab_before_using_it(name):
    # Each notebook opens in a runtime of its own, so each installs the kit itself.
    cells = _read(name).cells
    tagged = [c for c in cells if COLAB_TAG in c.metadata.get("tags", [])]
    assert [c.source for c in tagged] == [COLAB_NOTE, COLAB_INSTALL]
    assert cells[1:3] == tagged, "the note and install cell come right after the title"
    installs = [c for c in cells if c.cell_type == "code" and "%pip install" in c.source]
    assert installs == tagged[1:], "no other cell installs anything"


def test_the_install_cell_is_written_from_its_one_definition():
    assert sync_colab_cells(write=False) == [], "run python scripts/sync_notebooks.py"


def test_the_install_cell_runs_only_on_colab():
    lines = COLAB_INSTALL.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if "))
    assert 'if "google.colab" in sys.modules:' in lines[guard]
    assert "import sys" in lines[:guard]
    body = lines[guard + 1 :]
    assert any("%pip install" in line for line in body)
    # The repository is read at run time (KIT_REPO), defaulting to the one the kit names.
    assert any(f'os.environ.get("KIT_REPO", "{REPOSITORY}")' in line for line in body)
    assert any("github.com/{repo}" in line for line in body)
    assert all(line.startswith("    ") for line in body), "everything after the guard is Colab-only"
    assert "kit" not in "".join(lines[: guard + 1]), "the kit is not installed yet"


def test_train_notebook_mounts_drive_on_colab_before_choosing_the_run_folder():
    cells = [c for c in _read("04_train").cells if c.cell_type == "code"]
    mount = next(i for i, c in enumerate(cells) if "drive.mount" in c.source)
    lines = cells[mount].source.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if "))
    assert lines[guard].startswith("if in_colab():")
    assert all(line.startswith("    ") for line in lines[guard + 1 :] if line)
    assert "train(" not in cells[mount].source and "TrainPanel" not in cells[mount].source
    chooses = next(i for i, c in enumerate(cells) if "default_output_dir(" in c.source)
    assert mount < chooses


def test_train_notebook_has_a_headless_switch_off_by_default():
    nb = _read("04_train")
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert "headless = False" in params.source


def test_the_runner_injects_headless(tmp_path, monkeypatch):
    import papermill as pm

    seen = []
    monkeypatch.setattr(
        pm, "execute_notebook", lambda src, dst, **kw: seen.append(kw["parameters"])
    )
    run_notebooks(tmp_path, {"plot_every": 2}, only=["04"])
    assert seen == [{"output_dir": str(tmp_path / "run"), "headless": True, "plot_every": 2}]
    seen.clear()
    run_notebooks(tmp_path, {"headless": False}, only=["04"])  # an explicit choice wins
    assert seen[0]["headless"] is False


def test_kit_repo_names_the_repository_of_badges_and_install_cell(monkeypatch):
    import importlib

    import kit.ui.notebooks as notebooks

    monkeypatch.setenv("KIT_REPO", "someone/fork")
    try:
        fork = importlib.reload(notebooks)
        assert fork.REPOSITORY == "someone/fork"
        assert "github/someone/fork/blob/main/notebooks/04_train.ipynb" in fork.badge("04_train")
        assert '"KIT_REPO", "someone/fork"' in fork.COLAB_INSTALL
        assert fork.sync_colab_cells(write=False) == list(NOTEBOOKS)  # each would be rewritten
    finally:
        monkeypatch.delenv("KIT_REPO")
        importlib.reload(notebooks)
    assert notebooks.REPOSITORY == notebooks.DEFAULT_REPOSITORY
