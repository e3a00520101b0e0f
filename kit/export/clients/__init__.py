"""How the inference clients load an adapter file, each read from that client's own rules.

An exported adapter is only as good as what ComfyUI, A1111, kohya's sd-scripts or the LyCORIS
package make of it. Each module here (`comfyui`, `a1111`, `sdscripts`, `lycoris`) has one
`apply(tensors, metadata, model, *, strength=1.0, aliases=None) -> Applied` that matches the
file's keys to the model the way that client does, computes the patched weights with that
client's arithmetic (its alpha scaling, its DoRA normalisation, its broadcasting) and reports
every key the client would leave unread and everything it would refuse or silently get wrong.
Verifying an export is then: for each client, the weights it ends up with equal the weights the
kit trained, nothing is unconsumed and nothing is warned about.

`model` is the model's state dict in that client's own naming; each module's docstring says
which. (`lycoris.apply` also takes `merge=True`: what LyCORIS' `merge_to` writes, which differs
from its forward.) This package only holds what the readers share; import the client modules themselves.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Applied:
    """What one client does with one adapter file."""

    client: str
    merged: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Model weight key -> the weight after the patch (float32); only the keys it patched."""
    unconsumed: list[str] = dataclasses.field(default_factory=list)
    """File keys the client would ignore (sorted). The kit treats any as a failure."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What the client would refuse, mis-broadcast, drop silently, or print."""

    @property
    def clean(self) -> bool:
        """Every key was read and nothing was refused or mis-read."""
        return not self.unconsumed and not self.warnings


class Fatal(Exception):
    """Where the client itself would abort loading the whole file (an exception it lets out)."""


def failed(client: str, tensors: dict[str, torch.Tensor], reason: str) -> Applied:
    """The result of a load the client aborts: nothing patched, every key unread."""
    return Applied(client, {}, sorted(tensors), [reason])


def f32(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy: every client computes its patches in float32 (or we compare in it)."""
    return t.detach().to(torch.float32).clone()


def shape(t: torch.Tensor | torch.Size | tuple[int, ...]) -> str:
    """`(4, 8, 3, 3)` for messages."""
    dims = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
    return "(" + ", ".join(str(d) for d in dims) + ")"


def row_norm(w: torch.Tensor) -> torch.Tensor:
    """‖W‖ per output row (over every other axis), shaped (out, 1, ..., 1)."""
    return w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *[1] * (w.dim() - 1))


def col_norm(w: torch.Tensor) -> torch.Tensor:
    """‖W‖ per input column (over the output and spatial axes), shaped (1, in, 1, ..., 1)."""
    cols = w.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1)
    return cols.reshape(1, w.shape[1], *[1] * (w.dim() - 2))


def ratio_note(client: str, key: str, magnitude: torch.Tensor, norm: torch.Tensor) -> str | None:
    """A warning when `dora_scale / norm` broadcasts beyond the norm's own shape.

    That is the silent failure: the division succeeds, yet each weight is scaled by a magnitude
    meant for another row or column.
    """
    try:
        out = torch.broadcast_shapes(magnitude.shape, norm.shape)
    except RuntimeError:
        return None  # the client raises; its caller reports that instead
    if tuple(out) == tuple(norm.shape):
        return None
    return (
        f"{client}: {key}: dora_scale {shape(magnitude)} against its per-"
        f"{'row' if norm.shape[0] != 1 else 'column'} norm {shape(norm)} broadcasts to "
        f"{shape(out)}; the magnitudes land on the wrong weights"
    )


def scalar(t: torch.Tensor) -> float:
    """A stored `alpha` / `scale` as a float."""
    return float(t.detach().float().reshape(-1)[0])


# ------------------------------------------------------------------ the LDM UNet layout
