"""Qwen-Image-Edit, -2509 and -2511: Qwen-Image's transformer trained on pairs (controls → edit).

Everything but the references is Qwen-Image's (`kit.families.qwen_image.family`): the VAE, the σ shift
(from the target's size alone, as the edit pipelines compute `mu`), packing, exports and the
ComfyUI layout. Two things differ, both read from the diffusers pipelines:

- The controls' latents are cached like a target's, resized to about a megapixel
  (`calculate_dimensions(1024²)`), and per step packed into 2×2 tokens after the target's, each
  with its own entry in `img_shapes`; the prediction is cut back to the target's tokens.
- The prompt goes through Qwen2.5-VL WITH the control images (a vision-language prompt built by
  the pipeline's processor), so a caption's embedding depends on its pair's controls
  (`prompt_controls`): the text cache keys it by them, and encodes it with the controls as placed,
  resized for the vision tower as the pipeline resizes them (Edit: the same ~1 MP image the VAE
  gets; 2509/2511: a separate ~384² one).

Which model a base is comes from its configs: `model_index.json` names QwenImageEditPipeline
(Edit, one control) or QwenImageEditPlusPipeline (2509 and 2511, up to three); 2511's
transformer config sets `zero_cond_t` (its references are modulated at timestep 0 inside the
transformer: the pipeline's, and so the kit's, inputs are the same as 2509's).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from kit.errors import ConfigError, DataError
from kit.families import register, tiny
from kit.families.base import PARTS, Components
from kit.families.flux2.family import model_index
from kit.families.identity import part_config
from kit.families.parts import Part
from kit.families.qwen_image.family import (
    QwenImage,
    pack_latents,
    tiny_qwen2_tokenizer,
    tiny_qwen25_vl,
    tiny_vae_and_transformer,
    transformer_inputs,
    unpack_latents,
)
from kit.families.shipped import config_source

EDIT = "QwenImageEditPipeline"
PLUS = "QwenImageEditPlusPipeline"
VAE_FACTOR = 8
"""The VAE's downsampling; the pipelines' image processor works in multiples of 8 · 2."""
EDIT_TEMPLATE_WORDS = (
    "Describe the key features of the input image ( color , shape size texture objects background"
    " ), then explain how user 's text instruction should alter or modify . Generate a new that"
    " meets requirements while maintaining consistency with original where appropriate Picture"
).split()
"""The words of the edit pipelines' system prompt, as Qwen2's pre-tokenizer splits them: the
tiny tokenizer gives each one token, as Qwen2's does, so the pipelines' fixed
`prompt_template_encode_start_idx` (64) drops exactly that system prompt there too."""


def control_sizes(width: int, height: int, plus: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (width, height) the pipeline resizes a control of this size to for the VAE, and for
    the vision-language prompt: Edit uses one ~1 MP size for both; Plus (2509, 2511) ~1 MP for
    the VAE and ~384² for the prompt (`calculate_dimensions`, multiples of 32)."""
    if plus:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as p

        ratio = width / height
        return (
            p.calculate_dimensions(p.VAE_IMAGE_SIZE, ratio),
            p.calculate_dimensions(p.CONDITION_IMAGE_SIZE, ratio),
        )
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(1024 * 1024, width / height)
    return (w, h), (w, h)


