"""Offline building blocks for tiny random-init models: tokenizers made without a download."""

from __future__ import annotations

import json
from pathlib import Path

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
