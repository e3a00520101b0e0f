"""Reading the next cached batch in a background thread while the current one trains.

A batch is a handful of small safetensors files stacked into tensors: cheap, but on a fast
device it is time the device waits. The prefetcher reads batch `i + 1` while batch `i` runs.

What it reads must be exactly what the step would have read itself. The batch's caption
variants come from the batch's own random stream (`batch_generator`), whose first draw picks
them; the prefetcher draws them from a private copy of that stream (the same seed, never the
stream itself and never the global RNG), so the step's own draws, and the run, are unchanged.
The step checks the read batch against its own draw and reads directly on any difference; the
prefetcher holds no state that a checkpoint needs, so a resumed run simply starts reading at
its cursor.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kit.train.step import batch_seed


class Prefetcher:
    """Reads batches ahead, one at a time, in one background thread.

    `ahead(epoch, index, indices)` starts reading a batch; `take(epoch, index, indices,
    variants)` returns it (waiting for the read if it is still going), or reads it now when it
    was not read ahead or was read with other variants. `close()` ends the thread.
    """

    DEPTH = 2
    """Reads kept at once: the batch about to be taken and the one after it."""

    def __init__(self, data: Any, seed: int, enabled: bool = True) -> None:
        self.data = data
        self.seed = seed
        self.enabled = enabled
        self.pending: dict[tuple[int, int], tuple[list[int], Future]] = {}
        self.hits = 0
        """Batches served from a read ahead (the rest were read when asked)."""
        self._pool: ThreadPoolExecutor | None = None

    def ahead(self, epoch: int, index: int, indices: list[int]) -> None:
        """Start reading batch `index` of `epoch` (its samples `indices`) in the background."""
        if not self.enabled or not indices or (epoch, index) in self.pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kit-prefetch")
        # The batch now training and the next one are all that is ever taken: an older read
        # that was never taken (the loop went elsewhere) is dropped.
        while len(self.pending) >= self.DEPTH:
            self.pending.pop(next(iter(self.pending)))[1].cancel()
        future = self._pool.submit(self._read, epoch, index, list(indices))
        self.pending[(epoch, index)] = (list(indices), future)

    def _read(
        self, epoch: int, index: int, indices: list[int]
    ) -> tuple[list[int] | None, dict[str, torch.Tensor]]:
        """The batch as the step reads it, with the variants drawn from a copy of its stream."""
        own = torch.Generator().manual_seed(batch_seed(self.seed, epoch, index))
        variants = self.data.draw_variants(len(indices), own)
        return variants, self.data.load_batch(indices, variants)

    def take(
        self, epoch: int, index: int, indices: list[int], variants: list[int] | None
    ) -> dict[str, torch.Tensor]:
        """Batch `index` of `epoch`: the one read ahead when it matches, else read now.

        An error of the background read (an unreadable cache file) is raised here, as the
        direct read would raise it.
        """
        entry = self.pending.pop((epoch, index), None)
        if entry is not None and entry[0] == list(indices):
            drawn, batch = entry[1].result()
            if drawn == variants:
                self.hits += 1
                return batch
        return self.data.load_batch(indices, variants)

    def loader(self, epoch: int, index: int) -> Any:
        """`take` for one batch, in the `(indices, variants) -> batch` form the step calls."""
        return lambda indices, variants: self.take(epoch, index, indices, variants)

    def close(self) -> None:
        """Drop what was read ahead and end the thread (a read under way finishes first)."""
        for _, future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
