"""Stable Diffusion 3 / 3.5: MMDiT transformer, 16-channel VAE, CLIP-L + CLIP-G + T5, flow matching."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from kit.families import adapter_keys, register, tiny
from kit.families.flow import JOINT_ATTENTION, FlowFamily
from kit.families.identity import part_config
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import FLOW_SAMPLERS
from kit.families.sd3 import layout as sd3_layout

if TYPE_CHECKING:
    from kit.config import Config

CLIP_ENCODERS = ("text_encoder", "text_encoder_2")
T5_ENCODER = "text_encoder_3"


@register
class SD3(FlowFamily):
    name = "sd3"
    default_max_sequence_length = 256  # T5 tokens: the pipeline's default
    samplers = FLOW_SAMPLERS
    size_multiple = 16
    native_resolution = 1024
    hub_id = "stabilityai/stable-diffusion-3.5-medium"
    bucket_step = 64
    # Image and context projections of every joint block, as diffusers' SD3 LoRA example trains;
    # load_lora_weights restores all of them.
    default_lora_targets = JOINT_ATTENTION
    pipeline_class = "StableDiffusion3Pipeline"
    default_guidance_scale = 7.0  # StableDiffusion3Pipeline's default
    # The two CLIPs: StableDiffusion3Pipeline loads no LoRA into T5 (sd-scripts: lora_te3).
    kohya_text_prefixes = ("lora_te1", "lora_te2")
    base_model_version = "sd3"
    modelspec_architecture = "stable-diffusion-3"
    modelspec_implementation = "https://github.com/Stability-AI/sd3.5"
    # diffusers and ComfyUI read the diffusers file; Forge and sd-scripts only the original
    # layout of the kohya file.
    export_formats = ("diffusers", "kohya")
    kohya_dora = False
    quantized_text_encoders = (T5_ENCODER,)

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        # Plain diffusers must leave T5 out too, or its prompt embeddings differ from the kit's.
        self.pipeline_kwargs = {} if self.use_t5 else {"text_encoder_3": None, "tokenizer_3": None}

    @property
    def use_t5(self) -> bool:
        """Whether the T5 encoder is loaded (its part of the prompt is zeros otherwise)."""
        return self.cfg.model.use_t5

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("SD3Transformer2DModel"),
        vae(),
        *text("CLIPTextModelWithProjection", "CLIPTokenizer", trainable=True),
        *text("CLIPTextModelWithProjection", "CLIPTokenizer", 2, trainable=True),
        *text("T5EncoderModel", "T5TokenizerFast", 3),
        scheduler(),
    )
    meta_buffers = True  # the patch embedding's positional table is a buffer

    # The MMDiT alone (as ComfyUI's diffusion_models hold it) or Stability's whole checkpoint,
    # which keeps the encoders under `text_encoders.*`.
    single_file_markers = ("joint_blocks.0.context_block.adaLN_modulation.1.bias",)
    file_text_prefixes = (
        "text_encoders.clip_l.",
        "text_encoders.clip_g.",
        "text_encoders.t5xxl.",
    )

    def active_parts(self):
        # T5 and its tokenizer only when it is used (its part of the prompt is zeros otherwise).
        left_out = () if self.use_t5 else (T5_ENCODER, "tokenizer_3")
        return tuple(p for p in self.parts if p.name not in left_out)

    def identity_extras(self, pretrained, revision):
        # The cached prompt depends on the T5 length and, without T5, the width of the zeros
        # standing in for it.
        width = part_config(pretrained, "transformer", revision).get("joint_attention_dim")
        return {"max_sequence_length": self.max_sequence_length(), "joint_attention_dim": width}

    def token_limit(self, encoder, tokenizer):
        if encoder == T5_ENCODER:
            return self.max_sequence_length()
        return super().token_limit(encoder, tokenizer)

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt, so training sees exactly what sampling sees.
        pipe = self._text_pipeline(comps)
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=captions,
            prompt_2=None,
            prompt_3=None,
            device=comps.text_encoders[0].device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    # ------------------------------------------------------------ training

    def predict(self, comps, noisy, timesteps, cond):
        # The transformer predicts the velocity noise - x0 and takes t = σ·1000, as in sampling.
        return comps.denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
        ).sample

    def swap_blocks(self, denoiser):
        return list(denoiser.transformer_blocks)

    # ------------------------------------------------------------ sampling

    def build_pipeline(self, comps, cls=None, text_only=False, **extra):
        pipe = super().build_pipeline(comps, cls, text_only, **extra)
        if pipe.transformer is None and pipe.text_encoder_3 is None:
            # The cache fills before the transformer loads; without T5 the pipeline reads the
            # width of the zeros standing in for it from the transformer's config alone.
            width = part_config(comps.source, "transformer").get("joint_attention_dim")
            pipe.transformer = SimpleNamespace(config=SimpleNamespace(joint_attention_dim=width))
        return pipe

    original_layout = staticmethod(sd3_layout.to_original)

    def kohya_state_dict(self, state, alpha):
        # One LoRA per fused weight (q, k, v → qkv), named as sd-scripts' SD3 scripts do.
        return sd3_layout.kohya_lora(state, alpha)

    def lycoris_naming(self):
        # Kronecker factors of q, k and v cannot be fused into one: LoHa / LoKr keep diffusers'
        # names under `lycoris_`, which ComfyUI maps into the fused rows (Forge does not).
        return sd3_layout.LYCORIS_DIFFUSERS_PREFIX, lambda module: module

    def client_models(self, comps):
        # ComfyUI holds SD3 in the MMDiT layout; the LoRA names those weights, the LyCORIS
        # names diffusers' modules, which ComfyUI maps into the fused rows itself.
        t = comps.denoiser
        config = dict(t.config)
        clip_l, clip_g = comps.text_encoders[:2]
        model = {
            **adapter_keys.prefixed("diffusion_model.", self.original_state(t)),
            **adapter_keys.clip_state(clip_l, "clip_l.transformer."),
            **adapter_keys.clip_state(clip_g, "clip_g.transformer."),
        }
        swapped = sd3_layout.swapped_modules(config)
        aliases = adapter_keys.offset_aliases(sd3_layout.module_map(config), swapped)
        return {"ComfyUI": (model, aliases)}

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        # The string, even when empty, as plain diffusers and the other clients encode it.
        kwargs["negative_prompt"] = spec.negative_prompt
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        dn, vae = parts["denoiser"].config, parts["vae"].config
        f = 2 ** (len(vae.block_out_channels) - 1)
        latents = torch.zeros(batch, dn.in_channels, height // f, width // f, device="meta")
        # CLIP tokens, then T5's (zeros when T5 is left out, still part of the sequence).
        tokens = parts[CLIP_ENCODERS[0]].config.max_position_embeddings + self.max_sequence_length()
        return (latents,), {
            "timestep": torch.zeros(batch, device="meta"),
            "encoder_hidden_states": torch.zeros(
                batch, tokens, dn.joint_attention_dim, device="meta"
            ),
            "pooled_projections": torch.zeros(batch, dn.pooled_projection_dim, device="meta"),
        }

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

        torch.manual_seed(seed)
        tokenizer, tokenizer_2 = tiny.clip_tokenizer(), tiny.clip_tokenizer()
        tokenizer_3 = tiny.t5_tokenizer()
        # Widths as in the real model, scaled down: CLIP-L (32) and CLIP-G (48) states side by
        # side are narrower than T5's (96), so the pipeline zero-pads them as it does SD3's
        # 768 + 1280 < 4096; the two pooled projections (32 + 32) feed pooled_projection_dim.
        text_encoder = CLIPTextModelWithProjection(tiny.clip_text_config(tokenizer, 32))
        text_encoder_2 = CLIPTextModelWithProjection(tiny.clip_text_config(tokenizer_2, 48))
        text_encoder_3 = T5EncoderModel(
            T5Config(
                **tiny.t5_config_kwargs(
                    tokenizer_3, d_model=96, decoder_start_token_id=tokenizer_3.pad_token_id
                )
            )
        )
        vae = tiny.autoencoder_kl(
            block_out_channels=(16, 16, 32, 32),
            latent_channels=16,
            sample_size=256,
            # SD3's VAE: no quant convs, and its latent shift and scale.
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        transformer = SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=96,
            caption_projection_dim=32,  # must equal heads × head_dim
            pooled_projection_dim=64,
            out_channels=16,
            pos_embed_max_size=96,  # positions for latents up to 192 (1536 px), as SD3 at 2x
        )
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        text = (text_encoder, tokenizer, text_encoder_2, tokenizer_2, text_encoder_3, tokenizer_3)
        return self.save_tiny(out_dir, transformer, vae, *text, scheduler)
