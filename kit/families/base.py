"""The model-family seam: everything the trainer, estimator and notebooks ask of a model.

A family answers a small fixed set of questions (load, encode, noise, predict, sample, export,
tiny copy). The training loop, the notebooks and the estimator call these and never branch on a
family's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kit.config import Config
from kit.errors import KitError
from kit.families import tiny
from kit.families.drawing import Drawing
from kit.families.exports import FamilyExports
from kit.families.identity import (
    base_identity,
    check_layout,
    model_source,
    pipeline_parts,
    require_tokenizers,
    single_file,
)
from kit.families.noise import NoiseDraw, ddpm_noise_and_target
from kit.families.parts import PARTS, Components, PartTable, frozen
from kit.families.samplers import DEFAULT, check_validation
from kit.families.samplers import (
    ImageSpec as ImageSpec,  # re-exported: families and tests import it here
)
from kit.families.shipped import SHIPPED

__all__ = ["PARTS", "Components", "Family", "NoiseDraw", "frozen", "posterior_latent"]

if TYPE_CHECKING:
    from PIL import Image


def posterior_latent(dist: Any, generator: torch.Generator | None) -> torch.Tensor:
    """The VAE posterior's mean, or with `generator` a sample of it, mean + std · ε, with ε
    drawn in fp32 on the CPU generator so that a seed gives the same latents on any device."""
    mean = dist.mean
    if generator is None:
        return mean
    noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32)
    return mean + dist.std * noise.to(mean)


class Family(PartTable, FamilyExports, Drawing, ABC):
    """One model architecture. Subclass (a flow-matching DiT: `FlowFamily`), declare `parts`
    (`kit.families.parts`), set the class attributes, register with `@register`."""

    name: str = ""
    """The `model_family` value that selects this family."""
    bucket_step: int = 64
    """Bucket sides are multiples of this."""
    native_resolution: int = 512
    """The side, in pixels, the released base model was trained at (the planner's resolution)."""
    hub_id: str = ""
    """The hub repository of the maintained base model in diffusers layout (the planner's base)."""
    default_lora_targets: tuple[str, ...] = ()
    """Denoiser module names adapted by LoRA when the config names none."""
    kohya_prefix: str = "lora_unet"
    """Key prefix of denoiser weights in the kohya / A1111 naming."""
    kohya_text_prefixes: tuple[str, ...] = ()
    """Key prefix of each text encoder's LoRA weights in the kohya naming (`lora_te`,
    `lora_te1`, ...), in the family's encoder order; empty when no client loads text-encoder
    LoRA for this family."""
    diffusers_reads_kohya: bool = False
    """diffusers' `load_lora_weights` reads this family's kohya LoRA files (so an export can
    also be checked by redrawing images with it)."""
    kohya_dora: bool = True
    """DoRA can be written in the kohya layout (false where that layout fuses modules)."""
    base_model_version: str = ""
    """`ss_base_model_version` written into kohya metadata (sd-scripts' and musubi's values)."""
    objective: str = "ddpm"
    """The kind of training draw (`kit.families.noise.OBJECTIVES`): `ddpm` (epsilon or v, the
    UNet families) or `flow`; the objective keys of the other kind are refused."""
    modelspec_architecture: str = ""
    """`modelspec.architecture` of the base (the adapter's kind is appended: `…/lora`)."""
    modelspec_implementation: str = "diffusers"
    """`modelspec.implementation`: whose module naming the kohya file's keys follow."""
    single_file_implementation: str = ""
    """The same for a merged single-file checkpoint (its original layout); empty: as above."""
    pipeline_class: str = "StableDiffusionPipeline"
    """The diffusers pipeline class that samples this family (and saves its LoRA files)."""
    pipeline_kwargs: dict[str, Any] = {}
    """Extra `from_pretrained` arguments for that pipeline."""
    lora_layers_kwarg: str = "unet_lora_layers"
    """Keyword of the pipeline's `save_lora_weights` that takes the denoiser's LoRA weights."""
    export_formats: tuple[str, ...] = ("diffusers", "kohya")
    """Export formats this family writes."""
    textual_inversion_refusal: str = ""
    """Why no client could read this family's embeddings though its pipeline loads some; or ""."""
    full_refusal: str = ""
    """Why a fully fine-tuned model of this family could not be exported and read back; or ""."""
    embedding_names: tuple[str, ...] = ()
    """Keys of a textual-inversion file, one per text encoder (A1111 / ComfyUI naming);
    empty for one encoder, whose file holds a single tensor under the token's name."""
    video: bool = False
    """True when samples are clips (channels, frames, height, width) rather than images."""
    audio: bool = False
    """True when a clip's sound trains too (`encode_sound`; its latents are `joint_latents`)."""
    joint_latents: tuple[str, ...] = ()
    """Batch keys of latents the denoiser predicts beside `latents` in the same forward, noised
    at the same timesteps (LTX-2's `audio_latents`): `noise_and_target` takes each as a keyword
    and returns its draw in `NoiseDraw.joint`; `predict` reads each noisy one from `cond` and
    returns `(prediction, {key: prediction})`. A `<key>_weight` (B,) weights its loss."""
    samplers: tuple[str, ...] = (DEFAULT,)
    """The samplers (`kit.families.samplers.SAMPLERS` names) this family's pipeline can draw
    validation images with; `default` keeps the base model's own scheduler."""
    size_multiple: int = 8
    """What a drawn image's width and height must be multiples of: the VAE's factor and, for
    transformers, their patch size (pipelines refuse or silently round other sizes)."""
    image_alpha: bool = False
    """Whether the VAE reads RGBA: the cache hands `encode_images` an image with transparency as
    (4, H, W), its alpha kept; an opaque one stays (3, H, W), which the family fills as its
    pipeline does."""
    control_images: int = 0
    """How many control (reference) images a training pair may have: 0 for a family that
    takes none (a dataset with `control_dir` is refused), else the most its pipeline takes."""
    needs_control: bool = False
    """Whether every dataset must have its control images (an edit model)."""
    prompt_controls: bool = False
    """Whether a caption's embedding depends on its pair's control images (Qwen-Image-Edit's
    vision-language encoder reads them with the prompt): the text cache then keys a pair's
    captions by its controls too and calls `encode_text(comps, captions, controls=...)` with the
    controls as placed, and validation draws with the text encoder, not cached embeddings."""
    variants: tuple[str, ...] = ()
    """The released models this family trains, as `kit families` lists them (e.g. "dev",
    "klein 4B"); which one a base is, is read from its configs (`variant_of`)."""
    variant_guidance: dict[str, float] = {}
    """Validation guidance per variant, where the family's releases draw differently (a
    step-distilled one without CFG): `default_guidance_scale` reads the configured one's."""
    variant_steps: dict[str, int] = {}
    """Validation sampler steps per variant, read as `variant_guidance` is."""
    distilled_variants: dict[str, str] = {}
    """The step-distilled variants, each with the sentence `distillation` says of it."""

    @property
    def default_guidance_scale(self) -> float:
        """Validation guidance when the config sets none: what the family's diffusers pipeline
        draws with by default (for guidance-distilled models, the distilled guidance input);
        the configured variant's where the family has `variant_guidance`."""
        return self.variant_guidance[self.configured_variant()] if self.variant_guidance else 7.5

    @property
    def default_num_inference_steps(self) -> int:
        """Validation sampler steps when the config sets none; families whose pipeline draws
        with fewer by default (step-distilled bases) say so here, or per variant in
        `variant_steps`."""
        return self.variant_steps[self.configured_variant()] if self.variant_steps else 25

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg if cfg is not None else Config()
        # Validation entries are checked with the config: a long run must not fail at its grid.
        check_validation(self, self.cfg)

    def guidance_scale(self) -> float:
        """The validation guidance: the configured one, else the family's default."""
        configured = self.cfg.validation.validation_guidance_scale
        return self.default_guidance_scale if configured is None else float(configured)

    def inference_steps(self) -> int:
        """The validation sampler steps: the configured ones, else the family's default."""
        return (
            self.cfg.validation.validation_num_inference_steps or self.default_num_inference_steps
        )

    def version_metadata(self) -> dict[str, str]:
        """What clients read to tell this base from others (A1111 hides a LoRA whose version
        does not match the loaded checkpoint): `ss_base_model_version`, `ss_v2`, and the
        modelspec architecture, implementation and prediction type."""
        return {
            "ss_base_model_version": self.base_model_version,
            "ss_v2": "False",
            "modelspec.architecture": self.modelspec_architecture,
            "modelspec.implementation": self.modelspec_implementation,
        }

    def variant_of(self, pretrained: str) -> str:
        """Which of `variants` the base `pretrained` is (from its configs); "" for one variant."""
        return ""

    def configured_variant(self) -> str:
        """Which of `variants` the configured base is (the hub id where none is set)."""
        return self.variant_of(self.cfg.model.pretrained_model or self.hub_id)

    def quantization_refusal(self, kind: str) -> str | None:
        """Why the configured base cannot be stored as `kind` (`base_quantization`), or None."""
        return None

    def distillation(self, pretrained: str) -> str:
        """Why the base `pretrained` is step-distilled (trained to sample in a few steps without
        CFG), as a sentence naming the variant; "" for a base that is not.

        A LoRA trained straight on such a base comes out weak or grainy: the kit says so before
        training, and merges a `training_adapter` into the base while it trains. The default
        reads `distilled_variants`.
        """
        if not self.distilled_variants:
            return ""
        return self.distilled_variants.get(self.variant_of(pretrained), "")

    def frame_count(self, available: int) -> int:
        """The most frames (≤ available) a clip of this family may have; video families override."""
        return available

    def clip_fps(self) -> int:
        """Frames per second the configured model's validation clips play at (its released
        pipeline's own rate); video families whose models differ override."""
        return 16

    def swap_blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The denoiser's transformer blocks in the order its forward runs them: what
        `blocks_to_swap` may keep in CPU memory (`kit.train.offload`).

        Swapping pays where most weights sit in a long stack of blocks that each run once per
        pass; the SD UNets are small enough to fit whole and are not split, so the default
        refuses, naming the family.
        """
        raise KitError(
            f"blocks_to_swap: the {self.name} denoiser has no stack of transformer blocks to swap "
            "(only the transformer families are block-swapped); set blocks_to_swap: 0"
        )

    # ------------------------------------------------------------ loading

    quantized_text_encoders: tuple[str, ...] = ()
    """Subfolders of the text encoders that `base_quantization` stores quantized too, beside
    the denoiser: the T5s, large and only ever read frozen (the CLIPs are small)."""
    single_file_markers: tuple[str, ...] = ()
    """Key endings that every single-file checkpoint of this family's denoiser has."""
    single_file_excludes: tuple[str, ...] = ()
    """Key endings that show a file holds another family's denoiser (SDXL's among SD files)."""
    file_text_prefixes: tuple[str, ...] = ()
    """Key prefix of each text encoder (in `load`'s order) in a whole checkpoint file."""

    def model_source(self, pretrained: str, tokenizers: tuple[str, ...] = ()) -> str:
        """Where the configs, tokenizers, scheduler and any part a single file lacks are read:
        `pretrained` itself, or for one file the configured `model_config` (empty: the config
        the kit ships for this family's base), refused if it lacks the `tokenizers` folders."""
        source = model_source(pretrained, self.cfg.model.model_config, SHIPPED.get(self.hub_id, ""))
        if single_file(pretrained) and tokenizers:
            check_layout(pretrained, self)  # a file of another model is the first thing to say
            require_tokenizers(source, pretrained, tokenizers)
        return source

    def pipeline_type(self) -> type:
        """The diffusers pipeline class named by `pipeline_class`."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def base_pipeline(self, dtype: torch.dtype = torch.float32) -> Any:
        """The configured base as a plain diffusers pipeline in `dtype`, whatever its source:
        `from_pretrained` of its folder or hub id, with the single file's parts (and
        `vae_model`) passed in, as a diffusers user would build it."""
        m = self.cfg.model
        wanted = PARTS if single_file(m.pretrained_model) else ("vae",) if m.vae_model else ()
        loaded = wanted and self.load(
            m.pretrained_model, revision=m.revision, variant=m.variant, dtype=dtype, parts=wanted
        )
        return self.pipeline_type().from_pretrained(
            self.model_source(m.pretrained_model),
            revision=m.revision,
            variant=m.variant,
            dtype=dtype,
            **{**self.pipeline_kwargs, **pipeline_parts(loaded)},
        )

    def identity(self, pretrained: str, revision: str | None = None) -> dict[str, str]:
        """Fingerprints that key the caches, read from configs without loading any weights.

        `vae`: the VAE; `text`: the text encoders, their tokenizers and what else shapes the
        cached embeddings (`identity_extras`). A single file adds its content hash to every
        part; `vae_model` is the VAE's fingerprint.
        """
        source = self.model_source(pretrained)
        extras = self.identity_extras(source, revision)
        if self.cfg.model.text_encoder_quantization != "none":
            # A quantized encoder's embeddings differ from the full-precision one's.
            extras = [extras, f"text encoders {self.cfg.model.text_encoder_quantization}"]
        return base_identity(
            pretrained, source, self.text_subfolders, revision, extras, self.cfg.model.vae_model
        )

    def identity_extras(self, pretrained: str, revision: str | None) -> Any:
        """Settings besides the encoders that change cached text embeddings (e.g. a T5 length)."""
        return None

    def token_limit(self, encoder: str, tokenizer: Any) -> int:
        """Tokens the family feeds this encoder (special tokens included); the rest is cut off."""
        return int(tokenizer.model_max_length)

    # ------------------------------------------------------------ encoding

    @abstractmethod
    def encode_text(self, comps: Components, captions: list[str]) -> dict[str, torch.Tensor]:
        """Per-caption conditioning tensors (batch first), ready to cache.

        Differentiable: textual inversion and text-encoder training call it with gradients on
        (callers that only cache work with frozen encoders, so no graph is kept).
        """

    def prompt_kwargs(self, text: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Cached text tensors of one prompt (batch of one) as the pipeline call takes
        precomputed embeddings for it: by default as cached, whose names are the call's own
        (`prompt_embeds`, `pooled_prompt_embeds`, ...); the negative prompt's get `negative_`."""
        return dict(text)

    @abstractmethod
    def encode_images(
        self, comps: Components, pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Scaled latents of images in [-1, 1], shape (B, 3, H, W) (or (B, 3, F, H, W) for video).

        The VAE posterior's mean, or with `generator` a sample of it (`posterior_latent`).
        """

    # ------------------------------------------------------------ training

    @abstractmethod
    def noise_and_target(
        self, comps: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> NoiseDraw:
        """Draw timesteps and noise; the noisy latents and the regression target."""

    @abstractmethod
    def predict(
        self,
        comps: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The denoiser's output for noisy latents.

        `cond` holds the cached text tensors and, per sample, `original_size` (h, w),
        `crop_top_left` (top, left) and `target_size` (h, w) as recorded by bucketing.
        """

    def pixel_conditioning(
        self, comps: Components, pixels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Tensors that a sample's own pixels (1, 3, H, W) or (1, 3, F, H, W) in [-1, 1]
        condition the denoiser with beside its latents (image-to-video: its conditioning
        frame's latents and mask, its image embedding), unbatched, cached in its latent entry
        and handed to `predict` in `cond`; a `loss_mask` among them weights the loss. {} for
        most families."""
        return {}

    def control_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the pipeline resizes a control of this size to."""
        return width, height

    def control_pixels(self, image: Image.Image) -> torch.Tensor:
        """A control image as the pipeline feeds it to the VAE: resized by the pipeline's rule
        and normalised, (3, H, W) in [-1, 1]. Only families with `control_images` have one."""
        raise NotImplementedError(f"{self.name} takes no control images")

    # ------------------------------------------------------------ sampling

    @abstractmethod
    def pipeline(self, comps: Components) -> Any:
        """A diffusers pipeline that samples with these parts."""

    def ddpm_draw(
        self, comps: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> NoiseDraw:
        """`ddpm_noise_and_target` with the run's objective settings (for DDPM families)."""
        o = self.cfg.objective
        return ddpm_noise_and_target(
            comps.noise_scheduler,
            latents,
            generator,
            min_snr_gamma=o.min_snr_gamma,
            noise_offset=o.noise_offset,
            min_timestep=o.min_timestep,
            max_timestep=o.max_timestep,
        )

    # ------------------------------------------------------------ memory estimate

    @abstractmethod
    def denoiser_inputs(
        self, parts: dict[str, nn.Module], batch: int, height: int, width: int
    ) -> tuple[tuple, dict[str, Any]]:
        """Meta-device arguments for one denoiser forward at this image size."""

    # ------------------------------------------------------------ tiny copy

    @abstractmethod
    def make_tiny(self, out_dir: str | Path, seed: int = 0) -> Path:
        """Write a tiny random-init copy of this architecture in diffusers layout."""

    def save_tiny(self, out_dir: str | Path, *built: Any, **extra: Any) -> Path:
        """Save a tiny `pipeline_type` pipeline whose parts are `built`, in the table's order,
        with `extra` arguments of its constructor."""
        names = [p.name for p in self.parts]
        parts = dict(zip(names, built, strict=True))
        return tiny.save_pipeline(self.pipeline_type()(**parts, **extra), out_dir)
