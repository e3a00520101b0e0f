"""Qwen-Image 2.1 (and its Turbo): a 7B single-stream, block-causal flow-matching transformer on
the unpatched 64-channel latents of a 16x RGBA VAE, conditioned on the hidden states of
Qwen3-VL, which reads the prompt together with any reference images.

Everything fed to the transformer is built as `QwenImage21Pipeline` builds it (`transformer_inputs`):

- latents are flattened, not packed: one token per 16×16-pixel tile (`pack`), so a side must be
  a multiple of 32 (the pipeline's `vae_scale_factor * 2`: one vision slot covers 2×2 tokens);
- the prompt is the pipeline's own `encode_prompt` (its raw chat template, left padding, the
  system prompt dropped, the text model's last layer before its final norm); the cache pads it to a
  fixed length with a zero mask and keeps its `image_pad_mask`, and a batch is cut back to its
  longest caption, so the mask is None where the pipeline gives none;
- `img_mask` is that image-pad mask with one slot per 2×2 target tokens appended;
- the timestep is σ · 1000 in the latents' dtype, divided by 1000;
- the σ shift is the pipeline's `calculate_shift` on the unpatched sequence length (h · w).

The VAE reads RGBA: an RGB image gets an opaque alpha channel (1 after normalising), as the
pipeline's `convert("RGBA")` gives it.

Which release a base is comes from its `model_index.json`: the Turbo checkpoint ships its
sampling grid as `sample_sigmas` (diffusers' modular pipeline tells the two apart the same way).

Exports: the diffusers file only, for now. ComfyUI has the model (Comfy-Org/ComfyUI,
`comfy/ldm/qwen_image21/model.py` at 08f68f09: diffusers' module names, but the SwiGLU fused as
`img_mlp.gate_up` = [gate_layer; proj]); a file in its layout is not written until it is
verified by its loading rules.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kit.errors import ConfigError, DataError
from kit.families import register
from kit.families.flow import FlowFamily
from kit.families.flux2.family import model_index
from kit.families.parts import Part, denoiser, scheduler, vae
from kit.families.qwen_image.family import padded_prompts
from kit.families.qwen_image21 import tiny as tiny21
from kit.families.qwen_image_edit.family import ProcessorFamily
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source

BASE, TURBO = "Qwen-Image-2.1", "Qwen-Image-2.1-Turbo"
VAE_FACTOR = 16
"""The VAE's spatial factor: the pipeline's `vae_scale_factor`."""
REFERENCE_AREA = 1024 * 1024
"""The area a reference is resized to (`output_resolution`², the pipeline's default 1024)."""
MAX_SEQUENCE_LENGTH = 1024
"""The kit's cap on a caption's tokens (the cache's fixed length): the pipeline cuts nothing, so
a longer caption is refused rather than cut."""


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) or (B, C, 1, h, w) latents → (B, h · w, C) tokens, as the pipeline's
    `_pack_latents` (2.1 reads latents unpatched)."""
    if latents.ndim == 5:
        latents = latents.squeeze(2)
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """`pack`'s inverse: (B, h · w, C) → (B, C, h, w)."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, h, w)


