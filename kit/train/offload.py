"""`blocks_to_swap`: the last blocks of the denoiser's transformer stack keep their frozen
weights in CPU memory and visit the accelerator only while they run.

Each swapped block is brought to the device just before its forward (and its recompute under
gradient checkpointing, and its backward) and dropped from it right after. Only the frozen base
weights travel: a LoRA's own weights, and anything else that trains, stay on the device, so
the optimizer, gradient clipping, EMA and DDP see trained parameters exactly where they were.
Training never changes a frozen weight, so the CPU copy made at install is kept for the whole
run and "moving back" costs no copy: the device copy is only dropped. Every step moves each swapped
block's frozen weights host to device twice (forward, backward) and never device to host.

Why the last blocks, as musubi-tuner and sd-scripts choose: a forward reaches them after the
resident ones, so the first swapped block's copy overlaps with resident compute instead of
stalling the start of every pass, which matters most when sampling (many forwards, no
backward); and the same `blocks_to_swap` names the same blocks as in those trainers.

How a block's weights move: the frozen parameter keeps its identity and only its `.data` is
pointed at the device copy or at the CPU copy. autograd saves the parameter itself for the
backward, so what a backward reads is whatever the parameter holds when it runs: the hook on the
block's outputs puts the device copy back first. Under gradient checkpointing the recompute saves
aliases of the device copy, which live exactly as long as the block's backward needs them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.errors import ConfigError, KitError
from kit.families import Family
from kit.train.accel import deepspeed_launch

Copy = Callable[[torch.Tensor], torch.Tensor]
"""How a stored (CPU) tensor becomes its device copy."""

_SWAPS: weakref.WeakKeyDictionary[nn.Module, BlockSwap] = weakref.WeakKeyDictionary()


def _plain(p: nn.Parameter) -> bool:
    """Whether a parameter is an ordinary tensor, whose `.data` can be pointed elsewhere."""
    return type(p) is nn.Parameter and type(p.data) is torch.Tensor


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now (a forward hook
    that runs then is a recompute under gradient checkpointing, not a new pass)."""
    return torch._C._current_graph_task_id() != -1


