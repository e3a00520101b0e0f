"""Checks on what was trained on: buckets smaller than a batch, captions cut off, alike or
without the trigger word."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kit.data.captions import has_word
from kit.data.scan import is_prior_image
from kit.families import get_family
from kit.report.doctor.findings import Finding
from kit.report.doctor.run import RunRecord

SMALL_BUCKET_WEIGHT = 4.0  # an image alone in a short batch weighs this many times more: warning


def data_facts(run: RunRecord) -> list[str]:
    """Were captions and images really read? One line per fact, problems first."""
    man = run.manifest
    if not man:
        return [f"no {run.dir.manifest.name}: cannot check what was trained on"]
    out = []
    caps = run.captions
    empty = sum(not c.strip() for c in caps)
    hashes = len({r.get("sha256") for r in man})
    # A clip's windows are samples of one file: only the same file at the same frames repeats.
    distinct = len({(r.get("sha256"), tuple(r.get("frames") or ())) for r in man})
    flat_images = []
    for r in man[:4]:
        try:
            with Image.open(r["image"]) as im:
                if float(np.asarray(im.convert("L"), dtype=np.float32).std()) < 2.0:
                    flat_images.append(Path(r["image"]).name)
        except Exception:
            flat_images.append(f"{Path(str(r.get('image'))).name} (unreadable)")
    if empty:
        out.append(f"PROBLEM: {empty} of {len(caps)} captions are empty")
    if distinct < len(man):
        out.append(
            f"PROBLEM: {len(man)} samples but only {distinct} distinct image file(s) or clip window(s)"
        )
    if flat_images:
        out.append(f"PROBLEM: flat (single-colour) or unreadable images: {', '.join(flat_images)}")
    out.append(
        f"data read: {len(man)} images ({hashes} distinct files), "
        f"{len(set(caps))} distinct captions, {empty} empty"
    )
    sets: dict[str, list[dict]] = {}
    for r in man:
        if "dataset" in r:
            sets.setdefault(str(r["dataset"]), []).append(r)
    for name, rows in sets.items():
        repeats = int(rows[0].get("repeats", 1))
        out.append(
            f"dataset {name} ({rows[0].get('role', 'instance')}, {repeats} repeat(s)): "
            f"{len(rows)} images, {len(rows) * repeats} samples per epoch"
        )
    return out


def small_buckets(run: RunRecord) -> Iterator[Finding]:
    """Buckets smaller than a batch: their few images train alone, with outsized weight (or,
    under `small_bucket_policy: repeat`, are shown several times each epoch)."""
    batch = int(run.flat.get("train_batch_size") or 1)
    accum = int(run.flat.get("gradient_accumulation_steps") or 1)
    counts = Counter(tuple(r["bucket"]) for r in run.manifest if "bucket" in r)
    repeat = run.flat.get("small_bucket_policy") == "repeat"
    # Repeating fills one effective batch (processes are not recorded: at least batch × accum).
    limit = batch * accum if repeat else batch
    if limit < 2 or not counts:
        return
    micro = sum(math.ceil(n / batch) for n in counts.values())
    steps = run.rows[-1]["step"] if run.rows else int(run.flat.get("max_train_steps") or 0)
    epochs = steps * accum / micro if micro else 0
    small = sorted((n, b) for b, n in counts.items() if n < limit)
    if not small:
        return
    if repeat:
        evidence = [
            f"bucket {b[0]}x{b[1]} holds {n} image(s), fewer than an effective batch of {limit}: "
            f"small_bucket_policy repeat shows each {math.ceil(limit / n)}× per epoch, so they "
            f"weigh {math.ceil(limit / n):.1f}× an image of a full bucket"
            for n, b in small[:5]
        ]
        worst = float(math.ceil(limit / small[0][0]))
    else:
        evidence = [
            f"bucket {b[0]}x{b[1]} holds {n} image(s) with train_batch_size {batch}: each epoch "
            f"it makes a batch of {n}, so its images weigh {batch / n:.1f}× an image in a full "
            f"batch (about {epochs:.0f} epochs in this run)"
            for n, b in small[:5]
        ]
        worst = batch / small[0][0]
    fix = (
        "crop or remove the odd-shaped images, lower max_aspect_ratio or raise bucket_step so "
        "they join a larger bucket, or lower train_batch_size and raise "
        "gradient_accumulation_steps"
    )
    yield Finding(
        "small_buckets",
        "warning" if worst >= SMALL_BUCKET_WEIGHT else "info",
        f"{len(small)} bucket(s) hold fewer images than a batch",
        evidence,
        fix + ("; small_bucket_policy keep (the default) stops the repeats" if repeat else ""),
    )


def captions_truncated(run: RunRecord) -> Iterator[Finding]:
    """Captions longer than a text encoder reads: their ends are cut off silently."""
    if run.config is None or not run.captions:
        return
    cfg = run.config
    family = get_family(cfg.model.model_family, cfg)
    tokenizers = _tokenizers(family, cfg.model.pretrained_model)
    if tokenizers is None:
        return  # the base model is not reachable here
    for name, tok in tokenizers.items():
        limit = family.token_limit(name, tok)
        over = [(len(tok(c).input_ids), r) for c, r in zip(run.captions, run.manifest, strict=True)]
        over = [(n, r) for n, r in over if n > limit]
        if over:
            n, r = max(over, key=lambda x: x[0])
            yield Finding(
                "captions_truncated",
                "warning",
                f"{len(over)} caption(s) are cut off by the {name} tokenizer",
                [
                    f"{len(over)} of {len(run.captions)} captions exceed {limit} tokens",
                    f"longest: {n} tokens ({n - limit} cut off), {Path(str(r.get('image'))).name}",
                ],
                "shorten those captions (put the trigger word and key facts first); what is cut "
                "off is never seen by the model",
            )


# Keyed by the family's class (one per registered family), so no table here names a family.
_TOKENIZERS: dict[tuple[type, str], Any] = {}


def _tokenizers(family: Any, pretrained: str) -> dict[str, Any] | None:
    """The family's tokenizers, loaded once per process (None when unreachable)."""
    key = (type(family), pretrained)
    if key not in _TOKENIZERS:
        try:
            _TOKENIZERS[key] = family.load_tokenizers(pretrained)
        except Exception:
            _TOKENIZERS[key] = None
    return _TOKENIZERS[key]


