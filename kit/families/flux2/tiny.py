"""Tiny random-init FLUX.2 bases (dev: Mistral3 with a Pixtral tower; klein: Qwen3), built
offline: byte-level BPE tokenizers over `tiny.WORDS` with the chat templates the pipelines use,
text encoders of the real classes with enough layers for the pipelines' hidden-state picks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kit.families import tiny

# Chat templates reduced to what the pipelines send: dev a system and a user message whose
# content is a list of text parts (Mistral's [SYSTEM_PROMPT] / [INST] format), klein one user
# message with thinking switched off (Qwen3's format).
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}"
    "{% set text = m['content'] %}{% else %}{% set text = m['content'] | "
    "selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def _byte_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary in which every word of `tiny.WORDS` (after a space) is one
    token: the vocabulary and merges of the tiny LLM tokenizers."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in tiny.WORDS:
        current = "Ġ"
        for char in word:
            merged = current + char
            if merged not in vocab:
                merges.append((current, char))
                vocab[merged] = len(vocab)
            current = merged
    return vocab, merges


def _mistral_tokenizer() -> Any:
    """A tiny byte-level tokenizer with Mistral's special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_bpe()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["[INST]", "[/INST]", "[IMG]", "[SYSTEM_PROMPT]"]
        + ["[/SYSTEM_PROMPT]"],
        model_max_length=131072,
    )
    fast.chat_template = _MISTRAL_TEMPLATE
    return fast


def _qwen_tokenizer() -> Any:
    """A tiny `Qwen2Tokenizer` (the class klein's pipeline takes) with Qwen3's chat tokens."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_bpe()
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    )
    tok.chat_template = _QWEN_TEMPLATE
    return tok


def _tiny_llm(kind: str, tokenizer: Any) -> Any:
    """A tiny text encoder of the real class, with enough layers for the pipeline's hidden-state
    picks (dev: 10, 20, 30 of Mistral3; klein: 9, 18, 27 of Qwen3), each 16 wide."""
    import transformers as tf

    sizes = {
        "vocab_size": len(tokenizer),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if kind.startswith("klein"):
        config = tf.Qwen3Config(num_hidden_layers=28, tie_word_embeddings=True, **sizes)
        return tf.Qwen3ForCausalLM(config)
    text = tf.MistralConfig(
        num_hidden_layers=31,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sizes,
    )
    # Mistral3 always has its Pixtral vision tower; one layer of it, never run on text.
    vision = tf.PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=28,
        patch_size=14,
    )
    config = tf.Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    return tf.Mistral3ForConditionalGeneration(config)


def make(out_dir: str | Path, seed: int = 0, kind: str = "dev") -> Path:
    """Write a tiny random-init FLUX.2 `kind` ("dev", "klein", "klein base") with its pipeline."""
    import diffusers

    if kind not in ("dev", "klein", "klein base"):
        raise ValueError(f"kind: {kind!r} is not dev, klein or klein base")
    torch.manual_seed(seed)
    klein = kind.startswith("klein")
    tokenizer = _qwen_tokenizer() if klein else _mistral_tokenizer()
    text_encoder = _tiny_llm(kind, tokenizer)
    vae = tiny.flux2_vae()
    sizes = tiny.flux_transformer_sizes(
        in_channels=32,  # 8 latent channels × a 2×2 patch
        joint_attention_dim=3 * 16,  # three stacked hidden states of the 16-wide encoder
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        guidance_embeds=not klein,
    )
    transformer = diffusers.Flux2Transformer2DModel(**sizes)
    # FLUX.1-dev's scheduler, which diffusers' FLUX.2 conversion script ships with FLUX.2.
    scheduler = tiny.dynamic_flow_scheduler()
    parts = {"scheduler": scheduler, "vae": vae, "text_encoder": text_encoder}
    parts.update(tokenizer=tokenizer, transformer=transformer)
    if klein:
        pipe = diffusers.Flux2KleinPipeline(**parts, is_distilled=kind == "klein")
    else:
        pipe = diffusers.Flux2Pipeline(**parts)
    return tiny.save_pipeline(pipe, out_dir)