class BlockSwap:
    """Keep the frozen weights of the last `n` of `blocks` (in the order the forward runs
    them) in CPU memory, pinned on CUDA, and bring each block to `device` only while it runs.

    With `prefetch` the next swapped block to run is copied in while the current one computes
    (on CUDA on a side stream), so at most two swapped blocks are on the device at once;
    without it, one. On a CPU the moves are no-ops but every hook runs and counts.
    `to_device` replaces how a stored tensor is copied in (tests pass one whose copy can be
    told apart from its source on a CPU).
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        n: int,
        device: torch.device | str,
        *,
        prefetch: bool = True,
        pin_memory: bool = True,
        to_device: Copy | None = None,
    ) -> None:
        if not 0 < n <= len(blocks):
            raise KitError(
                f"blocks_to_swap: {n} must be between 1 and the {len(blocks)} blocks there are"
            )
        self.blocks = list(blocks)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.swapped = list(range(len(blocks) - n, len(blocks)))
        """Indices (into `blocks`) of the swapped blocks."""
        self._first = self.swapped[0]
        self._pinned = cuda and pin_memory
        self._copy = to_device or self._copy_in
        self._prefetch_on = prefetch
        # Off CUDA a prefetch copies at once; the order of moves is the same as with a stream.
        self._stream = torch.cuda.Stream(self.device) if cuda and prefetch else None
        self._stored: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self._resident: set[int] = set()
        self._pending: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self._callback_task = -1
        self._handles: list[Any] = []
        seen: set[int] = set()
        for i in self.swapped:
            self._stored[i] = self._store(self.blocks[i], seen)
        self.block_bytes = {
            i: sum(t.numel() * t.element_size() for _, t in self._stored[i]) for i in self.swapped
        }
        """Bytes of frozen weights each swapped block keeps in CPU memory."""
        self.stored_bytes = sum(self.block_bytes.values())
        """Bytes of frozen weights kept in CPU memory instead of on the device."""
        self.reset_counters()
        self._install_hooks()
        if cuda:
            torch.cuda.empty_cache()  # hand the dropped device copies back to the allocator

    # ------------------------------------------------------------ counters

    def reset_counters(self) -> None:
        """Zero the counters (a benchmark calls this before the step it measures)."""
        n = len(self.blocks)
        self.forward_loads = [0] * n
        """Per block index: times its weights were brought in for a forward."""
        self.backward_loads = [0] * n
        """Per block index: times brought in for a backward."""
        self.recompute_loads = [0] * n
        """Per block index: times a recompute found it away (its backward brings it first)."""
        self.prefetched = 0
        """Loads whose copy had started ahead (`prefetch`)."""
        self.bytes_to_device = 0
        """Bytes copied host to device (on a CPU: the bytes that would have been)."""
        self.peak_resident = 0
        """The most swapped blocks on the device (or on their way) at one time."""

    def counters(self) -> dict[str, int]:
        """The counters summed over the blocks, as a benchmark reports them per step."""
        return {
            "forward_loads": sum(self.forward_loads),
            "backward_loads": sum(self.backward_loads),
            "recompute_loads": sum(self.recompute_loads),
            "prefetched": self.prefetched,
            "bytes_to_device": self.bytes_to_device,
            "stored_bytes": self.stored_bytes,
            "peak_resident": self.peak_resident,
        }

    def resident(self) -> list[int]:
        """The swapped blocks whose frozen weights are on the device now."""
        return sorted(self._resident)

    # ------------------------------------------------------------ install and remove

    def _store(self, block: nn.Module, seen: set[int]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Keep a CPU copy of the block's frozen parameters and point them at it; whatever
        trains (and every buffer) goes to, or stays on, the device."""
        stored = []
        for module in block.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if p.requires_grad or not _plain(p):
                    # Trained, or a quantized weight (its library's own tensor type, which
                    # keeps codes and scales of its own): it stays on the device.
                    if p.device != self.device:
                        p.data = p.data.to(self.device)
                    continue
                host = p.data.detach().to("cpu")
                if self._pinned:
                    host = host.pin_memory()
                p.data = host
                stored.append((p, host))
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.device != self.device:
                    setattr(module, name, b.to(self.device))
        return stored

    def _install_hooks(self) -> None:
        for i in self.swapped:
            block = self.blocks[i]
            self._handles += [
                block.register_forward_pre_hook(self._forward_pre(i)),
                block.register_forward_hook(self._forward_post(i)),
            ]
        if self._first > 0:
            # The resident block before the first swapped one: the first swapped block starts
            # its copy while it runs forward, and the backward drops the last one when it
            # reaches it (not only at the end of the whole backward).
            before = self.blocks[self._first - 1]
            self._handles += [
                before.register_forward_pre_hook(self._forward_pre(-1)),
                before.register_forward_hook(self._forward_post(-1)),
            ]

    def remove(self) -> None:
        """Take the hooks off and put every swapped block's weights back on the device."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending.clear()
        for i in self.swapped:
            for p, host in self._stored[i]:
                p.data = host.to(self.device)
        self._resident = set(self.swapped)

    # ------------------------------------------------------------ hooks

    def _forward_pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if i < 0:  # the resident block before the first swapped one
                if not _in_backward():
                    self._prefetch(self._first)
                return
            if _in_backward():
                # A recompute under gradient checkpointing: the backward brought it already.
                self._bring_in(i, self.recompute_loads)
                return
            self._bring_in(i, self.forward_loads)
            if i + 1 < len(self.blocks):
                self._prefetch(i + 1)

        return hook

    def _forward_post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return  # the recomputed block's backward runs next and needs it
            if i >= 0:
                self._release(i)
            if i == len(self.blocks) - 1:
                self._pending.clear()
            outputs = output if isinstance(output, tuple | list) else (output,)
            tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                # The block's backward starts where the gradient of one of its outputs is
                # ready. Hooks on the outputs, not a module backward hook: those wrap the
                # outputs in views and warn for blocks called with keyword arguments only.
                fired = [-1]  # once per backward pass (a retained graph may see several)

                def start(grad: torch.Tensor) -> None:
                    task = torch._C._current_graph_task_id()
                    if fired[0] != task:
                        fired[0] = task
                        self._backward_start(i)

                for t in tensors:
                    t.register_hook(start)

        return hook

    def _backward_start(self, i: int) -> None:
        """Block `i`'s backward is about to run (-1: the resident one before the first swapped
        block): bring it in, start the next one's copy, drop the blocks after it. Their
        backward is done: autograd runs the ready node made last in the forward first, so no
        node of a later block is left once this block's output gradients are ready."""
        for j in [j for j in self._resident if j > i]:
            self._release(j)
        if i < 0:
            return
        self._bring_in(i, self.backward_loads)
        if i - 1 >= self._first:
            self._prefetch(i - 1)

    def _end_of_backward(self) -> None:
        """Run by autograd once the whole backward is done: drop what is still on the device."""
        self._callback_task = -1
        for j in list(self._resident):
            self._release(j)
        self._pending.clear()

    # ------------------------------------------------------------ moves

    def _copy_in(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=self._pinned)

    def _prefetch(self, i: int) -> None:
        """Start copying block `i` in ahead of its use: on the side stream on CUDA."""
        if not self._prefetch_on or i in self._resident or i in self._pending:
            return
        event = None
        if self._stream is None:
            copies = [self._copy(host) for _, host in self._stored[i]]
        else:
            with torch.cuda.stream(self._stream):
                copies = [self._copy(host) for _, host in self._stored[i]]
                event = self._stream.record_event()
        self._pending[i] = (copies, event)
        self.bytes_to_device += self.block_bytes[i]
        self._note_peak()

    def _bring_in(self, i: int, count: list[int]) -> None:
        """Point block `i`'s frozen parameters at device copies (waiting for a prefetched one)."""
        if _in_backward():
            task = torch._C._current_graph_task_id()
            if task != self._callback_task:
                self._callback_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if i in self._resident:
            return
        if i in self._pending:
            copies, event = self._pending.pop(i)
            if event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(event)
                for t in copies:
                    # Allocated on the side stream, used on this one: its memory is not
                    # reused before the work queued here on it is done.
                    t.record_stream(compute)
            self.prefetched += 1
        else:
            copies = [self._copy(host) for _, host in self._stored[i]]
            self.bytes_to_device += self.block_bytes[i]
        for (p, _), t in zip(self._stored[i], copies, strict=True):
            p.data = t
        self._resident.add(i)
        count[i] += 1
        self._note_peak()

    def _release(self, i: int) -> None:
        """Point block `i`'s frozen parameters back at their CPU copies; the device copies go
        as soon as nothing (a pending kernel, a recompute's saved alias) holds them."""
        if i not in self._resident:
            return
        for p, host in self._stored[i]:
            p.data = host
        self._resident.discard(i)

    def _note_peak(self) -> None:
        self.peak_resident = max(self.peak_resident, len(self._resident) + len(self._pending))