def edit_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
    controls: list[torch.Tensor],
) -> dict[str, Any]:
    """QwenImageTransformer2DModel's arguments as the edit pipelines build them: Qwen-Image's,
    with each control's packed tokens after the target's and its (1, h/2, w/2) in `img_shapes`
    after the target's."""
    kwargs = transformer_inputs(latents, timesteps, prompt_embeds, prompt_embeds_mask)
    b, _, h, w = latents.shape
    controls = [c.to(latents.device, latents.dtype) for c in controls]
    kwargs["hidden_states"] = torch.cat(
        [kwargs["hidden_states"], *[pack_latents(c) for c in controls]], dim=1
    )
    shapes = [(1, h // 2, w // 2), *[(1, c.shape[-2] // 2, c.shape[-1] // 2) for c in controls]]
    kwargs["img_shapes"] = [shapes] * b
    return kwargs


def has_torchvision() -> bool:
    """Whether transformers can build Qwen2VLProcessor (its video part needs torchvision)."""
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


IMAGE_ONLY_MODULE = "image_only_qwen2vl_processor"
"""Where a tiny base made without torchvision keeps `IMAGE_ONLY_SOURCE`: its processor folder,
as diffusers loads a custom component (`from_pretrained(..., trust_remote_code=True)`)."""
IMAGE_ONLY_SOURCE = '''"""Qwen2VLProcessor without its video part, written by the kit's tiny Qwen-Image-Edit.

transformers 5 builds Qwen2VLProcessor's video processor only with torchvision installed; the
edit pipelines call the processor on text and images alone, which this does exactly as
Qwen2VLProcessor does, on the same image processor and tokenizer.
"""

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
'''


def compile_class(source: str, module: str, owner: str, class_name: str) -> type:
    """`class_name` as the module text `source` (an image-only processor) defines it,
    compiled under the file name `module` and owned by the module named `owner`."""
    namespace: dict[str, Any] = {"__name__": owner}
    exec(compile(source, module, "exec"), namespace)  # noqa: S102
    return namespace[class_name]


def component_getattr(owner: str, class_name: str, build: Callable[[], type]) -> Any:
    """A module `__getattr__` for the module `owner`: a pipeline the kit saves names its
    image-only processor `class_name` as a component of it, built on first use (it imports
    transformers); diffusers then finds how to load it by the loadable base classes this
    "library" holds."""

    def module_getattr(name: str) -> Any:
        if name == class_name:
            return build()
        if name == "ProcessorMixin":
            from transformers.processing_utils import ProcessorMixin

            return ProcessorMixin
        raise AttributeError(f"module {owner!r} has no attribute {name!r}")

    return module_getattr


def read_vl_processor(
    class_name: str, image_only: Callable[[], type], source: str, revision: str | None
) -> Any:
    """The base's `processor` folder as the pipeline loads it (transformers' `class_name`);
    without torchvision, its image processor and tokenizer as the `image_only` class."""
    import transformers

    cls = getattr(transformers, class_name) if has_torchvision() else image_only()
    return cls.from_pretrained(source, subfolder="processor", revision=revision)


@functools.cache
def image_only_processor_class() -> type:
    """`ImageOnlyQwen2VLProcessor` (`IMAGE_ONLY_SOURCE`): the processor where torchvision,
    which transformers needs to build Qwen2VLProcessor, is not installed."""
    return compile_class(
        IMAGE_ONLY_SOURCE, IMAGE_ONLY_MODULE, __name__, "ImageOnlyQwen2VLProcessor"
    )


__getattr__ = component_getattr(__name__, "ImageOnlyQwen2VLProcessor", image_only_processor_class)


def load_processor(source: str, revision: str | None = None) -> Any:
    """The base's `processor` folder as the pipeline loads it (Qwen2VLProcessor)."""
    return read_vl_processor("Qwen2VLProcessor", image_only_processor_class, source, revision)


class ProcessorFamily:
    """What a family whose captions a vision-language processor reads with images adds to its
    base class (listed before it): the processor loaded beside the parts and kept per base, its
    image settings in the cache identity, and trust for a tiny base's own image-only processor
    (Qwen-Image-Edit's Qwen2VLProcessor, Qwen-Image 2.1's Qwen3VLProcessor)."""

    image_only_module = IMAGE_ONLY_MODULE
    """The module a tiny base made without torchvision names for its processor."""
    read_processor = staticmethod(load_processor)
    """The base's processor as its pipeline loads it: (source, revision) → processor."""

    @property
    def pipeline_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` arguments: without torchvision, a tiny base's processor is a
        custom component (`make_tiny`), which diffusers loads only when told to trust it. Only
        a base whose model_index names the kit's own processor module is trusted: never a
        released or downloaded model's code."""
        if has_torchvision() or self.cfg is None:
            return {}
        pretrained = self.cfg.model.pretrained_model or self.hub_id
        index = model_index(self.model_source(pretrained), self.cfg.model.revision)
        own = (index.get("processor") or [None])[0] == self.image_only_module
        return {"trust_remote_code": True} if own else {}

    def identity_extras(self, pretrained, revision):
        # The processor's image settings shape the vision-language prompt, so its embeddings.
        path = Path(config_source(pretrained)) / "processor" / "preprocessor_config.json"
        settings = path.read_text(encoding="utf-8") if path.is_file() else ""
        return [super().identity_extras(pretrained, revision), settings]

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        comps = super().load(
            pretrained, revision=revision, variant=variant, dtype=dtype, parts=parts
        )
        # The pipeline's processor (its tokenizer and image processor), kept by the source.
        self._processors[comps.source] = self.read_processor(comps.source, revision)
        return comps

    def processor(self, comps: Components) -> Any:
        """The processor of the base `comps` were loaded from."""
        if comps.source not in self._processors:
            self._processors[comps.source] = self.read_processor(comps.source)
        return self._processors[comps.source]


@register
class QwenImageEdit(ProcessorFamily, QwenImage):
    """Qwen-Image-Edit (one control), -2509 and -2511 (up to three)."""

    name = "qwen_image_edit"
    # Qwen-Image's parts and the processor that builds the vision-language prompt (`load`).
    parts = (*QwenImage.parts, Part("processor", "transformers.Qwen2VLProcessor", "processor"))
    hub_id = "Qwen/Qwen-Image-Edit"
    variants = ("Qwen-Image-Edit", "Qwen-Image-Edit-2509", "Qwen-Image-Edit-2511")
    control_images = 3  # QwenImageEditPlusPipeline's references; Edit's one is checked on load
    needs_control = True
    prompt_controls = True
    base_model_version = "qwen_image_edit"

    modelspec_architecture = "qwen-image-edit"

    def __init__(self, cfg: Any = None) -> None:
        self._processors: dict[str, Any] = {}
        self._classes: dict[str, str] = {}  # base → its pipeline class, read once
        super().__init__(cfg)
        o = self.cfg.objective
        # The empty caption's embedding, and a slider's prompts, would depend on each pair's
        # controls too; the cache holds one of each for the whole run.
        # (Textual inversion, whose configs drop captions, is refused by name for Qwen2.5-VL.)
        if o.caption_dropout > 0 and self.cfg.network.network_type != "textual_inversion":
            raise ConfigError(
                "caption_dropout: qwen_image_edit encodes each caption with its pair's control "
                "images, so there is no one empty caption to drop to; set caption_dropout: 0"
            )
        if o.slider is not None:
            raise ConfigError(
                "slider: qwen_image_edit's prompts are encoded with each pair's controls; "
                "a slider's prompts have none. Train a slider on qwen_image"
            )
        if self.cfg.model.pretrained_model and not self._plus():
            asked = [len(v.control) for v in self.cfg.validation.validation_prompts]
            given = max([*asked, self._configured_controls()])
            if given > 1:
                raise ConfigError(
                    f"control_dir: Qwen-Image-Edit (QwenImageEditPipeline) takes one control "
                    f"image per target, {given} are given; 2509 and 2511 take up to three"
                )

    def _configured_controls(self) -> int:
        """The most control folders (or a source's control columns) a dataset of the config pairs
        its targets with."""
        data = self.cfg.data
        return max(
            len(getattr(d, "control_dir", None) or ()) + len(getattr(d, "control_column", ()))
            for d in [data, *data.datasets]
        )

    # ------------------------------------------------------------ which model

    def _plus(self, pretrained: str | None = None) -> bool:
        pretrained = pretrained or self.cfg.model.pretrained_model or self.hub_id
        if pretrained not in self._classes:
            found = model_index(self.model_source(pretrained), self.cfg.model.revision)
            self._classes[pretrained] = found.get("_class_name", EDIT)
        return self._classes[pretrained] == PLUS

    @property
    def pipeline_class(self) -> str:  # type: ignore[override]
        """QwenImageEditPipeline for Edit, QwenImageEditPlusPipeline for 2509 and 2511."""
        return PLUS if self._plus() else EDIT

    def variant_of(self, pretrained: str) -> str:
        if not self._plus(pretrained):
            return "Qwen-Image-Edit"
        # 2511's transformer modulates the references at timestep 0 (`zero_cond_t`).
        config = part_config(config_source(self.model_source(pretrained)), "transformer")
        return "Qwen-Image-Edit-2511" if config.get("zero_cond_t") else "Qwen-Image-Edit-2509"

    def version_metadata(self) -> dict[str, str]:
        variant = self.variant_of(self.cfg.model.pretrained_model or self.hub_id)
        return {**super().version_metadata(), "modelspec.architecture": variant.lower()}

    # ------------------------------------------------------------ exports

    def client_models(self, comps):
        models = super().client_models(comps)
        if _index_timestep_zero(comps):
            model, extra = models["ComfyUI"]
            models["ComfyUI"] = ({**model, f"diffusion_model.{ZERO_MARKER}": torch.empty(0)}, extra)
        return models

    def single_file_state_dict(self, comps):
        state = super().single_file_state_dict(comps)
        if _index_timestep_zero(comps):
            # ComfyUI tells 2511 by this empty entry (its `index_timestep_zero` reference
            # method, diffusers' `zero_cond_t`); diffusers' `from_single_file` skips it.
            state[ZERO_MARKER] = torch.empty(0)
        return state

    # ------------------------------------------------------------ loading

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions, controls=None):
        """With `controls` (per caption, its pair's control images as placed): the edit
        pipeline's `encode_prompt` of the caption with those images, one caption at a time (the
        Plus pipeline takes one prompt per call), padded with a zero mask to the caption
        allowance plus the images' tokens (equal for the pairs of one batch, whose controls
        resize alike). Without: Qwen-Image's text-only encoding (a prompt with no control is
        drawn through QwenImagePipeline, see `edit_pipeline_class`)."""
        if controls is None:
            return super().encode_text(comps, captions)
        plus = self._plus()
        pipe = self._edit_text_pipeline(comps, plus)
        device = pipe.text_encoder.device
        embeds, masks = [], []
        for caption, images in zip(captions, controls, strict=True):
            prompt_images = [self.prompt_image(im, plus) for im in images]
            image = prompt_images if plus else prompt_images[0]
            e, m = pipe.encode_prompt(caption, image=image, device=device)
            grid = pipe.processor.image_processor(images=prompt_images)["image_grid_thw"]
            merge = pipe.processor.image_processor.merge_size**2
            length = self.max_sequence_length() + int(sum(int(g.prod()) // merge for g in grid))
            if e.shape[1] > length:
                raise DataError(
                    f"the caption {caption!r} takes more than the {self.max_sequence_length()} "
                    "text tokens of max_sequence_length beside its images; shorten it or raise "
                    "max_sequence_length"
                )
            m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if m is None else m
            pad = length - e.shape[1]
            embeds.append(torch.nn.functional.pad(e, (0, 0, 0, pad)))
            masks.append(torch.nn.functional.pad(m, (0, pad)))
        return {"prompt_embeds": torch.cat(embeds), "prompt_embeds_mask": torch.cat(masks)}

    def prompt_image(self, image: Image.Image, plus: bool | None = None) -> Image.Image:
        """A control as the pipeline hands it to the vision-language prompt."""
        from diffusers.image_processor import VaeImageProcessor

        plus = self._plus() if plus is None else plus
        _, (width, height) = control_sizes(image.width, image.height, plus)
        return VaeImageProcessor(vae_scale_factor=VAE_FACTOR * 2).resize(image, height, width)

    def control_size(self, width, height):
        return control_sizes(width, height, self._plus())[0]

    def control_pixels(self, image: Image.Image) -> torch.Tensor:
        from diffusers.image_processor import VaeImageProcessor

        # The pipelines' own processor (the VAE's factor × 2) and calls: Edit resizes, then
        # preprocesses the resized image; Plus preprocesses the image it was given.
        processor = VaeImageProcessor(vae_scale_factor=VAE_FACTOR * 2)
        plus = self._plus()
        (width, height), _ = control_sizes(image.width, image.height, plus)
        if not plus:
            image = processor.resize(image, height, width)
        return processor.preprocess(image, height, width)[0]

    # ------------------------------------------------------------ training

    def predict(self, comps, noisy, timesteps, cond):
        keys = (f"control_latents_{r}" for r in range(self.control_images))
        controls = [cond[k] for k in keys if k in cond]
        kwargs = edit_inputs(
            noisy, timesteps, cond["prompt_embeds"], cond["prompt_embeds_mask"], controls
        )
        out = comps.denoiser(**kwargs, return_dict=False)[0]
        h, w = noisy.shape[-2:]
        # The pipeline keeps the target's tokens of the prediction: the controls' come after.
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        return self.build_pipeline(comps, edit_pipeline_class(self._plus()))

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)  # without controls, QwenImagePipeline's call
        if spec.control:
            # The files, so the sidecar can record them; `sample` opens them for the pipeline
            # (Edit takes one image, Plus a list).
            kwargs["image"] = list(spec.control) if self._plus() else spec.control[0]
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        transformer = parts["denoiser"]
        config = transformer.config
        meta = {"device": "meta"}
        f = VAE_FACTOR
        latents = torch.zeros(batch, config.in_channels // 4, height // f, width // f, **meta)
        plus = self._plus()
        (cw, ch), (pw, ph) = control_sizes(width, height, plus)
        # The references the config pairs its targets with (one when it names none).
        n = max(self._configured_controls(), 1)
        control = torch.zeros(batch, config.in_channels // 4, ch // f, cw // f, **meta)
        # The vision tower's tokens of each control (14-pixel patches merged 2×2).
        rh, rw = smart_resize(ph, pw, factor=28, min_pixels=3136, max_pixels=12845056)
        seq = self.max_sequence_length() + n * (rh // 28) * (rw // 28)
        kwargs = edit_inputs(
            latents,
            torch.zeros(batch, **meta),
            torch.zeros(batch, seq, config.joint_attention_dim, **meta),
            None,
            [control] * n,
        )
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0, plus: bool = False, zero_cond_t: bool = False):
        """Qwen-Image's tiny parts, a tiny vision tower in the text encoder and the processor
        the edit pipelines call: Edit's by default, 2509's with `plus`, 2511's with both."""
        import diffusers
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer(tuple(EDIT_TEMPLATE_WORDS))
        text_encoder = tiny_qwen25_vl(tokenizer)
        # The release's image settings (14-pixel patches, merged 2×2; the pixel bounds).
        image_processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
        cls = image_only_processor_class()
        processor = cls(image_processor=image_processor, tokenizer=tokenizer)
        vae, transformer = tiny_vae_and_transformer(zero_cond_t=zero_cond_t)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            FlowMatchEulerDiscreteScheduler.load_config(
                config_source(self.hub_id), subfolder="scheduler"
            )
        )
        pipe = getattr(diffusers, PLUS if plus else EDIT)(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            transformer=transformer,
        )
        out = tiny.save_pipeline(pipe, out_dir)
        index = Path(out) / "model_index.json"
        if not has_torchvision():
            # diffusers' own form of a custom component: its code in the component's folder,
            # loaded with `trust_remote_code` (`pipeline_kwargs`), no kit needed.
            (Path(out) / "processor" / f"{IMAGE_ONLY_MODULE}.py").write_text(IMAGE_ONLY_SOURCE)
            data = json.loads(index.read_text(encoding="utf-8"))
            data["processor"] = [IMAGE_ONLY_MODULE, "ImageOnlyQwen2VLProcessor"]
            index.write_text(json.dumps(data, indent=2), encoding="utf-8")
        else:
            # Named as the release names it: transformers builds it (see `load_processor`).
            config = Path(out) / "processor" / "processor_config.json"
            data = json.loads(config.read_text(encoding="utf-8"))
            data["processor_class"] = "Qwen2VLProcessor"
            config.write_text(json.dumps(data, indent=2), encoding="utf-8")
            data = json.loads(index.read_text(encoding="utf-8"))
            data["processor"] = ["transformers", "Qwen2VLProcessor"]
            index.write_text(json.dumps(data, indent=2), encoding="utf-8")
        return out

    # ------------------------------------------------------------ helpers

    def _edit_text_pipeline(self, comps: Components, plus: bool) -> Any:
        """An edit pipeline holding only the text parts (enough for `encode_prompt`)."""
        import diffusers

        return self.build_pipeline(comps, getattr(diffusers, PLUS if plus else EDIT), True)


ZERO_MARKER = "__index_timestep_zero__"
"""The entry of ComfyUI's Qwen-Image model for 2511 (`comfy/ldm/qwen_image/model.py` registers
it when its reference method is `index_timestep_zero`; ComfyUI's 2511 files carry it)."""


def _index_timestep_zero(comps: Components) -> bool:
    """Whether the transformer modulates its references at timestep 0 (2511)."""
    transformer = getattr(comps.denoiser, "module", comps.denoiser)
    return bool(transformer.config.get("zero_cond_t", False))


@functools.cache
def edit_pipeline_class(plus: bool) -> type:
    """The edit pipeline, drawing a prompt given no image through QwenImagePipeline on the same
    parts (text to image: the diffusers edit pipelines need an image, and a validation prompt
    may have none); with an image, the diffusers pipeline's own call, unchanged."""
    import diffusers

    base = getattr(diffusers, PLUS if plus else EDIT)

    class EditPipeline(base):  # type: ignore[misc, valid-type]
        @functools.wraps(base.__call__)
        def __call__(self, *args: Any, image: Any = None, **kwargs: Any) -> Any:
            if image is not None:
                return super().__call__(*args, image=image, **kwargs)
            plain = diffusers.QwenImagePipeline(
                scheduler=self.scheduler,
                vae=self.vae,
                text_encoder=self.text_encoder,
                tokenizer=self.tokenizer,
                transformer=self.transformer,
            )
            return plain(*args, **kwargs)

    EditPipeline.__name__ = EditPipeline.__qualname__ = base.__name__
    return EditPipeline
