"""Notebooks on Colab and headless: a badge per notebook, Colab-only installs, `headless` injected."""

from __future__ import annotations

import re

import nbformat
import pytest

from kit.ui.notebooks import NOTEBOOKS, notebook_dir, run_notebooks

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
    assert repos == {"kit-project/diffusion-tuning-kit"}


@pytest.mark.parametrize("name", ["00_environment", "04_train"])
def test_colab_install_cell_runs_only_on_colab(name):
    cells = [c for c in _read(name).cells if c.cell_type == "code" and "google.colab" in c.source]
    assert len(cells) == 1
    lines = cells[0].source.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if "))
    assert 'if "google.colab" in sys.modules:' in lines[guard]
    assert "import sys" in lines[:guard]
    body = lines[guard + 1 :]
    assert any("%pip install" in line for line in body)
    assert all(line.startswith("    ") for line in body), "everything after the guard is Colab-only"
    assert "train(" not in cells[0].source and "TrainPanel" not in cells[0].source


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
