"""FLUX.1 Kontext dev: Flux.1 dev's transformer, trained on pairs (a control image → its edit).

Everything but the reference is Flux's (`kit.families.flux.family`): text, noise, σ shift (from the
target's size alone, as FluxKontextPipeline computes it), exports and key layouts. The
control's latents are cached like a target's; per step they are packed into 2×2 tokens placed
after the target's, with image ids whose first coordinate is 1 (the target's are 0), and the
prediction is cut back to the target's tokens, as FluxKontextPipeline does at every step.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from kit.families import register
from kit.families.flux.family import Flux, pack_latents

VAE_FACTOR = 8
"""Flux's VAE downsamples by 8; FluxKontextPipeline resizes controls to multiples of 8 · 2."""


def control_size(width: int, height: int, auto_resize: bool = True) -> tuple[int, int]:
    """The (width, height) FluxKontextPipeline resizes a control of this size to: the preferred
    Kontext resolution closest in aspect ratio (`_auto_resize`, its default), rounded down to
    multiples of 16."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    # The pipeline's image processor first rounds the image's own size down to multiples of 16.
    multiple = VAE_FACTOR * 2
    width, height = width - width % multiple, height - height % multiple
    if auto_resize:
        aspect = width / height
        _, width, height = min(
            (abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS
        )
    return width // multiple * multiple, height // multiple * multiple


def with_control(
    kwargs: dict[str, Any], latents: torch.Tensor, control: torch.Tensor
) -> dict[str, Any]:
    """Flux's transformer arguments as FluxKontextPipeline builds them: the control's packed
    tokens after the target's, and their ids (first coordinate 1) after the target's ids."""
    from diffusers import FluxKontextPipeline

    control = control.to(latents.device, latents.dtype)
    b, _, h, w = control.shape
    ids = FluxKontextPipeline._prepare_latent_image_ids(
        b, h // 2, w // 2, latents.device, latents.dtype
    )
    ids[..., 0] = 1
    kwargs["hidden_states"] = torch.cat([kwargs["hidden_states"], pack_latents(control)], dim=1)
    kwargs["img_ids"] = torch.cat([kwargs["img_ids"], ids], dim=0)
    return kwargs


@register
class FluxKontext(Flux):
    """FLUX.1 Kontext dev: one control image per target."""

    name = "flux_kontext"
    hub_id = "black-forest-labs/FLUX.1-Kontext-dev"
    pipeline_class = "FluxKontextPipeline"
    modelspec_architecture = "flux-1-kontext-dev"
    control_images = 1
    needs_control = True
    # FluxKontextPipeline always passes custom sigmas (and, unlike FluxPipeline, does not drop
    # them for multistep schedulers): only the schedulers whose set_timesteps takes sigmas.
    samplers = ("default", "flow_euler", "flow_unipc")
    # Controls are resized to a preferred Kontext resolution (about one megapixel), as the
    # pipeline does by default; a test may set False to keep tiny runs small.
    auto_resize = True

    def version_metadata(self) -> dict[str, str]:
        return {**super().version_metadata(), "modelspec.architecture": "flux-1-kontext-dev"}

    def control_size(self, width, height):
        return control_size(width, height, self.auto_resize)

    def control_pixels(self, image: Image.Image) -> torch.Tensor:
        from diffusers.image_processor import VaeImageProcessor

        # The pipeline's own processor (its factor is the VAE's × 2) and resize filter.
        processor = VaeImageProcessor(vae_scale_factor=VAE_FACTOR * 2)
        width, height = self.control_size(image.width, image.height)
        image = processor.resize(image, height, width)
        return processor.preprocess(image, height, width)[0]

    def transformer_kwargs(self, config, latents, timesteps, cond):
        kwargs = super().transformer_kwargs(config, latents, timesteps, cond)
        return with_control(kwargs, latents, cond["control_latents_0"])

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        # Kontext rescales the asked size to `max_area` (a megapixel by default): the asked
        # area keeps the grid at the validation size.
        kwargs["max_area"] = spec.width * spec.height
        if spec.control:
            # The file, so the sidecar can record it; `sample` opens it for the pipeline.
            kwargs["image"] = spec.control[0]
            if not self.auto_resize:
                kwargs["_auto_resize"] = False
        return kwargs

    def meta_controls(self, parts, batch, height, width):
        cw, ch = control_size(width, height, self.auto_resize)
        return {"control_latents_0": self.packed_meta_latents(parts, batch, ch, cw)}
