"""Krea 2 (Raw and Turbo): a single-stream flow-matching MMDiT on 2×2 patches of the Qwen-Image
VAE's latents, conditioned on a stack of hidden states tapped from twelve layers of Qwen3-VL-4B.

The cache holds each image's normalised VAE latents as (16, H/8, W/8) (the VAE's one frame
dropped) and each caption's tapped hidden states exactly as `Krea2Pipeline.encode_prompt` gives
them: a fixed-length block (B, L, layers, D) with its boolean mask (the pipeline pads in the
middle of its template, before the assistant suffix, so every caption has length L). Packing,
the position ids and the timestep scale are built per step as the pipeline builds them.

Which release a base is comes from its `model_index.json`: Krea2Pipeline's `is_distilled` marks
Turbo, the few-step distilled model that samples in 8 steps without CFG at a fixed time shift
(mu 1.15); Raw samples in 28 steps with CFG 4.5 and a resolution-dependent shift.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kit.errors import ConfigError
from kit.families import adapter_keys, register
from kit.families.base import PARTS, Components, Family, NoiseDraw, posterior_latent
from kit.families.krea2 import layout as krea2_layout
from kit.families.krea2 import tiny as krea2_tiny
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source

if TYPE_CHECKING:
    from kit.config import Config

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # Krea2Pipeline's `max_sequence_length`
SUFFIX_TOKENS = 5
"""The assistant suffix the pipeline appends after each caption's padding
(`prompt_template_encode_num_suffix_tokens`): a caption keeps L − 5 tokens."""
TURBO_MU = 1.15
"""The fixed time shift (mu) Krea2Pipeline samples the distilled checkpoint with."""
PIPELINE_ARGS = ("text_encoder_select_layers", "is_distilled", "patch_size")
"""Krea2Pipeline's own settings, which its `model_index.json` records."""
RAW, TURBO = "Raw", "Turbo"
GUIDANCE = {RAW: 4.5, TURBO: 0.0}
STEPS = {RAW: 28, TURBO: 8}
"""Validation guidance and steps per release, as Krea2Pipeline's docstring gives them: Raw
(its "base (midtrain)" checkpoint) the pipeline's defaults, Turbo 8 steps without guidance."""


@functools.lru_cache(maxsize=32)
def pipeline_config(source: str) -> dict[str, Any]:
    """A base's `model_index.json`: a folder's, the shipped copy's, or a hub download already in
    the local cache; {} when none of these has it (nothing is downloaded for it)."""
    folder = Path(config_source(source))
    path: Path | None = folder / "model_index.json"
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "model_index.json")
        path = Path(found) if isinstance(found, str) else None
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path else {}
    except (OSError, ValueError):
        return {}


def pack(latents: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """(B, C, h, w) latents → (B, h/p · w/p, C·p²) tokens, as `Krea2Pipeline._pack_latents`."""
    b, c, h, w = latents.shape
    tokens = latents.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens: torch.Tensor, h: int, w: int, patch: int = 2) -> torch.Tensor:
    """`pack`'s inverse: tokens → (B, C, h, w) latents (sizes in latent pixels)."""
    b, _, channels = tokens.shape
    c = channels // (patch * patch)
    latents = tokens.reshape(b, h // patch, w // patch, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, c, h, w)


def transformer_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor,
    dtype: torch.dtype | None,
    patch: int = 2,
    train_steps: int = 1000,
) -> dict[str, Any]:
    """Krea2Transformer2DModel's arguments for (B, C, h, w) latents at `timesteps` (σ · 1000),
    built as Krea2Pipeline builds them for one denoising step: packed latents, the flow time
    t / 1000 = σ, the tapped hidden states and their boolean mask as cached, and the (t, h, w)
    position ids of the text (at the origin) and the image grid. `dtype` is the transformer's
    (None keeps the latents'); the pipeline runs latents and text in the text encoder's, the
    transformer's own in every released setup."""
    from diffusers import Krea2Pipeline

    dtype = dtype or latents.dtype
    _, _, h, w = latents.shape
    device = latents.device
    return {
        "hidden_states": pack(latents.to(dtype), patch),
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        # The pipeline: (t / num_train_timesteps).expand(B).to(latents.dtype).
        "timestep": (timesteps.to(device) / train_steps).to(dtype),
        "position_ids": Krea2Pipeline.prepare_position_ids(
            prompt_embeds.shape[1], h // patch, w // patch, device
        ),
        "encoder_attention_mask": prompt_embeds_mask.to(device, torch.bool),
    }


