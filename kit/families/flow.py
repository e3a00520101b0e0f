"""The flow-matching DiT families' shared base: image encoding, the σ-shifted draw, the pipeline.

SD3, Flux and Kontext, FLUX.2, Chroma, Z-Image, Qwen-Image and its edit model, Krea 2, Wan and
LTX-2 train the same way: latents normalised as the pipeline's decode inverts them, σ drawn from the
configured distribution and shifted as the scheduler shifts it, the velocity noise − x0 as the
target, and a pipeline built from the parts table. A family overrides only what differs.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from kit.config import Config
from kit.errors import ConfigError, KitError
from kit.families.base import Components, Family, NoiseDraw, posterior_latent
from kit.families.noise import flow_noise_and_target, flow_sampling
from kit.families.parts import Part
from kit.families.samplers import ImageSpec

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections of a diffusers attention block."""
JOINT_ATTENTION = (
    *ATTENTION,
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
"""Both streams' attention projections of an MMDiT (image and text), as diffusers' LoRA
scripts for SD3, Flux and Qwen-Image adapt them: the default LoRA targets of those families."""


class FlowFamily(Family):
    """A flow-matching family: set `parts`, `pipeline_class` and the class attributes; write
    `encode_text`, `predict`, `denoiser_inputs` and `make_tiny`."""

    vae_frames: bool = False
    """The VAE encodes clips (B, 3, F, H, W): an image goes in as a one-frame clip (and, for an
    image family, its latents come out without the frame axis)."""
    bucket_multiple: int = 0
    """What bucket sides must be multiples of (16 where latents are packed into 2×2 patches:
    2 × the VAE's 8x); 0: not checked."""
    default_max_sequence_length: int = 512
    """Text tokens per caption when the config sets none: the pipeline's own default."""
    scale_kwarg: str = "joint_attention_kwargs"
    """The pipeline call's keyword that takes the adapter scale (`{"scale": s}`)."""
    lora_layers_kwarg = (
        "transformer_lora_layers"  # what every DiT pipeline's save_lora_weights takes
    )
    objective = "flow"
    mu_defaults: tuple[int, int, float, float] = (256, 4096, 0.5, 1.15)
    """What the pipeline's `calculate_shift` takes where the scheduler config names none:
    base_image_seq_len, max_image_seq_len, base_shift, max_shift."""
    i2v: Any = None
    """A video family's image-to-video settings when the run draws from a first frame; None:
    from text alone."""

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        step, multiple = self.cfg.data.bucket_step, self.bucket_multiple
        if multiple and step % multiple:
            raise ConfigError(
                f"bucket_step: {step} must be a multiple of {multiple} for {self.name} "
                "(64 is usual)"
            )

    def max_sequence_length(self) -> int:
        """Text tokens per caption: the configured length, else the pipeline's default."""
        return self.cfg.model.max_sequence_length or self.default_max_sequence_length

    def identity_extras(self, pretrained, revision):
        # Embeddings are cut or padded to the text length, so it is part of their key.
        return self.max_sequence_length()

    # ------------------------------------------------------------ encoding

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        one_frame = self.vae_frames and pixels.ndim == 4
        if one_frame:
            pixels = pixels.unsqueeze(2)  # (B, 3, H, W) → a one-frame clip
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        latents = self.normalize_latents(vae, posterior_latent(dist, generator))
        return latents.squeeze(2) if one_frame and not self.video else latents

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of the pipeline's decode: per channel (latents − mean) / std where the
        VAE's config has `latents_mean`, else (latents − shift_factor) · scaling_factor."""
        config = vae.config
        if getattr(config, "latents_mean", None) is not None:
            shape = (1, -1, *[1] * (latents.ndim - 2))
            mean = torch.tensor(config.latents_mean).view(shape).to(latents)
            std = torch.tensor(config.latents_std).view(shape).to(latents)
            return (latents - mean) / std
        shift = getattr(config, "shift_factor", None) or 0.0
        return (latents - shift) * config.scaling_factor

    # ------------------------------------------------------------ training

    def noise_and_target(
        self, comps: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> NoiseDraw:
        config = comps.noise_scheduler.config
        shift = self.flow_shift(config, latents.shape[-2], latents.shape[-1])
        return self.flow_draw(comps, latents, generator, shift)

    def flow_shift(self, scheduler_config: Any, height: int, width: int) -> float:
        """σ shift for latents of this size (latent pixels): the configured `flow_shift`, else
        the scheduler's: its fixed `shift`, or with dynamic shifting the `mu` its pipeline
        computes for the packed 2×2 sequence length (`dynamic_mu`), a σ shift by e^mu for the
        exponential time shift and by mu for the linear one."""
        if self.cfg.objective.flow_shift > 0:
            return float(self.cfg.objective.flow_shift)
        if not scheduler_config.get("use_dynamic_shifting", False):
            return float(scheduler_config.get("shift", 1.0))
        mu = self.dynamic_mu(scheduler_config, (height // 2) * (width // 2))
        return mu if scheduler_config.get("time_shift_type") == "linear" else math.exp(mu)

    def dynamic_mu(self, scheduler_config: Any, tokens: int) -> float:
        """The `mu` a dynamically shifting pipeline sets for `tokens` image tokens: diffusers'
        `calculate_shift`, the line through (base_image_seq_len, base_shift) and
        (max_image_seq_len, max_shift) that every flow pipeline copies, with its own fallbacks
        (`mu_defaults`)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        names = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
        fallbacks = zip(names, self.mu_defaults, strict=True)
        return calculate_shift(tokens, *(scheduler_config.get(k, v) for k, v in fallbacks))

    def flow_options(self) -> dict[str, Any]:
        """The run's objective settings as `flow_noise_and_target` (and `flow_sigmas`) take them."""
        o = self.cfg.objective
        return {
            "sampling": flow_sampling(o.timestep_sampling, o.loss_weighting),
            "logit_mean": o.logit_mean,
            "logit_std": o.logit_std,
            "mode_scale": o.mode_scale,
            "min_timestep": o.min_timestep,
            "max_timestep": o.max_timestep,
        }

    def flow_draw(
        self,
        comps: Components,
        latents: torch.Tensor,
        generator: torch.Generator,
        shift: float,
        steps: int | None = None,
        **accept: Any,
    ) -> NoiseDraw:
        """`flow_noise_and_target` with the run's objective settings and σ shifted by `shift`,
        weighted as diffusers' SD3 training weights the loss; `steps` (else the scheduler's
        `num_train_timesteps`) and `accept` go to the draw."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        weighting = self.cfg.objective.loss_weighting
        steps = steps or comps.noise_scheduler.config.num_train_timesteps
        options = self.flow_options()
        draw = flow_noise_and_target(
            latents, generator, **options, shift=shift, num_train_timesteps=steps, **accept
        )
        if weighting != "none":
            draw.weight = compute_loss_weighting_for_sd3(weighting, draw.timesteps / steps)
        return draw

    # ------------------------------------------------------------ single file

    def original_layout(self, state: dict, config: dict) -> dict:
        """The denoiser's weights `state` (of a transformer with `config`) in the layout of
        the model's own code, which ComfyUI's diffusion-model files hold: diffusers' names
        here; families whose original layout differs give their layout's converter."""
        return state

    def original_state(self, denoiser: Any) -> dict:
        """The denoiser's weights in its original layout (`original_layout`)."""
        return self.original_layout(denoiser.state_dict(), dict(denoiser.config))

    def single_file_state_dict(self, comps):
        # The transformer alone, in its original layout: the file ComfyUI loads as a diffusion
        # model beside the base's own text encoders and VAE.
        return self.original_state(comps.denoiser)

    def single_file_pipeline(self, path, config_source):
        name = self.part("denoiser").library_class.rpartition(".")[2]
        return self.transformer_file_pipeline(name, path, config_source)

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        return self.build_pipeline(comps)

    def _text_pipeline(self, comps: Components) -> Any:
        """The pipeline holding only the text parts (enough for `encode_prompt`)."""
        return self.build_pipeline(comps, text_only=True)

    def build_pipeline(
        self, comps: Components, cls: type | None = None, text_only: bool = False, **extra: Any
    ) -> Any:
        """`cls` (else `pipeline_type`) over the parts of the table it takes (`pipeline_part`),
        and `extra` arguments (which replace a part's)."""
        cls = cls or self.pipeline_type()
        takes = inspect.signature(cls.__init__).parameters
        kwargs: dict[str, Any] = {}
        index: dict[str, int] = {}
        for part in self.parts:
            i = index[part.role] = index.get(part.role, -1) + 1
            if part.name in takes:
                kwargs[part.name] = self.pipeline_part(comps, part, i, text_only)
        return cls(**{**kwargs, **extra})

    def pipeline_part(self, comps: Components, part: Part, i: int, text_only: bool) -> Any:
        """What the pipeline gets for `part`, the `i`-th of its role: the loaded module (None
        when not loaded, or with `text_only` for all but the text parts), the tokenizer, a
        fresh copy of the training scheduler (sampling changes its state), the processor, a
        held part."""
        role = part.role
        if role in ("text_encoder", "tokenizer"):
            loaded = comps.text_encoders if role == "text_encoder" else comps.tokenizers
            return loaded[i] if i < len(loaded) else None
        if role == "processor":
            return self.processor(comps)
        if text_only:
            return None
        if role == "held":
            return self.held(comps, part.name)
        if role == "scheduler":
            return type(comps.noise_scheduler).from_config(comps.noise_scheduler.config)
        return comps.denoiser if role == "denoiser" else comps.vae

    def call_kwargs(self, spec: ImageSpec) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale,
            "width": spec.width,
            "height": spec.height,
            "max_sequence_length": self.max_sequence_length(),
        }
        if spec.adapter_scale != 1.0:
            kwargs[self.scale_kwarg] = {"scale": spec.adapter_scale}
        return kwargs

    def require_image(self, spec: ImageSpec) -> None:
        """Refuse an image-to-video validation prompt without its image (its one control)."""
        if not spec.control:
            raise KitError(
                f"validation prompt {spec.prompt!r}: image-to-video draws from an image; "
                "give it as validation_prompts: [{prompt: ..., control: [image]}]"
            )

    def first_frame_kwargs(self, spec: ImageSpec) -> dict[str, Any]:
        """An image-to-video call's `image`: the file, so the sidecar records it
        (`pipeline_call` opens it); nothing when the run draws from text alone."""
        if self.i2v is None:
            return {}
        return {"image": spec.control[0] if spec.control else None}

    def draw_clip(self, pipe: Any, spec: ImageSpec) -> Any:
        """The pipeline's output for `spec`, a video family's draw; an image-to-video prompt
        without its image is refused first."""
        if self.i2v is not None:
            self.require_image(spec)
        generator = torch.Generator(spec.generator_device).manual_seed(spec.seed)
        with torch.no_grad():
            return pipe(**self.pipeline_call(spec), generator=generator)

    def packed_meta_latents(self, parts: dict, batch: int, height: int, width: int) -> torch.Tensor:
        """Meta-device latents of an image this size, for `denoiser_inputs` of a family whose
        transformer takes 2×2-packed latents: (B, in_channels / 4, h, w), sides even."""
        config = parts["vae"].config
        # The VAE's factor (Wan's and Qwen-Image's halve once per temporal flag), × 2.
        steps = config.get("temperal_downsample") or config.block_out_channels[1:]
        f = 2 ** len(steps) * 2
        channels = parts["denoiser"].config.in_channels // 4
        return torch.zeros(batch, channels, height // f * 2, width // f * 2, device="meta")

    def processor(self, comps: Components) -> Any:
        """The processor part of the base `comps` came from (families with one say how)."""
        raise NotImplementedError(f"{self.name} has no processor")

    def held(self, comps: Components, name: str) -> Any:
        """The held part `name` of the base `comps` came from (families with one say how)."""
        raise NotImplementedError(f"{self.name} holds no part {name}")
