"""Test helper: the diffusers → LDM naming of an SD UNet, worked out from the keys alone.

An implementation independent of `kit.families.ldm` (which derives the names from the UNet's
config): the client tests use it as ComfyUI's `unet_to_diffusers` and as the LDM model naming
of A1111 and sd-scripts, and a test checks that the two agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

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
