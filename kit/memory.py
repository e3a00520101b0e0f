"""A first VRAM estimate: parameter counts from the real architecture, activations from a
forward pass on the meta device (shapes only, no weights, no GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.families import get_family
from kit.network import adapter_config, trainable_parameters

GIB = 2**30
GPUS = {
    "T4 16GB": 16,
    "RTX 3060 12GB": 12,
    "RTX 4090 24GB": 24,
    "L4 24GB": 24,
    "A100 40GB": 40,
    "A100 80GB": 80,
    "H100 80GB": 80,
}
ALLOCATOR_RESERVE = 0.10  # share of the peak the caching allocator holds beyond live tensors


@dataclass
class Estimate:
    """Peak training memory by component, in bytes."""

    components: dict[str, int]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    def fits(self, budget_gib: float) -> bool:
        """True when the peak is within `budget_gib`."""
        return self.total_bytes <= budget_gib * GIB

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the card table."""
        return {
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GIB, 3),
            "components": self.components,
            "settings": self.settings,
            "fits": {name: self.fits(gib) for name, gib in GPUS.items()},
            "notes": self.notes,
        }


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _trainable(cfg: Config, family, denoiser: nn.Module, parts: dict[str, nn.Module]) -> int:
    """Trained parameters of the configured network, counted on the meta-device model."""
    kind = cfg.network.network_type
    if kind == "full":
        encoders = [m for name, m in parts.items() if name.startswith("text")]
        text = _params(encoders[0]) if cfg.network.train_text_encoder and encoders else 0
        return _params(denoiser) + text
    if kind == "textual_inversion":
        widths = [
            m.get_input_embeddings().weight.shape[1]
            for m in parts.values()
            if hasattr(m, "get_input_embeddings")
        ]
        return len(cfg.network.placeholder_tokens) * sum(widths)
    denoiser.requires_grad_(False)
    denoiser.add_adapter(adapter_config(cfg, family, denoiser))  # on meta: shapes only
    return sum(p.numel() for p in trainable_parameters(denoiser))


def _activation_bytes(
    denoiser: nn.Module, args: tuple, kwargs: dict, dtype_bytes: int, checkpointing: bool
) -> int:
    """Bytes of tensors the backward pass keeps: each layer's output, from a meta forward."""
    per_block: dict[str, int] = {}
    current = {"name": "other"}

    def leaf_hook(_m, _i, out):
        if isinstance(out, torch.Tensor):
            per_block[current["name"]] = per_block.get(current["name"], 0) + out.numel() * dtype_bytes

    def block_pre(name):
        def hook(_m, _i):
            current["name"] = name

        return hook

    handles = []
    blocks = {n: m for n, m in denoiser.named_modules() if n.count(".") == 1 and "blocks" in n}
    for n, m in blocks.items():
        handles.append(m.register_forward_pre_hook(block_pre(n)))
    for m in denoiser.modules():
        if not list(m.children()):
            handles.append(m.register_forward_hook(leaf_hook))
    try:
        with torch.no_grad():
            out = denoiser(*args, **kwargs)
        del out
    finally:
        for h in handles:
            h.remove()
    if not checkpointing:
        return sum(per_block.values())
    # Checkpointing keeps block inputs and recomputes one block at a time.
    boundaries = sum(a.numel() for a in args if isinstance(a, torch.Tensor)) * dtype_bytes
    return boundaries * (len(blocks) + 1) + max(per_block.values(), default=0)


def estimate(
    cfg: Config,
    *,
    resolution: int | None = None,
    batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
    mixed_precision: str | None = None,
) -> Estimate:
    """Estimate peak VRAM of the configured run; keyword arguments override the config."""
    family = get_family(cfg.model.model_family, cfg)
    parts = family.empty_parts(cfg.model.pretrained_model)
    res = resolution or cfg.data.resolution
    batch = batch_size or cfg.train.train_batch_size
    ckpt = cfg.train.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
    precision = mixed_precision or cfg.train.mixed_precision
    wbytes = 2 if precision in ("fp16", "bf16") else 4
    denoiser = parts.pop("denoiser")
    base_params = _params(denoiser)
    trainable = _trainable(cfg, family, denoiser, parts)
    args, kwargs = family.denoiser_inputs({"denoiser": denoiser, **parts}, batch, res, res)
    act = _activation_bytes(denoiser, args, kwargs, wbytes, ckpt)
    comps = {
        "denoiser_weights": base_params * wbytes,
        **{f"{name}_weights": _params(m) * wbytes for name, m in parts.items()},
        "trainable_weights": trainable * 4,
        "gradients": trainable * 4,
        "optimizer_state": trainable * 8,
        "activations": act,
    }
    comps["allocator_reserve"] = int(sum(comps.values()) * ALLOCATOR_RESERVE)
    notes = [
        "text encoder and VAE stay loaded for validation; with cached latents and embeddings "
        f"they could be offloaded, saving {(comps['vae_weights'] + sum(v for k, v in comps.items() if k.startswith('text'))) / GIB:.2f} GiB",
        "activations come from one forward pass on the meta device; attention is counted as "
        "its output only, as memory-efficient kernels keep it",
    ]
    settings = {
        "resolution": res,
        "batch_size": batch,
        "gradient_checkpointing": ckpt,
        "mixed_precision": precision,
        "trainable_params": trainable,
    }
    return Estimate(comps, settings, notes)
