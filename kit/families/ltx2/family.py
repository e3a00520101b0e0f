"""LTX-2: one transformer denoises a clip's video and its sound together (LTX2Pipeline).

Parts: LTX2VideoTransformer3DModel (a video stream and an audio stream with cross-attention
between them), AutoencoderKLLTX2Video (32x in space, 8x in time after the first frame, so a clip
has 8k+1 frames), AutoencoderKLLTX2Audio (stereo mel spectrogram ↔ latents), Gemma 3 (every
layer's hidden states) and the text connectors that turn them into the video stream's and the
audio stream's text tokens, and the vocoder (mel → waveform) that validation clips play.

Training follows the pipeline: video latents normalised by the VAE's statistics and packed into
tokens, audio latents packed and normalised, both noised at one σ (the pipeline steps both with
one schedule), the connectors' embeddings, and positions from the transformer's own rotary
helpers at the clip's frame rate. The loss is the video's plus the sound's (as Lightricks'
trainer adds them); a silent clip's sound weighs 0. See `sound.py` for waveform → latents.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from kit.config import Config
from kit.errors import KitError
from kit.families import adapter_keys, register
from kit.families.base import Components, Family, NoiseDraw
from kit.families.flow import FlowFamily
from kit.families.identity import base_identity, fingerprint, saved_scheduler
from kit.families.ltx2 import i2v as ltx2_i2v
from kit.families.ltx2 import layout as ltx2_layout
from kit.families.ltx2 import sound
from kit.families.ltx2 import tiny as ltx2_tiny
from kit.families.parts import Part, denoiser, scheduler, text, vae
from kit.families.samplers import Clip

FRAME_RATE = 24.0
"""Frames per second LTX2Pipeline generates at by default (`frame_rate`): validation clips and
clips whose rate is unknown (frame folders) are taken at it."""
AUDIO = "audio_latents"
"""The batch key of a clip's sound (packed, normalised audio latents, (L, C·M) per sample)."""


