"""Sizes read from data and config checked against what the data and the machine can hold,
before anything of that size is allocated: a header, a range, an epoch, a clip."""

from __future__ import annotations

import os
from typing import Any

from kit.errors import DataError

ORDER_BYTES = 128
"""Memory an epoch's order takes per sample drawn (a tuple of two ints in a list), about."""
PIXEL_BYTES = 3 * 4
"""Memory a frame's pixel takes while it is encoded: three float32 channels."""


SMALL_MEMBER = 64 << 20
"""A tar member below this size is read without asking the machine for its free memory (a
scan reads members by the hundred thousand)."""
UNKNOWN = 1 << 62
"""What `free_memory` answers where the machine cannot say: no bound is then checked."""


def free_memory() -> int:
    """Bytes of memory free for this process now (the machine's available memory)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that tells
        return UNKNOWN


def size_text(n: float) -> str:
    """A byte count as people read it (`60.00 GiB`, `3.2 MiB`)."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def check_member(shard: str, name: str, size: int) -> None:
    """Refuse a tar member too large to hold in memory (it is read whole), naming it."""
    if size < SMALL_MEMBER:
        return
    free = free_memory()
    if size > free // 2:
        raise DataError(
            f"shard {shard}: member {name} is {size_text(size)}, more than half the "
            f"{size_text(free)} of memory free; split it, or leave it out of the shard"
        )


def check_plan(plan: Any, views: list[Any]) -> None:
    """Refuse a plan whose epoch order (samples × `repeats`) or one of whose clips (frames ×
    bucket pixels) does not fit in the memory free now, naming the dataset and the key."""
    free = free_memory()
    per_dataset: dict[int, int] = {}
    for s in plan.samples:
        per_dataset[s.dataset] = per_dataset.get(s.dataset, 0) + 1
    drawn = sum(n * views[d].repeats for d, n in per_dataset.items())
    if drawn * ORDER_BYTES > free // 2:
        d = max(per_dataset, key=lambda d: per_dataset[d] * views[d].repeats)
        v = views[d]
        raise DataError(
            f"{v.where or 'data'}: repeats {v.repeats} makes {drawn:,} samples per epoch, whose "
            f"order alone takes {size_text(drawn * ORDER_BYTES)} of the {size_text(free)} free; "
            "lower repeats (or max_train_steps ends the run, not the epoch)"
        )
    largest = max(
        range(len(plan.samples)),
        key=lambda i: plan.placements[i].num_frames * _area(plan.placements[i]),
        default=None,
    )
    if largest is None:
        return
    p, s = plan.placements[largest], plan.samples[largest]
    need = p.num_frames * _area(p) * PIXEL_BYTES
    if p.frames and need > free // 2:
        v = views[s.dataset]
        raise DataError(
            f"num_frames {v.data.num_frames}: a window of {p.num_frames} frames of {s.image} at "
            f"{p.bucket[0]}x{p.bucket[1]} takes {size_text(need)} to encode, more than half the "
            f"{size_text(free)} free; lower num_frames or resolution"
        )


def _area(p: Any) -> int:
    return p.bucket[0] * p.bucket[1]
