"""The seven notebooks: their form (one literal parameters cell, no outputs) and a headless run."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from kit.ui.notebooks import NOTEBOOKS, notebook_dir, run_notebooks
from tests.conftest import lazy_module

nbformat = lazy_module("nbformat")

# What a newcomer should never read in a cell's output: a dataclass or object repr instead of a
# sentence, table or figure, and library warnings.
RAW_REPR = re.compile(r"\b[A-Z]\w*\(\w+=|<[\w.]+ object at 0x[0-9a-f]+>|PosixPath\(")
WARNING = re.compile(r"warn", re.IGNORECASE)


def output_noise(nb: nbformat.NotebookNode) -> list[str]:
    """Each stderr output, raw repr or warning line in the executed notebook's cells."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and out.name == "stderr":
                found.append(f"cell {i}: stderr: {out.text[:300]}")
                continue
            if out.output_type == "stream":
                text = out.text
            elif out.output_type in ("execute_result", "display_data"):
                data = out.get("data", {})
                # The plain text of a table, figure or widget is only a fallback nobody reads.
                text = "" if set(data) - {"text/plain"} else data.get("text/plain", "")
            else:
                continue
            found += [
                f"cell {i}: {line[:300]}"
                for line in text.splitlines()
                if RAW_REPR.search(line) or WARNING.search(line)
            ]
    return found


