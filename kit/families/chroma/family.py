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
from kit.families.chroma import layout as chroma_layout
from kit.families.flow import JOINT_ATTENTION, FlowFamily

# ChromaPipeline packs its latents with FluxPipeline's own code (the tests compare the inputs).
from kit.families.flux.family import pack_latents, unpack_latents
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import DEFAULT

if TYPE_CHECKING:
    from kit.config import Config


@register
class Chroma(FlowFamily):
    """Chroma1-HD and Chroma1-Base: one architecture, told apart by the release's name."""

    name = "chroma"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    # The pipeline hands its scheduler custom sigmas, which only these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    size_multiple = 16
    native_resolution = 1024
    hub_id = "lodestones/Chroma1-HD"
    bucket_step = 64
    default_lora_targets = JOINT_ATTENTION
    pipeline_class = "ChromaPipeline"
    # True CFG against the negative prompt (ChromaPipeline's default scale; no guidance input).
    default_guidance_scale = 5.0
    default_num_inference_steps = 35  # ChromaPipeline's default
    pipeline_kwargs: dict[str, Any] = {}
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

    original_layout = staticmethod(chroma_layout.to_original)

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
        model = adapter_keys.prefixed("diffusion_model.", self.original_state(t))
        return {"ComfyUI": (model, chroma_layout.comfy_aliases(config))}

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
        if not self.cfg.model.use_t5:
            raise ConfigError("use_t5: chroma's only text encoder is T5; set it to true")

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("ChromaTransformer2DModel"),
        vae(),
        *text("T5EncoderModel", "T5TokenizerFast"),
        scheduler(),
    )

    quantized_text_encoders = ("text_encoder",)  # T5-XXL
    # The approximator is what tells a Chroma file from a Flux.1 one (diffusers tests the same).
    single_file_markers = (
        "double_blocks.0.img_attn.qkv.weight",
        "distilled_guidance_layer.in_proj.bias",
    )
    file_text_prefixes = ("text_encoders.t5xxl.",)

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

    # ------------------------------------------------------------ training

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

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)  # guidance: true CFG when above 1
        # The pipeline encodes None as "": the string is the same call, and recorded.
        kwargs["negative_prompt"] = spec.negative_prompt
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        meta = {"device": "meta"}
        latents = self.packed_meta_latents(parts, batch, height, width)
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
        from diffusers import ChromaTransformer2DModel

        torch.manual_seed(seed)
        tokenizer = tiny.t5_tokenizer()
        text_encoder = tiny.t5_v11_encoder(tokenizer)
        vae = tiny.flux_vae()
        sizes = tiny.flux_transformer_sizes(
            approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=2
        )
        transformer = ChromaTransformer2DModel(**sizes)
        # Chroma1's scheduler is Flux's, resolution-dependent.
        scheduler = tiny.dynamic_flow_scheduler()
        return self.save_tiny(out_dir, transformer, vae, text_encoder, tokenizer, scheduler)


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
