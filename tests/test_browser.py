"""The notebooks in a real JupyterLab, driven by headless Chromium: what a user clicks, works.

Needs Debian's `chromium` (`make test` installs it when run as root) and the `playwright` pip
package (dev extra); the browser is the system's, never one downloaded by playwright.
Screenshots go to $KIT_SCREENSHOTS, else to the test's temporary folder
(`/tmp/pytest-of-$USER/pytest-N/test_each_notebook_after_run_a0/screenshots/NN_name.png`, one
per notebook after Run All; each test prints its folder, shown with `pytest -s` or in a
failure's report). pytest keeps only its last three such folders, so set KIT_SCREENSHOTS to
keep them past later runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import lazy_module

nbformat = lazy_module("nbformat")

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

START_S = 90  # JupyterLab's first start builds nothing, but imports a lot on 2 busy cores
RUN_ALL_S = 300  # the slowest notebook here, run to its last cell
TRAIN_S = 300  # a few steps and one validation image on the toy model


@dataclass
class Lab:
    """A running JupyterLab: where to reach it and what it serves."""

    url: str
    token: str
    root: Path

    def notebook_url(self, relative: str) -> str:
        # `reset` starts from an empty workspace, whatever an earlier session left open.
        return f"{self.url}/lab/tree/{relative}?token={self.token}&reset"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(folder: Path) -> None:
    """User settings: every cell rendered (no windowing), kernels started unasked, no pop-ups."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {
            "autoStartDefaultKernel": True
        },
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
    }
    for name, value in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(value))


