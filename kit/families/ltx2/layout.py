"""LTX-2's transformer in its original layout: the names Lightricks' checkpoints and ComfyUI use.

ComfyUI loads LTX-2 as `LTXAVModel` (`comfy/ldm/lightricks/av_model.py`, read at commit
2fb2e7567fc2 of comfyanonymous/ComfyUI, and `CrossAttention` in `comfy/ldm/lightricks/model.py`):
the same blocks as diffusers (`transformer_blocks.N.{attn1, attn2, audio_attn1, audio_attn2,
audio_to_video_attn, video_to_audio_attn}.{to_q, to_k, to_v, to_out.0}`, `ff`, `audio_ff`),
with the top-level modules and a few parameters under their original names. The renaming is
diffusers' own, read backwards: `_convert_non_diffusers_ltx2_lora_to_diffusers` (diffusers'
`loaders/lora_conversion_utils.py`) maps original LoRA keys onto the diffusers transformer, and a
test checks that it brings every name written here back.
"""

from __future__ import annotations

import torch

TOP = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single",
    "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "prompt_adaln": "prompt_adaln_single",  # LTX-2.3
    "audio_prompt_adaln": "audio_prompt_adaln_single",
}
"""Top-level modules: diffusers name → original name."""
PART = {
    "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
    "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
    "norm_q": "q_norm",
    "norm_k": "k_norm",
}
"""Names inside the blocks: diffusers → original."""


def original_name(path: str) -> str:
    """A diffusers transformer path (module or parameter) under its original name."""
    head, *rest = path.split(".")
    return ".".join([TOP.get(head, head), *(PART.get(p, p) for p in rest)])


def to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformer's state dict under the original names."""
    return {original_name(k): v for k, v in state.items()}
