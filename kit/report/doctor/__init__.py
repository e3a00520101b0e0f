"""The doctor: read a run folder (logs, checkpoints, validation images, data manifest) and list
what went wrong, most serious first, each finding with its evidence and the usual fix.

Cheap and safe on a half-written run: every check reads what is there, skips what is not, and a
check that fails becomes an `info` finding instead of an exception. `write_report` is what the
end of every training run calls; it writes `doctor.json` in the run folder.

The checks live by kind: `training` (the loss, resumes, memory), `data` (buckets and captions)
and `images` (validation images and held-out loss); `run` reads the folder they all look at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from kit.io import write_json
from kit.report.doctor import data, images, training
from kit.report.doctor.findings import SEVERITIES, Finding, format_findings, rows, serious
from kit.report.doctor.run import RunRecord
from kit.run.folder import RunDir

__all__ = [
    "CHECKS",
    "SEVERITIES",
    "Check",
    "Finding",
    "RunRecord",
    "diagnose",
    "format_findings",
    "rows",
    "serious",
    "write_report",
]

Check = Callable[[RunRecord], Iterator[Finding]]
CHECKS: tuple[Check, ...] = (*training.CHECKS, *data.CHECKS, *images.CHECKS)
"""Every check, in the order findings of one severity are listed. A new check is a function in
the module of its kind, added to that module's `CHECKS`."""


def diagnose(run_dir: str | Path, error: str | None = None) -> list[Finding]:
    """Every finding for the run folder, most serious first; never raises.

    `error` is the message that stopped training, if any; without it, the one `write_report`
    stored in an earlier `doctor.json` is used while the log has not moved past it.
    """
    root = Path(run_dir)
    if error is None:
        error = _stored_error(root)
    run = RunRecord(root, error)
    findings: list[Finding] = []
    if not run.dir.config.is_file():
        findings.append(
            Finding(
                "not_a_run",
                "info",
                f"{root} has no {run.dir.config.name} yet",
                ["checks that need the config use the defaults"],
                "point the doctor at the output_dir of a run",
            )
        )
    for check in CHECKS:
        try:
            findings += list(check(run))
        except Exception as e:  # a half-written run must not break the report
            findings.append(
                Finding(
                    "check_failed",
                    "info",
                    f"the {check.__name__} check could not run",
                    [f"{type(e).__name__}: {e}"],
                    "",
                )
            )
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def _stored_error(root: Path) -> str | None:
    try:
        run = RunDir(root)
        old = json.loads(run.doctor_report.read_text())
        err, at = old.get("error"), old.get("step")
        metrics = run.read_metrics()
        last = metrics[-1].get("step") if metrics else 0
        return err if err and (at is None or last <= at) else None
    except Exception:
        return None


def write_report(run_dir: str | Path, error: BaseException | str | None = None) -> Path | None:
    """Diagnose the run and write `doctor.json` in its folder; never raises (None on failure)."""
    try:
        run = RunDir(Path(run_dir))
        text = None if error is None else str(error) or type(error).__name__
        findings = diagnose(run.root, text)
        metrics = run.read_metrics()
        write_json(
            run.doctor_report,
            {
                "step": metrics[-1].get("step") if metrics else 0,
                "error": text,
                "counts": {s: sum(f.severity == s for f in findings) for s in SEVERITIES},
                "findings": [f.to_dict() for f in findings],
            },
        )
        return run.doctor_report
    except Exception:
        return None
