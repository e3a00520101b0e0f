"""The run archive (`archive.json`): what a run was, in one file, so that runs can be compared."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kit.config import flat_config
from kit.errors import KitError
from kit.io import sha256_file, write_json, write_with
from kit.report.plots import smooth
from kit.run.env import devices, versions
from kit.run.folder import RunDir, open_run

ARCHIVE_FILE = RunDir(Path()).archive.name
SCHEMA = 1
# Keys that name where a run lives rather than how it trained: every pair of runs differs there.
RUN_IDENTITY_KEYS = ("output_dir",)


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


def kit_version() -> str | None:
    """The installed version of the kit, or None when it runs from an uninstalled checkout."""
    from importlib import metadata

    try:
        return metadata.version("diffusion-tuning-kit")
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the kit's source checkout, or None outside git (e.g. a wheel install)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Package versions and the GPU that trained (None on a CPU)."""
    dev = devices()[0]
    return {"versions": versions(), "gpu": None if dev["device"] == "cpu" else dev["name"]}


def _dataset(run: RunDir, config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's files with their hashes, named relative to their image folder (and, with
    several datasets, by dataset, with its repeats and role)."""
    if not run.manifest.is_file():
        return {"manifest": None, "manifest_sha256": None, "files": []}
    flat = flat_config(config)
    folders = {
        str(d.get("name") or Path(str(d.get("image_dir", ""))).name): d.get("image_dir")
        for d in flat.get("datasets") or []
    }
    rows = json.loads(run.manifest.read_text())
    files = []
    for r in rows:
        name = Path(r["image"])
        image_dir = folders.get(r["dataset"]) if "dataset" in r else flat.get("image_dir")
        # Relative names let two runs on copies of one dataset in other folders compare equal.
        if image_dir:
            try:
                name = name.relative_to(image_dir)
            except ValueError:
                pass
        row = {"file": name.as_posix(), "sha256": r["sha256"], "caption": r.get("caption")}
        row.update({k: r[k] for k in ("dataset", "role", "repeats") if k in r})
        files.append(row)
    return {
        "manifest": run.manifest.name,
        "manifest_sha256": sha256_file(run.manifest),
        "files": files,
    }


VALIDATION_FILES = frozenset({".png", ".webp", ".mp4"})
"""What validation draws: images and frame strips, and a clip's animated WebP and MP4."""


def _validation(run: RunDir) -> list[dict[str, str]]:
    if not run.validation.is_dir():
        return []
    return [
        {"path": p.relative_to(run.root).as_posix(), "sha256": sha256_file(p)}
        for p in sorted(run.validation.rglob("*"))
        if p.suffix in VALIDATION_FILES and not p.name.startswith(".")
    ]


def _loss(run: RunDir) -> dict[str, Any]:
    history = [[r["step"], r["loss"]] for r in run.read_metrics() if "loss" in r]
    if not history:
        return {"history": [], "final": None, "min": None, "min_step": None}
    min_step, min_loss = min(history, key=lambda h: h[1])
    return {"history": history, "final": history[-1][1], "min": min_loss, "min_step": min_step}


def build_archive(
    run_dir: str | Path,
    *,
    started: float | None = None,
    ended: float | None = None,
    error: BaseException | str | None = None,
    interrupted: bool = False,
) -> dict[str, Any]:
    """Collect the archive of a run folder (times are Unix seconds, when known)."""
    run = open_run(run_dir)
    config = json.loads(run.config.read_text())
    status = "failed" if error is not None else "interrupted" if interrupted else "finished"
    return {
        "schema": SCHEMA,
        "run_dir": str(run.root),
        "status": status,
        "error": None if error is None else str(error) or type(error).__name__,
        "kit": {"version": kit_version(), "git_commit": git_commit()},
        "time": {
            "start": _iso(started),
            "end": _iso(ended),
            "duration_s": None if started is None or ended is None else round(ended - started, 3),
        },
        "config": config,
        "dataset": _dataset(run, config),
        "validation": _validation(run),
        "loss": _loss(run),
        "environment": environment(),
    }


def write_archive(
    run_dir: str | Path,
    *,
    started: float | None = None,
    error: BaseException | str | None = None,
    interrupted: bool = False,
) -> Path | None:
    """Write `archive.json` in the run folder; never raises (None on failure), so no run is lost."""
    try:
        archive = build_archive(
            run_dir, started=started, ended=time.time(), error=error, interrupted=interrupted
        )
        path = RunDir(Path(run_dir)).archive
        write_json(path, archive)
        return path
    except Exception:
        return None


