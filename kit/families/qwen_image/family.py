"""Qwen-Image (and Qwen-Image-2512): a 20B flow-matching MMDiT on packed 2×2 latent patches,
with Qwen2.5-VL-7B as its text encoder and Wan's 3D causal VAE used on single frames.

The cache holds each image's normalised VAE latents as (16, H/8, W/8) (the VAE's one frame
dropped) and each caption's last hidden states, padded to a fixed length with a mask. Packing,
`img_shapes`, the timestep scale and the text mask are built per step, exactly as
QwenImagePipeline builds them. The module-level functions (`encode_prompts`, `pack_latents`,
`unpack_latents`, `transformer_inputs`, `flow_shift`, the tiny tokenizer and text encoder) are
what an edit family built on this one reuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kit.errors import ConfigError
from kit.families import adapter_keys, register, tiny
from kit.families.base import Components
from kit.families.flow import JOINT_ATTENTION, FlowFamily
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.qwen_image import layout as qwen_image_layout
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source

MAX_SEQUENCE_LENGTH = 1024
"""The most the pipeline accepts (`check_inputs`)."""
EMPTY_NEGATIVE = " "
"""The negative prompt of the pipeline's own examples when none is given: true CFG runs only
with a negative prompt, and `" "` is what Qwen's model card samples with."""


# ---------------------------------------------------------------- reusable pieces


def encode_prompts(pipe: Any, captions: list[str], length: int) -> dict[str, torch.Tensor]:
    """`prompt_embeds` (B, length, D) and `prompt_embeds_mask` (B, length) of `captions`, from the
    pipeline's own `encode_prompt` (template, dropped system-prompt tokens, cut to `length`).

    The pipeline pads a batch only to its longest caption and gives no mask when none is padded;
    the cache needs one shape for every caption, so the embeddings are padded with zeros up to
    `length` and the mask (1 = a caption token) marks them. `transformer_inputs` cuts a batch back
    to its longest caption, so the transformer sees what the pipeline feeds it.
    """
    device = pipe.text_encoder.device
    embeds, mask = pipe.encode_prompt(captions, device=device, max_sequence_length=length)
    return padded_prompts(embeds, mask, length)


def padded_prompts(
    embeds: torch.Tensor, mask: torch.Tensor | None, length: int
) -> dict[str, torch.Tensor]:
    """`embeds` (B, n, D) zero-padded to `length` tokens, with the mask (1 = a caption token;
    None from the pipeline: every one) padded alike."""
    b, n, _ = embeds.shape
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    pad = length - n
    return {
        "prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
        "prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad)),
    }


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) or (B, C, 1, h, w) latents → (B, h/2 · w/2, 4C) tokens of 2×2 patches."""
    from diffusers import QwenImagePipeline

    if latents.ndim == 5:
        latents = latents.squeeze(2)
    b, c, h, w = latents.shape
    return QwenImagePipeline._pack_latents(latents, b, c, h, w)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens back to (B, C, height, width) latents; sizes in latent pixels."""
    from diffusers import QwenImagePipeline

    # The pipeline's helper takes image pixels and a VAE factor (1: latent pixels) and returns
    # the VAE's one-frame layout (B, C, 1, h, w).
    return QwenImagePipeline._unpack_latents(tokens, height, width, 1).squeeze(2)