def test_the_noise_check_catches_reprs_warnings_and_stderr():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output(
            "execute_result", {"text/plain": "TrainResult(run_dir=PosixPath('/r'))"}
        ),
        nbformat.v4.new_output(
            "stream", name="stdout", text="[WARNING] Setting accelerator to CPU\n"
        ),
        nbformat.v4.new_output("stream", name="stderr", text="anything\n"),
        nbformat.v4.new_output("execute_result", {"text/plain": "<kit.x.Y object at 0x7f00>"}),
        nbformat.v4.new_output("display_data", {"text/html": "<b>t</b>", "text/plain": "<HTML>"}),
        nbformat.v4.new_output("stream", name="stdout", text="3 of 3 captions have commas\n"),
    ]
    nb.cells.append(cell)
    assert len(output_noise(nb)) == 4


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_form(name):
    nb = nbformat.read(notebook_dir() / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    for stmt in ast.parse(params[0].source).body:
        # papermill overrides by name: literal values only, each with a `# meaning` comment
        assert isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        ast.literal_eval(stmt.value)
    assert all("#" in line for line in params[0].source.splitlines() if "=" in line)
    assert all(not c.outputs and c.execution_count is None for c in code), "committed outputs"
    assert all(len(c.source.splitlines()) <= 15 for c in code), "a long cell belongs in kit/"
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 3, "markdown that teaches"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")


@pytest.mark.slow
def test_all_notebooks_run_headlessly(tmp_path, make_config, capsys):
    """`kit notebooks OUT` runs all seven in order and leaves the demo's results behind."""
    from kit.cli import main

    cfg = make_config(
        max_train_steps=6,
        checkpointing_steps=3,
        validation_steps=3,
        validation_seeds=[0, 1],
        trigger_words=["zorbic"],
    )
    out = tmp_path / "demo"
    assert (
        main(
            ["notebooks", str(out), "-p", "config_path", str(cfg), "-p", "plot_every", "2"]
            + ["-p", "drift_prompts", "4"]
        )
        == 0
    )
    for name in NOTEBOOKS:
        nb = nbformat.read(out / "notebooks" / f"{name}.ipynb", as_version=4)
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert not errors, name
        noise = output_noise(nb)
        assert not noise, f"{name} shows a newcomer noise:\n" + "\n".join(noise)
    run = out / "run"
    # 05's learning report is saved, and the command prints it at the end.
    report = json.loads((run / "learning_report.json").read_text())
    assert set(report["groups"]) == {"memorization", "generalization", "unrelated"}
    console = capsys.readouterr()
    printed = console.out
    assert "What the fine-tune learned" in printed and "concept on trigger prompts" in printed
    # Drift as distances too, on the 4 drift prompts asked for, in the console and the file.
    assert "drift of unrelated prompts (4 prompts" in printed and report["drift"]["n"] == 4
    # One line per notebook, as it ends: its name, its time and where its executed copy is.
    for name in NOTEBOOKS:
        line = next(x for x in printed.splitlines() if x.startswith(name))
        assert re.search(r"\d+\.\d s", line) and str(out / "notebooks" / f"{name}.ipynb") in line
    assert "without encryption" not in console.err, "the kernel's transport warning is back"
    # 04 draws one training step before training, and its result reads as a sentence.
    nb04 = nbformat.read(out / "notebooks/04_train.ipynb", as_version=4)
    step = next(c for c in nb04.cells if "one_step(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in step.outputs)
    # 03 estimates real architectures beside the toy one, offline.
    nb03 = nbformat.read(out / "notebooks/03_vram.ipynb", as_version=4)
    real = next(c for c in nb03.cells if "estimates_on(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in real.outputs)
    assert (run / "loss.png").is_file()
    assert (run / "validation/step-000006/grid.png").is_file()
    assert (run / "validation/step-000006-scales/grid.png").is_file()
    for fmt in ("diffusers", "kohya"):
        verify = next((run / "exports" / fmt).glob("*.verify.json"))
        assert json.loads(verify.read_text())["passed"]
    # 04 shows the live figure and 06 redraws an image with plain diffusers, identical.
    nb04 = nbformat.read(out / "notebooks/04_train.ipynb", as_version=4)
    assert any("image/png" in o.get("data", {}) for c in nb04.cells for o in c.get("outputs", []))
    nb06 = nbformat.read(out / "notebooks/06_export.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb06.cells for o in c.get("outputs", []))
    assert "largest pixel difference from the kit's own image: 0" in text


def test_unknown_notebook_selection(tmp_path):
    from kit.errors import KitError

    with pytest.raises(KitError, match="matches none"):
        run_notebooks(tmp_path, only=["99"])


def test_each_notebook_gets_only_its_parameters_and_typos_are_refused(tmp_path, monkeypatch):
    import papermill as pm

    from kit.errors import KitError

    seen = {}
    monkeypatch.setattr(
        pm, "execute_notebook", lambda src, dst, parameters, **kw: seen.update({src: parameters})
    )
    run_notebooks(tmp_path, {"max_train_steps": 3}, only=["00", "04"])
    by_name = {Path(k).stem: v for k, v in seen.items()}
    assert "max_train_steps" in by_name["04_train"] and by_name["04_train"]["headless"] is True
    assert "max_train_steps" not in by_name["00_environment"]
    assert "headless" not in by_name["00_environment"]
    with pytest.raises(KitError, match="max_train_step\\b"):
        run_notebooks(tmp_path, {"max_train_step": 3}, only=["04"])


def test_papermill_shuts_kernels_down_without_interrupting_them(monkeypatch):
    """jupyter_client interrupts (SIGINT) every kernel it shuts down, which ipykernel may log as
    "KeyboardInterrupt caught in kernel"; the kit's manager only asks it to shut down."""
    import asyncio
    import signal

    from kit.ui.notebooks import quiet_shutdown_manager

    manager = quiet_shutdown_manager()(kernel_name="python3")
    sent = []
    real = manager._async_signal_kernel

    async def record(signum):
        sent.append(signum)
        await real(signum)

    monkeypatch.setattr(manager, "_async_signal_kernel", record)

    async def start_interrupt_and_stop():
        await manager.start_kernel()
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        await manager.interrupt_kernel()  # an interrupt asked for still interrupts
        client.stop_channels()
        await manager.shutdown_kernel()

    asyncio.run(start_interrupt_and_stop())
    assert sent == [signal.SIGINT]
    assert not manager.has_kernel