@pytest.fixture(scope="module")
def chromium() -> str:
    """The system Chromium, or a skip that says how to get it."""
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    path = shutil.which("chromium")
    if path is None:
        pytest.skip(
            "Debian's chromium is not installed: `make test` installs it when run as root, "
            "or run apt-get install chromium"
        )
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium) -> Lab:
    """JupyterLab on a free loopback port, serving copies of the notebooks and example data."""
    root = tmp_path_factory.mktemp("lab")
    # The notebooks refer to ../datasets_example and ../models; copies keep the repo untouched.
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    shutil.copytree(ROOT / "datasets_example", root / "datasets_example")
    (root / "models").symlink_to(ROOT / "models")  # read only: the toy base model
    home = root / ".home"
    _settings(home / "settings")
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        # Nothing from the user's own Jupyter setup (kernels, passwords, extensions) leaks in.
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "IPYTHONDIR": str(home / "ipython"),
        "XDG_CACHE_HOME": str(home / "cache"),  # the kit's latent cache, among others
        "OMP_NUM_THREADS": "1",  # the notebooks' tiny models run fastest on one thread
    }
    port, token = _free_port(), os.urandom(16).hex()
    log = open(root / "jupyterlab.log", "wb")  # closed in the finalizer
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.terminals_enabled=False",
            # CI containers run as root; the server refuses that unless told.
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited: {(root / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer on {url} within {START_S} s")
                time.sleep(0.5)
        yield Lab(url, token, root)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def browser(chromium):
    """Headless system Chromium through Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: Chromium's sandbox refuses to run as root, which CI containers are.
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    """A fresh browser tab with a large window (every cell visible in the screenshots)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


@pytest.fixture()
def shots(tmp_path) -> Path:
    """Folder of the screenshots: $KIT_SCREENSHOTS, else the test's temporary folder."""
    folder = Path(os.environ.get("KIT_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {folder}")
    return folder


def open_and_run_all(page, lab: Lab, relative: str) -> None:
    """Open a notebook, wait for its kernel, Run All from the menu, wait for the last cell."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(lab.notebook_url(relative))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=START_S * 1000)
    select = page.locator(".jp-Dialog button", has_text="Select")
    try:  # only where the kernel is not started unasked
        select.wait_for(timeout=5_000)
        select.click()
    except PlaywrightTimeout:
        pass
    page.wait_for_function(
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar').innerText)",
        timeout=START_S * 1000,
    )
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    # Every code cell shows an execution count once run; `[*]` while running or queued.
    page.wait_for_function(
        """() => {
            const p = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt')];
            return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent));
        }""",
        timeout=RUN_ALL_S * 1000,
    )
    tracebacks = page.locator(".jp-OutputArea-output", has_text="Traceback").all_inner_texts()
    assert not tracebacks, f"{relative} raised:\n" + "\n".join(t[-1500:] for t in tracebacks)


def notebook_screenshot(page, path: Path) -> None:
    """The whole notebook in one image: the window is made as tall as the notebook's content
    (JupyterLab scrolls inside its panel, so a full-page shot alone shows the first screen)."""
    height = page.evaluate(
        """() => Math.max(...[...document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer, .jp-NotebookPanel .jp-Notebook')]
            .map(e => e.scrollHeight), 1000)"""
    )
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": min(height + 200, 30_000)})
    # Run All leaves the notebook scrolled to its last cell: start the picture at the title.
    page.evaluate(
        """() => document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer, .jp-NotebookPanel .jp-Notebook')
            .forEach(e => { e.scrollTop = 0; })"""
    )
    page.wait_for_timeout(500)
    try:
        page.screenshot(path=str(path), full_page=True)
    finally:
        page.set_viewport_size(size)


def _image_src(locator) -> str | None:
    return locator.get_attribute("src") if locator.count() else None


def test_vram_explorer_redraws_when_the_slider_moves(lab, page, shots):
    """Notebook 03: Run All, then the resolution slider, moved by keyboard, redraws the chart."""
    open_and_run_all(page, lab, "notebooks/03_vram.ipynb")
    page.screenshot(path=str(shots / "03_run_all.png"), full_page=True)

    slider = page.locator(".widget-slider", has=page.locator("label", has_text="resolution"))
    slider.scroll_into_view_if_needed()
    interact = page.locator(".widget-interact", has=slider)
    chart = interact.locator(".jp-OutputArea-output img").last
    # interact_manual draws on its button; a live `interactive` draws by itself.
    run_button = interact.locator("button", has_text="Run Interact")

    def redraw() -> None:
        if run_button.count():
            run_button.click()

    redraw()
    chart.wait_for(timeout=RUN_ALL_S * 1000)
    before = _image_src(chart)
    readout = slider.locator(".widget-readout")
    value = readout.inner_text()

    slider.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "([el, v]) => el.textContent.trim() !== v",
        arg=[readout.element_handle(), value.strip()],
        timeout=10_000,
    )
    assert int(readout.inner_text()) > int(value), "the arrow keys did not raise the resolution"
    redraw()
    page.wait_for_function(
        """([box, src]) => {
            const imgs = box.querySelectorAll('.jp-OutputArea-output img');
            return imgs.length > 0 && imgs[imgs.length - 1].src !== src;
        }""",
        arg=[interact.element_handle(), before],
        timeout=RUN_ALL_S * 1000,
    )
    interact.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "03_after_slider.png"), full_page=True)
    assert _image_src(chart) != before


def set_parameters(nb: nbformat.NotebookNode, **values: object) -> None:
    """Set values in the notebook's `parameters` cell, in place, as a user would type them."""
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for name, value in values.items():
        pattern = re.compile(rf"^{name} = .*$", re.MULTILINE)
        assert pattern.search(cell.source), f"no parameter {name!r} in the parameters cell"
        cell.source = pattern.sub(f"{name} = {value!r}  # set by the test", cell.source)


def _short_run_notebook(lab: Lab, tmp_path: Path) -> str:
    """A copy of notebook 04 parameterized for a few steps into a temporary run folder."""
    example = json.loads((lab.root / "datasets_example/config.json").read_text())
    example.update(
        max_train_steps=6,
        checkpointing_steps=3,
        validation_steps=0,  # one validation image set, at the end
        validation_prompt=["a large red zorbstar on a white background, in the center"],
        validation_seeds=[0],
        validation_num_inference_steps=2,
        cache_dir=str(tmp_path / "cache"),
    )
    (lab.root / "datasets_example/browser.json").write_text(json.dumps(example, indent=1))
    nb = nbformat.read(lab.root / "notebooks/04_train.ipynb", as_version=4)
    set_parameters(
        nb,
        config_path="../datasets_example/browser.json",
        output_dir=str(tmp_path / "run"),
        resume="",
        plot_every=1,
    )
    nbformat.write(nb, lab.root / "notebooks/04_browser.ipynb")
    return "notebooks/04_browser.ipynb"


def test_each_notebook_after_run_all(lab, page, shots, tmp_path):
    """All seven, in order, on a short run: Run All raises nothing; a screenshot of each, for a
    person to read as a newcomer would."""
    from kit.ui.notebooks import NOTEBOOKS

    _short_run_notebook(lab, tmp_path)  # writes the short config, browser.json
    common = {
        "config_path": "../datasets_example/browser.json",
        "output_dir": str(tmp_path / "run"),
    }
    extra = {
        "04_train": {"headless": True, "resume": ""},
        "05_validate": {"seeds": 2, "prompts_per_group": 1},
    }
    for name in NOTEBOOKS:
        nb = nbformat.read(lab.root / f"notebooks/{name}.ipynb", as_version=4)
        set_parameters(nb, **common, **extra.get(name, {}))
        nbformat.write(nb, lab.root / f"notebooks/{name}_shot.ipynb")
        open_and_run_all(page, lab, f"notebooks/{name}_shot.ipynb")
        notebook_screenshot(page, shots / f"{name}.png")
    assert sorted(p.stem for p in shots.glob("*.png")) == sorted(NOTEBOOKS)


def test_train_panel_runs_to_the_end(lab, page, shots, tmp_path):
    """Notebook 04: Run All, click Start; the bar reaches its end and the live image changes."""
    open_and_run_all(page, lab, _short_run_notebook(lab, tmp_path))
    panel = page.locator(".kit-train-panel").first
    panel.scroll_into_view_if_needed()
    live = page.locator(".kit-live-plot img, img.kit-live-plot").first
    before = _image_src(live)
    page.screenshot(path=str(shots / "04_before_start.png"), full_page=True)

    panel.locator("button", has_text=re.compile(r"^\s*Start\s*$")).click()
    panel.get_by_text(re.compile(r"finished at step 6/6")).wait_for(timeout=TRAIN_S * 1000)
    bar = panel.locator(".widget-hprogress", has=page.locator("label", has_text="steps"))
    page.wait_for_function(
        "el => el.querySelector('.progress-bar').style.width === '100%'",
        arg=bar.element_handle(),
        timeout=30_000,
    )
    page.wait_for_function(
        "([el, src]) => el.getAttribute('src') && el.getAttribute('src') !== src",
        arg=[live.element_handle(), before],
        timeout=60_000,
    )
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "04_after_training.png"), full_page=True)
    assert (tmp_path / "run/logs/metrics.jsonl").is_file()
    assert (tmp_path / "run/checkpoints").is_dir()
    assert json.loads((tmp_path / "run/archive.json").read_text())["status"] == "finished"
