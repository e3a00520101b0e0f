"""Wan image-to-video: a clip's frame conditions the rest, built as `WanImageToVideoPipeline`.

The pipeline (diffusers 0.42.1, `pipeline_wan_i2v.py`) conditions in one of two ways, and which
one a base takes is read from its configs, never from its name:

* Wan 2.1 I2V and Wan 2.2 I2V A14B: the transformer takes more channels than it returns
  (`in_channels` 36 = 16 noisy + 4 mask + 16 condition). The image followed by zeros for the
  other frames goes through the VAE (its mode), normalised; a mask marks the first latent frame
  (in the pipeline's layout: one channel per frame the VAE folds into a latent frame), and mask
  and condition are concatenated on channels after the noisy latents. Wan 2.1's transformer
  also attends to the image's CLIP tokens (`image_dim` set; `encoder_hidden_states_image`, the
  penultimate hidden states of the base's `CLIPVisionModel`); Wan 2.2's has no image encoder.
* Wan 2.2 TI2V-5B (`expand_timesteps`): the image alone goes through the VAE and replaces the
  first latent frame of the noisy input; that frame's tokens get timestep 0 through the mask,
  and the pipeline keeps the image's latents there at the end. So the loss is on the other
  frames only (a `loss_mask` with the first latent frame 0). TI2V-5B trains text-to-video
  unless `condition_frame` is set.

Training builds these with the pipeline's own `prepare_latents` and `encode_image` on the
clip's conditioning frame (`condition_frame`, default the first), handed to them as the PIL
image a user would give the pipeline, and caches them with the clip's latents; `predict` then
assembles the transformer's input as the denoising loop does. With `condition_frame` k > 0 the
window still starts at its own first frame: the model learns to continue from an image that is
frame k of what it draws, which the pipeline (always its first frame) never asks for; 0 is the
pipeline's task.

Validation draws each `validation_prompts` entry from its image, given as the entry's one
`control` image (`validation_prompts: [{prompt: ..., control: [first_frame.png]}]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kit.errors import ConfigError, KitError
from kit.families import tiny
from kit.families.shipped import config_source
from kit.families.wan.experts import read_index

PIPELINE = "WanImageToVideoPipeline"
IMAGE_TOKENS = 257
"""CLIP ViT-H/14 tokens of a 224-pixel image (16 × 16 patches and the class token)."""


@dataclass(frozen=True)
class ImageToVideo:
    """How a base is conditioned on an image (see the module's text)."""

    first_frame: bool
    """TI2V-5B: the image's latents replace the first latent frame (`expand_timesteps`)."""
    image_encoder: bool
    """Wan 2.1 I2V: the transformer also attends to the image's CLIP tokens."""
    frame: int
    """The frame of each training window that conditions it (`condition_frame`)."""


def transformer_config(source: str) -> dict[str, Any]:
    """The base's transformer config.json ({} where there is none)."""
    from diffusers import WanTransformer3DModel

    for sub in ("transformer", "transformer_2"):
        try:
            return dict(WanTransformer3DModel.load_config(config_source(source), subfolder=sub))
        except (OSError, ValueError):
            continue
    return {}


def conditioned(source: str) -> bool:
    """Whether the base's transformer takes conditioning channels (Wan 2.1 / 2.2 I2V)."""
    config = transformer_config(source) if read_index(source) else {}
    channels, out = config.get("in_channels"), config.get("out_channels")
    return channels is not None and channels > (out or channels)


def read_i2v(source: str, condition_frame: int | None) -> ImageToVideo | None:
    """The image conditioning a run on base `source` trains, None for text-to-video; refuses
    an image-to-video base without conditioning frames and `condition_frame` where none is."""
    index = read_index(source)
    if not index:
        return None
    frame = condition_frame or 0
    if index.get("expand_timesteps"):  # TI2V-5B: both tasks, image-to-video when asked
        return None if condition_frame is None else ImageToVideo(True, False, frame)
    if conditioned(source):
        image = transformer_config(source).get("image_dim") is not None
        encoder = index.get("image_encoder") or [None]
        if image and (encoder[0] is None or not (index.get("image_processor") or [None])[0]):
            raise KitError(
                f"{source}: its transformer attends to CLIP image tokens (image_dim), but its "
                "model_index.json names no image_encoder and image_processor; use the base's "
                "complete diffusers folder (Wan 2.1 I2V ships both)"
            )
        return ImageToVideo(False, image, frame)
    if index.get("_class_name") == PIPELINE:
        raise KitError(
            f"{source}: model_index.json names {PIPELINE}, but its transformer takes no "
            "conditioning frames (in_channels equals out_channels) and it has no "
            "expand_timesteps; the kit cannot train image-to-video on it"
        )
    if condition_frame is not None:
        raise ConfigError(
            f"condition_frame: {condition_frame}, but {source} is a text-to-video base (no "
            "conditioning channels, no expand_timesteps); remove condition_frame"
        )
    return None


def check_run(i2v: ImageToVideo | None, cfg: Any, frames: int) -> None:
    """Refuse what an image-to-video run cannot do, when the config is read."""
    if i2v is None:
        return
    if i2v.frame < 0 or i2v.frame >= max(frames, 1):
        raise ConfigError(
            f"condition_frame: {i2v.frame} is not a frame of a {frames}-frame training window "
            f"(0 to {frames - 1})"
        )
    data = cfg.data
    if data.control_dir or any(d.control_dir or d.control_column for d in data.datasets):
        raise ConfigError(
            "control_dir: image-to-video conditions each clip on its own frame "
            "(condition_frame); remove control_dir (or a dataset's control_column)"
        )
    v = cfg.validation
    if (data.image_dir or data.datasets) and not v.validation_prompts:
        raise ConfigError(
            "validation_prompts: image-to-video draws each prompt from an image; give "
            "validation_prompts: [{prompt: ..., control: [image]}] (the image is the clip's "
            "first frame)"
        )
    if v.validation_prompt:
        raise ConfigError(
            "validation_prompt: image-to-video draws each prompt from an image; write "
            "validation_prompts: [{prompt: ..., control: [image]}] instead"
        )
    for i, entry in enumerate(v.validation_prompts):
        if len(entry.control) != 1:
            raise ConfigError(
                f"validation_prompts[{i}].control: image-to-video draws from one image (the "
                "first frame); give it as control: [image]"
            )


def frame_image(frame: torch.Tensor) -> Any:
    """A frame (3, H, W) in [-1, 1], cut from 8-bit pixels, back as the PIL image it was."""
    from PIL import Image

    u8 = ((frame.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(u8.permute(1, 2, 0).numpy()), "RGB")


def conditioning(
    i2v: ImageToVideo, vae: Any, pixels: torch.Tensor, encoder: tuple[Any, Any] | None
) -> dict[str, torch.Tensor]:
    """What the pipeline builds from a clip's conditioning frame (unbatched): `i2v_condition`
    (mask and condition latents on channels; TI2V: the image's latents), Wan 2.1's
    `image_embeds`, TI2V's `loss_mask`. `pixels` is (1, 3, F, H, W); `encoder` the base's
    (CLIP image processor, CLIP vision model) where its transformer takes image tokens."""
    from diffusers import WanImageToVideoPipeline

    frames, (height, width) = pixels.shape[2], pixels.shape[-2:]
    image = frame_image(pixels[0, :, i2v.frame])
    processor, model = encoder if encoder is not None else (None, None)
    # The pipeline itself, holding only what its conditioning steps use.
    pipe = WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=None,
        image_processor=processor,
        image_encoder=model,
        expand_timesteps=i2v.first_frame,
    )
    device = pixels.device
    with torch.no_grad():
        processed = pipe.video_processor.preprocess(image, height=height, width=width)
        placeholder = torch.zeros(1)  # the noise: drawn by the kit, not here
        made = pipe.prepare_latents(
            processed.to(device, torch.float32),
            1,
            vae.config.z_dim,
            height,
            width,
            frames,
            torch.float32,
            device,
            None,
            placeholder,
        )
        out = {"i2v_condition": made[1][0]}
        if i2v.first_frame:
            out["loss_mask"] = made[2][0]  # the first latent frame is the image's, not drawn
        if i2v.image_encoder:
            # On the clips' device while it encodes, then back: it is not kept on the GPU
            # beside the denoiser (the text encoders leave it once the cache is filled too).
            model.to(device)
            try:
                out["image_embeds"] = pipe.encode_image(image, device)[0]
            finally:
                model.to("cpu")
    return out


def load_encoder(source: str) -> tuple[Any, Any]:
    """The base's CLIP image processor and vision model (fp32, frozen, in CPU memory), as the
    pipeline loads them from its `image_processor` and `image_encoder` folders."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    processor = CLIPImageProcessor.from_pretrained(source, subfolder="image_processor")
    model = CLIPVisionModel.from_pretrained(source, subfolder="image_encoder", dtype=torch.float32)
    return processor, model.requires_grad_(False).eval()


def transformer_inputs(
    i2v: ImageToVideo, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, Any]
) -> dict[str, Any]:
    """The transformer's keyword arguments for noisy latents (B, C, F, h, w) at per-sample
    `timesteps`, as WanImageToVideoPipeline's denoising loop builds them."""
    condition = cond["i2v_condition"]
    if i2v.first_frame:
        # expand_timesteps: the image's latents in the first frame, its tokens at timestep 0.
        mask = torch.ones(1, 1, *noisy.shape[2:], dtype=torch.float32, device=noisy.device)
        mask[:, :, 0] = 0
        hidden = ((1 - mask) * condition.to(noisy) + mask * noisy).to(noisy.dtype)
        timestep = torch.stack([(mask[0][0][:, ::2, ::2] * t).flatten() for t in timesteps])
    else:
        hidden = torch.cat([noisy, condition.to(noisy)], dim=1)
        timestep = timesteps
    kwargs = {
        "hidden_states": hidden,
        "timestep": timestep,
        "encoder_hidden_states": cond["prompt_embeds"],
    }
    if i2v.image_encoder:
        kwargs["encoder_hidden_states_image"] = cond["image_embeds"]
    return kwargs


def image_tokens(source: str) -> int:
    """CLIP tokens per image of the base's image encoder (patches and the class token)."""
    try:
        from transformers import CLIPVisionConfig

        c = CLIPVisionConfig.from_pretrained(config_source(source), subfolder="image_encoder")
        return (c.image_size // c.patch_size) ** 2 + 1
    except (OSError, ValueError):
        return IMAGE_TOKENS


def make_tiny(
    two_experts: bool, build_transformer: Any, parts: dict[str, Any], out_dir: Any
) -> Path:
    """A tiny WanImageToVideoPipeline: Wan 2.1 I2V (with a tiny CLIP vision model and its
    processor), or with `two_experts` Wan 2.2 I2V A14B (two experts, no image encoder)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    z = parts["vae"].config.z_dim
    channels = z + parts["vae"].config.scale_factor_temporal + z  # noisy, mask, condition
    if two_experts:
        pipe = WanImageToVideoPipeline(
            **parts,
            transformer=build_transformer(in_channels=channels),
            transformer_2=build_transformer(in_channels=channels),
            boundary_ratio=0.9,  # Wan 2.2 I2V A14B's
        )
        return tiny.save_pipeline(pipe, out_dir)
    vision = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,  # the pipeline takes the penultimate hidden states
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            projection_dim=32,
        )
    )
    processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    transformer = build_transformer(in_channels=channels, image_dim=32, added_kv_proj_dim=64)
    pipe = WanImageToVideoPipeline(
        **parts, transformer=transformer, image_encoder=vision, image_processor=processor
    )
    return tiny.save_pipeline(pipe, out_dir)
