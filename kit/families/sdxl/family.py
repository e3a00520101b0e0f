"""Stable Diffusion XL: UNet with size/crop conditioning, AutoencoderKL, two CLIP text encoders."""

from __future__ import annotations

from typing import Any

import torch

from kit.families import adapter_keys, ldm, register, tiny
from kit.families.base import posterior_latent
from kit.families.identity import part_config, saved_scheduler
from kit.families.ldm import ldm_aliases
from kit.families.parts import text
from kit.families.shipped import config_source
from kit.families.unet import TINY_UNET, LatentDiffusion, sd_schedule, tiny_vae, unet_parts

# The CLIP context length both encoders are fed (what the pipeline pads to).
CONTEXT = 77


def pool_at_eos(encoder: Any, tokenizer: Any) -> None:
    """Make the CLIP encoder pool at the first EOS token, as A1111 and ComfyUI read it.

    SDXL's second encoder ships with `eos_token_id: 2`, for which transformers pools at the
    highest token id: the EOS token until textual inversion adds a placeholder above it, which
    would then be pooled instead. The kit's validation pipeline shares this encoder, so it draws
    with the pooled vector training sees.
    """
    model = getattr(encoder, "text_model", None)
    if model is not None and hasattr(model, "eos_token_id"):
        model.eos_token_id = tokenizer.eos_token_id


