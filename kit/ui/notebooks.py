"""The seven notebooks: run them headlessly with papermill, and keep their Colab cells in step.

Every notebook opens in its own Colab runtime, so each must install the kit before its first
`import kit`. That install cell cannot call the kit (it is not installed yet), so its text is
defined once here and written into every notebook by `sync_colab_cells`
(`python scripts/sync_notebooks.py`); a test checks that no notebook differs from it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.errors import KitError

NOTEBOOKS = (
    "00_environment",
    "01_captions",
    "02_buckets",
    "03_vram",
    "04_train",
    "05_validate",
    "06_export",
)


DEFAULT_REPOSITORY = "kit-project/diffusion-tuning-kit"
"""The kit's GitHub repository (owner/name), unless `KIT_REPO` names another (a fork)."""
REPO_ENV = "KIT_REPO"
REPOSITORY = os.environ.get(REPO_ENV) or DEFAULT_REPOSITORY
"""The repository that the Colab badges open and the install cell clones by default: the one
place that names it. `KIT_REPO=owner/name python scripts/sync_notebooks.py` points a fork's
notebooks at the fork; on Colab, `KIT_REPO` set before the install cell runs wins again."""
CLONE_DIR = "/content/diffusion-tuning-kit"
"""Where the install cell clones the repository on a Colab machine (whatever its name)."""
COLAB_TAG = "colab"
"""Tag of the cells that follow each notebook's title: a note, then the install cell."""
COLAB_NOTE = """On Google Colab the next cell fetches the kit with its example dataset and installs
it (Colab already has PyTorch). Anywhere else it does nothing."""
COLAB_INSTALL = f"""import os
import sys

if "google.colab" in sys.modules:  # Colab only
    repo = os.environ.get("{REPO_ENV}", "{REPOSITORY}")  # owner/name on GitHub
    !git clone --quiet --depth 1 https://github.com/{{repo}} {CLONE_DIR}
    %pip install --quiet {CLONE_DIR}
    %cd {CLONE_DIR}/notebooks"""
"""The install cell: plain text, since it runs before the kit exists on the machine (so it
reads `KIT_REPO` itself; IPython puts `{{repo}}` into the shell line)."""
BADGE = re.compile(
    r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
    r"\(https://colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/blob/main/notebooks/"
    r"\w+\.ipynb\)"
)
"""The "Open in Colab" badge in each notebook's title cell."""


def badge(name: str) -> str:
    """The Colab badge of notebook `name`, opening it from `REPOSITORY`."""
    return (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{REPOSITORY}/blob/main/notebooks/{name}.ipynb)"
    )


def notebook_dir() -> Path:
    """The `notebooks/` folder beside the `kit` package."""
    path = Path(__file__).resolve().parents[2] / "notebooks"
    if not path.is_dir():
        raise KitError(f"notebooks folder not found at {path}; run from a clone of the repository")
    return path


