"""Offline building blocks for tiny random-init models: tokenizers made without a download.

Each family's `make_tiny` states only its own sizes; the steps every family takes (tokenizers
from these files, text-encoder configs sized to them, the VAE's common layout, the atomic save)
live here.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from kit.io import atomic_dir

# Words that get their own token in tiny tokenizers, so captions stay short and readable.
WORDS = (
    "a an the of on in at with and or to by for is this photo picture image drawing painting "
    "style background left right center top bottom middle small large big tiny huge "
    "red green blue yellow purple orange pink brown cyan magenta white black gray grey "
    "circle square triangle star shape dog cat person man woman face portrait landscape "
    "sky tree house car flower"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """The byte → printable character table of byte-level BPE (as in GPT-2 and CLIP)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_clip_tokenizer_files(
    out_dir: str | Path, words: tuple[str, ...] | list[str] = WORDS
) -> int:
    """Write `vocab.json` and `merges.txt` of a small CLIP-style BPE; return the vocab size."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for tok in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(tok, len(vocab))
    merges: list[str] = []
    for word in words:
        # A left-to-right chain of merges turns each listed word into one token.
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        current = parts[0]
        for nxt in parts[1:]:
            merged = current + nxt
            if merged not in vocab:
                merges.append(f"{current} {nxt}")
                vocab[merged] = len(vocab)
            current = merged
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return len(vocab)


def write_t5_tokenizer(out_dir: str | Path, words: tuple[str, ...] | list[str] = WORDS) -> int:
    """Write a small T5-style (Unigram, `▁` word marks) tokenizer; return its vocab size.

    Built with the `tokenizers` library, so nothing is downloaded: every listed word is one
    piece, and any other word falls back to single characters.
    """
    import string

    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{w}", -1.0) for w in words]
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    pieces += [(c, -5.0) for c in chars] + [(f"▁{c}", -4.0) for c in chars]
    seen: set[str] = set()
    pieces = [p for p in pieces if not (p[0] in seen or seen.add(p[0]))]
    tok = Tokenizer(Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.save_pretrained(str(out_dir))
    return len(pieces)


def clip_tokenizer(max_length: int = 77) -> Any:
    """A `CLIPTokenizer` over `WORDS`, built offline."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_clip_tokenizer_files(tmp)
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=max_length)


def t5_tokenizer(loader: str = "T5TokenizerFast") -> Any:
    """A T5-style tokenizer over `WORDS`, built offline and read back by the transformers class
    `loader` (`T5TokenizerFast` adds T5's 100 sentinel tokens; `AutoTokenizer` does not)."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        write_t5_tokenizer(tmp)
        return getattr(transformers, loader).from_pretrained(tmp)


def clip_text_config(
    tokenizer: Any, hidden: int = 32, max_positions: int = 77, projection: int = 32
) -> Any:
    """A two-layer `CLIPTextConfig` sized to `tokenizer`, `hidden` wide."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_positions,
        projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # where the pooled output is read
        pad_token_id=tokenizer.pad_token_id,
    )


def t5_config_kwargs(tokenizer: Any, **overrides: Any) -> dict[str, Any]:
    """Arguments of a two-layer (UM)T5 encoder config sized to `tokenizer`; `overrides` win."""
    return {
        "vocab_size": len(tokenizer),
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **overrides,
    }


def autoencoder_kl(**sizes: Any) -> Any:
    """An `AutoencoderKL` of four one-layer levels; `sizes` give the family's widths and factors."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=16,
        **sizes,
    )


def flux_vae() -> Any:
    """The tiny VAE of Flux.1's layout (16 latent channels, no quant convs) with its latent
    shift and scale, which Chroma and Z-Image use too."""
    return autoencoder_kl(
        block_out_channels=(16, 32, 32, 32),
        latent_channels=16,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )


def flux2_vae() -> Any:
    """The tiny VAE of FLUX.2's layout (8 latent channels, batch-normalised per 2×2 patch),
    which FLUX.3 uses too; its statistics are drawn away from (0, 1), so that a missed
    normalisation shows in the tests."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32),
        layers_per_block=1,
        norm_num_groups=16,
        latent_channels=8,
        sample_size=64,
    )
    vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.3)
    vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
    return vae


def t5_v11_encoder(tokenizer: Any) -> Any:
    """A tiny T5 v1.1 encoder (gated GELU), 32 wide, as Flux.1 and Chroma use."""
    from transformers import T5Config, T5EncoderModel

    config = t5_config_kwargs(
        tokenizer,
        d_model=32,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
    )
    return T5EncoderModel(T5Config(**config))


def flux_transformer_sizes(**overrides: Any) -> dict[str, Any]:
    """A tiny Flux.1-style transformer's sizes (one double- and one single-stream block, two
    16-wide heads, 16 latent channels packed 2×2, 32-wide text), which Chroma's and FLUX.2's
    share; `overrides` win."""
    return {
        "patch_size": 1,
        "in_channels": 64,  # 16 latent channels × a 2×2 patch
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "axes_dims_rope": (4, 4, 8),  # sums to attention_head_dim
        **overrides,
    }


def dynamic_flow_scheduler() -> Any:
    """FLUX.1-dev's flow scheduler: shift 3, resolution-dependent (dynamic) shifting between
    0.5 and 1.15 over 256 to 4096 tokens (Chroma's and FLUX.2's too)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def wan_vae(cls: str = "AutoencoderKLWan") -> Any:
    """The tiny 3D causal VAE of diffusers' own Wan pipeline tests (8x, as the release) as the
    diffusers class `cls` (Qwen-Image's is this VAE, used on single frames)."""
    import diffusers

    return getattr(diffusers, cls)(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def save_pipeline(pipe: Any, out_dir: str | Path) -> Path:
    """Save a tiny pipeline (safetensors) into `out_dir`, all at once or not at all."""
    with atomic_dir(out_dir) as tmp_dir:
        pipe.save_pretrained(tmp_dir, safe_serialization=True)
    return Path(out_dir)
