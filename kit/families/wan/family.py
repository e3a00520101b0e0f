"""Wan 2.1 text-to-video: WanTransformer3DModel, AutoencoderKLWan, UMT5 text encoder, flow matching.
Samples are clips (3, F, H, W). The VAE compresses 8x in space and 4x in time after the first
frame, so a clip has 4k+1 frames; the transformer patches latents by (1, 2, 2).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from kit.config import Config
from kit.errors import KitError
from kit.families import adapter_keys, register, tiny
from kit.families.base import PARTS, Components, NoiseDraw
from kit.families.flow import ATTENTION, FlowFamily
from kit.families.identity import (
    base_identity,
    fingerprint,
    part_dtype,
    saved_scheduler,
    single_file,
)
from kit.families.noise import flow_sigmas
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import FLOW_SAMPLERS
from kit.families.wan import i2v as wan_i2v
from kit.families.wan import layout as wan_layout
from kit.families.wan.experts import (
    EXPERT_OF_FILE,
    EXPERTS,
    FILE_SUFFIX,
    PART_TITLES,
    PIPELINE_NAMES,
    WanExperts,
    accept_for,
    make_tiny_experts,
    read_experts,
    read_index,
    split_state,
    timestep_range,
    trained_experts,
)

TEMPORAL_FACTOR = 4
"""Frames per latent frame after the first (AutoencoderKLWan's `scale_factor_temporal`)."""


@register
class Wan(FlowFamily):
    name = "wan"
    samplers = FLOW_SAMPLERS
    size_multiple = 16
    native_resolution = 480
    hub_id = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    # 8x VAE times the transformer's 2x2 patches; WanPipeline refuses sides not divisible by 16.
    bucket_step = 16
    # Wan 2.1 has no separate temporal attention: each block's self-attention (attn1) runs over
    # all frames' tokens at once (spatio-temporal), and attn2 attends to the text.
    default_lora_targets = ATTENTION
    pipeline_class = "WanPipeline"
    default_guidance_scale = 5.0  # WanPipeline's default
    # ComfyUI reads Wan LoRA only under the original module names (`blocks.0.self_attn.q`), as
    # musubi-tuner writes them: the kohya file; diffusers reads the diffusers one.
    export_formats = ("diffusers", "kohya")
    part_titles = PART_TITLES
    quantized_text_encoders = ("text_encoder",)  # UMT5-XXL, a T5
    base_model_version = "wan2.1"
    modelspec_architecture = "wan2.1"  # musubi-tuner's value
    modelspec_implementation = "https://github.com/Wan-Video/Wan2.1"
    video = True
    # Which one a base is, read from its model_index.json and transformer config (`variant_of`).
    variants = (
        "Wan 2.1 T2V",
        "Wan 2.2 T2V A14B (two experts)",
        "Wan 2.2 TI2V 5B",
        "Wan 2.1 I2V",
        "Wan 2.2 I2V A14B (two experts)",
    )

    def __init__(self, cfg: Config | None = None) -> None:
        # Image-to-video (kit.families.wan.i2v) is read from the base's configs first: it
        # draws through WanImageToVideoPipeline, each validation prompt from its one image.
        self.cfg = cfg if cfg is not None else Config()
        try:
            source = self.model_source(self.cfg.model.pretrained_model)
        except KitError:
            source = ""  # a bad model_config is refused where the base is loaded
        self.i2v = wan_i2v.read_i2v(source, self.cfg.data.condition_frame) if source else None
        self._image_encoder: tuple[Any, Any] | None = None
        if self.i2v is not None:
            self.pipeline_class = wan_i2v.PIPELINE
            self.control_images = 1  # a validation prompt's image, given as its `control`
        super().__init__(self.cfg)
        wan_i2v.check_run(self.i2v, self.cfg, self.frame_count(self.cfg.data.num_frames))

    def frame_count(self, available: int) -> int:
        """The most frames <= `available` a Wan clip can have (4k+1); 0 when none."""
        return (available - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR + 1 if available > 0 else 0

    def clip_fps(self):
        # The rate the released models' examples export at (diffusers' Wan docs and Wan's own
        # repository): 16 fps for Wan 2.1 and Wan 2.2 A14B, 24 fps for TI2V-5B (its clips are
        # trained at 24 fps; the only base with per-token timesteps, `expand_timesteps`).
        source = self.model_source(self.cfg.model.pretrained_model)
        return 24 if read_index(source).get("expand_timesteps") else 16

    # ------------------------------------------------------------ loading

    # The transformer is the one expert of Wan 2.1 and 2.2 TI2V, A14B's high-noise one: `load`
    # adds its low-noise `transformer_2` (same class) where the base has two.
    parts = (
        denoiser("WanTransformer3DModel"),
        vae("AutoencoderKLWan"),
        *text("UMT5EncoderModel", "AutoTokenizer"),
        scheduler(),
    )
    vae_frames = True
    meta_buffers = True  # the rotary tables must be on the meta device with the activations

    # The transformer alone in Wan's own layout, as ComfyUI's diffusion_models hold it.
    single_file_markers = ("blocks.0.self_attn.q.weight",)

    def identity_extras(self, pretrained, revision):
        # Read before anything is cached: `train_experts` on a base without experts is refused.
        self.experts(pretrained)
        # Cached embeddings are padded to the sequence length, so it is part of their key.
        return self.max_sequence_length()

    def identity(self, pretrained, revision=None):
        ident = super().identity(pretrained, revision)
        if self.i2v is not None:
            # Latent entries hold the conditioning too: keyed by how it is built and by the
            # image encoder it was built with.
            source = self.model_source(pretrained)
            clip = (
                base_identity(pretrained, source, ("image_encoder",), revision, None, "")["text"]
                if self.i2v.image_encoder
                else ""
            )
            ident["vae"] = fingerprint([ident["vae"], "i2v", str(self.i2v), clip])
        return ident

    def variant_of(self, pretrained):
        # Two transformers and a boundary: A14B; a timestep per token: TI2V-5B; conditioning
        # channels in the transformer's input: I2V.
        source = self.model_source(pretrained)
        index = read_index(source)
        i2v = 3 if wan_i2v.conditioned(source) else 0
        if read_experts(source) is not None:
            return self.variants[1 + i2v]
        return self.variants[2] if index.get("expand_timesteps") else self.variants[i2v]

    def version_metadata(self):
        variant = self.variant_of(self.cfg.model.pretrained_model)
        return {**super().version_metadata(), **wan_layout.RELEASES.get(variant, {})}

    def part_metadata(self, part):
        source = self.model_source(self.cfg.model.pretrained_model)
        return timestep_range(read_experts(source), EXPERT_OF_FILE[part]) if part else {}

    def experts(self, source: str) -> tuple[str, ...]:
        """The Wan 2.2 experts a run on base `source` trains (`train_experts`), () for a base
        with one transformer; refuses `train_experts` there (see kit.families.wan.experts)."""
        return trained_experts(self.cfg.model.train_experts, read_experts(source), source)

    def kohya_module(self, module):
        return wan_layout.original_name(module)

    def denoiser_files(self, state):
        # Two experts: one file each, as diffusers and ComfyUI load one LoRA per transformer.
        if any(k.split(".", 1)[0] in EXPERTS for k in state):
            return {FILE_SUFFIX[e]: w for e, w in split_state(state).items()}
        return {"": state}

    def denoiser_part(self, denoiser, part):
        return denoiser.expert(EXPERT_OF_FILE[part]) if part else denoiser

    def host_resident(self, denoiser):
        # One expert waits in CPU memory while the other trains (kit.families.wan.experts).
        if not isinstance(denoiser, WanExperts):
            return {}
        if len(denoiser.trained) == 2:
            return {"the expert a step does not train (they change places)": denoiser.low}
        held = next(e for e in ("high", "low") if e not in denoiser.trained)
        return {f"the untrained {held}-noise expert (for validation)": denoiser.expert(held)}

    def lora_load_kwargs(self, part):
        # diffusers' WanLoraLoaderMixin loads into transformer_2 when asked, by this keyword.
        return {"load_into_transformer_2": True} if part == FILE_SUFFIX["low"] else {}

    original_layout = staticmethod(wan_layout.to_original)

    def client_models(self, comps):
        # ComfyUI holds Wan in its original layout and reads LoRA by those names only.
        t = comps.denoiser
        original = self.original_state(t)
        return {"ComfyUI": (adapter_keys.prefixed("diffusion_model.", original), None)}

    def load(
        self, pretrained, *, revision=None, variant=None, dtype=torch.float32, parts=PARTS
    ) -> Components:
        comps = super().load(
            pretrained, revision=revision, variant=variant, dtype=dtype, parts=parts
        )
        source = self.model_source(pretrained)
        info = read_experts(source)
        if info is not None and comps.denoiser is not None:
            if single_file(pretrained):
                raise KitError(
                    f"pretrained_model {pretrained}: one file holds one Wan 2.2 expert; train "
                    "the two-expert model from its diffusers folder or hub id"
                )
            _refuse_with_experts()
            expert = self.part("denoiser").cls()  # the low-noise one: same class, own config
            low = expert.from_pretrained(
                source,
                subfolder=PIPELINE_NAMES["low"],
                revision=revision,
                variant=variant,
                torch_dtype=part_dtype(dtype, "denoiser"),
            )
            low.requires_grad_(False)
            steps = comps.noise_scheduler.config.num_train_timesteps
            trained = self.experts(source)
            comps.denoiser = WanExperts(
                comps.denoiser.eval(), low.eval(), info.boundary_ratio, steps, trained
            )
        return comps

    def token_limit(self, encoder, tokenizer):
        return self.max_sequence_length()

    def load_scheduler(self, pretrained, revision):
        """Flow matching with the configured shift, else the saved sampler's (Wan ships UniPC)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        saved = FlowMatchEulerDiscreteScheduler.load_config(
            self.model_source(pretrained), subfolder="scheduler", revision=revision
        )
        shift = (
            self.cfg.objective.flow_shift or saved.get("shift") or saved.get("flow_shift") or 1.0
        )
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=saved.get("num_train_timesteps", 1000), shift=float(shift)
        )

    # ------------------------------------------------------------ encoding

    @torch.no_grad()
    def encode_text(self, comps, captions):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tok, enc = comps.tokenizers[0], comps.text_encoders[0]
        inputs = tok(
            [prompt_clean(c) for c in captions],
            padding="max_length",
            max_length=self.max_sequence_length(),
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(enc.device)
        embeds = enc(inputs.input_ids.to(enc.device), mask).last_hidden_state
        # As WanPipeline: positions past a caption's tokens are zeros, not the encoder's padding.
        return {"prompt_embeds": torch.where(mask.bool().unsqueeze(-1), embeds, 0.0)}

    # ------------------------------------------------------------ training

    def noise_and_target(self, comps, latents, generator) -> NoiseDraw:
        shift = comps.noise_scheduler.config.shift
        experts = getattr(comps.denoiser, "module", comps.denoiser)  # DDP keeps it in .module
        if not isinstance(experts, WanExperts):
            return self.flow_draw(comps, latents, generator, shift)
        return self._expert_draw(comps, experts, latents, generator, shift)

    def _expert_draw(self, comps, experts: WanExperts, latents, generator, shift) -> NoiseDraw:
        """`flow_draw` on one expert's side of the boundary: the trained expert's, or with both
        trained the expert of a first σ drawn from the whole distribution (see wan_experts)."""
        steps = experts.num_train_timesteps
        if len(experts.trained) == 1:
            name = experts.trained[0]
        else:
            first = flow_sigmas(1, generator, **self.flow_options(), shift=shift) * steps
            name = "high" if bool(experts.expert_of(first)[0]) else "low"
        draw = self.flow_draw(
            comps, latents, generator, shift, steps, accept=accept_for(experts, name)
        )
        draw.part = FILE_SUFFIX[
            name
        ]  # which expert drew it: counted, an expert never drawn is named
        return draw

    def pixel_conditioning(self, comps, pixels):
        if self.i2v is None:
            return {}
        if self.i2v.image_encoder and self._image_encoder is None:
            self._image_encoder = wan_i2v.load_encoder(comps.source)
        return wan_i2v.conditioning(self.i2v, comps.vae, pixels, self._image_encoder)

    def predict(self, comps, noisy, timesteps, cond):
        if self.i2v is not None:
            inputs = wan_i2v.transformer_inputs(self.i2v, noisy, timesteps, cond)
            return comps.denoiser(**inputs, return_dict=False)[0]
        if read_index(comps.source).get("expand_timesteps"):
            # TI2V-5B text-to-video: a timestep per latent token, as WanPipeline's
            # `expand_timesteps` builds it from its all-ones mask over the (1, 2, 2) patches
            # (its image-to-video, with `condition_frame`, is wan_i2v's).
            mask = torch.ones(noisy.shape[2:], dtype=torch.float32, device=noisy.device)
            tokens = mask[:, ::2, ::2].flatten()
            timesteps = torch.stack([tokens * t for t in timesteps.float()])
        return comps.denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]

    def swap_blocks(self, denoiser):
        # Two experts: the blocks of the one on the accelerator (the other waits in CPU memory
        # whole); `swap_stacks` gives both, each swapped as one transformer's.
        if isinstance(denoiser, WanExperts):
            return list(denoiser.expert(denoiser.active).blocks)
        return list(denoiser.blocks)

    def swap_stacks(self, denoiser):
        """Each expert's blocks (the held one's too: validation runs it), for kit.train.offload."""
        if not isinstance(denoiser, WanExperts):
            return [list(denoiser.blocks)]
        return [list(denoiser.expert(e).blocks) for e in ("high", "low")]

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        # The base's own sampler (Wan ships UniPC), and both experts or the image encoder.
        denoiser = getattr(comps.denoiser, "module", comps.denoiser)
        experts: dict[str, Any] = {"transformer": denoiser}
        if isinstance(denoiser, WanExperts):
            # Both experts with their adapters, switched at the base's own boundary.
            experts = {
                "transformer": denoiser.expert("high"),
                "transformer_2": denoiser.expert("low"),
                "boundary_ratio": denoiser.boundary_ratio,
            }
        if self.i2v is not None and self.i2v.image_encoder:
            if self._image_encoder is None:
                self._image_encoder = wan_i2v.load_encoder(comps.source)
            processor, encoder = self._image_encoder
            experts.update(image_processor=processor, image_encoder=encoder)
        return self.build_pipeline(
            comps,
            scheduler=saved_scheduler(comps.source, "FlowMatchEulerDiscreteScheduler"),
            expand_timesteps=bool(read_index(comps.source).get("expand_timesteps")),
            **experts,
        )

    def call_kwargs(self, spec):
        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "negative_prompt": spec.negative_prompt,  # WanPipeline reads None as "" too
            "height": spec.height,
            "width": spec.width,
            "num_frames": self.frame_count(self.cfg.data.num_frames),
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale,
            "max_sequence_length": self.max_sequence_length(),
        }
        if spec.adapter_scale != 1.0:
            kwargs["attention_kwargs"] = {"scale": spec.adapter_scale}
        return {**kwargs, **self.first_frame_kwargs(spec)}

    def sample(self, pipe, spec):
        out = self.draw_clip(pipe, spec)
        # The pipeline's default output is floats in [0, 1]; rounded as a plain user would.
        return [
            Image.fromarray((np.asarray(f) * 255).round().astype("uint8")) for f in out.frames[0]
        ]

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        parts = super().empty_parts(pretrained)
        source = self.model_source(pretrained)
        trained = self.experts(source)  # refuses train_experts on a base without experts
        info = read_experts(source)
        if info is not None:
            # The second expert: the same architecture, its own config.
            cls = self.part("denoiser").cls()
            config = cls.load_config(source, subfolder=PIPELINE_NAMES["low"])
            with torch.device("meta"):
                low = cls.from_config(config)
            steps = saved_scheduler(source, "FlowMatchEulerDiscreteScheduler").config
            parts["denoiser"] = WanExperts(
                parts["denoiser"],
                low,
                info.boundary_ratio,
                steps.num_train_timesteps,
                trained,
            )
        return parts

    def denoiser_inputs(self, parts, batch, height, width):
        transformer, vae = parts["denoiser"], parts["vae"]
        frames = self.frame_count(self.cfg.data.num_frames)
        latent_frames = (frames - 1) // vae.config.scale_factor_temporal + 1
        s = vae.config.scale_factor_spatial
        c = transformer.config.in_channels
        latents = torch.zeros(batch, c, latent_frames, height // s, width // s, device="meta")
        steps = torch.zeros(batch, device="meta")
        embeds = torch.zeros(
            batch, self.max_sequence_length(), transformer.config.text_dim, device="meta"
        )
        kwargs = {"encoder_hidden_states": embeds}
        if transformer.config.image_dim is not None:  # Wan 2.1 I2V's CLIP image tokens
            tokens = wan_i2v.image_tokens(self.model_source(self.cfg.model.pretrained_model))
            image = (batch, tokens, transformer.config.image_dim)
            kwargs["encoder_hidden_states_image"] = torch.zeros(image, device="meta")
        return (latents, steps), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0, variant: str = ""):
        """The tiny Wan 2.1 T2V, or the layout of another of `variants` (two experts; TI2V-5B's
        48-channel residual VAE with 2x2 patches and per-token timesteps)."""
        variant = variant or self.variants[0]
        if variant not in self.variants:
            raise KitError(f"no Wan variant '{variant}' (choose from {', '.join(self.variants)})")
        ti2v = variant == self.variants[2]
        i2v = variant in self.variants[3:]
        from diffusers import (
            AutoencoderKLWan,
            FlowMatchEulerDiscreteScheduler,
            WanPipeline,
            WanTransformer3DModel,
        )
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(seed)
        tokenizer = tiny.t5_tokenizer("AutoTokenizer")  # Wan's tokenizer has no sentinels
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                **tiny.t5_config_kwargs(
                    tokenizer,
                    d_model=32,
                    dropout_rate=0.0,
                    decoder_start_token_id=tokenizer.pad_token_id,
                )
            )
        )
        # The VAE of diffusers' own Wan pipeline tests; a slightly wider transformer than theirs,
        # so a few steps of LoRA visibly move its samples.
        vae = tiny.wan_vae()
        if ti2v:  # the Wan 2.2 VAE: 48 channels, 16x in space (2x2 pixel patches inside)
            vae = AutoencoderKLWan(
                base_dim=12,
                z_dim=48,
                in_channels=12,
                out_channels=12,
                is_residual=True,
                patch_size=2,
                scale_factor_spatial=16,
                scale_factor_temporal=4,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.0] * 48,
                latents_std=[1.0] * 48,
            )

        def build_transformer(**i2v_sizes):
            return WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=4,
                attention_head_dim=16,
                in_channels=i2v_sizes.pop("in_channels", vae.config.z_dim),
                out_channels=vae.config.z_dim,
                text_dim=32,
                freq_dim=256,
                ffn_dim=128,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
                **i2v_sizes,  # conditioning channels, CLIP image width
            )

        parts = {
            "tokenizer": tokenizer,
            "text_encoder": text_encoder,
            "vae": vae,
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        }
        if i2v:
            two = variant == self.variants[4]
            return wan_i2v.make_tiny(two, build_transformer, parts, out_dir)
        if variant == self.variants[1]:
            return make_tiny_experts(build_transformer(), build_transformer, out_dir, parts)
        pipe = WanPipeline(**parts, transformer=build_transformer(), expand_timesteps=ti2v)
        return tiny.save_pipeline(pipe, out_dir)


def _refuse_with_experts() -> None:
    """What the two-expert denoiser does not do yet, refused by name before it loads."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each process would train the expert of its own batch, and DDP averages gradients
        # over all of them: the other expert would step on zeros.
        raise KitError(
            "Wan 2.2's two experts train on one process for now (each step trains the expert of "
            "its timesteps, which differs between processes); launch without accelerate / "
            "torchrun, or train one expert per run (train_experts: high, then low)"
        )
