"""How a family turns a validation spec into a diffusers pipeline call, and draws it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kit.families.samplers import ImageSpec, open_named_images

if TYPE_CHECKING:
    from PIL import Image

BATCHED_KWARGS = ("prompt", "negative_prompt")
"""The pipeline call's arguments that `Drawing.sample_batch` gives as one list per batch."""


class Drawing:
    """A family's pipeline calls: the keyword arguments of a spec, and drawing one or several."""

    def call_kwargs(self, spec: ImageSpec) -> dict[str, Any]:
        """The keyword arguments of the pipeline call that draws `spec` (recorded in sidecars)."""
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            # The string, even when empty: ComfyUI and A1111 encode an empty negative prompt, and
            # SDXL's pipeline would draw with zeros for None (`force_zeros_for_empty_prompt`).
            "negative_prompt": spec.negative_prompt,
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale,
            "width": spec.width,
            "height": spec.height,
        }
        if spec.adapter_scale != 1.0:
            kwargs["cross_attention_kwargs"] = {"scale": spec.adapter_scale}
        return kwargs

    def pipeline_call(self, spec: ImageSpec) -> dict[str, Any]:
        """`call_kwargs` with the images they name by file (an edit model's controls, an
        image-to-video model's first frame: files, so the sidecar records them) opened."""
        return open_named_images(self.call_kwargs(spec))

    def sample(self, pipe: Any, spec: ImageSpec) -> list[Image.Image]:
        """Draw `spec`: one image, or the frames of a clip."""
        generator = torch.Generator(spec.generator_device).manual_seed(spec.seed)
        with torch.no_grad():
            out = pipe(**self.pipeline_call(spec), generator=generator)
        return [out.images[0]]

    def sample_batch(self, pipe: Any, specs: list[ImageSpec]) -> list[list[Image.Image]]:
        """Draw `specs` as `sample` draws each: in one pipeline call when they differ only in
        prompt and seed, with a generator per image (each image's starting noise is the one its
        own call would draw); one call each otherwise, or where a family draws its own way."""
        shared = [
            {k: v for k, v in self.call_kwargs(s).items() if k not in BATCHED_KWARGS} for s in specs
        ]
        own_way = type(self).sample is not Drawing.sample
        if (
            len(specs) < 2
            or own_way
            or any(s.control for s in specs)
            or shared.count(shared[0]) < len(shared)
        ):
            return [self.sample(pipe, s) for s in specs]
        kwargs = {
            **self.pipeline_call(specs[0]),
            "prompt": [s.prompt for s in specs],
            "negative_prompt": [s.negative_prompt for s in specs],
        }
        generators = [torch.Generator(s.generator_device).manual_seed(s.seed) for s in specs]
        with torch.no_grad():
            out = pipe(**kwargs, generator=generators)
        return [[image] for image in out.images]
