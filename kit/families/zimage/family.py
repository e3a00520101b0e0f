"""Z-Image (Tongyi-MAI): a single-stream flow-matching DiT, a Qwen3 text encoder, Flux's VAE.

Two released models share one architecture: Z-Image Turbo, step-distilled (about 8 steps, no
CFG), and the base Z-Image (CFG, about 50 steps). The cache holds unpacked VAE latents
(B, 16, H/8, W/8) and each caption's Qwen3 hidden states padded to a fixed length with a mask;
`predict` rebuilds the lists ZImagePipeline feeds its transformer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from kit.families import adapter_keys, register, tiny
from kit.families.flow import ATTENTION, FlowFamily
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source
from kit.families.zimage import layout as zimage_layout

if TYPE_CHECKING:
    pass

TURBO_SHIFT = 3.0
"""The σ shift of Z-Image Turbo's released scheduler config; the base Z-Image ships 6.0."""
TURBO, BASE = "Turbo", "base"

# The Qwen3 chat template's result for one user message with a generation prompt, as
# `ZImagePipeline._encode_prompt` applies it (`enable_thinking=True` adds no think block).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def pad_embeds(embeds: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ZImagePipeline's per-caption embeddings (each (tokens_i, D), tokens_i ≤ `length`) →
    (B, length, D) zeros-padded after each caption's tokens, and the (B, length) bool mask of
    the real tokens. `unpad_embeds` gives the list back exactly."""
    out = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.bool, device=embeds[0].device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = True
    return out, mask


def unpad_embeds(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The pipeline's list form: each caption's real tokens (`embeds[i][mask[i]]`, as
    `_encode_prompt` selects them from the padded encoder output)."""
    return [e[m] for e, m in zip(embeds, mask.bool(), strict=True)]


