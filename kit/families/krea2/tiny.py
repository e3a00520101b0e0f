"""The tiny random-init Krea 2 (Raw) the tests load back through `from_pretrained`.

Every part keeps the release's structure at a few dozen channels: the transformer's grouped-query
attention (2 heads over 1 key/value head), its two layer-wise and two refiner text-fusion blocks
(ComfyUI's model assumes two of each), a two-layer Qwen3-VL whose embedding output and both
layers are tapped, the Qwen-Image VAE's 8x layout, and the release's scheduler config.
"""

from __future__ import annotations

from typing import Any

import torch

from kit.families import tiny
from kit.families.qwen_image.family import tiny_qwen2_tokenizer, tiny_qwen3_vl_config
from kit.families.shipped import config_source

HUB_ID = "krea/Krea-2-Raw"
TAPS = (0, 1, 2)
"""The tiny text encoder's tapped hidden states (embedding output and its two layers)."""


def qwen3_vl(tokenizer: Any) -> Any:
    """A two-layer `Qwen3VLModel` (`tiny_qwen3_vl_config`) sized to `tokenizer`."""
    from transformers import Qwen3VLModel

    config = tiny_qwen3_vl_config(
        tokenizer,
        text={},
        # A small patch and position table: the tower is never run, only saved and loaded.
        vision={"patch_size": 2, "num_position_embeddings": 16},
    )
    return Qwen3VLModel(config)


def parts(seed: int = 0) -> tuple[Any, ...]:
    """The tiny Krea 2 Raw's parts, in the order of the family's table (transformer, VAE, text
    encoder, tokenizer, scheduler); its pipeline taps `TAPS`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = tiny_qwen2_tokenizer()
    text_encoder = qwen3_vl(tokenizer)
    vae = tiny.wan_vae("AutoencoderKLQwenImage")  # Qwen-Image's tiny VAE, 8x as the release
    transformer = Krea2Transformer2DModel(
        in_channels=64,  # 16 latent channels × a 2×2 patch
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        timestep_embed_dim=16,
        text_hidden_dim=32,  # the Qwen3-VL width
        num_text_layers=len(TAPS),
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=32,
        axes_dims_rope=(4, 6, 6),  # sums to the head width; ComfyUI's split of 16
    )
    # Random weights for the zero-initialised tables and norms too, so that a wrong layout
    # of any of them shows.
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "scale_shift_table" in name or "norm" in name:
                p.normal_(0, 0.1)
    # The release's scheduler config (dynamic exponential shift up to 6400 tokens).
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        FlowMatchEulerDiscreteScheduler.load_config(config_source(HUB_ID), subfolder="scheduler")
    )
    return transformer, vae, text_encoder, tokenizer, scheduler
