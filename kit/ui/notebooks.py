"""Run the seven notebooks headlessly with papermill, in order, with shared parameters."""

from __future__ import annotations

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


def notebook_dir() -> Path:
    """The `notebooks/` folder beside the `kit` package."""
    path = Path(__file__).resolve().parents[2] / "notebooks"
    if not path.is_dir():
        raise KitError(f"notebooks folder not found at {path}; run from a clone of the repository")
    return path


def run_notebooks(
    out_dir: str | Path, params: dict[str, Any] | None = None, only: list[str] | None = None
) -> list[Path]:
    """Execute the notebooks into `out_dir/notebooks`; the run itself goes to `out_dir/run`."""
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
        try:
            pm.execute_notebook(
                str(src / f"{name}.ipynb"),
                str(target),
                parameters={k: v for k, v in params.items() if k in declared[name]},
                cwd=str(src),
                kernel_name="python3",
                progress_bar=False,
                report_mode=False,
            )
        except pm.PapermillExecutionError as e:
            raise KitError(
                f"notebook {name} failed in cell {e.exec_count}: {e.ename}: {e.evalue} "
                f"(executed copy: {target})"
            ) from None
        done.append(target)
    return done
