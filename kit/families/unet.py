"""The base of the UNet families, SD 1.x / 2.x and SDXL: what their DDPM training, CLIP prompts,
latent shapes and kohya naming share. Each family sets its parts and writes what differs."""

from __future__ import annotations

from typing import Any

import torch

from kit.families import tiny
from kit.families.base import Family, NoiseDraw
from kit.families.parts import Part, denoiser, scheduler, text, vae
from kit.families.samplers import DDPM_SAMPLERS

TINY_UNET: dict[str, Any] = {
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "norm_num_groups": 32,
}
"""The tiny UNet's sizes: 16x16 latents of 4 channels, two one-layer levels; a family adds its
block types, attention and conditioning."""


def unet_parts(*encoders: Part) -> tuple[Part, ...]:
    """A UNet family's parts: the UNet, the VAE, the first CLIP text encoder (SD 2's OpenCLIP
    is the same class) and then `encoders`, and the DDPM schedule training noise is drawn from."""
    return (
        denoiser("UNet2DConditionModel", "unet"),
        vae(),
        *text("CLIPTextModel", "CLIPTokenizer", trainable=True),
        *encoders,
        scheduler("DDPMScheduler"),
    )


class LatentDiffusion(Family):
    """A Stable Diffusion UNet family: epsilon or v on a DDPM schedule, CLIP prompts padded to
    the tokenizer's context, latents 8x smaller than the image, LoRA on the attention."""

    samplers = DDPM_SAMPLERS
    size_multiple = 8
    bucket_step = 64
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    kohya_prefix = "lora_unet"
    diffusers_reads_kohya = True

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        return self.ddpm_draw(comps, latents, generator)

    def clip_ids(self, tokenizer: Any, captions: list[str], device: Any) -> torch.Tensor:
        """The token ids of `captions`, padded and cut to the tokenizer's context as the
        pipelines' `encode_prompt` does."""
        return tokenizer(
            captions,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(device)

    def meta_latents(
        self, parts: dict, batch: int, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta-device latents of an image this size and their timesteps, the UNet's two
        positional inputs, for `denoiser_inputs`."""
        unet, vae = parts["denoiser"], parts["vae"]
        f = 2 ** (len(vae.config.block_out_channels) - 1)
        c = unet.config.in_channels
        latents = torch.zeros(batch, c, height // f, width // f, device="meta")
        steps = torch.zeros(batch, dtype=torch.long, device="meta")
        return latents, steps


def tiny_vae(**extra: Any) -> Any:
    """The tiny AutoencoderKL both families use: 8x, 4 latent channels (`extra`: the family's
    own scaling)."""
    return tiny.autoencoder_kl(
        block_out_channels=(16, 32, 32, 32), latent_channels=4, sample_size=128, **extra
    )


def sd_schedule(cls: type, **extra: Any) -> Any:
    """A scheduler `cls` on the noise schedule the released SD 1.x and SDXL models train with
    (scaled-linear betas, 0.00085 to 0.012, epsilon); `extra`: the sampler's own settings."""
    return cls(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        prediction_type="epsilon",
        **extra,
    )