@register
class SDXL(LatentDiffusion):
    name = "sdxl"
    parts = unet_parts(*text("CLIPTextModelWithProjection", "CLIPTokenizer", 2, trainable=True))
    native_resolution = 1024
    hub_id = "stabilityai/stable-diffusion-xl-base-1.0"
    embedding_names = ("clip_l", "clip_g")
    kohya_text_prefixes = ("lora_te1", "lora_te2")
    base_model_version = "sdxl_base_v1-0"
    modelspec_architecture = "stable-diffusion-xl-v1-base"
    # The kohya file names UNet modules as Stability's SDXL code does (input_blocks…).
    modelspec_implementation = "https://github.com/Stability-AI/generative-models"
    pipeline_class = "StableDiffusionXLPipeline"
    default_guidance_scale = 5.0  # StableDiffusionXLPipeline's default
    # The pipeline watermarks its output whenever invisible-watermark is installed; off, so the
    # kit's images and a plain diffusers redraw agree on any machine.
    pipeline_kwargs = {"add_watermarker": False}

    # A1111 / ComfyUI SDXL checkpoints: the UNet with its size embedding, the two encoders each
    # under its own prefix (told apart by prefix, not width).
    single_file_markers = ("diffusion_model.input_blocks.0.0.weight", "label_emb.0.0.weight")
    file_text_prefixes = ("conditioner.embedders.0.", "conditioner.embedders.1.")

    def version_metadata(self) -> dict[str, str]:
        return {**super().version_metadata(), "modelspec.prediction_type": "epsilon"}

    def kohya_module(self, module):
        # kohya's SDXL scripts, and LyCORIS on them, name UNet modules as Stability's code does
        # (`input_blocks.4.1…`), not by diffusers' names.
        if not hasattr(self, "_ldm_names"):
            source = self.model_source(self.cfg.model.pretrained_model)
            unet = part_config(config_source(source), "unet")
            self._ldm_names = ldm.unet_module_names(unet)
        return self._ldm_names[module]

    def text_loaded(self, comps, revision):
        pool_at_eos(comps.text_encoders[1], comps.tokenizers[1])

    def encode_text(self, comps, captions):
        # As StableDiffusionXLPipeline.encode_prompt: penultimate hidden states of both encoders
        # side by side, and the second encoder's projected pooled output, read at the first EOS
        # token whatever the encoder's config says (see `pool_at_eos`).
        hidden = []
        for tok, enc in zip(comps.tokenizers, comps.text_encoders, strict=True):
            bare = getattr(enc, "module", enc)  # a trained encoder is wrapped under DDP
            ids = self.clip_ids(tok, captions, bare.device)
            out = enc(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
        eos = (ids == tok.eos_token_id).int().argmax(dim=-1)
        rows = torch.arange(ids.shape[0], device=ids.device)
        pooled = bare.text_projection(out.last_hidden_state[rows, eos])
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled_prompt_embeds": pooled}

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        mean = posterior_latent(dist, generator)
        cfg = vae.config
        # The inverse of the pipeline's decode, which uses per-channel stats when the VAE has them.
        mu, sd = cfg.get("latents_mean"), cfg.get("latents_std")
        if mu is not None and sd is not None:
            mu = torch.tensor(mu).view(1, -1, 1, 1).to(mean)
            sd = torch.tensor(sd).view(1, -1, 1, 1).to(mean)
            return (mean - mu) * cfg.scaling_factor / sd
        return mean * cfg.scaling_factor

    def predict(self, comps, noisy, timesteps, cond):
        pooled = cond["pooled_prompt_embeds"]
        # Per sample, as recorded by bucketing: (orig h, orig w, crop top, crop left, h, w).
        time_ids = torch.cat(
            [cond["original_size"], cond["crop_top_left"], cond["target_size"]], dim=1
        )
        added = {"text_embeds": pooled, "time_ids": time_ids.to(pooled.dtype)}
        return comps.denoiser(
            noisy, timesteps, encoder_hidden_states=cond["prompt_embeds"], added_cond_kwargs=added
        ).sample

    def pipeline(self, comps):
        from diffusers import StableDiffusionXLPipeline

        # Honour the base model's own setting, as from_pretrained would.
        saved = StableDiffusionXLPipeline.load_config(comps.source)
        return StableDiffusionXLPipeline(
            vae=comps.vae,
            text_encoder=comps.text_encoders[0],
            text_encoder_2=comps.text_encoders[1],
            tokenizer=comps.tokenizers[0],
            tokenizer_2=comps.tokenizers[1],
            unet=comps.denoiser,
            scheduler=saved_scheduler(comps.source, "EulerDiscreteScheduler"),
            force_zeros_for_empty_prompt=saved.get("force_zeros_for_empty_prompt", True),
            **self.pipeline_kwargs,
        )

    def denoiser_inputs(self, parts, batch, height, width):
        te1, te2 = parts["text_encoder"].config, parts["text_encoder_2"].config
        latents, steps = self.meta_latents(parts, batch, height, width)
        embeds = torch.zeros(batch, CONTEXT, te1.hidden_size + te2.hidden_size, device="meta")
        added = {
            "text_embeds": torch.zeros(batch, te2.projection_dim, device="meta"),
            "time_ids": torch.zeros(batch, 6, device="meta"),
        }
        return (latents, steps), {"encoder_hidden_states": embeds, "added_cond_kwargs": added}

    def make_tiny(self, out_dir, seed=0):
        from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        torch.manual_seed(seed)
        tokenizer = tiny.clip_tokenizer(CONTEXT)
        tokenizer_2 = tiny.clip_tokenizer(CONTEXT)
        text_encoder = CLIPTextModel(tiny.clip_text_config(tokenizer, max_positions=CONTEXT))
        text_encoder_2 = CLIPTextModelWithProjection(
            tiny.clip_text_config(tokenizer_2, max_positions=CONTEXT)
        )
        te_cfg = text_encoder_2.config
        vae = tiny_vae(scaling_factor=0.13025)
        time_dim = 8
        unet = UNet2DConditionModel(
            **TINY_UNET,
            # As SDXL: no attention at the highest resolution.
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            cross_attention_dim=2 * te_cfg.hidden_size,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            # Six size/crop ids, each embedded in time_dim, plus the pooled text projection.
            projection_class_embeddings_input_dim=6 * time_dim + te_cfg.projection_dim,
        )
        scheduler = sd_schedule(EulerDiscreteScheduler, timestep_spacing="leading")
        text = (text_encoder, tokenizer, text_encoder_2, tokenizer_2)
        return self.save_tiny(out_dir, unet, vae, *text, scheduler, **self.pipeline_kwargs)

    # ------------------------------------------------------------ clients

    def client_models(self, comps):
        unet = comps.denoiser
        te1, te2 = comps.text_encoders
        original = ldm.unet_to_ldm(unet.state_dict(), unet.config)
        # sd-scripts' SDXL UNet (and LyCORIS on it) uses the LDM names.
        kohya_model = {
            **adapter_keys.prefixed("unet.", original),
            **adapter_keys.clip_state(te1, "text_encoder1."),
            **adapter_keys.clip_state(te2, "text_encoder2."),
        }
        comfy = {
            **adapter_keys.prefixed("diffusion_model.", original),
            **adapter_keys.clip_state(te1, "clip_l.transformer."),
            **adapter_keys.clip_state(te2, "clip_g.transformer."),
        }
        return {
            "ComfyUI": (comfy, ldm_aliases(unet.config)),
            "A1111": (self.single_file_state_dict(comps), None),
            "sd-scripts": (kohya_model, None),
            "LyCORIS": (kohya_model, None),
        }

    # ------------------------------------------------------------ single file

    def single_file_state_dict(self, comps):
        return ldm.components_state_dict(comps, "sdxl")

    def single_file_pipeline(self, path, config_source):
        return ldm.load_pipeline(
            self.pipeline_class, str(path), str(config_source), "sdxl", self.pipeline_kwargs
        )
