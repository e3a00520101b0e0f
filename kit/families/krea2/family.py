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
from typing import Any

import torch

from kit.families import adapter_keys, register
from kit.families.base import Components, NoiseDraw
from kit.families.flow import FlowFamily
from kit.families.krea2 import layout as krea2_layout
from kit.families.krea2 import tiny as krea2_tiny
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source

SUFFIX_TOKENS = 5
"""The assistant suffix the pipeline appends after each caption's padding
(`prompt_template_encode_num_suffix_tokens`): a caption keeps L − 5 tokens."""
TURBO_MU = 1.15
"""The fixed time shift (mu) Krea2Pipeline samples the distilled checkpoint with."""
PIPELINE_ARGS = ("text_encoder_select_layers", "is_distilled", "patch_size")
"""Krea2Pipeline's own settings, which its `model_index.json` records."""
RAW, TURBO = "Raw", "Turbo"


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
class Krea2(FlowFamily):
    """Krea 2 Raw or Turbo; which one is read from the base's `model_index.json`."""

    name = "krea2"
    scale_kwarg = "attention_kwargs"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    # Krea2Pipeline's own `calculate_shift` fallbacks: up to 6400 image tokens.
    mu_defaults = (256, 6400, 0.5, 1.15)
    default_max_sequence_length = 512  # Krea2Pipeline's, the assistant suffix included
    # The pipeline hands its scheduler custom sigmas and a mu, which these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    size_multiple = 16  # the VAE's 8 × the 2×2 patches (the pipeline rounds other sizes up)
    native_resolution = 1024  # Krea2Pipeline's default size
    hub_id = "krea/Krea-2-Raw"  # diffusers' single-file default repository for Krea 2
    bucket_step = 64
    variants = (RAW, TURBO)
    variant_guidance = {RAW: 4.5, TURBO: 0.0}
    variant_steps = {RAW: 28, TURBO: 8}
    """Validation guidance and steps per release, as Krea2Pipeline's docstring gives them: Raw
    (its "base (midtrain)" checkpoint) the pipeline's defaults, Turbo 8 steps without guidance."""
    distilled_variants = {
        TURBO: "Krea 2 Turbo is step-distilled (its model_index.json says is_distilled: it "
        "samples in about 8 steps without CFG, at a fixed time shift); Krea 2 Raw is not"
    }
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
    # The "kohya" file is Krea's own LoRA layout (krea2_layout.LORA_PREFIX says why).
    kohya_prefix = krea2_layout.LORA_PREFIX
    # Krea2Pipeline loads LoRA into the transformer only (`_lora_loadable_modules`).
    kohya_text_prefixes = ()
    diffusers_reads_kohya = True  # `_convert_non_diffusers_krea2_lora_to_diffusers`
    base_model_version = "krea2"
    modelspec_architecture = "krea-2-raw"
    modelspec_implementation = "https://github.com/krea-ai/krea-2"
    export_formats = ("diffusers", "kohya")

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

    def version_metadata(self) -> dict[str, str]:
        return {
            **super().version_metadata(),
            "modelspec.architecture": f"krea-2-{self.configured_variant().lower()}",
        }

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("Krea2Transformer2DModel"),
        vae("AutoencoderKLQwenImage"),
        *text("Qwen3VLModel", "AutoTokenizer"),
        scheduler(),
    )
    vae_frames = True  # the Qwen-Image VAE (Wan's 3D causal one), used on single frames

    quantized_text_encoders = ("text_encoder",)  # Qwen3-VL-4B, only ever read frozen
    # Krea's transformer file (ComfyUI's diffusion_models), in the original layout; the key
    # diffusers' single-file loader tells Krea 2 by.
    single_file_markers = ("txtfusion.projector.weight",)

    def identity_extras(self, pretrained, revision):
        # The cached embeddings are padded to this length and tapped at these layers.
        layers = self._pipeline_args(pretrained).get("text_encoder_select_layers")
        return [self.max_sequence_length(), layers]

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

    # ------------------------------------------------------------ training

    def sigma_shift(self, comps: Components, height: int, width: int) -> float:
        """The σ shift the pipeline samples this size at: Raw's resolution-dependent one
        (`FlowFamily.flow_shift`), Turbo's fixed mu 1.15 where the scheduler shifts by mu."""
        config = comps.noise_scheduler.config
        turbo = self._pipeline_args(comps.source).get("is_distilled", False)
        if self.cfg.objective.flow_shift > 0 or not turbo:
            return self.flow_shift(config, height, width)
        if not config.get("use_dynamic_shifting", False):
            return float(config.get("shift", 1.0))  # the scheduler ignores the pipeline's mu
        return TURBO_MU if config.get("time_shift_type") == "linear" else math.exp(TURBO_MU)

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        # Turbo's fixed shift depends on the base `comps` came from (`sigma_shift`).
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

    def build_pipeline(self, comps, cls=None, text_only=False, **extra):
        # Krea2Pipeline's own settings (tapped layers, distillation, patch size), as the base's
        # model_index records them.
        args = {**self._pipeline_args(comps.source), **extra}
        return super().build_pipeline(comps, cls, text_only, **args)

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        # CFG runs whenever the scale is above 0, as cond + scale · (cond − uncond).
        if spec.guidance_scale > 0:
            # Named even when empty: the pipeline takes None to mean "", and a run drawing from
            # cached embeddings needs the text it stands for.
            kwargs["negative_prompt"] = spec.negative_prompt
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        meta = {"device": "meta"}
        latents = self.packed_meta_latents(parts, batch, height, width)
        seq = self.max_sequence_length()  # every caption is padded to it
        embeds = torch.zeros(batch, seq, config.num_text_layers, config.text_hidden_dim, **meta)
        mask = torch.ones(batch, seq, dtype=torch.bool, **meta)
        kwargs = transformer_inputs(latents, torch.zeros(batch, **meta), embeds, mask, None)
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        """A tiny random-init Krea 2 Raw (`kit.families.krea2.tiny`)."""
        built = krea2_tiny.parts(seed)
        return self.save_tiny(
            out_dir, *built, text_encoder_select_layers=krea2_tiny.TAPS, is_distilled=False
        )

    # ------------------------------------------------------------ export

    def kohya_module(self, module):
        # The original module path (LoHa / LoKr files name it under `kohya_prefix` too).
        return krea2_layout.original_module(module)

    def kohya_state_dict(self, state, alpha):
        # Krea's own LoRA keys: lora_A / lora_B, the scale folded in, no alpha.
        return krea2_layout.lora_file(state, alpha)

    def original_layout(self, state, config):
        # Krea's own module names (its transformer file, ComfyUI's diffusion_models).
        return krea2_layout.to_original(state)

    def client_models(self, comps):
        # ComfyUI holds Krea 2 in the original layout and reads `diffusion_model.<its key>`
        # names for every model: the kit's file needs none of its diffusers-name aliases.
        model = self.original_state(comps.denoiser)
        return {"ComfyUI": (adapter_keys.prefixed("diffusion_model.", model), None)}