def transformer_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
) -> dict[str, Any]:
    """QwenImageTransformer2DModel's arguments for (B, C, h, w) latents at `timesteps` (σ · 1000),
    built as QwenImagePipeline builds them for one denoising step (a mask of None: every
    caption fills `prompt_embeds`)."""
    b, _, h, w = latents.shape
    dtype = latents.dtype
    mask = None
    if prompt_embeds_mask is not None:
        # The pipeline pads a batch to its longest caption; the cache to a fixed length.
        # Cutting the columns no caption uses gives the pipeline's tensors (padding is masked
        # out of the attention and text positions start at 0, so it would not change the
        # output anyway), and no mask when nothing is left padded, as `encode_prompt` returns.
        used = prompt_embeds_mask.bool().any(dim=0)
        keep = int(used.nonzero().max()) + 1 if bool(used.any()) else used.shape[0]
        prompt_embeds = prompt_embeds[:, :keep]
        kept = prompt_embeds_mask[:, :keep].to(latents.device, torch.long)
        mask = None if bool(kept.all()) else kept
    return {
        "hidden_states": pack_latents(latents),
        # The pipeline feeds t / 1000 = σ (its timesteps are σ · 1000, cast to the latents' dtype).
        "timestep": timesteps.to(latents.device, dtype) / 1000,
        "guidance": None,  # no released Qwen-Image is guidance-distilled
        "encoder_hidden_states_mask": mask,
        "encoder_hidden_states": prompt_embeds.to(latents.device, dtype),
        "img_shapes": [[(1, h // 2, w // 2)]] * b,
    }


# The system prompt of QwenImagePipeline's template: the tiny tokenizer gives its words one token
# each (as Qwen2's does), so the pipeline's fixed `prompt_template_encode_start_idx` (34) drops
# exactly the system prompt there too.
TEMPLATE_WORDS = (
    "system user assistant Describe the image by detailing color shape size texture quantity "
    "text spatial relationships of objects and background"
).split()
SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _bpe(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair merging of `word`'s symbols: always the lowest-ranked pair first."""
    while len(word) > 1:
        pairs = [
            (ranks.get(p, math.inf), i) for i, p in enumerate(zip(word[:-1], word[1:], strict=True))
        ]
        rank, i = min(pairs)
        if rank == math.inf:
            break
        word = [*word[:i], word[i] + word[i + 1], *word[i + 2 :]]
    return word


def tiny_qwen2_tokenizer(words: tuple[str, ...] = ()) -> Any:
    """A `Qwen2Tokenizer` (Qwen2's own pre-tokenizer, byte-level BPE) over a few words (and
    `words`, one token each too), with the chat and vision special tokens Qwen2.5-VL's template
    and config use; built offline."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    ranks: dict[tuple[str, str], int] = {}
    # Words after a space are pre-tokenized with the byte-level space `Ġ` in front.
    for word in [*TEMPLATE_WORDS, *tiny.WORDS, *words]:
        for form in (word, "Ġ" + word):
            pieces = _bpe(list(form), ranks)
            while len(pieces) > 1:  # a new merge ranks last, so earlier words stay one token
                ranks[(pieces[0], pieces[1])] = len(ranks)
                vocab.setdefault(pieces[0] + pieces[1], len(vocab))
                pieces = _bpe(list(form), ranks)
    merges = [pair for pair, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
    return tok


def tiny_vl_config(config_cls: type, tokenizer: Any, text: dict, vision: dict, **extra: Any) -> Any:
    """A tiny Qwen vision-language `config_cls`: text 32 wide over two layers and a one-layer
    vision tower, sized to `tokenizer` with its chat and vision token ids; `text`, `vision` and
    `extra` add each model's own settings (Krea 2's Qwen3-VL builds on it too)."""
    ids = tokenizer.convert_tokens_to_ids
    return config_cls(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            **text,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            **vision,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        **extra,
    )


def tiny_qwen3_vl_config(tokenizer: Any, text: dict, vision: dict) -> Any:
    """A tiny `Qwen3VLConfig` (`tiny_vl_config`): 8-wide heads with Qwen3-VL's interleaved
    mRoPE, one deepstack tap and tied embeddings; `text` and `vision` add each model's own
    settings (Krea 2's, FLUX.3's and Qwen-Image 2.1's encoders)."""
    from transformers import Qwen3VLConfig

    return tiny_vl_config(
        Qwen3VLConfig,
        tokenizer,
        text={
            **text,
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 1, 1],  # sums to head_dim / 2, as [24, 20, 20] to 64
                "mrope_interleaved": True,
            },
        },
        vision={"deepstack_visual_indexes": [0], **vision},
        tie_word_embeddings=True,
    )


def tiny_qwen25_vl(tokenizer: Any) -> Any:
    """A two-layer `Qwen2_5_VLForConditionalGeneration` (`tiny_vl_config`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = tiny_vl_config(
        Qwen2_5_VLConfig,
        tokenizer,
        text={
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]},
            "bos_token_id": None,
        },
        vision={"fullatt_block_indexes": [0]},
    )
    return Qwen2_5_VLForConditionalGeneration(config)


# ---------------------------------------------------------------- the family


def tiny_vae_and_transformer(**transformer_config: Any) -> tuple[Any, Any]:
    """A tiny random-init Qwen-Image VAE and transformer (the edit family's too; its 2511 adds
    `zero_cond_t`)."""
    from diffusers import QwenImageTransformer2DModel

    # Wan's tiny VAE sizes (8x, as the release); the latent statistics are the release's.
    vae = tiny.wan_vae("AutoencoderKLQwenImage")
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels × a 2×2 patch
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        **transformer_config,
    )
    return vae, transformer


@register
class QwenImage(FlowFamily):
    """Qwen-Image and Qwen-Image-2512 (one architecture; neither is step-distilled)."""

    name = "qwen_image"
    scale_kwarg = "attention_kwargs"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    # The pipeline hands its scheduler custom sigmas, which only these schedulers take.
    samplers = (DEFAULT, "flow_euler", "flow_unipc")
    size_multiple = 16
    default_num_inference_steps = 50  # QwenImagePipeline's default
    native_resolution = 1024  # QwenImagePipeline's default size (128 latent pixels × 8)
    hub_id = "Qwen/Qwen-Image"
    bucket_step = 64
    variants = ("Qwen-Image", "Qwen-Image-2512")
    # Both streams' attention, as diffusers' Qwen-Image LoRA script and Flux here adapt.
    default_lora_targets = JOINT_ATTENTION
    pipeline_class = "QwenImagePipeline"
    default_guidance_scale = 4.0  # QwenImagePipeline's `true_cfg_scale`
    # QwenImagePipeline loads LoRA into the transformer only (`_lora_loadable_modules`).
    kohya_text_prefixes = ()
    # `lora_unet_<path with _>` as musubi-tuner writes Qwen-Image LoRA: ComfyUI's generic rule
    # and diffusers' Qwen converter both read it (see qwen_image_layout).
    kohya_prefix = "lora_unet"
    diffusers_reads_kohya = True
    base_model_version = "qwen_image"  # musubi-tuner's value
    modelspec_architecture = "qwen-image"
    modelspec_implementation = "https://github.com/QwenLM/Qwen-Image"
    export_formats = ("diffusers", "kohya")

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        if self.max_sequence_length() > MAX_SEQUENCE_LENGTH:
            raise ConfigError(
                f"max_sequence_length: {self.max_sequence_length()} is more than "
                f"QwenImagePipeline accepts ({MAX_SEQUENCE_LENGTH})"
            )

    def variant_of(self, pretrained: str) -> str:
        # Qwen-Image-2512 is a retrained Qwen-Image with the same configs: only its recorded
        # name (hub id or folder) tells the two apart.
        return "Qwen-Image-2512" if "2512" in str(pretrained) else "Qwen-Image"

    def kohya_module(self, module):
        return qwen_image_layout.kohya_module(module)

    original_layout = staticmethod(qwen_image_layout.to_comfy)

    def client_models(self, comps):
        # ComfyUI holds Qwen-Image under diffusers' own names (comfy/ldm/qwen_image/model.py).
        t = comps.denoiser
        model = self.original_state(t)
        return {"ComfyUI": (adapter_keys.prefixed("diffusion_model.", model), None)}

    def version_metadata(self) -> dict[str, str]:
        variant = self.variant_of(self.cfg.model.pretrained_model)
        arch = "qwen-image-2512" if variant == "Qwen-Image-2512" else "qwen-image"
        return {**super().version_metadata(), "modelspec.architecture": arch}

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("QwenImageTransformer2DModel"),
        vae("AutoencoderKLQwenImage"),
        *text("Qwen2_5_VLForConditionalGeneration", "Qwen2Tokenizer"),
        scheduler(),
    )
    vae_frames = True  # Wan's 3D causal VAE, used on single frames

    quantized_text_encoders = ("text_encoder",)  # Qwen2.5-VL-7B, only ever read frozen
    # ComfyUI's diffusion_models file: the transformer alone under diffusers' names.
    single_file_markers = ("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")

    def token_limit(self, encoder, tokenizer):
        # The embeddings after the system prompt are cut to this many; the caption comes first.
        return self.max_sequence_length()

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        return encode_prompts(self._text_pipeline(comps), captions, self.max_sequence_length())

    # ------------------------------------------------------------ training

    # `noise_and_target`: the pipeline's dynamic shift (`flow_shift`); Qwen's `shift_terminal`
    # only stretches the inference schedule's tail, not the σ a training step is drawn at.

    def predict(self, comps, noisy, timesteps, cond):
        kwargs = transformer_inputs(
            noisy, timesteps, cond["prompt_embeds"], cond["prompt_embeds_mask"]
        )
        out = comps.denoiser(**kwargs, return_dict=False)[0]
        # The pipeline steps with the model's output as it is (velocity noise − latents).
        return unpack_latents(out, noisy.shape[-2], noisy.shape[-1])

    def swap_blocks(self, denoiser):
        return list(denoiser.transformer_blocks)

    # ------------------------------------------------------------ sampling

    def call_kwargs(self, spec):
        kwargs = super().call_kwargs(spec)
        # True CFG (two passes per step) needs a negative prompt; Qwen's own default is " ".
        kwargs["negative_prompt"] = spec.negative_prompt or EMPTY_NEGATIVE
        kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale")
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        transformer, vae = parts["denoiser"], parts["vae"]
        config = transformer.config
        f = 2 ** len(vae.config.temperal_downsample)  # the VAE's 8x
        meta = {"device": "meta"}
        latents = torch.zeros(batch, config.in_channels // 4, height // f, width // f, **meta)
        seq = self.max_sequence_length()
        kwargs = transformer_inputs(
            latents,
            torch.zeros(batch, **meta),
            torch.zeros(batch, seq, config.joint_attention_dim, **meta),
            None,  # every caption at full length: the most the estimate can meet
        )
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import FlowMatchEulerDiscreteScheduler

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer()
        text_encoder = tiny_qwen25_vl(tokenizer)
        vae, transformer = tiny_vae_and_transformer()
        # The release's scheduler config (dynamic, exponential shift; see configs/).
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            FlowMatchEulerDiscreteScheduler.load_config(
                config_source(self.hub_id), subfolder="scheduler"
            )
        )
        return self.save_tiny(out_dir, transformer, vae, text_encoder, tokenizer, scheduler)

    # ------------------------------------------------------------ helpers

    def _text_pipeline(self, comps: Components) -> Any:
        # QwenImagePipeline's encode_prompt, for the edit family's captions without controls too.
        from diffusers import QwenImagePipeline

        return self.build_pipeline(comps, QwenImagePipeline, text_only=True)
