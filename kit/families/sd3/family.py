"""Stable Diffusion 3 / 3.5: MMDiT transformer, 16-channel VAE, CLIP-L + CLIP-G + T5, flow matching."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kit.families import adapter_keys, register, tiny
from kit.families.base import PARTS, Components, Family, NoiseDraw, posterior_latent
from kit.families.identity import part_config
from kit.families.samplers import FLOW_SAMPLERS
from kit.families.sd3 import layout as sd3_layout

if TYPE_CHECKING:
    from kit.config import Config

CLIP_ENCODERS = ("text_encoder", "text_encoder_2")
T5_ENCODER = "text_encoder_3"
DEFAULT_T5_TOKENS = 256  # the pipeline's default `max_sequence_length`


@register
class SD3(Family):
    name = "sd3"
    samplers = FLOW_SAMPLERS
    size_multiple = 16
    native_resolution = 1024
    hub_id = "stabilityai/stable-diffusion-3.5-medium"
    bucket_step = 64
    # Image and context projections of every joint block, as diffusers' SD3 LoRA example trains;
    # load_lora_weights restores all of them.
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
    pipeline_class = "StableDiffusion3Pipeline"
    default_guidance_scale = 7.0  # StableDiffusion3Pipeline's default
    lora_layers_kwarg = "transformer_lora_layers"
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

    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per caption."""
        return self.cfg.model.max_sequence_length or DEFAULT_T5_TOKENS

    # ------------------------------------------------------------ loading

    # The MMDiT alone (as ComfyUI's diffusion_models hold it) or Stability's whole checkpoint,
    # which keeps the encoders under `text_encoders.*`.
    single_file_markers = ("joint_blocks.0.context_block.adaLN_modulation.1.bias",)
    file_text_prefixes = (
        "text_encoders.clip_l.",
        "text_encoders.clip_g.",
        "text_encoders.t5xxl.",
    )

    @property
    def text_subfolders(self) -> tuple[str, ...]:
        """The CLIP encoders, and T5 when it is used."""
        return (*CLIP_ENCODERS, T5_ENCODER) if self.use_t5 else CLIP_ENCODERS

    def identity_extras(self, pretrained, revision):
        # The cached prompt depends on the T5 length and, without T5, the width of the zeros
        # standing in for it.
        width = part_config(pretrained, "transformer", revision).get("joint_attention_dim")
        return {"max_sequence_length": self.max_sequence_length, "joint_attention_dim": width}

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        encoders = [(CLIPTextModelWithProjection, name) for name in CLIP_ENCODERS]
        if self.use_t5:
            encoders.append((T5EncoderModel, T5_ENCODER))
        return self.load_parts(
            pretrained,
            parts,
            revision=revision,
            variant=variant,
            dtype=dtype,
            denoiser=(SD3Transformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=encoders,
            tokenizers=list(self._tokenizers(pretrained, revision).values()),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_source(pretrained), subfolder="scheduler", revision=revision
            ),
        )

    def load_tokenizers(self, pretrained):
        return self._tokenizers(pretrained)

    def _tokenizers(self, pretrained: str, revision: str | None = None) -> dict[str, Any]:
        """Encoder name → tokenizer, T5's only when T5 is used."""
        from transformers import CLIPTokenizer, T5TokenizerFast

        names = ("tokenizer", "tokenizer_2", "tokenizer_3")[: 3 if self.use_t5 else 2]
        source = self.model_source(pretrained, names)
        out: dict[str, Any] = {
            enc: CLIPTokenizer.from_pretrained(source, subfolder=tok, revision=revision)
            for enc, tok in zip(CLIP_ENCODERS, names, strict=False)
        }
        if self.use_t5:
            out[T5_ENCODER] = T5TokenizerFast.from_pretrained(
                source, subfolder="tokenizer_3", revision=revision
            )
        return out

    def token_limit(self, encoder, tokenizer):
        if encoder == T5_ENCODER:
            return self.max_sequence_length
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
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        shift = vae.config.shift_factor or 0.0
        return (posterior_latent(dist, generator) - shift) * vae.config.scaling_factor

    # ------------------------------------------------------------ training

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        # SD3 trains with σ shifted as its scheduler samples (shift 3.0 in the released configs).
        shift = self.cfg.objective.flow_shift or comps.noise_scheduler.config.get("shift", 1.0)
        return self.flow_draw(comps, latents, generator, shift)

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

    def pipeline(self, comps):
        from diffusers import FlowMatchEulerDiscreteScheduler

        # A fresh scheduler: sampling keeps step state that training's copy must not carry.
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(comps.noise_scheduler.config)
        return self._text_pipeline(comps, vae=comps.vae, scheduler=scheduler)

    def _text_pipeline(self, comps: Components, **parts: Any) -> Any:
        """A StableDiffusion3Pipeline over these parts (T5 None when it is left out)."""
        from diffusers import StableDiffusion3Pipeline

        encoders = [*comps.text_encoders, None][:3]
        tokenizers = [*comps.tokenizers, None][:3]
        kwargs: dict[str, Any] = {"vae": None, "scheduler": None, **parts}
        pipe = StableDiffusion3Pipeline(
            transformer=comps.denoiser,
            text_encoder=encoders[0],
            tokenizer=tokenizers[0],
            text_encoder_2=encoders[1],
            tokenizer_2=tokenizers[1],
            text_encoder_3=encoders[2],
            tokenizer_3=tokenizers[2],
            **kwargs,
        )
        if comps.denoiser is None and encoders[2] is None:
            # The cache fills before the transformer loads; without T5 the pipeline reads the
            # width of the zeros standing in for it from the transformer's config alone.
            width = part_config(comps.source, "transformer").get("joint_attention_dim")
            pipe.transformer = SimpleNamespace(config=SimpleNamespace(joint_attention_dim=width))
        return pipe

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
            **adapter_keys.prefixed(
                "diffusion_model.", sd3_layout.to_original(t.state_dict(), config)
            ),
            **adapter_keys.clip_state(clip_l, "clip_l.transformer."),
            **adapter_keys.clip_state(clip_g, "clip_g.transformer."),
        }
        swapped = sd3_layout.swapped_modules(config)
        aliases = adapter_keys.offset_aliases(sd3_layout.module_map(config), swapped)
        return {"ComfyUI": (model, aliases)}

    def single_file_state_dict(self, comps):
        # The transformer alone, in its original layout: the file ComfyUI loads as a diffusion
        # model beside the base's own text encoders and VAE.
        t = comps.denoiser
        return sd3_layout.to_original(t.state_dict(), dict(t.config))

    def single_file_pipeline(self, path, config_source):
        return self.transformer_file_pipeline("SD3Transformer2DModel", path, config_source)

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        scale = kwargs.pop("cross_attention_kwargs", None)
        kwargs["max_sequence_length"] = self.max_sequence_length
        if scale is not None:
            # SD3's transformer reads the LoRA scale from its joint attention kwargs.
            kwargs["joint_attention_kwargs"] = scale
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        encoders = [(CLIPTextModelWithProjection, name) for name in CLIP_ENCODERS]
        if self.use_t5:
            encoders.append((T5EncoderModel, T5_ENCODER))
        # Buffers go to the meta device too: the patch embedding's positional table is one.
        return self.empty_from_configs(
            pretrained,
            denoiser=(SD3Transformer2DModel, "transformer"),
            vae=(AutoencoderKL, "vae"),
            encoders=encoders,
            include_buffers=True,
        )

    def denoiser_inputs(self, parts, batch, height, width):
        dn, vae = parts["denoiser"].config, parts["vae"].config
        f = 2 ** (len(vae.block_out_channels) - 1)
        latents = torch.zeros(batch, dn.in_channels, height // f, width // f, device="meta")
        # CLIP tokens, then T5's (zeros when T5 is left out, still part of the sequence).
        tokens = parts[CLIP_ENCODERS[0]].config.max_position_embeddings + self.max_sequence_length
        return (latents,), {
            "timestep": torch.zeros(batch, device="meta"),
            "encoder_hidden_states": torch.zeros(
                batch, tokens, dn.joint_attention_dim, device="meta"
            ),
            "pooled_projections": torch.zeros(batch, dn.pooled_projection_dim, device="meta"),
        }

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )
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
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
        return tiny.save_pipeline(pipe, out_dir)