def captions_identical(run: RunRecord) -> Iterator[Finding]:
    """Most captions the same: the model cannot tell what varies from what to learn."""
    caps = run.captions
    if len(caps) < 4:
        return
    text, n = Counter(caps).most_common(1)[0]
    if n / len(caps) >= 0.5:
        yield Finding(
            "captions_identical",
            "warning",
            f"{n} of {len(caps)} captions are identical",
            [f"'{text[:80]}' appears {n} times; {len(set(caps))} distinct captions in all"],
            "caption what differs between images (pose, background, lighting, clothes), so the "
            "trigger word takes only what stays the same",
        )


def trigger_missing(run: RunRecord) -> Iterator[Finding]:
    """Trigger words absent from many captions."""
    patterns = run.flat.get("prior_images") or []
    image_dir = run.flat.get("image_dir") or ""
    rows = [
        (c, r)
        for c, r in zip(run.captions, run.manifest, strict=True)
        if r.get("role") != "prior" and not is_prior_image(str(r.get("image")), patterns, image_dir)
    ]
    if not rows:
        return
    for word in run.triggers:
        missing = [r for c, r in rows if not has_word(c, word)]
        if missing:
            share = len(missing) / len(rows)
            yield Finding(
                "trigger_missing",
                "warning" if share > 0.2 else "info",
                f"the trigger word '{word}' is missing from {len(missing)} of {len(rows)} captions",
                [f"e.g. {', '.join(Path(str(r.get('image'))).name for r in missing[:3])}"],
                f"add '{word}' to those captions (kit captions CONFIG lists them), or remove it "
                "from trigger_words",
            )


CHECKS = (small_buckets, captions_truncated, captions_identical, trigger_missing)
"""This module's checks, in report order."""
