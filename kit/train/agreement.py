"""Every process of a launch on the same run: their configs and datasets compared before training.

The processes of a multi-process launch each read their own config file and scan their own
dataset folder; on several machines these are separate copies. A copy that differs (one node's
config edited, one caption changed on one node) would not fail: each process would train its own
share of different data, or with different settings, and the averaged weights would silently be
neither run's. So before anything is cached or trained, every process sends a fingerprint of
its config and its dataset to all the others, and a difference stops every process with the same
error, naming the keys or the first file that differ and the processes involved.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.data.scan import Sample
from kit.errors import KitError

NODE_LOCAL_KEYS = ("cache_dir", "image_dir", "caption_dir")
"""Config keys that may differ between processes: where this machine keeps its cache and its
copy of the images. The images themselves are compared through the dataset fingerprint, so a
copy at another path passes and a copy with other content does not. Everything else, the
output folder included (every process writes its checkpoint shards there), must agree."""

Gather = Callable[[list[Any]], list[Any]]
"""Sends this process's list to every process and returns all of them, concatenated in rank
order (accelerate's `gather_object`)."""


def config_fingerprint(cfg: Config) -> dict[str, str]:
    """The flat config minus `NODE_LOCAL_KEYS`, each value as text (what the error shows)."""
    flat = cfg.to_dict(flat=True)
    return {k: repr(v) for k, v in sorted(flat.items()) if k not in NODE_LOCAL_KEYS}


def _size(path: Path) -> int:
    """A file's size in bytes; a clip folder's total over its frames."""
    if path.is_dir():
        return sum(p.stat().st_size for p in sorted(path.iterdir()) if p.is_file())
    return path.stat().st_size


def dataset_entries(samples: Sequence[Sample]) -> list[tuple[str, int, str]]:
    """Sorted (image path relative to the dataset's common folder, size in bytes, caption digest)
    of the scanned samples: the same on two copies of the dataset at different paths. Sizes, not
    content hashes, so that a large dataset is fingerprinted from its file listing alone."""
    if not samples:
        return []
    paths = [Path(s.image) for s in samples]
    root = Path(os.path.commonpath([str(p.parent) for p in paths]))
    return sorted(
        (
            p.relative_to(root).as_posix(),
            s.blob.size if s.blob is not None else _size(p),
            hashlib.sha256(s.caption.encode()).hexdigest()[:16],
        )
        for p, s in zip(paths, samples, strict=True)
    )


def _digest(entries: list[tuple[str, int, str]]) -> str:
    h = hashlib.sha256()
    for rel, size, caption in entries:
        h.update(f"{rel}\0{size}\0{caption}\n".encode())
    return h.hexdigest()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def config_differences(configs: list[dict[str, str]]) -> list[str]:
    """One line per key on which the processes' configs differ: each value with its ranks."""
    out = []
    for key in sorted({k for c in configs for k in c}):
        by_value: dict[str, list[int]] = {}
        for rank, c in enumerate(configs):
            by_value.setdefault(c.get(key, "(not set)"), []).append(rank)
        if len(by_value) > 1:
            values = "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())
            out.append(f"{key} ({values})")
    return out


def first_dataset_difference(
    a: list[tuple[str, int, str]], b: list[tuple[str, int, str]], names: tuple[str, str]
) -> str:
    """The first file (in path order) that listing `a` or `b` lacks or holds otherwise; `names`
    call the two listings in the text."""
    left, right = {e[0]: e[1:] for e in a}, {e[0]: e[1:] for e in b}
    for rel in sorted(set(left) | set(right)):
        x, y = left.get(rel), right.get(rel)
        if x == y:
            continue
        if x is None or y is None:
            return f"{rel} is only in {names[0] if y is None else names[1]}'s"
        if x[0] != y[0]:
            return f"{rel} is {x[0]} bytes in {names[0]}'s and {y[0]} in {names[1]}'s"
        return f"{rel} has another caption in {names[1]}'s"
    return "the same files"


def check_agreement(cfg: Config, samples: Sequence[Sample], gather: Gather, world: int) -> None:
    """Stop every process when their configs or datasets differ (a collective: every process of
    the launch calls it, with its own config and scanned samples)."""
    if world <= 1:
        return
    entries = dataset_entries(samples)
    mine = {"config": config_fingerprint(cfg), "dataset": _digest(entries), "count": len(entries)}
    records = gather([mine])
    problems = []
    keys = config_differences([r["config"] for r in records])
    if keys:
        problems.append(f"config keys differ: {', '.join(keys)}")
    digests = [r["dataset"] for r in records]
    if len(set(digests)) > 1:
        # Only now are the listings themselves sent: they are large, and usually equal.
        listings = gather([entries])
        odd = [rank for rank, d in enumerate(digests) if d != digests[0]]
        counts = ", ".join(f"rank {rank}: {r['count']}" for rank, r in enumerate(records))
        first = first_dataset_difference(
            listings[0], listings[odd[0]], ("rank 0", f"rank {odd[0]}")
        )
        problems.append(
            f"the dataset of {_ranks(odd)} differs from rank 0's (images per rank: {counts}); "
            f"first difference: {first}"
        )
    if problems:
        raise KitError(
            "the processes of this launch disagree, so none of them starts training: "
            + "; ".join(problems)
            + f". Every process must read the same config (only {', '.join(NODE_LOCAL_KEYS)} "
            "may differ) and the same images and captions."
        )