def qwen_tokenizer() -> Any:
    """A tiny byte-level BPE `Qwen2Tokenizer` over `tiny.WORDS` with Qwen's special tokens and
    chat template, built offline."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {"<|endoftext|>": 0}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    # Every word with its leading space (GPT-2 / Qwen mark it Ġ) first, then bare: each word a
    # left-to-right chain of merges, so no merge of one word breaks another's chain.
    for piece in [f"Ġ{w}" for w in tiny.WORDS] + list(tiny.WORDS):
        current = piece[0]
        for nxt in piece[1:]:
            if current + nxt not in vocab:
                merges.append((current, nxt))
                vocab[current + nxt] = len(vocab)
            current += nxt
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


@register
class ZImage(FlowFamily):
    """Z-Image Turbo or base; which one is read from the scheduler config (`variant_of`)."""

    name = "zimage"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    # The pipeline hands its scheduler custom sigmas (a list), which only flow Euler takes.
    samplers = (DEFAULT, "flow_euler")
    size_multiple = 16
    native_resolution = 1024
    hub_id = "Tongyi-MAI/Z-Image-Turbo"
    bucket_step = 64
    # Every linear layer of the attention and the feed-forward of every block: the main stack
    # and both refiners (the modulation layers stay frozen unless named).
    default_lora_targets = (*ATTENTION, "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    pipeline_class = "ZImagePipeline"
    pipeline_kwargs: dict[str, Any] = {}
    # The "kohya" file: diffusers module names under `diffusion_model.`, which both ComfyUI and
    # diffusers' Z-Image converter read in full (zimage_layout.LORA_PREFIX says why no other).
    kohya_prefix = zimage_layout.LORA_PREFIX
    # ZImagePipeline loads LoRA into the transformer only; no client reads Qwen3 LoRA for it.
    kohya_text_prefixes = ()
    diffusers_reads_kohya = True
    base_model_version = "z_image"  # musubi-tuner's ARCHITECTURE_Z_IMAGE_FULL
    modelspec_architecture = "z-image-turbo"
    modelspec_implementation = "https://github.com/Tongyi-MAI/Z-Image"
    export_formats = ("diffusers", "kohya")
    client_versions = {"ComfyUI": zimage_layout.COMFYUI_SINCE}
    client_title = "Z-Image"
    variants = (TURBO, BASE)
    variant_guidance = {TURBO: 0.0, BASE: 5.0}
    """Turbo samples without CFG (guidance 0, as its model card and ZImagePipeline's example
    call it); the base takes the pipeline's own default, 5.0."""
    variant_steps = {TURBO: 9, BASE: 50}
    """Turbo's model card draws in 9 (8 denoiser passes); the base takes ZImagePipeline's
    default."""
    distilled_variants = {
        TURBO: "Z-Image Turbo is step-distilled: it samples in about 8 steps without "
        "classifier-free guidance (its scheduler's shift 3.0 marks it; the base Z-Image ships 6.0)"
    }

    # ------------------------------------------------------------ variants

    def variant_of(self, pretrained: str) -> str:
        # The two releases have the same transformer, VAE and text-encoder configs; what tells
        # them apart is the scheduler: Turbo ships shift 3.0, the base Z-Image 6.0 (both static,
        # `use_dynamic_shifting: false`). A folder without a scheduler config falls back to the
        # hub id's name.
        from diffusers import FlowMatchEulerDiscreteScheduler

        try:
            source = config_source(self.model_source(pretrained))
            saved = FlowMatchEulerDiscreteScheduler.load_config(source, subfolder="scheduler")
        except (OSError, ValueError):
            return TURBO if "turbo" in pretrained.lower() else BASE
        return TURBO if math.isclose(float(saved.get("shift", 1.0)), TURBO_SHIFT) else BASE

    def version_metadata(self) -> dict[str, str]:
        turbo = self.configured_variant() == TURBO
        return {
            **super().version_metadata(),
            "modelspec.architecture": "z-image-turbo" if turbo else "z-image",
        }

    # ------------------------------------------------------------ loading

    parts = (
        denoiser("ZImageTransformer2DModel"),
        vae(),
        *text("Qwen3Model", "AutoTokenizer"),
        scheduler(),
    )

    quantized_text_encoders = ("text_encoder",)  # Qwen3-4B, large and only ever read frozen
    # Tongyi-MAI's transformer file (ComfyUI's diffusion_models), in the original layout.
    single_file_markers = ("layers.0.attention.qkv.weight", "cap_embedder.1.weight")

    def token_limit(self, encoder, tokenizer):
        # The pipeline cuts the caption *inside* its chat template at `max_sequence_length`
        # tokens; a bare caption may take what the template's own tokens leave.
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        return self.max_sequence_length() - len(tokenizer(templated).input_ids)

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt (chat template, second-to-last hidden state, only the
        # real tokens), so cached embeddings are what sampling computes. It returns one
        # (tokens_i, D) tensor per caption; the cache needs one shape per caption, so each is
        # padded with zeros to the fixed sequence length and a mask marks its real tokens
        # (`unpad_embeds` rebuilds the list exactly).
        pipe = self._text_pipeline(comps)
        embeds, _ = pipe.encode_prompt(
            list(captions),  # encode_prompt writes the templated prompts into its list
            device=comps.text_encoders[0].device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length(),
        )
        padded, mask = pad_embeds(embeds, self.max_sequence_length())
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    # ------------------------------------------------------------ training

    def prompt_kwargs(self, text):
        # ZImagePipeline takes each prompt's embedding as one tensor of its own length.
        return {"prompt_embeds": unpad_embeds(text["prompt_embeds"], text["prompt_embeds_mask"])}

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        inner = getattr(transformer, "module", transformer)  # unwrapped under DDP
        caps = unpad_embeds(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        kwargs = transformer_inputs(noisy, timesteps, caps, inner.dtype)
        out = transformer(**kwargs, return_dict=False)[0]
        return model_velocity(out)

    def swap_blocks(self, denoiser):
        # The noise refiner runs first, then the context refiner, then the main stack.
        return [*denoiser.noise_refiner, *denoiser.context_refiner, *denoiser.layers]

    # ------------------------------------------------------------ sampling

    def call_kwargs(self, spec):
        # CFG runs only when the scale is above 0 (ZImagePipeline's rule), as
        # pos + scale · (pos − neg); the negative prompt acts only then.
        kwargs = super().call_kwargs(spec)
        if spec.negative_prompt or spec.guidance_scale > 0:
            # With CFG the empty negative prompt too, as the pipeline takes None to mean "".
            kwargs["negative_prompt"] = spec.negative_prompt
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        transformer, vae = parts["denoiser"], parts["vae"]
        config = transformer.config
        f = 2 ** (len(vae.config.block_out_channels) - 1)  # the VAE's factor
        meta = {"device": "meta"}
        latents = torch.zeros(batch, config.in_channels, height // f, width // f, **meta)
        seq = self.max_sequence_length()
        # Full-length captions: the most text tokens a step can see.
        caps = [torch.zeros(seq, config.cap_feat_dim, **meta) for _ in range(batch)]
        kwargs = transformer_inputs(latents, torch.zeros(batch, **meta), caps, None)
        return (kwargs.pop("x"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0):
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        torch.manual_seed(seed)
        tokenizer = qwen_tokenizer()
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        vae = tiny.flux_vae()  # Flux's VAE, which Z-Image uses
        transformer = ZImageTransformer2DModel(
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=32,  # the Qwen3 width
            axes_dims=[4, 6, 6],  # sums to the head width, 16
            axes_lens=[1536, 128, 128],
        )
        # Turbo's scheduler (fixed shift 3), so the tiny base is the maintained Turbo variant.
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=TURBO_SHIFT, use_dynamic_shifting=False
        )
        return self.save_tiny(out_dir, transformer, vae, text_encoder, tokenizer, scheduler)

    # ------------------------------------------------------------ export

    original_layout = staticmethod(zimage_layout.to_original)

    def client_models(self, comps):
        # ComfyUI holds Z-Image in the original layout (fused qkv) and maps the file's
        # `diffusion_model.<diffusers path>` names onto it, q / k / v as row slices of qkv.
        t = comps.denoiser
        config = dict(t.config)
        model = adapter_keys.prefixed("diffusion_model.", self.original_state(t))
        aliases = adapter_keys.offset_aliases(zimage_layout.weight_modules(config))
        return {"ComfyUI": (model, aliases)}


def transformer_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    captions: list[torch.Tensor],
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """ZImageTransformer2DModel's arguments, built as ZImagePipeline builds them per step.

    The pipeline gives the transformer a list of (C, 1, H, W) latents (a frame axis added), the
    timestep as (1000 − t) / 1000 = 1 − σ (its model counts time from noise to image), and a
    list of each caption's real tokens (`unpad_embeds`). `dtype` is the transformer's (None keeps
    the latents').
    """
    dtype = dtype or latents.dtype
    x = list(latents.to(dtype).unsqueeze(2).unbind(dim=0))
    caps = [c.to(latents.device, dtype) for c in captions]
    return {"x": x, "t": (1000 - timesteps) / 1000, "cap_feats": caps}


def model_velocity(out: list[torch.Tensor]) -> torch.Tensor:
    """The transformer's per-sample outputs → the kit's flow target's layout and sign.

    ZImagePipeline steps the scheduler with the negated output (`noise_pred = -noise_pred`): the
    model predicts x0 − noise, and the scheduler's velocity (the kit's target) is noise − x0.
    """
    return -torch.stack(out, dim=0).squeeze(2)
