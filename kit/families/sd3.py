"""Stable Diffusion 3 / 3.5: MMDiT transformer, 16-channel VAE, CLIP-L + CLIP-G + T5, flow matching."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kit.families import register
from kit.families.base import PARTS, Components, Family, NoiseDraw
from kit.families.identity import part_config
from kit.families.noise import flow_noise_and_target

if TYPE_CHECKING:
    from kit.config import Config

CLIP_ENCODERS = ("text_encoder", "text_encoder_2")
T5_ENCODER = "text_encoder_3"
DEFAULT_T5_TOKENS = 256  # the pipeline's default `max_sequence_length`


@register
class SD3(Family):
    name = "sd3"
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
    lora_layers_kwarg = "transformer_lora_layers"
    # ComfyUI loads SD3 LoRAs in the diffusers key layout.
    export_formats = ("diffusers",)

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
                pretrained, subfolder="scheduler", revision=revision
            ),
        )

    def load_tokenizers(self, pretrained):
        return self._tokenizers(pretrained)

    def _tokenizers(self, pretrained: str, revision: str | None = None) -> dict[str, Any]:
        """Encoder name → tokenizer, T5's only when T5 is used."""
        from transformers import CLIPTokenizer, T5TokenizerFast

        out: dict[str, Any] = {
            enc: CLIPTokenizer.from_pretrained(pretrained, subfolder=tok, revision=revision)
            for enc, tok in zip(CLIP_ENCODERS, ("tokenizer", "tokenizer_2"), strict=True)
        }
        if self.use_t5:
            out[T5_ENCODER] = T5TokenizerFast.from_pretrained(
                pretrained, subfolder="tokenizer_3", revision=revision
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
    def encode_images(self, comps, pixels):
        vae = comps.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        shift = vae.config.shift_factor or 0.0
        # The mean, not a sample: the cache then holds one exact value per image.
        return (dist.mean - shift) * vae.config.scaling_factor

    # ------------------------------------------------------------ training

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        o = self.cfg.objective
        sched = comps.noise_scheduler.config
        steps = sched.num_train_timesteps
        # SD3 trains with σ shifted as its scheduler samples (shift 3.0 in the released configs).
        draw = flow_noise_and_target(
            latents,
            generator,
            sampling=o.timestep_sampling,
            logit_mean=o.logit_mean,
            logit_std=o.logit_std,
            mode_scale=o.mode_scale,
            shift=o.flow_shift or sched.get("shift", 1.0),
            num_train_timesteps=steps,
        )
        if o.loss_weighting != "none":
            draw.weight = compute_loss_weighting_for_sd3(o.loss_weighting, draw.timesteps / steps)
        return draw

    def predict(self, comps, noisy, timesteps, cond):
        # The transformer predicts the velocity noise - x0 and takes t = σ·1000, as in sampling.
        return comps.denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
        ).sample

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
        return StableDiffusion3Pipeline(
            transformer=comps.denoiser,
            text_encoder=encoders[0],
            tokenizer=tokenizers[0],
            text_encoder_2=encoders[1],
            tokenizer_2=tokenizers[1],
            text_encoder_3=encoders[2],
            tokenizer_3=tokenizers[2],
            **kwargs,
        )

    def call_kwargs(self, spec):
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "negative_prompt": spec.negative_prompt or None,
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale,
            "width": spec.width,
            "height": spec.height,
            "max_sequence_length": self.max_sequence_length,
        }
        if spec.adapter_scale != 1.0:
            # SD3's transformer reads the LoRA scale from its joint attention kwargs.
            kwargs["joint_attention_kwargs"] = {"scale": spec.adapter_scale}
        return kwargs

    # ------------------------------------------------------------ export

    def save_diffusers_lora(self, state, adapter_config, out_dir):
        from diffusers import StableDiffusion3Pipeline

        # Keys stay in peft naming, as diffusers' SD3 LoRA example saves them: the UNet-era
        # renaming (to_q.lora.down ...) is not read back by SD3's loader, which drops those keys.
        StableDiffusion3Pipeline.save_lora_weights(
            out_dir,
            transformer_lora_layers=state,
            transformer_lora_adapter_metadata=adapter_config,
            safe_serialization=True,
        )
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            T5Config,
            T5EncoderModel,
        )

        dn_cfg = SD3Transformer2DModel.load_config(pretrained, subfolder="transformer")
        vae_cfg = AutoencoderKL.load_config(pretrained, subfolder="vae")
        clip_cfgs = {
            n: CLIPTextConfig.from_pretrained(pretrained, subfolder=n) for n in CLIP_ENCODERS
        }
        # Buffers go to the meta device too: the patch embedding's positional table is one.
        with init_empty_weights(include_buffers=True):
            parts = {
                "denoiser": SD3Transformer2DModel.from_config(dn_cfg),
                "vae": AutoencoderKL.from_config(vae_cfg),
                **{n: CLIPTextModelWithProjection(c) for n, c in clip_cfgs.items()},
            }
            if self.use_t5:
                t5_cfg = T5Config.from_pretrained(pretrained, subfolder=T5_ENCODER)
                parts[T5_ENCODER] = T5EncoderModel(t5_cfg)
        return parts

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
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            CLIPTokenizer,
            T5Config,
            T5EncoderModel,
            T5TokenizerFast,
        )

        from kit.families.tiny import write_clip_tokenizer_files, write_t5_tokenizer
        from kit.io import atomic_dir

        torch.manual_seed(seed)
        with tempfile.TemporaryDirectory() as tmp:
            clip_vocab = write_clip_tokenizer_files(Path(tmp) / "clip")
            tokenizer = CLIPTokenizer.from_pretrained(Path(tmp) / "clip", model_max_length=77)
            tokenizer_2 = CLIPTokenizer.from_pretrained(Path(tmp) / "clip", model_max_length=77)
            write_t5_tokenizer(Path(tmp) / "t5")
            tokenizer_3 = T5TokenizerFast.from_pretrained(Path(tmp) / "t5")

        def clip(hidden: int) -> CLIPTextModelWithProjection:
            return CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=clip_vocab,
                    hidden_size=hidden,
                    intermediate_size=2 * hidden,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=77,
                    projection_dim=32,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            )

        # Widths as in the real model, scaled down: CLIP-L (32) and CLIP-G (48) states side by
        # side are narrower than T5's (96), so the pipeline zero-pads them as it does SD3's
        # 768 + 1280 < 4096; the two pooled projections (32 + 32) feed pooled_projection_dim.
        text_encoder, text_encoder_2 = clip(32), clip(48)
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_3),
                d_model=96,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer_3.pad_token_id,
                eos_token_id=tokenizer_3.eos_token_id,
                decoder_start_token_id=tokenizer_3.pad_token_id,
            )
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(16, 16, 32, 32),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=16,
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
        with atomic_dir(out_dir) as tmp_dir:
            pipe.save_pretrained(tmp_dir, safe_serialization=True)
        return Path(out_dir)