# ---------------------------------------------------------------- the run's swap


def _bare(model: nn.Module) -> nn.Module:
    """The model inside a DDP (or other `.module`) wrapper."""
    return getattr(model, "module", model)


def check_block_swap(cfg: Config, family: Family, method: Any, denoiser: nn.Module) -> list:
    """The blocks `blocks_to_swap` would swap ([] when it is 0), or a refusal naming why not:
    a negative value, more blocks than the denoiser has, a family without a block stack
    (the SD UNets), a method that trains the whole denoiser, a quantized base, a DeepSpeed
    launch."""
    n = cfg.train.blocks_to_swap
    if n == 0:
        return []
    if n < 0:
        raise ConfigError(f"blocks_to_swap: {n} must be 0 (no swapping) or more")
    if method.whole_denoiser:
        raise KitError(
            f"blocks_to_swap: {n} keeps frozen weights in CPU memory, and network_type "
            f"{method.name} trains every weight of the denoiser (none stays frozen, and the "
            "optimizer updates them on the device); set blocks_to_swap: 0 or train an adapter"
        )
    kind = cfg.model.base_quantization
    if kind != "none":
        raise KitError(
            f"blocks_to_swap: {n} with base_quantization: {kind}: quantized weights are not "
            "swapped (their libraries' tensors keep codes and scales of their own), and they "
            "are nearly all of a block, so little would move; set one of the two to 0 / none"
        )
    if deepspeed_launch():
        raise KitError(
            f"blocks_to_swap: {n} cannot run under DeepSpeed, which places the model's weights "
            "itself (use its own offload settings instead); set blocks_to_swap: 0"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise KitError(
            f"blocks_to_swap: {n} runs on one process: DDP broadcasts every weight from the "
            "device at start, and the swapped ones live in CPU memory; launch one process, "
            "or set blocks_to_swap: 0 on GPUs large enough for the model"
        )
    blocks = family.swap_blocks(_bare(denoiser))
    if n > len(blocks):
        raise KitError(
            f"blocks_to_swap: {n} is more than the {len(blocks)} transformer blocks of this "
            f"{family.name} denoiser; set it to at most {len(blocks)}"
        )
    return blocks


def place(
    denoiser: nn.Module, blocks: Sequence[nn.Module], n: int, device: Any, dtype: torch.dtype
) -> None:
    """Put the denoiser on `device` in `dtype`, except the frozen weights of its last `n`
    `blocks`, which are cast where they are (CPU memory): the model is never whole on the
    device, so a base larger than the card's memory loads at all."""
    held = {id(p) for b in blocks[len(blocks) - n :] for p in b.parameters() if _plain(p)}
    # A denoiser of several models (Wan 2.2's experts) keeps the ones waiting in CPU memory.
    waiting = list(getattr(denoiser, "waiting_models", list)())
    away = {id(t) for m in waiting for t in [*m.parameters(), *m.buffers()]}
    seen: set[int] = set()
    for module in [*denoiser.modules(), *(m for w in waiting for m in w.modules())]:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for p in module.parameters(recurse=False):
            target = "cpu" if id(p) in held or id(p) in away else device
            cast = dtype if p.is_floating_point() and _plain(p) else None
            p.data = p.data.to(target, dtype=cast)
        for name, b in module.named_buffers(recurse=False):
            if b is not None:
                setattr(module, name, b.to("cpu" if id(b) in away else device))


def block_swap(
    cfg: Config, family: Family, method: Any, denoiser: nn.Module, device: torch.device | str
) -> BlockSwap | None:
    """Swap the configured `blocks_to_swap` of the run's denoiser (None when 0).

    Called once the method is attached (`place` kept the swapped weights off the device) and
    before accelerate prepares the denoiser, which is then told not to move it.
    """
    blocks = check_block_swap(cfg, family, method, denoiser)
    if not blocks:
        return None
    bare = _bare(denoiser)
    previous = _SWAPS.pop(bare, None)
    if previous is not None:
        previous.remove()
    # A denoiser of several models run one at a time (Wan 2.2's experts, `swap_stacks`): the
    # same last blocks of each are swapped, each stack by a swap of its own whose hooks run
    # when its model does; the models' own moves leave the swapped weights to the swaps.
    stacks = getattr(family, "swap_stacks", None)
    if stacks is None or not hasattr(bare, "swapped_params"):
        swap: BlockSwap | SwapGroup = BlockSwap(blocks, cfg.train.blocks_to_swap, device)
    else:
        swap = SwapGroup([BlockSwap(s, cfg.train.blocks_to_swap, device) for s in stacks(bare)])
        bare.swapped_params = swap.stored_params()
    _SWAPS[bare] = swap
    return swap


class SwapGroup:
    """One `BlockSwap` per model of a denoiser of several (Wan 2.2's two experts), read as one:
    counters summed, removed together."""

    def __init__(self, swaps: list[BlockSwap]) -> None:
        self.swaps = swaps
        self.stored_bytes = sum(s.stored_bytes for s in swaps)

    def stored_params(self) -> set[int]:
        """The ids of the parameters whose weights the swaps keep in CPU memory."""
        return {id(p) for s in self.swaps for i in s.swapped for p, _ in s._stored[i]}

    def reset_counters(self) -> None:
        for s in self.swaps:
            s.reset_counters()

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.swaps:
            for k, v in s.counters().items():
                out[k] = max(out.get(k, 0), v) if k == "peak_resident" else out.get(k, 0) + v
        return out

    def resident(self) -> list[int]:
        return sorted({i for s in self.swaps for i in s.resident()})

    def remove(self) -> None:
        for s in self.swaps:
            s.remove()


def attached(denoiser: nn.Module) -> BlockSwap | SwapGroup | None:
    """The swap installed on this denoiser (wrapped or not), for its counters; None if none."""
    return _SWAPS.get(_bare(denoiser))
