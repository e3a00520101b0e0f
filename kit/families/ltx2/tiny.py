"""The tiny random-init LTX-2: every part of `LTX2Pipeline` at a few kilobytes to a few MB.

The layout is the released one (32x spatial, 8x temporal video VAE with 4x4 pixel patches; a
causal audio VAE over stereo mel spectrograms; Gemma 3 with a vision tower; the text connectors;
the vocoder), only narrow. The audio VAE's `base_channels` equals its packed latent width
(latent channels × latent mel bins), as in the release (128 = 8 × 16): the pipeline normalises
packed audio latents by per-feature statistics of that length.
"""

from __future__ import annotations

from typing import Any

import torch

from kit.families import tiny


def parts(seed: int = 0) -> tuple[Any, ...]:
    """The tiny LTX-2's parts, in the order of the family's table."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    tokenizer = tiny.t5_tokenizer("AutoTokenizer")
    tokenizer.model_max_length = 1024  # the pipeline's `max_sequence_length`
    width, layers = 16, 2
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        sliding_window=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    )
    vae = AutoencoderKLLTX2Video(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False,) * 4,
        downsample_type=("spatiotemporal",) * 3 + ("spatial",),
        upsample_type=("spatiotemporal",) * 3,
        upsample_residual=(True,) * 3,
        upsample_factor=(2, 2, 2),
        patch_size=4,
        decoder_causal=False,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=16,
        ch_mult=(1, 2, 4),
        num_res_blocks=1,
        latent_channels=4,
        mel_bins=16,
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=16,  # 4 latent channels × 4 latent mel bins
        audio_out_channels=16,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=width,
    )
    connectors = LTX2TextConnectors(
        caption_channels=width,
        text_proj_in_factor=layers + 1,  # Gemma's hidden states: the embeddings and each layer
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,  # LTX-2.0: both connectors as wide as Gemma
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 16,  # stereo × mel bins
        hidden_channels=16,
        upsample_kernel_sizes=[8, 8, 15],
        upsample_factors=[4, 4, 15],  # 240: 100 mel frames a second → 24 kHz
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1]],
        output_sampling_rate=24000,
    )
    # Dynamic exponential shift between 0.95 at 1024 tokens and 2.05 at 4096: the values
    # LTX2Pipeline falls back to when a scheduler config has none.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
    )
    return transformer, vae, audio_vae, text_encoder, tokenizer, connectors, vocoder, scheduler