def run_notebooks(
    out_dir: str | Path,
    params: dict[str, Any] | None = None,
    only: list[str] | None = None,
    report: Callable[[str], None] | None = print,
) -> list[Path]:
    """Execute the notebooks into `out_dir/notebooks`; the run itself goes to `out_dir/run`.

    `report` gets one line per notebook as it finishes (name, seconds, executed copy); None
    says nothing.
    """
    import papermill as pm

    out = Path(out_dir).resolve()
    # No front end clicks Start here: notebooks with a `headless` parameter run their work in
    # the cell itself.
    params = {"output_dir": str(out / "run"), "headless": True, **(params or {})}
    for key in ("config_path", "output_dir"):
        if key in params and params[key]:
            params[key] = str(Path(params[key]).resolve())
    names = [n for n in NOTEBOOKS if not only or any(n.startswith(o) for o in only)]
    if not names:
        raise KitError(f"--only {only} matches none of {', '.join(NOTEBOOKS)}")
    src = notebook_dir()
    # Each notebook gets the parameters it declares; a name no notebook declares is a typo.
    declared = {n: set(pm.inspect_notebook(str(src / f"{n}.ipynb"))) for n in names}
    unknown = sorted(set(params) - {"output_dir", "headless"} - set().union(*declared.values()))
    if unknown:
        raise KitError(f"no notebook has the parameter(s) {', '.join(unknown)}")
    done = []
    for name in names:
        target = out / "notebooks" / f"{name}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            pm.execute_notebook(
                str(src / f"{name}.ipynb"),
                str(target),
                parameters={k: v for k, v in params.items() if k in declared[name]},
                cwd=str(src),
                kernel_name="python3",
                progress_bar=False,
                report_mode=False,
                config=_kernel_config(),
                kernel_manager_class=quiet_shutdown_manager(),
            )
        except pm.PapermillExecutionError as e:
            raise KitError(
                f"notebook {name} failed in cell {e.exec_count}: {e.ename}: {e.evalue} "
                f"(executed copy: {target})"
            ) from None
        done.append(target)
        if report is not None:
            report(f"{name:<16} {time.monotonic() - started:6.1f} s   {target}")
    return done


def quiet_shutdown_manager() -> type:
    """The kernel manager papermill runs each notebook with: jupyter_client's own, except that it
    does not interrupt a kernel it is shutting down.

    jupyter_client sends SIGINT before every shutdown request. A kernel that papermill shuts down
    has finished its last cell, so there is nothing to interrupt; but when the signal lands while
    ipykernel is between messages, it logs "KeyboardInterrupt caught in kernel" at ERROR level,
    a line on the console between two notebooks that says nothing about them.
    """
    from jupyter_client import AsyncKernelManager

    class QuietShutdown(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

        interrupt_kernel = _async_interrupt_kernel

    return QuietShutdown


def _kernel_config() -> Any:
    """Kernel manager settings for headless runs: encrypted kernel traffic where possible.

    ipykernel warns at every start that its TCP sockets are unencrypted; the kernel manager can
    hand it CurveZMQ keys instead (when pyzmq has CurveZMQ and the kernel declares support),
    which removes the cause rather than hiding the warning.
    """
    import zmq
    from traitlets.config import Config

    policy = "auto" if zmq.has("curve") else "disabled"
    return Config({"KernelManager": {"transport_encryption": policy}})


def colab_cells() -> list[dict[str, Any]]:
    """The note and the install cell that follow every notebook's title, as notebook JSON."""
    return [
        {
            "cell_type": "markdown",
            "id": "colab-note",
            "metadata": {"tags": [COLAB_TAG]},
            "source": COLAB_NOTE.splitlines(keepends=True),
        },
        {
            "cell_type": "code",
            "execution_count": None,
            "id": "colab-install",
            "metadata": {"tags": [COLAB_TAG]},
            "outputs": [],
            "source": COLAB_INSTALL.splitlines(keepends=True),
        },
    ]


def sync_colab_cells(write: bool = True) -> list[str]:
    """Make the cells tagged `COLAB_TAG` in every notebook `colab_cells()`, right after the title,
    and the title's Colab badge open the notebook from `REPOSITORY`.

    Returns the notebooks that differed; with `write=False` nothing is changed (a check).
    """
    changed = []
    for name in NOTEBOOKS:
        path = notebook_dir() / f"{name}.ipynb"
        text = path.read_text(encoding="utf-8")
        nb = json.loads(text)
        rest = [c for c in nb["cells"] if COLAB_TAG not in c["metadata"].get("tags", [])]
        title = "".join(rest[0]["source"])
        if BADGE.search(title):  # the badge opens this notebook from REPOSITORY
            title = BADGE.sub(badge(name), title)  # a URL: no backslashes to escape
            rest[0]["source"] = title.splitlines(keepends=True)
        nb["cells"] = rest[:1] + colab_cells() + rest[1:]
        new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        if new != text:
            changed.append(name)
            if write:
                path.write_text(new, encoding="utf-8")
    return changed