@register
class Krea2(Family):
    """Krea 2 Raw or Turbo; which one is read from the base's `model_index.json`."""

    name = "krea2"
    # The pipeline hands its scheduler custom sigmas and a mu, which these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    size_multiple = 16  # the VAE's 8 × the 2×2 patches (the pipeline rounds other sizes up)
    native_resolution = 1024  # Krea2Pipeline's default size
    hub_id = "krea/Krea-2-Raw"  # diffusers' single-file default repository for Krea 2
    bucket_step = 64
    variants = (RAW, TURBO)
    # Every linear layer of attention (with its output gate) and of the SwiGLU, in the main
    # blocks and the text-fusion blocks: the modules both Krea's LoRA layout and ComfyUI name.
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "to_gate",
        "ff.gate",
        "ff.up",
        "ff.down",
    )
    pipeline_class = "Krea2Pipeline"
    pipeline_kwargs: dict[str, Any] = {}
    lora_layers_kwarg = "transformer_lora_layers"
    # The "kohya" file is Krea's own LoRA layout (krea2_layout.LORA_PREFIX says why).
    kohya_prefix = krea2_layout.LORA_PREFIX
    # Krea2Pipeline loads LoRA into the transformer only (`_lora_loadable_modules`).
    kohya_text_prefixes = ()
    diffusers_reads_kohya = True  # `_convert_non_diffusers_krea2_lora_to_diffusers`
    base_model_version = "krea2"
    modelspec_architecture = "krea-2-raw"
    modelspec_implementation = "https://github.com/krea-ai/krea-2"
    export_formats = ("diffusers", "kohya")

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        step = self.cfg.data.bucket_step
        if step % 16:
            # Packing needs an even latent side: 2 × the VAE's 8x.
            raise ConfigError(
                f"bucket_step: {step} must be a multiple of 16 for krea2 (64 is usual)"
            )

    def max_sequence_length(self) -> int:
        """Text tokens per caption (the suffix included): configured, else the pipeline's 512."""
        return self.cfg.model.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH

    # ------------------------------------------------------------ variants

    def _pipeline_args(self, pretrained: str) -> dict[str, Any]:
        """The pipeline settings the base records (tapped layers, distillation, patch size)."""
        found = pipeline_config(self.model_source(pretrained))
        return {k: found[k] for k in PIPELINE_ARGS if k in found}

    def variant_of(self, pretrained: str) -> str:
        args = self._pipeline_args(pretrained)
        if "is_distilled" in args:
            return TURBO if args["is_distilled"] else RAW
        # No pipeline config to read (a hub id neither shipped nor downloaded): its name.
        return TURBO if "turbo" in str(pretrained).lower() else RAW

    def distillation(self, pretrained: str) -> str:
        if self.variant_of(pretrained) != TURBO:
            return ""
        return (
            "Krea 2 Turbo is step-distilled (its model_index.json says is_distilled: it samples "
            "in about 8 steps without CFG, at a fixed time shift); Krea 2 Raw is not"
        )

    def _configured(self) -> str:
        return self.variant_of(self.cfg.model.pretrained_model or self.hub_id)

    @property
    def default_guidance_scale(self) -> float:  # type: ignore[override]
        """Krea2Pipeline's guidance for this release: 4.5 for Raw, 0 (no CFG) for Turbo."""
        return GUIDANCE[self._configured()]

    @property
    def default_num_inference_steps(self) -> int:  # type: ignore[override]
        """The validation steps of this release (`STEPS`)."""
        return STEPS[self._configured()]

    def version_metadata(self) -> dict[str, str]:
        return {
            **super().version_metadata(),
            "modelspec.architecture": f"krea-2-{self._configured().lower()}",
        }

    # ------------------------------------------------------------ loading

    text_subfolders = ("text_encoder",)
    quantized_text_encoders = ("text_encoder",)  # Qwen3-VL-4B, only ever read frozen
    # Krea's transformer file (ComfyUI's diffusion_models), in the original layout; the key
    # diffusers' single-file loader tells Krea 2 by.
    single_file_markers = ("txtfusion.projector.weight",)

    def identity_extras(self, pretrained, revision):
        # The cached embeddings are padded to this length and tapped at these layers.
        layers = self._pipeline_args(pretrained).get("text_encoder_select_layers")
        return [self.max_sequence_length(), layers]

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            Krea2Transformer2DModel,
        )
        from transformers import Qwen3VLModel

        return self.load_parts(
            pretrained,
            parts,
            revision=revision,
            variant=variant,
            dtype=dtype,
            denoiser=(Krea2Transformer2DModel, "transformer"),
            vae=(AutoencoderKLQwenImage, "vae"),
            encoders=[(Qwen3VLModel, "text_encoder")],
            tokenizers=[self._tokenizer(pretrained, revision)],
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_source(pretrained), subfolder="scheduler", revision=revision
            ),
        )

    def load_tokenizers(self, pretrained):
        return {"text_encoder": self._tokenizer(pretrained)}

    def _tokenizer(self, pretrained: str, revision: str | None = None) -> Any:
        from transformers import AutoTokenizer

        source = self.model_source(pretrained, ("tokenizer",))
        return AutoTokenizer.from_pretrained(source, subfolder="tokenizer", revision=revision)

    def token_limit(self, encoder, tokenizer):
        # The pipeline cuts the caption (after its system prefix) so that caption + suffix fill
        # the fixed length.
        return self.max_sequence_length() - SUFFIX_TOKENS

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt: template, fixed-length padding before the suffix,
        # real-token positions, the tapped layers stacked, the system prefix dropped.
        pipe = self._text_pipeline(comps)
        embeds, mask = pipe.encode_prompt(
            list(captions),
            device=comps.text_encoders[0].device,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def prompt_kwargs(self, text):
        # The mask goes to attention as a key-padding mask: it must stay boolean.
        return {
            "prompt_embeds": text["prompt_embeds"],
            "prompt_embeds_mask": text["prompt_embeds_mask"].bool(),
        }

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        dist = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist
        latents = posterior_latent(dist, generator)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        # The inverse of the pipeline's decode (latents · std + mean), the one frame dropped.
        return ((latents - mean) / std).squeeze(2)

    # ------------------------------------------------------------ training

    def dynamic_mu(self, scheduler_config, tokens):
        # Krea2Pipeline's own fallbacks where the scheduler config names none (6400 tokens).
        from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

        return calculate_shift(
            tokens,
            scheduler_config.get("base_image_seq_len", 256),
            scheduler_config.get("max_image_seq_len", 6400),
            scheduler_config.get("base_shift", 0.5),
            scheduler_config.get("max_shift", 1.15),
        )

    def sigma_shift(self, comps: Components, height: int, width: int) -> float:
        """The σ shift the pipeline samples this size at: Raw's resolution-dependent one
        (`Family.flow_shift`), Turbo's fixed mu 1.15 where the scheduler shifts by mu."""
        config = comps.noise_scheduler.config
        turbo = self._pipeline_args(comps.source).get("is_distilled", False)
        if self.cfg.objective.flow_shift > 0 or not turbo:
            return self.flow_shift(config, height, width)
        if not config.get("use_dynamic_shifting", False):
            return float(config.get("shift", 1.0))  # the scheduler ignores the pipeline's mu
        return TURBO_MU if config.get("time_shift_type") == "linear" else math.exp(TURBO_MU)

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        shift = self.sigma_shift(comps, latents.shape[-2], latents.shape[-1])
        return self.flow_draw(comps, latents, generator, shift)

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        inner = getattr(transformer, "module", transformer)  # unwrapped under DDP
        patch = self._pipeline_args(comps.source).get("patch_size", 2)
        kwargs = transformer_inputs(
            noisy,
            timesteps,
            cond["prompt_embeds"],
            cond["prompt_embeds_mask"],
            inner.dtype,
            patch,
            comps.noise_scheduler.config.num_train_timesteps,
        )
        out = transformer(**kwargs, return_dict=False)[0]
        # The pipeline steps with the output as it is: the velocity noise − latents.
        return unpack(out, noisy.shape[-2], noisy.shape[-1], patch)

    def swap_blocks(self, denoiser):
        # The text fusion runs first (across layers, then across tokens), then the main stack.
        fusion = denoiser.text_fusion
        return [*fusion.layerwise_blocks, *fusion.refiner_blocks, *denoiser.transformer_blocks]

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        from diffusers import Krea2Pipeline

        # A fresh scheduler: sampling changes its state.
        scheduler = type(comps.noise_scheduler).from_config(comps.noise_scheduler.config)
        return Krea2Pipeline(
            scheduler=scheduler,
            vae=comps.vae,
            text_encoder=comps.text_encoders[0] if comps.text_encoders else None,
            tokenizer=comps.tokenizers[0],
            transformer=comps.denoiser,
            **self._pipeline_args(comps.source),
        )

    def call_kwargs(self, spec):
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "num_inference_steps": spec.num_inference_steps,
            # CFG runs whenever the scale is above 0, as cond + scale · (cond − uncond).
            "guidance_scale": spec.guidance_scale,
            "width": spec.width,
            "height": spec.height,
            "max_sequence_length": self.max_sequence_length(),
        }
        if spec.guidance_scale > 0:
            # Named even when empty: the pipeline takes None to mean "", and a run drawing from
            # cached embeddings needs the text it stands for.
            kwargs["negative_prompt"] = spec.negative_prompt
        if spec.adapter_scale != 1.0:
            kwargs["attention_kwargs"] = {"scale": spec.adapter_scale}
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
        from transformers import Qwen3VLModel

        return self.empty_from_configs(
            pretrained,
            denoiser=(Krea2Transformer2DModel, "transformer"),
            vae=(AutoencoderKLQwenImage, "vae"),
            encoders=[(Qwen3VLModel, "text_encoder")],
        )

    def denoiser_inputs(self, parts, batch, height, width):
        transformer, vae = parts["denoiser"], parts["vae"]
        config = transformer.config
        f = 2 ** len(vae.config.temperal_downsample)  # the VAE's 8x
        meta = {"device": "meta"}
        latents = torch.zeros(batch, config.in_channels // 4, height // f, width // f, **meta)
        seq = self.max_sequence_length()  # every caption is padded to it
        embeds = torch.zeros(batch, seq, config.num_text_layers, config.text_hidden_dim, **meta)
        mask = torch.ones(batch, seq, dtype=torch.bool, **meta)
        kwargs = transformer_inputs(latents, torch.zeros(batch, **meta), embeds, mask, None)
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        """A tiny random-init Krea 2 Raw (`kit.families.krea2.tiny`)."""
        return krea2_tiny.make(out_dir, seed)

    # ------------------------------------------------------------ export

    def kohya_module(self, module):
        # The original module path (LoHa / LoKr files name it under `kohya_prefix` too).
        return krea2_layout.original_module(module)

    def kohya_state_dict(self, state, alpha):
        # Krea's own LoRA keys: lora_A / lora_B, the scale folded in, no alpha.
        return krea2_layout.lora_file(state, alpha)

    def client_models(self, comps):
        # ComfyUI holds Krea 2 in the original layout and reads `diffusion_model.<its key>`
        # names for every model: the kit's file needs none of its diffusers-name aliases.
        model = krea2_layout.to_original(comps.denoiser.state_dict())
        return {"ComfyUI": (adapter_keys.prefixed("diffusion_model.", model), None)}

    def single_file_state_dict(self, comps):
        # The transformer alone, in the original layout: ComfyUI's diffusion_models file.
        return krea2_layout.to_original(comps.denoiser.state_dict())

    def single_file_pipeline(self, path, config_source):
        return self.transformer_file_pipeline("Krea2Transformer2DModel", path, config_source)

    # ------------------------------------------------------------ helpers

    def _text_pipeline(self, comps: Components) -> Any:
        """A Krea2Pipeline holding only the text parts (enough for `encode_prompt`)."""
        from diffusers import Krea2Pipeline

        return Krea2Pipeline(
            scheduler=None,
            vae=None,
            text_encoder=comps.text_encoders[0],
            tokenizer=comps.tokenizers[0],
            transformer=None,
            **self._pipeline_args(comps.source),
        )
