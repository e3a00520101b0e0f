"""An exported adapter file checked by each client's own loading rules (`kit.export.clients`).

The base model is put into the naming each client holds it in (`Family.client_models`); the
file is applied with that client's rules; the result must equal peft's merge of the trained
adapter, put into the same naming, on every weight the adapter changes, with every file key
read. A method names the clients that cannot represent what it trained (`Method.client_gaps`):
those are measured and reported, and the others must be exact.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kit.export.clients import a1111, comfyui, lycoris, sdscripts
from kit.export.merge import merge_adapters
from kit.families import Components, Family
from kit.methods.base import Method

READERS = {
    comfyui.CLIENT: comfyui.apply,
    a1111.CLIENT: a1111.apply,
    sdscripts.CLIENT: sdscripts.apply,
    lycoris.CLIENT: lycoris.apply,
}
"""Client name → its reader."""

MAX_CHECKED_PARAMETERS = 4_000_000_000
"""Bases larger than this are not copied into every client's naming at export (it would hold
several full copies in memory); the test suite checks their layouts on tiny models."""


@dataclass
class ClientCheck:
    """How one client loads one file."""

    client: str
    exact: bool
    """Every file key read and every changed weight equal to peft's merge."""
    weights: int = 0
    """Weights the adapter changes."""
    missed: list[str] = field(default_factory=list)
    """Weights the adapter changes that the client leaves as they were."""
    unconsumed: list[str] = field(default_factory=list)
    """File keys the client does not read."""
    max_relative_error: float = 0.0
    """The largest |client − peft| / max|peft| over the changed weights."""
    warnings: list[str] = field(default_factory=list)
    known_gap: str = ""
    """Why this method's result cannot be exact in this client (the check still measures it)."""
    skipped: str = ""
    """Why this client was not checked."""
    part: str = ""
    """The model of the denoiser the file is for, where it is several (`Family.denoiser_files`)."""

    @property
    def passed(self) -> bool:
        return self.exact or bool(self.known_gap) or bool(self.skipped)


def tolerance(tensors: dict[str, torch.Tensor]) -> float:
    """The relative error a file's dtype allows: its rounding, with room for the arithmetic."""
    half = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors.values())
    return 1e-2 if half else 1e-4


def _changed(base: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        k: v for k, v in merged.items() if k in base and not torch.equal(base[k].float(), v.float())
    }


def check_file(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    family: Family,
    method: Method,
    base: Components,
    trained: dict[str, torch.Tensor],
) -> list[ClientCheck]:
    """Apply the file with every client that reads this family's kohya files; compare each
    result with peft's merge of `trained` on `base` (which is left unchanged)."""
    size = sum(p.numel() for p in base.denoiser.parameters())
    models = family.client_models(base)
    if size > MAX_CHECKED_PARAMETERS:
        why = f"a {size / 1e9:.0f}B-parameter base is not copied per client at export"
        return [ClientCheck(c, False, skipped=why) for c in models]
    merged = copy.deepcopy(base)
    method.attach(merged)
    method.load_state_dict(merged, trained)
    merge_adapters(merged, 1.0, tuple(family.text_subfolders))
    expected_models = family.client_models(merged)
    gaps = method.client_gaps()
    allowed = tolerance(tensors)
    checks = []
    for client, entry in models.items():
        if isinstance(entry, str):
            checks.append(ClientCheck(client, False, skipped=entry))
            continue
        model, aliases = entry
        expected = _changed(model, expected_models[client][0])
        applied = READERS[client](tensors, metadata, model, aliases=aliases)
        missed, worst = [], 0.0
        for key, want in expected.items():
            got = applied.merged.get(key)
            if got is None:
                missed.append(key)
                continue
            scale = float(want.float().abs().max()) or 1.0
            worst = max(worst, float((got.float() - want.float()).abs().max()) / scale)
        # A weight the client changes that peft's merge leaves alone is an error too.
        for key, got in applied.merged.items():
            if key not in expected and key in model:
                scale = float(model[key].float().abs().max()) or 1.0
                worst = max(worst, float((got.float() - model[key].float()).abs().max()) / scale)
        exact = not missed and not applied.unconsumed and worst <= allowed
        checks.append(
            ClientCheck(
                client,
                exact,
                weights=len(expected),
                missed=sorted(missed),
                unconsumed=list(applied.unconsumed),
                max_relative_error=worst,
                warnings=list(applied.warnings),
                known_gap="" if exact else gaps.get(client, ""),
            )
        )
    return checks


def summary(checks: list[ClientCheck]) -> str:
    """One line per client, for the console and the export's verification record."""
    lines = []
    for c in checks:
        if c.skipped:
            lines.append(f"{c.client}: not checked ({c.skipped})")
        elif c.exact:
            lines.append(f"{c.client}: loads every key; equals the trained weights")
        else:
            what = []
            if c.unconsumed:
                what.append(f"{len(c.unconsumed)} keys unread (e.g. {c.unconsumed[0]})")
            if c.missed:
                what.append(f"{len(c.missed)} of {c.weights} weights unchanged")
            what.append(f"relative error {c.max_relative_error:.2g}")
            note = f" — {c.known_gap}" if c.known_gap else ""
            lines.append(f"{c.client}: {'; '.join(what)}{note}")
    return "\n".join(lines)


def as_records(checks: list[ClientCheck]) -> list[dict[str, Any]]:
    """The checks as JSON-able records (the first few keys of long lists)."""
    out = []
    for c in checks:
        record = asdict(c)
        for key in ("missed", "unconsumed", "warnings"):
            record[key] = record[key][:5]
        record["passed"] = c.passed
        out.append(record)
    return out