@register
class LTX2(FlowFamily):
    name = "ltx2"
    size_multiple = 32
    bucket_step = 32
    native_resolution = 512
    hub_id = "Lightricks/LTX-2"
    video = True
    audio = True
    joint_latents = (AUDIO,)
    # Every attention of both streams (self, text and the audio↔video cross-attention) and the
    # feed-forwards: diffusers' LTX-2 LoRA examples adapt the attention projections.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_class = "LTX2Pipeline"
    default_guidance_scale = 3.0  # LTX2Pipeline's default
    default_num_inference_steps = 30
    default_max_sequence_length = 1024  # Gemma tokens LTX2Pipeline pads every prompt to
    scale_kwarg = "attention_kwargs"
    # LTX2Pipeline's own `calculate_shift` fallbacks: 0.95 at 1024 tokens to 2.05 at 4096.
    mu_defaults = (1024, 4096, 0.95, 2.05)
    # The kohya file is ComfyUI's: `lora_unet_<original path>`, which ComfyUI accepts for every
    # weight of its LTXAVModel (`model_lora_keys_unet`), checked against the original layout
    # (`layout.py`); diffusers reads only its own file.
    export_formats = ("diffusers", "kohya")
    modelspec_implementation = "https://github.com/Lightricks/LTX-2"
    base_model_version = "ltx2"
    modelspec_architecture = "ltx-2"

    def __init__(self, cfg: Config | None = None) -> None:
        # Image-to-video (kit.families.ltx2.i2v) when the run names its conditioning frame: the
        # same base, drawn through LTX2ImageToVideoPipeline, each validation prompt from an image.
        self.cfg = cfg if cfg is not None else Config()
        self.i2v: int | None = self.cfg.data.condition_frame
        if self.i2v is not None:
            self.pipeline_class = ltx2_i2v.PIPELINE
            self.control_images = 1  # a validation prompt's image, given as its `control`
        super().__init__(self.cfg)
        ltx2_i2v.check_run(self.i2v, self.cfg, self.frame_count(self.cfg.data.num_frames))
        self._held: dict[str, Any] = {}

    def frame_count(self, available: int) -> int:
        """The most frames <= `available` an LTX-2 clip can have (8k+1); 0 when none."""
        return (available - 1) // 8 * 8 + 1 if available > 0 else 0

    def clip_fps(self) -> int:
        return int(FRAME_RATE)

    # ------------------------------------------------------------ loading

    # The connectors, audio VAE and vocoder are LTX2Pipeline's parts that `Components` has no
    # place for: `held` loads and keeps them.
    parts = (
        denoiser("LTX2VideoTransformer3DModel"),
        vae("AutoencoderKLLTX2Video"),
        Part("audio_vae", "diffusers.AutoencoderKLLTX2Audio", "held"),
        *text("Gemma3ForConditionalGeneration", "AutoTokenizer"),
        Part("connectors", "diffusers.pipelines.ltx2.connectors.LTX2TextConnectors", "held"),
        Part("vocoder", "diffusers.pipelines.ltx2.vocoder.LTX2Vocoder", "held"),
        scheduler(),
    )
    held_parts = ("connectors",)
    """The held parts `empty_parts` measures: the connectors run with the text encoder (the
    audio VAE and the vocoder only while caching and drawing)."""
    vae_frames = True
    meta_buffers = True  # the rotary tables must be on the meta device with the activations

    def text_loaded(self, comps, revision):
        # The connectors are the text encoder's second half (their output is what is cached):
        # loaded with it, in its dtype.
        dtype = comps.text_encoders[0].dtype
        self._held["connectors"] = self._read_held("connectors", comps.source, revision, dtype)

    def kohya_module(self, module):
        return ltx2_layout.original_name(module)

    def client_models(self, comps):
        # ComfyUI holds LTX-2's transformer in its original layout.
        t = getattr(comps.denoiser, "module", comps.denoiser)
        original = ltx2_layout.to_original(t.state_dict())
        return {"ComfyUI": (adapter_keys.prefixed("diffusion_model.", original), None)}

    def token_limit(self, encoder, tokenizer):
        return self.max_sequence_length()

    def identity(self, pretrained, revision=None):
        ident = super().identity(pretrained, revision)
        # Cached text is the connectors' output, and a clip's latent entry holds its sound's
        # latents: keyed by the connectors and by the audio VAE (and the mel it reads) too.
        source = self.model_source(pretrained)
        for key, sub, extra in (("text", "connectors", None), ("vae", "audio_vae", sound.N_FFT)):
            part = base_identity(pretrained, source, (sub,), revision, None, "")["text"]
            ident[key] = fingerprint([ident[key], sub, part, extra])
        if self.i2v is not None:
            # Latent entries hold the conditioning image's latents too.
            ident["vae"] = fingerprint([ident["vae"], "i2v", self.i2v, self._image_crf(source)])
        return ident

    def _image_crf(self, source: str) -> int:
        """The CRF the image-to-video pipeline re-compresses its image with for this base."""
        from transformers import AutoConfig

        return ltx2_i2v.image_crf(AutoConfig.from_pretrained(source, subfolder="text_encoder"))

    def read_tokenizer(self, part, source, revision):
        # As LTX2Pipeline sets it: Gemma pads on the left, with its end token if it has no pad.
        tok = super().read_tokenizer(part, source, revision)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok

    def _read_held(
        self, name: str, source: str, revision: str | None = None, dtype: Any = None
    ) -> Any:
        """The held part `name` of the base at `source`, frozen."""
        (part,) = [p for p in self.parts_of("held") if p.name == name]
        cls = self.part_class(part, source)
        module = cls.from_pretrained(
            source, subfolder=part.folder, revision=revision, torch_dtype=dtype
        )
        return module.requires_grad_(False).eval()

    def held(self, comps, name):
        """A held part, frozen: the text `connectors` (loaded with the text encoder), the
        `audio_vae` or the `vocoder` (loaded from the base on first use); on the device, and in
        the floating dtype, of the module it works beside."""
        if name not in self._held:
            self._held[name] = self._read_held(name, comps.source)
        module = self._held[name]
        beside = comps.text_encoders[0] if name == "connectors" and comps.text_encoders else None
        beside = beside or comps.vae or comps.denoiser
        if beside is not None:
            dtype = getattr(beside, "dtype", None)  # a quantized encoder's stays out of it
            dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
            module.to(device=next(beside.parameters()).device, dtype=dtype)
        return module

    def part(self, role, name=None):
        # `part(comps, name)` is the held module, as the parity tests read the audio VAE.
        return super().part(role) if name is None else self.held(role, name)

    # ------------------------------------------------------------ encoding

    @torch.no_grad()
    def encode_text(self, comps, captions):
        tok, gemma = comps.tokenizers[0], comps.text_encoders[0]
        connectors = self.held(comps, "connectors")
        inputs = tok(
            [c.strip() for c in captions],
            padding="max_length",
            max_length=self.max_sequence_length(),
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids.to(gemma.device), inputs.attention_mask.to(gemma.device)
        out = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        # As LTX2Pipeline: every layer's hidden states side by side, then the connectors.
        stacked = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(gemma.dtype)
        video, audio, kept = connectors(stacked, mask, padding_side=tok.padding_side)
        return {
            "prompt_embeds": video,
            "audio_prompt_embeds": audio,
            "prompt_attention_mask": kept,
        }

    def normalize_latents(self, vae, latents):
        # The VAE keeps its statistics as buffers (not in its config), scaled as the pipeline's.
        from diffusers import LTX2Pipeline

        return LTX2Pipeline._normalize_latents(
            latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )

    def sound_rate(self, comps: Components) -> int:
        """Samples a second of the waveforms `encode_sound` takes: the audio VAE's rate."""
        return int(self.held(comps, "audio_vae").config.sample_rate)

    @torch.no_grad()
    def encode_sound(
        self, comps: Components, waveform: torch.Tensor | None, frames: int, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """A clip window's sound as its latent entry holds it: `waveform` (2, samples) at the
        audio VAE's rate from the window's first frame on, or None for a silent clip (digital
        silence, its loss weighted 0), for `frames` frames at `fps` (None: the pipeline's 24)."""
        from diffusers import LTX2Pipeline

        vae = self.held(comps, "audio_vae")
        rate = float(fps or FRAME_RATE)
        count = sound.latent_count(frames / rate, vae.config, vae.temporal_compression_ratio)
        count = max(count, 1)
        need = sound.window_samples(count, vae.config, vae.temporal_compression_ratio)
        wave = torch.zeros(1, 2, need)
        if waveform is not None:
            take = waveform[:, :need].float()
            wave[0, : take.shape[0], : take.shape[1]] = take
            if take.shape[0] == 1:  # mono: both ears
                wave[0, 1] = wave[0, 0]
        mel = sound.log_mel(wave, vae.config).to(vae.device, vae.dtype)
        raw = vae.encode(mel).latent_dist.mode()[:, :, :count]
        packed = LTX2Pipeline._pack_audio_latents(raw)
        normed = LTX2Pipeline._normalize_audio_latents(packed, vae.latents_mean, vae.latents_std)
        return {
            AUDIO: normed[0].float(),
            f"{AUDIO}_weight": torch.tensor(0.0 if waveform is None else 1.0),
            "frame_rate": torch.tensor(rate),
        }

    # ------------------------------------------------------------ training

    def noise_and_target(self, comps, latents, generator, **joint) -> NoiseDraw:
        # The sound is drawn with the video; σ is shifted for the clip's tokens, frames too.
        config = comps.noise_scheduler.config
        shift = self.cfg.objective.flow_shift
        if shift <= 0:
            # The pipeline's exponential shift for this clip's video tokens (1x1x1 patches).
            shift = math.exp(self.dynamic_mu(config, math.prod(latents.shape[2:])))
        draw = self.flow_draw(comps, latents, generator, shift)
        audio = joint.get(AUDIO)
        if audio is not None:
            # One σ for both streams, as the pipeline steps them with one schedule.
            sigma = (draw.timesteps / config.num_train_timesteps).view(-1, 1, 1).to(audio)
            noise = torch.randn(audio.shape, generator=generator, dtype=torch.float32).to(audio)
            noisy = (1 - sigma) * audio + sigma * noise
            draw.joint[AUDIO] = NoiseDraw(noisy, draw.timesteps, noise - audio)
        return draw

    def pixel_conditioning(self, comps, pixels):
        if self.i2v is None:
            return {}
        crf = self._image_crf(comps.source)
        return ltx2_i2v.conditioning(comps.vae, pixels, self.i2v, crf)

    def transformer_inputs(
        self, denoiser: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict
    ) -> dict[str, Any]:
        """The keyword arguments of the transformer's forward, built as LTX2Pipeline builds
        them for one denoising step without guidance."""
        from diffusers import LTX2Pipeline
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        t = getattr(denoiser, "module", denoiser)
        p, pt = t.config.patch_size, t.config.patch_size_t
        b, _, f, h, w = noisy.shape
        embeds = cond["prompt_embeds"]
        audio = cond[AUDIO]
        rates = cond.get("frame_rate")
        rate = float(rates.reshape(-1)[0]) if rates is not None else FRAME_RATE
        if rates is not None and not bool((rates == rates.reshape(-1)[0]).all()):
            raise KitError("ltx2: the clips of one batch must share a frame rate")
        fps = conditioning_frame_rate(rate, 1.0)
        extra: dict[str, Any] = {}
        video_timesteps = timesteps
        if self.i2v is not None:
            noisy, video_timesteps = ltx2_i2v.inputs(noisy, timesteps, cond, p, pt)
            extra["audio_timestep"] = timesteps
        return {
            **extra,
            "hidden_states": LTX2Pipeline._pack_latents(noisy, p, pt).to(embeds.dtype),
            "audio_hidden_states": audio.to(embeds.dtype),
            "encoder_hidden_states": embeds,
            "audio_encoder_hidden_states": cond["audio_prompt_embeds"],
            "timestep": video_timesteps,
            "sigma": timesteps,
            "encoder_attention_mask": cond["prompt_attention_mask"].long(),
            "audio_encoder_attention_mask": cond["prompt_attention_mask"].long(),
            "num_frames": f // pt,
            "height": h // p,
            "width": w // p,
            "fps": fps,
            "audio_num_frames": audio.shape[1],
            "video_coords": t.rope.prepare_video_coords(b, f, h, w, noisy.device, fps=fps),
            "audio_coords": t.audio_rope.prepare_audio_coords(b, audio.shape[1], noisy.device),
            "isolate_modalities": False,
            "spatio_temporal_guidance_blocks": None,
            "perturbation_mask": None,
            "use_cross_timestep": True,
            "attention_kwargs": None,
        }

    def predict(self, comps, noisy, timesteps, cond):
        from diffusers import LTX2Pipeline

        t = getattr(comps.denoiser, "module", comps.denoiser)
        inputs = self.transformer_inputs(comps.denoiser, noisy, timesteps, cond)
        video, audio = comps.denoiser(**inputs, return_dict=False)
        p, pt = t.config.patch_size, t.config.patch_size_t
        _, _, f, h, w = noisy.shape
        video = LTX2Pipeline._unpack_latents(video, f // pt, h // p, w // p, p, pt)
        return video, {AUDIO: audio}

    def swap_blocks(self, denoiser):
        return list(denoiser.transformer_blocks)

    # ------------------------------------------------------------ sampling

    def pipeline(self, comps):
        # The base's own sampler config, the bare transformer, and connectors that split
        # cached embeddings when there is no text encoder.
        connectors = self.held(comps, "connectors")
        if not comps.text_encoders or comps.text_encoders[0] is None:
            # Drawn from cached embeddings (`kit.sample.embedded`): the cache holds the
            # connectors' output, which `prompt_kwargs` hands the pipeline as its prompt embeds.
            connectors = Connected(connectors)
        return self.build_pipeline(
            comps,
            scheduler=saved_scheduler(comps.source, "FlowMatchEulerDiscreteScheduler"),
            connectors=connectors,
            transformer=getattr(comps.denoiser, "module", comps.denoiser),
        )

    def prompt_kwargs(self, text):
        # The pipeline takes Gemma's states and runs the connectors on them; the cache holds
        # the connectors' output: both streams side by side, which `Connected` splits again.
        both = torch.cat([text["prompt_embeds"], text["audio_prompt_embeds"]], dim=-1)
        return {
            "prompt_embeds": both,
            "prompt_attention_mask": text["prompt_attention_mask"].long(),
        }

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        kwargs.update(
            negative_prompt=spec.negative_prompt,
            num_frames=self.frame_count(self.cfg.data.num_frames),
            frame_rate=FRAME_RATE,
            output_type="np",  # frames as floats, and the vocoder's waveform beside them
        )
        return {**kwargs, **self.first_frame_kwargs(spec)}

    def sample(self, pipe, spec):
        out = self.draw_clip(pipe, spec)
        video, audio = out.frames, out.audio
        frames = [Image.fromarray((np.asarray(f) * 255).round().astype("uint8")) for f in video[0]]
        # The vocoder's waveform, (channels, samples) at its output rate, plays with the frames.
        rate = int(pipe.vocoder.config.output_sampling_rate)
        return Clip(frames, sound=audio[0].float().cpu().numpy(), sample_rate=rate)

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained):
        # The held parts the estimate counts, built from their configs too.
        parts = super().empty_parts(pretrained)
        source = self.model_source(pretrained)
        for part in self.parts_of("held"):
            if part.name in self.held_parts:
                cls = self.part_class(part, pretrained)
                config = cls.load_config(source, subfolder=part.folder)
                with torch.device("meta"):
                    parts[part.name] = cls.from_config(config)
        return parts

    def denoiser_inputs(self, parts, batch, height, width):
        t, vae = parts["denoiser"], parts["vae"]
        frames = self.frame_count(self.cfg.data.num_frames)
        f = (frames - 1) // vae.temporal_compression_ratio + 1
        s = vae.spatial_compression_ratio
        h, w = height // s, width // s
        audio = max(1, round(frames / FRAME_RATE * 25))  # 16 kHz, hop 160, 4x: 25 a second
        meta = {"device": "meta"}
        tokens = self.max_sequence_length()
        connectors = parts["connectors"]
        video_width = connectors.video_connector.inner_dim
        audio_width = connectors.audio_connector.inner_dim
        kwargs = {
            "audio_hidden_states": torch.zeros(batch, audio, t.config.audio_in_channels, **meta),
            # The connectors' output: what the transformer's caption projections take.
            "encoder_hidden_states": torch.zeros(batch, tokens, video_width, **meta),
            "audio_encoder_hidden_states": torch.zeros(batch, tokens, audio_width, **meta),
            "timestep": torch.zeros(batch, **meta),
            "sigma": torch.zeros(batch, **meta),
            "encoder_attention_mask": torch.ones(batch, tokens, dtype=torch.long, **meta),
            "audio_encoder_attention_mask": torch.ones(batch, tokens, dtype=torch.long, **meta),
            "num_frames": f,
            "height": h,
            "width": w,
            "fps": FRAME_RATE,
            "audio_num_frames": audio,
            "use_cross_timestep": True,
            "return_dict": False,  # (video, audio): the estimate's loss reads the video's
        }
        latents = torch.zeros(batch, f * h * w, t.config.in_channels, **meta)
        return (latents,), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        return self.save_tiny(out_dir, *ltx2_tiny.parts(seed))

    def single_file_state_dict(self, comps):
        # No merged single-file layout for LTX-2 yet: refused as `Family` refuses one.
        return Family.single_file_state_dict(self, comps)


class Connected(torch.nn.Module):
    """The text connectors of a pipeline that is handed their output (cached embeddings): the
    video and audio streams' embeddings side by side are split back, the mask passed on."""

    def __init__(self, connectors: torch.nn.Module) -> None:
        super().__init__()
        self.inner = connectors
        self.config = connectors.config

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, embeds, attention_mask, padding_side="left", scale_factor=8):
        split = embeds.shape[-1] - self.inner.audio_connector.inner_dim
        return embeds[..., :split], embeds[..., split:], attention_mask.long()
