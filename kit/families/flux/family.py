"""Flux.1 (dev and schnell): a flow-matching MMDiT on packed 2×2 latent patches, CLIP pooled + T5.

The cache holds unpacked VAE latents (B, 16, H/8, W/8); packing into the token sequence, the
position ids and the guidance embedding are built per step, exactly as FluxPipeline builds them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from kit.errors import ConfigError
from kit.families import adapter_keys, register, tiny
from kit.families.base import Components
from kit.families.flow import JOINT_ATTENTION, FlowFamily
from kit.families.flux import layout as flux_layout
from kit.families.identity import part_config
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import CUSTOM_SIGMA_SAMPLERS
from kit.families.shipped import config_source

if TYPE_CHECKING:
    from kit.config import Config


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) latents → (B, h/2 · w/2, 4C) tokens of 2×2 patches, as FluxPipeline packs them."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens back to (B, C, height, width) latents; sizes in latent pixels."""
    from diffusers import FluxPipeline

    # The pipeline's helper takes image pixels and a VAE factor; a factor of 1 means latent pixels.
    return FluxPipeline._unpack_latents(tokens, height, width, 1)


@register
class Flux(FlowFamily):
    """Flux.1 dev (guidance embedding) or schnell (none), read from the transformer's config."""

    name = "flux"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    samplers = CUSTOM_SIGMA_SAMPLERS
    size_multiple = 16
    native_resolution = 1024
    hub_id = "black-forest-labs/FLUX.1-dev"
    bucket_step = 64
    default_lora_targets = JOINT_ATTENTION
    pipeline_class = "FluxPipeline"
    # Flux dev's distilled guidance, not a CFG scale: FluxPipeline samples with 3.5 by default,
    # and diffusers' and kohya's Flux trainers feed the same 3.5 in training.
    default_guidance_scale = 3.5
    default_train_guidance_scale = 3.5
    pipeline_kwargs: dict[str, Any] = {}
    # CLIP-L only: FluxPipeline loads no LoRA into T5 (sd-scripts would name it lora_te3).
    kohya_text_prefixes = ("lora_te1",)
    base_model_version = "flux1"  # sd-scripts' value
    modelspec_architecture = "flux-1-dev"
    modelspec_implementation = "https://github.com/black-forest-labs/flux"
    export_formats = ("diffusers", "kohya")
    kohya_dora = False

    original_layout = staticmethod(flux_layout.to_original)

    def kohya_state_dict(self, state, alpha):
        # One LoRA per fused BFL weight (q, k, v → qkv; + the MLP input in single blocks).
        return flux_layout.kohya_lora(state, alpha)

    def lycoris_naming(self):
        # A Kronecker product cannot hold three fused parts: LoHa / LoKr keep diffusers' module
        # names under `lycoris_`, which ComfyUI maps into the fused rows itself.
        return flux_layout.LYCORIS_PREFIX, flux_layout.lycoris_module

    def client_models(self, comps):
        # ComfyUI holds Flux in the BFL layout; the LoRA names those weights, the LyCORIS
        # names diffusers' modules, which ComfyUI maps into the fused rows itself.
        t, clip = comps.denoiser, comps.text_encoders[0]
        config = dict(t.config)
        model = {
            **adapter_keys.prefixed("diffusion_model.", self.original_state(t)),
            **adapter_keys.clip_state(clip, "clip_l.transformer."),
        }
        aliases = adapter_keys.offset_aliases(
            flux_layout.module_map(config), flux_layout.SWAPPED_HALVES
        )
        return {"ComfyUI": (model, aliases)}

    def version_metadata(self) -> dict[str, str]:
        source = config_source(self.model_source(self.cfg.model.pretrained_model))
        dev = part_config(source, "transformer").get("guidance_embeds", True)
        return {
            **super().version_metadata(),
            "modelspec.architecture": "flux-1-dev" if dev else "flux-1-schnell",
        }

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        if not self.cfg.model.use_t5:
            raise ConfigError("use_t5: flux cannot run without its T5 text encoder; set it to true")

    def train_guidance_scale(self) -> float:
        """The guidance fed to a guidance-embedding model in training: configured, else 3.5."""
        configured = self.cfg.objective.train_guidance_scale
        return self.default_train_guidance_scale if configured is None else float(configured)

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("FluxTransformer2DModel"),
        vae(),
        *text("CLIPTextModel", "CLIPTokenizer", trainable=True),
        *text("T5EncoderModel", "T5TokenizerFast", 2),
        scheduler(),
    )

    quantized_text_encoders = ("text_encoder_2",)  # T5-XXL
    # BFL's transformer file (ComfyUI's diffusion_models); all-in-one files add the encoders.
    single_file_markers = ("double_blocks.0.img_attn.qkv.weight",)
    # Chroma shares the BFL block names; its modulation approximator is its own.
    single_file_excludes = ("distilled_guidance_layer.in_proj.bias",)
    file_text_prefixes = ("text_encoders.clip_l.", "text_encoders.t5xxl.")

    def token_limit(self, encoder, tokenizer):
        if encoder == "text_encoder_2":
            return self.max_sequence_length()
        return super().token_limit(encoder, tokenizer)

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt, so cached embeddings are what sampling computes.
        pipe = self._text_pipeline(comps)
        embeds, pooled, _ = pipe.encode_prompt(
            captions,
            device=comps.text_encoders[1].device,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    # ------------------------------------------------------------ training

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        config = getattr(transformer, "module", transformer).config  # unwrapped under DDP
        kwargs = self.transformer_kwargs(config, noisy, timesteps, cond)
        out = transformer(**kwargs, return_dict=False)[0]
        h, w = noisy.shape[-2:]
        # The pipeline keeps the target's tokens of the prediction (a control's come after).
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)

    def transformer_kwargs(self, config, latents, timesteps, cond) -> dict[str, Any]:
        """The transformer's arguments for `cond`'s tensors, as the pipeline builds them."""
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        guidance = self.train_guidance_scale()
        return _transformer_inputs(config, latents, timesteps, embeds, pooled, guidance)

    def swap_blocks(self, denoiser):
        # The double-stream blocks run first, then the single-stream ones.
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # ------------------------------------------------------------ sampling

    def call_kwargs(self, spec):
        from diffusers import FluxPipeline

        kwargs = super().call_kwargs(spec)  # guidance: dev's distilled input; schnell ignores it
        if spec.negative_prompt:
            kwargs["negative_prompt"] = spec.negative_prompt
            # A negative prompt acts only through true CFG, which doubles the sampling cost.
            if "true_cfg_scale" in inspect.signature(FluxPipeline.__call__).parameters:
                kwargs["true_cfg_scale"] = spec.guidance_scale
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        meta = {"device": "meta"}
        cond = {
            "prompt_embeds": torch.zeros(
                batch, self.max_sequence_length(), config.joint_attention_dim, **meta
            ),
            "pooled_prompt_embeds": torch.zeros(batch, config.pooled_projection_dim, **meta),
            **self.meta_controls(parts, batch, height, width),
        }
        latents = self.packed_meta_latents(parts, batch, height, width)
        kwargs = self.transformer_kwargs(config, latents, torch.zeros(batch, **meta), cond)
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    def meta_controls(self, parts, batch, height, width) -> dict[str, Any]:
        """Meta-device control latents a step of this size takes (none for Flux.1)."""
        return {}

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import FluxTransformer2DModel
        from transformers import CLIPTextModel

        torch.manual_seed(seed)
        tokenizer, tokenizer_2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        text_encoder = CLIPTextModel(tiny.clip_text_config(tokenizer))
        text_encoder_2 = tiny.t5_v11_encoder(tokenizer_2)
        vae = tiny.flux_vae()
        sizes = tiny.flux_transformer_sizes(pooled_projection_dim=32, guidance_embeds=True)
        transformer = FluxTransformer2DModel(**sizes)
        text = (text_encoder, tokenizer, text_encoder_2, tokenizer_2)
        return self.save_tiny(out_dir, transformer, vae, *text, tiny.dynamic_flow_scheduler())

    # ------------------------------------------------------------ helpers

    def _text_pipeline(self, comps: Components) -> Any:
        # FluxPipeline's encode_prompt, for Kontext too (whose pipeline's is a copy of it).
        from diffusers import FluxPipeline

        return self.build_pipeline(comps, FluxPipeline, text_only=True)


def _transformer_inputs(
    config: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
    guidance_scale: float,
) -> dict[str, Any]:
    """FluxTransformer2DModel's arguments for unpacked latents, built as FluxPipeline builds them."""
    from diffusers import FluxPipeline

    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    guidance = None
    if config.guidance_embeds:  # dev-style; schnell-style models have no guidance input
        guidance = torch.full((b,), guidance_scale, device=device, dtype=torch.float32)
    return {
        "hidden_states": pack_latents(latents),
        # The pipeline feeds σ in [0, 1] (its timesteps / 1000); the model scales it back.
        "timestep": timesteps.to(dtype) / 1000,
        "guidance": guidance,
        "pooled_projections": pooled.to(device, dtype),
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
        "img_ids": FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
    }
