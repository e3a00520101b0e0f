"""Stable Diffusion 1.x / 2.x layout: UNet, AutoencoderKL, one CLIP text encoder, epsilon or v."""

from __future__ import annotations

import torch

from kit.families import adapter_keys, ldm, register, tiny
from kit.families.base import posterior_latent
from kit.families.identity import part_config, saved_scheduler
from kit.families.ldm import ldm_aliases
from kit.families.shipped import config_source
from kit.families.unet import TINY_UNET, LatentDiffusion, sd_schedule, tiny_vae, unet_parts


@register
class SD15(LatentDiffusion):
    name = "sd15"
    parts = unet_parts()
    native_resolution = 512
    hub_id = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    kohya_text_prefixes = ("lora_te",)
    base_model_version = "sd_v1"
    modelspec_architecture = "stable-diffusion-v1"
    single_file_implementation = "https://github.com/Stability-AI/generative-models"
    pipeline_class = "StableDiffusionPipeline"
    default_guidance_scale = 7.5  # StableDiffusionPipeline's default
    pipeline_kwargs = {"safety_checker": None, "requires_safety_checker": False}
    # A1111 / ComfyUI checkpoints of SD 1.x and 2.x: the UNet's first convolution, and no
    # SDXL size embedding; one text encoder (OpenAI CLIP or OpenCLIP) under one prefix.
    single_file_markers = ("diffusion_model.input_blocks.0.0.weight",)
    single_file_excludes = ("diffusion_model.label_emb.0.0.weight",)
    file_text_prefixes = ("cond_stage_model.",)

    def version_metadata(self) -> dict[str, str]:
        # SD 2.x shares this layout: told apart by its OpenCLIP text encoder and, for the 768
        # models, v-prediction; kohya's values, so A1111 lists the file under SD2.
        source = config_source(self.model_source(self.cfg.model.pretrained_model))
        v2 = ldm.open_clip_text(part_config(source, "text_encoder"))
        prediction = saved_scheduler(source, "DDPMScheduler").config.prediction_type
        v_pred = prediction == "v_prediction"
        version = ("sd_v2" if v2 else "sd_v1") + ("_v" if v_pred else "")
        arch = "stable-diffusion-v1"
        if v2:
            arch = "stable-diffusion-v2-768-v" if v_pred else "stable-diffusion-v2-512"
        return {
            **super().version_metadata(),
            "ss_base_model_version": version,
            "ss_v2": str(v2),
            "ss_v_parameterization": str(v_pred),
            "modelspec.architecture": arch,
            "modelspec.prediction_type": "v" if v_pred else "epsilon",
        }

    def encode_text(self, comps, captions):
        enc = comps.text_encoders[0]
        ids = self.clip_ids(comps.tokenizers[0], captions, enc.device)
        return {"prompt_embeds": enc(ids)[0]}

    @torch.no_grad()
    def encode_images(self, comps, pixels, generator=None):
        vae = comps.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (posterior_latent(dist, generator) - shift) * vae.config.scaling_factor

    def predict(self, comps, noisy, timesteps, cond):
        return comps.denoiser(noisy, timesteps, encoder_hidden_states=cond["prompt_embeds"]).sample

    def pipeline(self, comps):
        from diffusers import StableDiffusionPipeline

        scheduler = saved_scheduler(comps.source, "DDIMScheduler")
        return StableDiffusionPipeline(
            vae=comps.vae,
            text_encoder=comps.text_encoders[0],
            tokenizer=comps.tokenizers[0],
            unet=comps.denoiser,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    def denoiser_inputs(self, parts, batch, height, width):
        latents, steps = self.meta_latents(parts, batch, height, width)
        width_te = parts["text_encoder"].config.hidden_size
        embeds = torch.zeros(batch, 77, width_te, device="meta")
        return (latents, steps), {"encoder_hidden_states": embeds}

    def make_tiny(self, out_dir, seed=0):
        from diffusers import DDIMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel

        torch.manual_seed(seed)
        tokenizer = tiny.clip_tokenizer()
        text_encoder = CLIPTextModel(tiny.clip_text_config(tokenizer))
        vae = tiny_vae()
        unet = UNet2DConditionModel(
            **TINY_UNET,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
        )
        scheduler = sd_schedule(DDIMScheduler, clip_sample=False, set_alpha_to_one=False)
        extra = {"feature_extractor": None, **self.pipeline_kwargs}  # no safety checker
        return self.save_tiny(out_dir, unet, vae, text_encoder, tokenizer, scheduler, **extra)

    # ------------------------------------------------------------ clients

    def client_models(self, comps):
        unet, enc = comps.denoiser, comps.text_encoders[0]
        original = ldm.unet_to_ldm(unet.state_dict(), unet.config)
        clip = "clip_h" if ldm.open_clip_text(enc.config) else "clip_l"
        kohya_model = {
            **adapter_keys.prefixed("unet.", unet.state_dict()),
            **adapter_keys.clip_state(enc, "text_encoder."),
        }
        per_block = unet.config.layers_per_block
        return {
            "ComfyUI": (
                {
                    **adapter_keys.prefixed("diffusion_model.", original),
                    **adapter_keys.clip_state(enc, f"{clip}.transformer."),
                },
                ldm_aliases(unet.config),
            ),
            # A1111 renames diffusers-named UNet keys with the released models' arithmetic.
            "A1111": (self.single_file_state_dict(comps), None)
            if per_block == 2
            else "A1111 renames diffusers UNet names assuming 2 resnets per block; "
            f"this base has {per_block}",
            "sd-scripts": (kohya_model, None),
            "LyCORIS": (kohya_model, None),
        }

    # ------------------------------------------------------------ single file

    def single_file_state_dict(self, comps):
        # SD2 is this architecture with OpenCLIP ViT-H as its text encoder, which the original
        # layout keeps in OpenCLIP's own naming; SD1's OpenAI CLIP keeps the transformers one.
        open_clip = comps.text_encoders and ldm.open_clip_text(comps.text_encoders[0].config)
        layout = "sd2" if open_clip else "sd1"
        return ldm.components_state_dict(comps, layout)
