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
from kit.families.base import PARTS, Components, Family, NoiseDraw, posterior_latent
from kit.families.flux import layout as flux_layout
from kit.families.identity import part_config
from kit.families.samplers import FLOW_SAMPLERS
from kit.families.shipped import config_source

if TYPE_CHECKING:
    from kit.config import Config

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default T5 length


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
class Flux(Family):
    """Flux.1 dev (guidance embedding) or schnell (none), read from the transformer's config."""

    name = "flux"
    # FluxPipeline passes custom sigmas, which the flow Heun scheduler cannot take.
    samplers = tuple(s for s in FLOW_SAMPLERS if s != "flow_heun")
    size_multiple = 16
    native_resolution = 1024
    hub_id = "black-forest-labs/FLUX.1-dev"
    bucket_step = 64
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )
    pipeline_class = "FluxPipeline"
    # Flux dev's distilled guidance, not a CFG scale: FluxPipeline samples with 3.5 by default,
    # and diffusers' and kohya's Flux trainers feed the same 3.5 in training.
    default_guidance_scale = 3.5
    default_train_guidance_scale = 3.5
    pipeline_kwargs: dict[str, Any] = {}
    lora_layers_kwarg = "transformer_lora_layers"
    # CLIP-L only: FluxPipeline loads no LoRA into T5 (sd-scripts would name it lora_te3).
    kohya_text_prefixes = ("lora_te1",)
    base_model_version = "flux1"  # sd-scripts' value
    modelspec_architecture = "flux-1-dev"
    modelspec_implementation = "https://github.com/black-forest-labs/flux"
    export_formats = ("diffusers", "kohya")
    kohya_dora = False

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
            **adapter_keys.prefixed(
                "diffusion_model.", flux_layout.to_original(t.state_dict(), config)
            ),
            **adapter_keys.clip_state(clip, "clip_l.transformer."),
        }
        aliases = adapter_keys.offset_aliases(
            flux_layout.module_map(config), flux_layout.SWAPPED_HALVES
        )
        return {"ComfyUI": (model, aliases)}

    def single_file_state_dict(self, comps):
        # The transformer alone, in its original layout: the file ComfyUI loads as a diffusion
        # model beside the base's own text encoders and VAE.
        t = comps.denoiser
        return flux_layout.to_original(t.state_dict(), dict(t.config))

    def single_file_pipeline(self, path, config_source):
        return self.transformer_file_pipeline("FluxTransformer2DModel", path, config_source)

    def version_metadata(self) -> dict[str, str]:
        source = config_source(self.model_source(self.cfg.model.pretrained_model))
        dev = part_config(source, "transformer").get("guidance_embeds", True)
        return {
            **super().version_metadata(),
            "modelspec.architecture": "flux-1-dev" if dev else "flux-1-schnell",
        }

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        step = self.cfg.data.bucket_step
        if step % 16:
            # Packing needs an even latent side: 2 × the VAE's 8x.
            raise ConfigError(
                f"bucket_step: {step} must be a multiple of 16 for flux (64 is usual)"
            )
        if not self.cfg.model.use_t5:
            raise ConfigError("use_t5: flux cannot run without its T5 text encoder; set it to true")

    def train_guidance_scale(self) -> float:
        """The guidance fed to a guidance-embedding model in training: configured, else 3.5."""
        configured = self.cfg.objective.train_guidance_scale
        return self.default_train_guidance_scale if configured is None else float(configured)

    def max_sequence_length(self) -> int:
        """T5 tokens per caption: the configured length, else FluxPipeline's default."""
        return self.cfg.model.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH

    # ------------------------------------------------------------ loading

    text_subfolders = ("text_encoder", "text_encoder_2")
    quantized_text_encoders = ("text_encoder_2",)  # T5-XXL
    # BFL's transformer file (ComfyUI's diffusion_models); all-in-one files add the encoders.
    single_file_markers = ("double_blocks.0.img_attn.qkv.weight",)
    # Chroma shares the BFL block names; its modulation approximator is its own.
    single_file_excludes = ("distilled_guidance_layer.in_proj.bias",)
    file_text_prefixes = ("text_encoders.clip_l.", "text_encoders.t5xxl.")

    def identity_extras(self, pretrained, revision):
        # The T5 length changes the cached embeddings, so it is part of their key.
        return self.max_sequence_length()

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        return self.load_parts(
            pretrained,
            parts,
            revision=revision,
            variant=variant,
            dtype=dtype,
            denoiser=(FluxTransformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=[(CLIPTextModel, "text_encoder"), (T5EncoderModel, "text_encoder_2")],
            tokenizers=list(self._tokenizers(pretrained, revision).values()),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_source(pretrained), subfolder="scheduler", revision=revision
            ),
        )

    def load_tokenizers(self, pretrained):
        return self._tokenizers(pretrained, None)

    def _tokenizers(self, pretrained: str, revision: str | None) -> dict[str, Any]:
        from transformers import CLIPTokenizer, T5TokenizerFast

        source = self.model_source(pretrained, ("tokenizer", "tokenizer_2"))
        return {
            "text_encoder": CLIPTokenizer.from_pretrained(
                source, subfolder="tokenizer", revision=revision
            ),
            "text_encoder_2": T5TokenizerFast.from_pretrained(
                source, subfolder="tokenizer_2", revision=revision
            ),
        }

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

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        latents = posterior_latent(dist, generator)
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    # ------------------------------------------------------------ training

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        config = comps.noise_scheduler.config
        shift = self.flow_shift(config, latents.shape[-2], latents.shape[-1])
        return self.flow_draw(comps, latents, generator, shift)

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        config = getattr(transformer, "module", transformer).config  # unwrapped under DDP
        kwargs = _transformer_inputs(
            config,
            noisy,
            timesteps,
            cond["prompt_embeds"],
            cond["pooled_prompt_embeds"],
            self.train_guidance_scale(),
        )
        out = transformer(**kwargs, return_dict=False)[0]
        return unpack_latents(out, noisy.shape[-2], noisy.shape[-1])

    def swap_blocks(self, denoiser):
        # The double-stream blocks run first, then the single-stream ones.
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        clip, t5 = comps.text_encoders
        tok, tok_2 = comps.tokenizers
        # A fresh scheduler: sampling changes its state.
        scheduler = type(comps.noise_scheduler).from_config(comps.noise_scheduler.config)
        return self.pipeline_type()(
            scheduler=scheduler,
            vae=comps.vae,
            text_encoder=clip,
            tokenizer=tok,
            text_encoder_2=t5,
            tokenizer_2=tok_2,
            transformer=comps.denoiser,
        )

    def call_kwargs(self, spec):
        from diffusers import FluxPipeline

        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "num_inference_steps": spec.num_inference_steps,
            # Flux dev's distilled guidance (an input of the model); schnell ignores it.
            "guidance_scale": spec.guidance_scale,
            "width": spec.width,
            "height": spec.height,
            "max_sequence_length": self.max_sequence_length(),
        }
        if spec.negative_prompt:
            kwargs["negative_prompt"] = spec.negative_prompt
            # A negative prompt acts only through true CFG, which doubles the sampling cost.
            if "true_cfg_scale" in inspect.signature(FluxPipeline.__call__).parameters:
                kwargs["true_cfg_scale"] = spec.guidance_scale
        if spec.adapter_scale != 1.0:
            kwargs["joint_attention_kwargs"] = {"scale": spec.adapter_scale}
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        return self.empty_from_configs(
            pretrained,
            denoiser=(FluxTransformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=[(CLIPTextModel, "text_encoder"), (T5EncoderModel, "text_encoder_2")],
        )

    def denoiser_inputs(self, parts, batch, height, width):
        transformer, vae = parts["denoiser"], parts["vae"]
        config = transformer.config
        f = 2 ** (len(vae.config.block_out_channels) - 1) * 2  # the VAE's factor, then 2×2 packing
        meta = {"device": "meta"}
        latents = torch.zeros(
            batch, config.in_channels // 4, height // f * 2, width // f * 2, **meta
        )
        seq = self.max_sequence_length()
        kwargs = _transformer_inputs(
            config,
            latents,
            torch.zeros(batch, **meta),
            torch.zeros(batch, seq, config.joint_attention_dim, **meta),
            torch.zeros(batch, config.pooled_projection_dim, **meta),
            self.train_guidance_scale(),
        )
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5Config, T5EncoderModel

        torch.manual_seed(seed)
        tokenizer, tokenizer_2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        text_encoder = CLIPTextModel(tiny.clip_text_config(tokenizer))
        text_encoder_2 = T5EncoderModel(
            T5Config(
                **tiny.t5_config_kwargs(
                    tokenizer_2,
                    d_model=32,
                    relative_attention_max_distance=32,
                    feed_forward_proj="gated-gelu",  # T5 v1.1, as Flux uses
                    is_encoder_decoder=False,
                )
            )
        )
        vae = tiny.autoencoder_kl(
            block_out_channels=(16, 32, 32, 32),
            latent_channels=16,
            sample_size=64,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.1159,  # Flux's VAE values
            scaling_factor=0.3611,
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels × a 2×2 patch
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        )
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = self.pipeline_type()(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            transformer=transformer,
        )
        return tiny.save_pipeline(pipe, out_dir)

    # ------------------------------------------------------------ helpers

    def pipeline_type(self) -> type:
        """The diffusers pipeline class named by `pipeline_class` (a subclass may name another)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def _text_pipeline(self, comps: Components) -> Any:
        """A FluxPipeline holding only the text parts (enough for `encode_prompt`)."""
        from diffusers import FluxPipeline

        clip, t5 = comps.text_encoders
        tok, tok_2 = comps.tokenizers
        return FluxPipeline(
            scheduler=None,
            vae=None,
            text_encoder=clip,
            tokenizer=tok,
            text_encoder_2=t5,
            tokenizer_2=tok_2,
            transformer=None,
        )


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


transformer_inputs = _transformer_inputs  # public for the families built on Flux's (Kontext)