def load_archive(run_dir: str | Path) -> dict[str, Any]:
    """A run's archive; collected from the folder when the run predates archives."""
    path = RunDir(Path(run_dir)).archive
    if not path.is_file():
        return build_archive(run_dir)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KitError(f"{path} is not valid JSON ({e}); delete it to rebuild it") from None


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    """Keys whose values differ between two saved configs, with both values (`[a, b]`)."""
    fa, fb = flat_config(a), flat_config(b)
    return {
        k: [fa.get(k), fb.get(k)]
        for k in sorted(fa.keys() | fb.keys())
        if k not in RUN_IDENTITY_KEYS and fa.get(k) != fb.get(k)
    }


def dataset_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[str]]:
    """Files only in run B (added), only in run A (removed), or in both with other bytes/caption."""
    fa = {f["file"]: f for f in a["files"]}
    fb = {f["file"]: f for f in b["files"]}
    changed = [
        name
        for name in sorted(fa.keys() & fb.keys())
        if (fa[name]["sha256"], fa[name]["caption"]) != (fb[name]["sha256"], fb[name]["caption"])
    ]
    return {
        "added": sorted(fb.keys() - fa.keys()),
        "removed": sorted(fa.keys() - fb.keys()),
        "changed": changed,
    }


def compare(run_a: str | Path, run_b: str | Path) -> dict[str, Any]:
    """What differs between two runs: config, dataset and losses."""
    a, b = load_archive(run_a), load_archive(run_b)
    summary = {
        k: {key: arc["loss"][key] for key in ("final", "min", "min_step")}
        | {"steps": len(arc["loss"]["history"]), "status": arc.get("status")}
        for k, arc in (("a", a), ("b", b))
    }
    return {
        "runs": {"a": str(run_a), "b": str(run_b)},
        "config": config_diff(a["config"], b["config"]),
        "dataset": dataset_diff(a["dataset"], b["dataset"]),
        "loss": summary,
        "history": {"a": a["loss"]["history"], "b": b["loss"]["history"]},
    }


def plot_comparison(result: dict[str, Any], path: str | Path) -> Path:
    """Both runs' loss curves side by side on one y scale, as a PNG (atomic)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, key in zip(axes, ("a", "b"), strict=True):
        history = result["history"][key]
        steps = [s for s, _ in history]
        loss = [v for _, v in history]
        ax.plot(steps, loss, alpha=0.35, label="loss")
        if loss:
            ax.plot(steps, smooth(loss), label="smoothed")
        other = result["history"]["b" if key == "a" else "a"]
        if other:  # the other run's smoothed curve, for reading the difference in one panel
            ax.plot(
                [s for s, _ in other],
                smooth([v for _, v in other]),
                "--",
                color="grey",
                label=f"{'B' if key == 'a' else 'A'} smoothed",
            )
        ax.set_title(f"{key.upper()}: {Path(result['runs'][key]).name}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    axes[0].set_ylabel("loss")
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return Path(path)


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as text for a terminal."""
    lines = [f"A: {result['runs']['a']}", f"B: {result['runs']['b']}", "", "config:"]
    if result["config"]:
        width = max(len(k) for k in result["config"])
        for k, (va, vb) in result["config"].items():
            lines.append(f"  {k:<{width}}  {json.dumps(va)} → {json.dumps(vb)}")
    else:
        lines.append("  same")
    lines.append("dataset:")
    ds = result["dataset"]
    if any(ds.values()):
        for what in ("added", "removed", "changed"):
            if ds[what]:
                lines.append(f"  {what} ({len(ds[what])}): {', '.join(ds[what][:10])}")
    else:
        lines.append("  same files")
    lines.append("loss:")
    for key in ("a", "b"):
        s = result["loss"][key]
        if s["final"] is None:
            lines.append(f"  {key.upper()}: no logged steps")
        else:
            lines.append(
                f"  {key.upper()}: final {s['final']:.4f}, min {s['min']:.4f} "
                f"at step {s['min_step']} ({s['steps']} logged steps, {s['status']})"
            )
    return "\n".join(lines)
