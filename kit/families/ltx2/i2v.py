"""LTX-2 image-to-video: a clip's frame conditions the rest, as `LTX2ImageToVideoPipeline` does.

The same base draws text-to-video and image-to-video; a run trains image-to-video when it sets
`condition_frame` (the frame of each window that conditions it; 0 is the pipeline's task: the
first). The pipeline (diffusers 0.42, `pipeline_ltx2_image2video.py`) re-compresses the image
with H.264 at the CRF its text encoder's generation was trained with (33 for Gemma 3, through
PyAV), resizes and normalises it with its video processor, encodes it alone through the VAE
(its mode) and normalises it; those latents are the first latent frame of the noisy input, whose
tokens get timestep 0 (the sound's keep the step's). Training builds the same from the
window's conditioning frame, handed over as the PIL image a user would give, and caches it with
the clip's latents; the loss leaves the first latent frame out, as the pipeline keeps it.

Validation draws each `validation_prompts` entry from its image, given as the entry's one
`control` image (`validation_prompts: [{prompt: ..., control: [first_frame.png]}]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kit.errors import ConfigError, KitError

PIPELINE = "LTX2ImageToVideoPipeline"
CONDITION = "condition_latents"
"""The latent entry's key of the conditioning image's latents, (C, 1, h, w)."""


def check_run(frame: int | None, cfg: Any, frames: int) -> None:
    """Refuse what an image-to-video run cannot do, when the config is read."""
    if frame is None:
        return
    if frame < 0 or frame >= max(frames, 1):
        raise ConfigError(
            f"condition_frame: {frame} is not a frame of a {frames}-frame training window "
            f"(0 to {frames - 1})"
        )
    data, v = cfg.data, cfg.validation
    if data.control_dir or any(d.control_dir or d.control_column for d in data.datasets):
        raise ConfigError(
            "control_dir: image-to-video conditions each clip on its own frame "
            "(condition_frame); remove control_dir (or a dataset's control_column)"
        )
    if v.validation_prompt:
        raise ConfigError(
            "validation_prompt: image-to-video draws each prompt from an image; write "
            "validation_prompts: [{prompt: ..., control: [image]}] instead"
        )


def image_crf(text_encoder: Any) -> int:
    """The CRF the pipeline re-compresses the image with for this text encoder."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    return int(resolve_default_image_crf(text_encoder))


def as_image(pixels: torch.Tensor, frame: int) -> Any:
    """Frame `frame` of a clip's pixels (1, 3, F, H, W) in [-1, 1] as an RGB PIL image."""
    from PIL import Image

    x = pixels[0, :, frame] if pixels.ndim == 5 else pixels[0]
    x = ((x.float().cpu() + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(x.permute(1, 2, 0).numpy())


def conditioning(vae: Any, pixels: torch.Tensor, frame: int, crf: int) -> dict[str, torch.Tensor]:
    """The conditioning latents of a window and its loss mask (the first latent frame out)."""
    from diffusers import LTX2ImageToVideoPipeline
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    image = as_image(pixels, frame)
    if crf:
        try:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        except ImportError as e:
            raise KitError(
                f"LTX-2 image-to-video re-compresses its image as the pipeline does (H.264, "
                f"CRF {crf}), which needs PyAV: `pip install av` (the kit's `video` extra) ({e})"
            ) from None
    h, w = pixels.shape[-2:]
    processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio)
    image = processor.preprocess(image, height=h, width=w).to(vae.device, vae.dtype)
    with torch.no_grad():
        latents = vae.encode(image.unsqueeze(2)).latent_dist.mode()
    latents = LTX2ImageToVideoPipeline._normalize_latents(
        latents, vae.latents_mean, vae.latents_std
    )
    frames = pixels.shape[2] if pixels.ndim == 5 else 1
    f = (frames - 1) // vae.temporal_compression_ratio + 1
    mask = torch.ones(1, f, *latents.shape[-2:])
    mask[:, 0] = 0.0  # the pipeline keeps the image's latents there: no loss
    return {CONDITION: latents[0].float(), "loss_mask": mask}


def inputs(noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict, p: int, pt: int) -> Any:
    """The noisy latents with the image's in the first latent frame, and the per-token video
    timesteps (0 on those tokens), as the pipeline's denoising loop feeds them."""
    from diffusers import LTX2ImageToVideoPipeline

    image = cond[CONDITION].to(noisy)
    noisy = torch.cat([image, noisy[:, :, 1:]], dim=2)
    b, _, f, h, w = noisy.shape
    mask = torch.zeros(b, 1, f, h, w, device=noisy.device, dtype=torch.float32)
    mask[:, :, 0] = 1.0
    mask = LTX2ImageToVideoPipeline._pack_latents(mask, p, pt).squeeze(-1)
    return noisy, timesteps.unsqueeze(-1) * (1 - mask)