def transformer_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
    image_pad_mask: torch.Tensor,
    references: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """QwenImage21Transformer2DModel's arguments for (B, C, h, w) latents at `timesteps` (σ·1000)
    as the pipeline builds them for one step: the references' tokens first, then the target's."""
    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    if prompt_embeds_mask is not None:
        # The cache pads every caption to one length; the pipeline pads a batch to its longest.
        used = prompt_embeds_mask.bool().any(dim=0)
        keep = int(used.nonzero().max()) + 1 if bool(used.any()) else used.shape[0]
        prompt_embeds, image_pad_mask = prompt_embeds[:, :keep], image_pad_mask[:, :keep]
        kept = prompt_embeds_mask[:, :keep].to(device, torch.long)
        prompt_embeds_mask = None if bool(kept.all()) else kept
    refs = [r.to(device, dtype) for r in references]
    slots = image_pad_mask.to(device, torch.bool)
    return {
        "hidden_states": torch.cat([*[pack(r) for r in refs], pack(latents)], dim=1),
        "timestep": timesteps.to(device, dtype) / 1000,
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        "encoder_hidden_states_mask": prompt_embeds_mask,
        "img_shapes": [[*[(1, r.shape[-2], r.shape[-1]) for r in refs], (1, h, w)]] * b,
        "img_mask": torch.cat([slots, slots.new_ones(slots.shape[0], h * w // 4)], dim=1),
    }


@register
class QwenImage21(ProcessorFamily, FlowFamily):
    """Qwen-Image 2.1 and its Turbo (one architecture; Turbo ships a few-step sampling grid)."""

    name = "qwen_image21"
    scale_kwarg = "attention_kwargs"
    bucket_multiple = 32  # the pipeline's `vae_scale_factor * 2`: a vision slot is 2×2 tokens
    size_multiple = 32
    # The pipeline hands its scheduler custom sigmas and a mu, which these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    native_resolution = 1024  # the pipeline's `output_resolution`
    hub_id = "Qwen/Qwen-Image-2.1"  # the pipeline's example; diffusers' single-file default
    bucket_step = 64
    variants = (BASE, TURBO)
    image_only_module = tiny21.IMAGE_ONLY_MODULE
    read_processor = staticmethod(tiny21.load_processor)  # its Qwen3VLProcessor
    variant_steps = {BASE: 40, TURBO: 8}
    """QwenImage21Pipeline's default (40); Turbo's modular pipeline default (8, its
    `sample_sigmas` decide the count when the base ships them)."""
    distilled_variants = {
        TURBO: "Qwen-Image 2.1 Turbo is step-distilled (its model_index.json ships "
        "sample_sigmas, a few-step grid it samples without guidance); Qwen-Image 2.1 is not"
    }
    default_max_sequence_length = MAX_SEQUENCE_LENGTH
    default_guidance_scale = 1.0  # `true_cfg_scale`: the model samples without guidance
    # Attention and the SwiGLU of every block (the pipeline's LoRA loader maps any module).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "proj", "gate_layer", "out")
    pipeline_class = "QwenImage21Pipeline"
    kohya_text_prefixes = ()
    base_model_version = "qwen_image21"
    modelspec_architecture = "qwen-image-2.1"
    modelspec_implementation = "https://github.com/QwenLM/Qwen-Image"
    export_formats = ("diffusers",)
    quantized_text_encoders = ("text_encoder",)  # Qwen3-VL, only ever read frozen
    vae_frames = True  # a 3D causal VAE used on single frames
    # Text to image and edit in one: up to ten references (the release's), none needed. The
    # prompt is encoded with its pair's references (the VL encoder reads them).
    control_images = 10
    prompt_controls = True
    image_alpha = True  # the VAE reads RGBA

    parts = (
        denoiser("QwenImage21Transformer2DModel"),
        vae("AutoencoderKLQwenImage21"),
        Part("text_encoder", "transformers.Qwen3VLForConditionalGeneration", "text_encoder"),
        # The pipeline takes no tokenizer: its processor's folder holds it.
        Part("tokenizer", "transformers.Qwen2Tokenizer", "tokenizer", subfolder="processor"),
        Part("processor", "transformers.Qwen3VLProcessor", "processor"),
        scheduler(),
    )

    def __init__(self, cfg: Any = None) -> None:
        self._processors: dict[str, Any] = {}
        super().__init__(cfg)
        data = self.cfg.data
        with_references = any(
            getattr(d, "control_dir", None) or getattr(d, "control_column", ())
            for d in [data, *data.datasets]
        )
        # The empty caption's embedding would depend on each pair's references; the cache
        # holds one for the whole run.
        if with_references and self.cfg.objective.caption_dropout > 0:
            raise ConfigError(
                "caption_dropout: qwen_image21 encodes each caption with its pair's reference "
                "images, so there is no one empty caption to drop to; set caption_dropout: 0"
            )

    # ------------------------------------------------------------ variants

    def variant_of(self, pretrained: str) -> str:
        found = model_index(self.model_source(pretrained), self.cfg.model.revision)
        if found:
            return TURBO if found.get("sample_sigmas") else BASE
        return TURBO if "turbo" in str(pretrained).lower() else BASE

    # ------------------------------------------------------------ loading

    def token_limit(self, encoder, tokenizer):
        return self.max_sequence_length()

    # ------------------------------------------------------------ encoding

    def encode_images(self, comps, pixels, generator=None):
        # The VAE reads RGBA; an RGB image is opaque, as the pipeline's convert("RGBA") makes it.
        if pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        # The pipeline's pixels are channels-last (its preprocess permutes numpy's H×W×C), and
        # the VAE's convolutions round by memory layout: encode in that layout.
        hwc = pixels.permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format)
        pixels = hwc.permute(0, 3, 1, 2)
        return super().encode_images(comps, pixels, generator)

    def encode_text(self, comps, captions, controls=None):
        """The pipeline's `encode_prompt`, padded to the caption allowance (plus, with
        `controls`, each caption's references' vision slots) with a zero mask. With `controls`
        (per caption, its pair's references as placed) one caption at a time, its references
        resized as the pipeline resizes them for the VL encoder."""
        pipe = self._text_pipeline(comps)
        device = pipe.text_encoder.device
        if controls is None:
            return self._padded(pipe.encode_prompt(list(captions), device=device), 0)
        parts = []
        for caption, images in zip(captions, controls, strict=True):
            shown = [self.prompt_image(im) for im in images] or None
            slots = sum((im.height // 32) * (im.width // 32) for im in shown or ())
            parts.append(
                self._padded(pipe.encode_prompt(caption, image=shown, device=device), slots)
            )
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def _padded(self, encoded: tuple, slots: int) -> dict[str, torch.Tensor]:
        embeds, mask, image_slots = encoded
        length = self.max_sequence_length() + slots
        n = embeds.shape[1]
        if n > length:
            raise DataError(
                f"a caption takes {n - slots} tokens, more than max_sequence_length "
                f"({self.max_sequence_length()}); the pipeline cuts none, so shorten it or "
                "raise max_sequence_length"
            )
        return {
            **padded_prompts(embeds, mask, length),
            "image_pad_mask": torch.nn.functional.pad(image_slots, (0, length - n)),
        }

    def control_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the pipeline resizes a reference of this size to, for the VAE and
        the VL encoder alike: ~1 MP in multiples of 32 (`calculate_dimensions`)."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

        w, h, _ = calculate_dimensions(REFERENCE_AREA, width / height)
        return w, h

    def _image_processor(self) -> Any:
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=VAE_FACTOR, vae_latent_channels=64)

    def prompt_image(self, image: Any) -> Any:
        """A reference as the pipeline hands it to the VL encoder: RGBA, resized (the encoder
        composites it over white)."""
        w, h = self.control_size(image.width, image.height)
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        return self._image_processor().resize(rgba, height=h, width=w)

    def control_pixels(self, image: Any) -> torch.Tensor:
        """A reference's RGBA pixels as the pipeline preprocesses it for the VAE."""
        w, h = self.control_size(image.width, image.height)
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        return self._image_processor().preprocess(rgba, height=h, width=w)[0]

    def prompt_kwargs(self, text):
        # The call takes embeddings and their mask, never an image-pad mask: given embeddings
        # it reads them as text alone (no slot is an image's), as a caption without references
        # is. Cut to the caption's own tokens, the call sees what `encode_prompt` returns.
        mask = text["prompt_embeds_mask"].bool()
        keep = int(mask.any(dim=0).nonzero().max()) + 1
        kept = text["prompt_embeds_mask"][:, :keep].long()
        return {
            "prompt_embeds": text["prompt_embeds"][:, :keep],
            "prompt_embeds_mask": None if bool(kept.all()) else kept,
        }

    # ------------------------------------------------------------ training

    def flow_shift(self, scheduler_config: Any, height: int, width: int) -> float:
        # The pipeline's mu counts the unpatched tokens (h · w), not 2×2 patches.
        if self.cfg.objective.flow_shift > 0:
            return float(self.cfg.objective.flow_shift)
        if not scheduler_config.get("use_dynamic_shifting", False):
            return float(scheduler_config.get("shift", 1.0))
        mu = self.dynamic_mu(scheduler_config, height * width)
        return mu if scheduler_config.get("time_shift_type") == "linear" else math.exp(mu)

    def predict(self, comps, noisy, timesteps, cond):
        keys = (f"control_latents_{r}" for r in range(self.control_images))
        slots = cond["image_pad_mask"].bool()
        references = self._read_with([cond[k] for k in keys if k in cond], int(slots[0].sum()))
        if references and not bool((slots == slots[:1]).all()):
            # The transformer reads one layout (row 0's) for the whole batch.
            raise DataError(
                "the captions of one batch place their references' slots differently (their "
                "lengths differ): train batch_size 1 with references"
            )
        kwargs = transformer_inputs(
            noisy,
            timesteps,
            cond["prompt_embeds"],
            cond["prompt_embeds_mask"],
            cond["image_pad_mask"],
            references,
        )
        out = comps.denoiser(**kwargs, return_dict=False)[0]
        h, w = noisy.shape[-2:]
        # The pipeline keeps the target's tokens, the last h · w.
        return unpack(out[:, -h * w :], h, w)

    @staticmethod
    def _read_with(references: list[torch.Tensor], slots: int) -> list[torch.Tensor]:
        """The references the prompt was encoded with, by its vision slots (one per 2×2 latent
        tokens): the transformer takes a reference only where the VL encoder read it, as the
        pipeline gives both or neither."""
        total = 0
        for n, r in enumerate([None, *references]):
            total += 0 if r is None else r.shape[-2] * r.shape[-1] // 4
            if total == slots:
                return references[:n]
        raise DataError(
            f"the prompt holds {slots} reference slots, which its pair's references do not "
            "fill; re-cache the text with its references"
        )

    def swap_blocks(self, denoiser):
        return list(denoiser.transformer_blocks)

    # ------------------------------------------------------------ sampling

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        kwargs.pop("max_sequence_length")  # the pipeline cuts nothing and takes no limit
        kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale")
        if kwargs["true_cfg_scale"] > 1:
            kwargs["negative_prompt"] = spec.negative_prompt or " "
        if spec.control:
            kwargs["image"] = list(spec.control)  # `sample` opens the files for the pipeline
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        meta = {"device": "meta"}
        latents = torch.zeros(
            batch, config.in_channels, height // VAE_FACTOR, width // VAE_FACTOR, **meta
        )
        seq = self.max_sequence_length()
        kwargs = transformer_inputs(
            latents,
            torch.zeros(batch, **meta),
            torch.zeros(batch, seq, config.context_in_dim, **meta),
            None,
            torch.zeros(batch, seq, dtype=torch.bool, **meta),
        )
        # The transformer reads its layout from the mask's values (which slots hold the target's
        # tokens): a CPU mask, which the estimator's trace lets meta tensors use.
        text = torch.zeros(batch, seq, dtype=torch.bool)
        target = torch.ones(batch, latents.shape[-2] * latents.shape[-1] // 4, dtype=torch.bool)
        kwargs["img_mask"] = torch.cat([text, target], dim=1)
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        """A tiny random-init Qwen-Image 2.1 (`kit.families.qwen_image21.tiny`)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

        config = FlowMatchEulerDiscreteScheduler.load_config(
            config_source(self.hub_id), subfolder="scheduler"
        )
        return tiny21.save(QwenImage21Pipeline(**tiny21.parts(config, seed)), out_dir)
