"""A finding: what the doctor saw, how serious, the evidence and the usual fix; and the ways of
showing a list of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("error", "warning", "info")
"""`error`: the run is broken; `warning`: the result is likely worse than it should be;
`info`: worth knowing, often by design."""


@dataclass
class Finding:
    """One diagnosis: what, how sure, the evidence and the usual fix."""

    code: str
    severity: str
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        """As plain data."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"[{self.severity}] {self.title}"]
        lines += [f"    - {e}" for e in self.evidence]
        if self.fix:
            lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


def serious(findings: list[Finding]) -> list[Finding]:
    """The errors and warnings."""
    return [f for f in findings if f.severity in ("error", "warning")]


def rows(findings: list[Finding]) -> list[dict[str, str]]:
    """Table rows for a notebook: severity, finding, evidence, fix."""
    return [
        {
            "severity": f.severity,
            "finding": f.title,
            "evidence": "; ".join(f.evidence),
            "fix": f.fix,
        }
        for f in findings
    ]


def format_findings(findings: list[Finding]) -> str:
    """The findings as text, or a line saying there are none."""
    if not findings:
        return "no findings: nothing in this run looks wrong"
    return "\n".join(str(f) for f in findings)
