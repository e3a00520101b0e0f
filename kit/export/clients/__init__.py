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
import re
from collections.abc import Iterable

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

_RESNET_PARTS = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_BLOCK = re.compile(
    r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)$"
)
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)\.(.+)$")
_TOP = {
    "conv_in.": "input_blocks.0.0.",
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",
    "add_embedding.linear_2.": "label_emb.0.2.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
}


def ldm_unet_map(diffusers_keys: Iterable[str]) -> dict[str, str]:
    """Diffusers UNet parameter key -> the same parameter in the original (LDM) layout.

    The SD1 / SD2 / SDXL UNets are one layout in two namings: `down_blocks.i.resnets.j` is
    `input_blocks.{1 + i(L+1) + j}.0`, an up block's upsampler sits after its resnet (and its
    attention, when it has one), and so on, with L resnets per down block. L and which up blocks
    have attention are read from the keys themselves, so the map fits tiny test UNets as well.
    ComfyUI and A1111 hold the UNet in this layout, as sd-scripts does for SDXL; this is the map
    ComfyUI's `unet_to_diffusers` gives for such a UNet (pass it as ComfyUI's `aliases`).
    """
    keys = list(diffusers_keys)
    per_down = 1 + max(
        (int(m.group(4)) for k in keys if (m := _BLOCK.match(k)) and m.group(1) == "down_blocks"),
        default=-1,
    )
    if per_down == 0:
        return {}
    up_attn = {
        int(m.group(2))
        for k in keys
        if (m := _BLOCK.match(k)) and m.group(1) == "up_blocks" and m.group(3) == "attentions"
    }
    out: dict[str, str] = {}
    for key in keys:
        new = _ldm_key(key, per_down, up_attn)
        if new is not None:
            out[key] = new
    return out


def _ldm_key(key: str, per_down: int, up_attn: set[int]) -> str | None:
    for old, new in _TOP.items():
        if key.startswith(old):
            return new + key[len(old) :]
    if m := _MID.match(key):
        kind, j, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * j}.{_resnet_part(rest)}"
    m = _BLOCK.match(key)
    if not m:
        return None
    side, i, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
    if side == "down_blocks":
        if kind == "downsamplers":
            return f"input_blocks.{(i + 1) * (per_down + 1)}.0.{rest.replace('conv.', 'op.', 1)}"
        index = 1 + i * (per_down + 1) + j
    else:
        if kind == "upsamplers":
            return (
                f"output_blocks.{i * (per_down + 1) + per_down}.{2 if i in up_attn else 1}.{rest}"
            )
        index = i * (per_down + 1) + j
    if kind == "attentions":
        return f"{'input' if side == 'down_blocks' else 'output'}_blocks.{index}.1.{rest}"
    return f"{'input' if side == 'down_blocks' else 'output'}_blocks.{index}.0.{_resnet_part(rest)}"


def _resnet_part(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESNET_PARTS.get(head, head)}.{tail}" if tail else _RESNET_PARTS.get(head, head)
