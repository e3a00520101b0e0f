"""Sizes no machine at hand can hold, refused in one line before anything loads.

A rank or an image side typed with a few zeros too many does not fail: the process grows until
the operating system kills it, with no message at all. Each check here compares a lower bound
of what the setting needs (what it must hold at the least, whatever the other settings) with
all the memory the run could use, the GPU's and the host's together; only a setting that
cannot fit even so is refused, so a run that might fit is never stopped here.
"""

from __future__ import annotations

import os

import torch

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.methods import get_method, preview

RANK_CHECKED_ABOVE = 256
"""Ranks up to this are the usual ones and are not checked (the check builds the network on the
meta device: a second or two on a large base)."""
BYTES_PER_TRAINED = 8
"""What each trained value holds at the least: its weight and its gradient, kept in float32."""
STATE_BYTES = {"adamw": 8}
"""What the optimizer keeps per trained value besides (AdamW: two float32 moments); the others
are counted at nothing, as a lower bound."""
BYTES_PER_PIXEL = 15
"""What each pixel of a validation image holds at the least on the host: the pipeline's float32
RGB output (12 bytes) and the 8-bit image made from it (3)."""


def refuse_impossible_sizes(cfg: Config) -> None:
    """Refuse a `lora_rank` or a validation image size that cannot fit in this machine's memory."""
    refuse_impossible_validation(cfg)
    refuse_impossible_rank(cfg)


def refuse_impossible_validation(cfg: Config) -> None:
    """Refuse a validation image too large to draw in this machine's host memory."""
    host = _host_bytes()
    for key, side_w, side_h in _validation_sizes(cfg):
        need = side_w * side_h * BYTES_PER_PIXEL
        if host is not None and need > host:
            raise ConfigError(
                f"{key}: a {side_w}x{side_h} image needs at least {_gib(need)} of host memory "
                f"to draw, and this machine has {_gib(host)}; choose a size near the training "
                f"resolution ({cfg.data.resolution})"
            )


def refuse_impossible_rank(cfg: Config) -> None:
    """Refuse a `lora_rank` whose trained weights, gradients and optimizer state alone exceed
    all of this machine's memory."""
    host, rank = _host_bytes(), cfg.network.lora_rank
    if host is None or rank <= RANK_CHECKED_ABOVE:
        return
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    # The processes of a launch may split what trains between them (ZeRO, FSDP).
    processes = max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
    trained = trained_at_rank(cfg, rank)
    if trained is None:
        return
    need = trained * (BYTES_PER_TRAINED + STATE_BYTES.get(cfg.train.optimizer, 0))
    if need > (host + gpu) * processes:
        raise ConfigError(
            f"lora_rank: {rank} makes {trained:,} trained values, which need at least "
            f"{_gib(need)} of memory, and this machine has {_gib(host + gpu)} in all; "
            "usual ranks are 4 to 128"
        )


def trained_at_rank(cfg: Config, rank: int) -> int | None:
    """How many values the configured network trains at `rank`, without building it there: a
    method whose size grows in proportion to its rank (`Method.size_per_rank`) is built at
    ranks 1 and 2 on the meta device, and its count carried on to `rank`. None for any other
    (LoKr's factors stop growing with the rank): nothing is claimed of it."""
    if not get_method(cfg, get_family(cfg.model.model_family, cfg)).size_per_rank:
        return None
    one, two = (preview(cfg.replace(lora_rank=r)).trainable for r in (1, 2))
    return one + (two - one) * (rank - 1)


def _validation_sizes(cfg: Config) -> list[tuple[str, int, int]]:
    """Each validation image size the config asks for, with the key that sets it."""
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    key = "validation_resolution" if v.validation_resolution else "resolution"
    out = [(key, side, side)]
    for i, entry in enumerate(v.validation_prompts):
        w, h = entry.width or side, entry.height or side
        out.append((f"validation_prompts[{i}] width/height", w, h))
    return out


def _host_bytes() -> int | None:
    """The host's physical memory, in bytes (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"
