"""Chroma1 (HD, Base): FLUX.1-schnell pruned to 8.9 B, T5-XXL only, with a distilled modulation.

The cache holds unpacked VAE latents (B, 16, H/8, W/8) and, per caption, the T5 embeddings with
the text attention mask ChromaPipeline builds (every real token and the first padding token);
packing, position ids and the joint text + image mask are built per step, exactly as
ChromaPipeline builds them. Sampling uses true CFG with a negative prompt (no guidance input).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kit.errors import ConfigError
from kit.families import adapter_keys, register, tiny
from kit.families.base import PARTS, Components, Family, NoiseDraw, posterior_latent
from kit.families.chroma import layout as chroma_layout

# ChromaPipeline packs its latents with FluxPipeline's own code (the tests compare the inputs).
from kit.families.flux.family import pack_latents, unpack_latents
from kit.families.samplers import DEFAULT

if TYPE_CHECKING:
    from kit.config import Config

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # ChromaPipeline's default T5 length


@register
class Chroma(Family):
    """Chroma1-HD and Chroma1-Base: one architecture, told apart by the release's name."""

    name = "chroma"
    # The pipeline hands its scheduler custom sigmas, which only these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    size_multiple = 16
    native_resolution = 1024
    hub_id = "lodestones/Chroma1-HD"
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
    pipeline_class = "ChromaPipeline"
    # True CFG against the negative prompt (ChromaPipeline's default scale; no guidance input).
    default_guidance_scale = 5.0
    default_num_inference_steps = 35  # ChromaPipeline's default
    pipeline_kwargs: dict[str, Any] = {}
    lora_layers_kwarg = (
        "transformer_lora_layers"  # FluxLoraLoaderMixin's, which ChromaPipeline uses
    )
    # No text-encoder adapters: the only encoder is T5-XXL, whose LoRA no client's Chroma loader
    # is checked to read here.
    kohya_text_prefixes = ()
    base_model_version = "chroma"
    modelspec_architecture = "chroma"  # sd-scripts' ARCH_FLUX_1_CHROMA
    # The kohya file's keys follow BFL's Flux module names.
    modelspec_implementation = "https://github.com/black-forest-labs/flux"
    export_formats = ("diffusers", "kohya")
    # A fused qkv / linear1 LoRA has no exact DoRA form (its parts' norms differ), as for Flux.
    kohya_dora = False
    variants = ("HD", "Base")
    textual_inversion_refusal = (
        "Chroma's only text encoder is T5-XXL; the kit's embedding export and its check follow "
        "the CLIP embedding files that A1111 and ComfyUI read, so a T5 embedding could be "
        "neither written in a client's form nor verified"
    )

    def kohya_state_dict(self, state, alpha):
        # One LoRA per fused original weight (q, k, v → qkv; + the MLP input in single blocks).
        return chroma_layout.kohya_lora(state, alpha)

    def lycoris_naming(self):
        # diffusers' module names under `lycoris_`, which ComfyUI maps into the fused rows itself.
        return chroma_layout.LYCORIS_PREFIX, chroma_layout.lycoris_module

    def client_models(self, comps):
        # ComfyUI holds Chroma in the original layout (its model class is a Flux subclass, so
        # its LoRA loader also takes diffusers' names through `flux_to_diffusers`).
        t = comps.denoiser
        config = dict(t.config)
        model = adapter_keys.prefixed(
            "diffusion_model.", chroma_layout.to_original(t.state_dict(), config)
        )
        return {"ComfyUI": (model, chroma_layout.comfy_aliases(config))}

    def single_file_state_dict(self, comps):
        # The transformer alone, in its original layout: the file ComfyUI loads as a diffusion
        # model beside the base's own T5 and VAE.
        t = comps.denoiser
        return chroma_layout.to_original(t.state_dict(), dict(t.config))

    def single_file_pipeline(self, path, config_source):
        return self.transformer_file_pipeline("ChromaTransformer2DModel", path, config_source)

    def variant_of(self, pretrained: str) -> str:
        # HD is a fine-tune of Base with the same configs; only the release's name tells them
        # apart ("" for a local copy whose name says neither).
        name = Path(str(pretrained)).name.lower()
        for variant in self.variants:
            if variant.lower() in name:
                return variant
        return ""

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        step = self.cfg.data.bucket_step
        if step % 16:
            # Packing needs an even latent side: 2 × the VAE's 8x.
            raise ConfigError(
                f"bucket_step: {step} must be a multiple of 16 for chroma (64 is usual)"
            )
        if not self.cfg.model.use_t5:
            raise ConfigError("use_t5: chroma's only text encoder is T5; set it to true")

    def max_sequence_length(self) -> int:
        """T5 tokens per caption: the configured length, else ChromaPipeline's default."""
        return self.cfg.model.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH

    # ------------------------------------------------------------ loading

    text_subfolders = ("text_encoder",)
    quantized_text_encoders = ("text_encoder",)  # T5-XXL
    # The approximator is what tells a Chroma file from a Flux.1 one (diffusers tests the same).
    single_file_markers = (
        "double_blocks.0.img_attn.qkv.weight",
        "distilled_guidance_layer.in_proj.bias",
    )
    file_text_prefixes = ("text_encoders.t5xxl.",)

    def identity_extras(self, pretrained, revision):
        # The T5 length changes the cached embeddings and masks, so it is part of their key.
        return self.max_sequence_length()

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        from diffusers import (
            AutoencoderKL,
            ChromaTransformer2DModel,
            FlowMatchEulerDiscreteScheduler,
        )
        from transformers import T5EncoderModel

        return self.load_parts(
            pretrained,
            parts,
            revision=revision,
            variant=variant,
            dtype=dtype,
            denoiser=(ChromaTransformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=[(T5EncoderModel, "text_encoder")],
            tokenizers=list(self._tokenizers(pretrained, revision).values()),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_source(pretrained), subfolder="scheduler", revision=revision
            ),
        )

    def load_tokenizers(self, pretrained):
        return self._tokenizers(pretrained, None)

    def _tokenizers(self, pretrained: str, revision: str | None) -> dict[str, Any]:
        from transformers import T5TokenizerFast

        source = self.model_source(pretrained, ("tokenizer",))
        tokenizer = T5TokenizerFast.from_pretrained(
            source, subfolder="tokenizer", revision=revision
        )
        return {"text_encoder": tokenizer}

    def token_limit(self, encoder, tokenizer):
        return self.max_sequence_length()

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt: the T5 embeddings (computed with the tokenizer's
        # mask) and the mask the transformer gets, which keeps the first padding token. Both
        # have the fixed length `max_sequence_length` (the tokenizer pads to it), so they cache
        # as they are, under the call's keyword names.
        pipe = self._text_pipeline(comps)
        embeds, _, mask, *_ = pipe.encode_prompt(
            captions,
            device=comps.text_encoders[0].device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

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
        model = getattr(transformer, "module", transformer)  # unwrapped under DDP
        kwargs = transformer_inputs(
            noisy, timesteps, cond["prompt_embeds"], cond["prompt_attention_mask"]
        )
        with _mask_under_checkpointing(model, kwargs["attention_mask"]):
            out = transformer(**kwargs, return_dict=False)[0]
        return unpack_latents(out, noisy.shape[-2], noisy.shape[-1])

    def swap_blocks(self, denoiser):
        # The double-stream blocks run first, then the single-stream ones.
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        from diffusers import ChromaPipeline

        # A fresh scheduler: sampling changes its state.
        scheduler = type(comps.noise_scheduler).from_config(comps.noise_scheduler.config)
        return ChromaPipeline(
            scheduler=scheduler,
            vae=comps.vae,
            text_encoder=comps.text_encoders[0],
            tokenizer=comps.tokenizers[0],
            transformer=comps.denoiser,
        )

    def call_kwargs(self, spec):
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            # The pipeline encodes None as "": the string is the same call, and recorded.
            "negative_prompt": spec.negative_prompt,
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale,  # true CFG when above 1
            "width": spec.width,
            "height": spec.height,
            "max_sequence_length": self.max_sequence_length(),
        }
        if spec.adapter_scale != 1.0:
            kwargs["joint_attention_kwargs"] = {"scale": spec.adapter_scale}
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        from diffusers import AutoencoderKL, ChromaTransformer2DModel
        from transformers import T5EncoderModel

        return self.empty_from_configs(
            pretrained,
            denoiser=(ChromaTransformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=[(T5EncoderModel, "text_encoder")],
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
        kwargs = transformer_inputs(
            latents,
            torch.zeros(batch, **meta),
            torch.zeros(batch, seq, config.joint_attention_dim, **meta),
            torch.zeros(batch, seq, **meta),
        )
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import (
            ChromaPipeline,
            ChromaTransformer2DModel,
            FlowMatchEulerDiscreteScheduler,
        )
        from transformers import T5Config, T5EncoderModel

        torch.manual_seed(seed)
        tokenizer = tiny.t5_tokenizer()
        text_encoder = T5EncoderModel(
            T5Config(
                **tiny.t5_config_kwargs(
                    tokenizer,
                    d_model=32,
                    relative_attention_max_distance=32,
                    feed_forward_proj="gated-gelu",  # T5 v1.1, as Chroma uses
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
            shift_factor=0.1159,  # the Flux VAE's values
            scaling_factor=0.3611,
        )
        transformer = ChromaTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels × a 2×2 patch
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
            approximator_num_channels=8,
            approximator_hidden_dim=32,
            approximator_layers=2,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(  # Chroma1's, resolution-dependent
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = ChromaPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
        )
        return tiny.save_pipeline(pipe, out_dir)

    # ------------------------------------------------------------ helpers

    def _text_pipeline(self, comps: Components) -> Any:
        """A ChromaPipeline holding only the text parts (enough for `encode_prompt`)."""
        from diffusers import ChromaPipeline

        return ChromaPipeline(
            scheduler=None,
            vae=None,
            text_encoder=comps.text_encoders[0],
            tokenizer=comps.tokenizers[0],
            transformer=None,
        )


def transformer_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    text_mask: torch.Tensor,
) -> dict[str, Any]:
    """ChromaTransformer2DModel's arguments for unpacked latents, built as ChromaPipeline builds
    them: σ in [0, 1], text ids of zeros, the packed tokens' ids, and the text mask extended
    with ones over the image tokens (`_prepare_attention_mask`: the float text mask joined to a
    bool block of ones, which promotes to the mask's float dtype)."""
    from diffusers import ChromaPipeline

    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    tokens = pack_latents(latents)
    mask = text_mask.to(device, dtype)
    image = torch.ones(b, tokens.shape[1], device=device, dtype=torch.bool)
    return {
        "hidden_states": tokens,
        # The pipeline feeds σ in [0, 1] (its timesteps / 1000); the model scales it back.
        "timestep": timesteps.to(dtype) / 1000,
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
        "img_ids": ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
        "attention_mask": torch.cat([mask, image], dim=1),
    }


@contextmanager
def _mask_under_checkpointing(model: Any, mask: torch.Tensor) -> Iterator[None]:
    """Give the single-stream blocks their attention mask under gradient checkpointing.

    diffusers' ChromaTransformer2DModel (0.42) calls a checkpointed single block with
    (hidden_states, temb, image_rotary_emb) only, so the mask every other path passes would be
    dropped and training would attend differently from inference. While this is open, the
    model's checkpointing function appends the mask to those calls.
    """
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock

    if not getattr(model, "gradient_checkpointing", False) or not torch.is_grad_enabled():
        yield
        return
    original = model._gradient_checkpointing_func

    def with_mask(block: Any, *args: Any) -> Any:
        if isinstance(block, ChromaSingleTransformerBlock) and len(args) == 3:
            args = (*args, mask)
        return original(block, *args)

    model._gradient_checkpointing_func = with_mask
    try:
        yield
    finally:
        model._gradient_checkpointing_func = original
