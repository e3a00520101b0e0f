"""What training minimises: the denoising loss, caption dropout, fixed-noise losses and EMA."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kit.errors import ConfigError
from kit.families import Components, Family


def denoising_loss(
    family: Family,
    comps: Components,
    batch: dict[str, torch.Tensor],
    generator: torch.Generator,
    device: torch.device | str,
    reg: Any = None,
    drawn: dict[str, int] | None = None,
) -> torch.Tensor:
    """The per-element loss (`loss_type`) between the denoiser's output and the family's
    target, averaged per sample, then weighted per sample (min-SNR, flow weighting, and the
    sample's dataset `loss_weight`).

    A batch's `loss_mask` (masked loss: (B, 1, h, w), or (B, 1, F, h, w) for clips, on the
    latent grid) weights the elements; each sample's loss is then the mean over its mask, so a
    small subject trains as strongly as a large one. A batch's `loss_weight` (B,) scales each
    sample (a prior dataset's prior-preservation weight).

    `reg` (`kit.train.preserve.Preserver`) makes the predictions and targets when the run
    preserves the base's output or trains samples toward the base's prediction; its
    per-sample preservation loss joins each sample's (weighted like it by the timestep).
    `drawn` counts the batches each part of a denoiser of several drew (`NoiseDraw.part`)."""
    o = family.cfg.objective
    batch = {k: v.to(device) for k, v in batch.items()}
    latents = batch.pop("latents")
    mask = batch.pop("loss_mask", None)
    sample_weight = batch.pop("loss_weight", None)
    extras = {k: batch.pop(k) for k in list(batch) if k.startswith(("preserve.", "base_target"))}
    joint = {k: batch.pop(k) for k in getattr(family, "joint_latents", ())}  # stubs have none
    joint_weight = {k: batch.pop(f"{k}_weight", None) for k in joint}
    draw = family.noise_and_target(comps, latents, generator, **joint)
    batch.update({k: d.noisy for k, d in getattr(draw, "joint", {}).items()})  # `predict` reads
    if drawn is not None and draw.part:
        drawn[draw.part] = drawn.get(draw.part, 0) + 1
    extra = None
    if reg is None:
        pred, target = family.predict(comps, draw.noisy, draw.timesteps, batch), draw.target
    elif joint:
        raise ConfigError(
            f"{family.name} predicts {', '.join(joint)} beside the latents: output preservation "
            "and base-prediction targets are not written for it yet; turn them off"
        )
    else:
        pred, target, extra = reg(family, comps, draw, batch, extras, generator)
    beside = []
    if joint:
        # The other streams' losses join each sample's (LTX-2: video + sound, as Lightricks'
        # trainer adds them), each weighted by its own per-sample weight (a silent clip: 0).
        pred, joint_pred = pred
        for k, d in draw.joint.items():
            loss = elementwise_loss(joint_pred[k], d.target, o.loss_type, o.huber_c)
            w = joint_weight[k]
            beside.append(loss.flatten(1).mean(1) * (1 if w is None else w.to(loss)))
    elements = elementwise_loss(pred, target, o.loss_type, o.huber_c)
    if mask is None:
        per_sample = elements.flatten(1).mean(1)
    else:
        weights = mask.float().expand_as(elements).flatten(1)
        total = (elements.flatten(1) * weights).sum(1)
        per_sample = total / weights.sum(1).clamp_min(1e-6)
    for loss in beside:
        per_sample = per_sample + loss
    if draw.weight is not None:
        per_sample = per_sample * draw.weight.to(per_sample)
    if sample_weight is not None:
        per_sample = per_sample * sample_weight.to(per_sample)
    if extra is not None:
        per_sample = per_sample + extra * (1 if draw.weight is None else draw.weight.to(extra))
    return per_sample.mean()


def elementwise_loss(
    pred: torch.Tensor, target: torch.Tensor, loss_type: str = "mse", huber_c: float = 0.1
) -> torch.Tensor:
    """The loss of each element, in fp32: `mse` (d²), `huber` or `smooth_l1`, d = pred - target.

    Both robust losses are the smooth pseudo-Huber curve sd-scripts trains with, with one c
    for every timestep (its `--huber_schedule constant`; its default `snr` schedule, which
    varies c with the timestep, is not offered):
    `huber` is 2c(√(d² + c²) - c), ≈ d² for |d| ≪ c (the mse scale, so learning rates carry
    over) and ≈ 2c|d| for |d| ≫ c; `smooth_l1` is the same divided by c, 2(√(d² + c²) - c),
    ≈ d²/c near zero and ≈ 2|d| far out (an L1 loss in the limit c → 0). Not torch's piecewise
    `smooth_l1_loss`: kohya configs that name `smooth_l1` mean this curve, and it has no kink.
    """
    d = pred.float() - target.float()
    if loss_type == "mse":
        return d.pow(2)
    if loss_type not in ("huber", "smooth_l1"):
        raise ConfigError(f"loss_type: {loss_type!r} is not one of mse, huber, smooth_l1")
    c = float(huber_c)
    # 2(√(d² + c²) - c) rewritten as 2d² / (√(d² + c²) + c): the same value without the
    # cancellation that loses every digit of small errors in fp32 when |d| ≪ c.
    square = d.pow(2)
    robust = 2 * square / (torch.sqrt(square + c * c) + c)
    return robust * c if loss_type == "huber" else robust


def drop_captions(
    batch: dict[str, torch.Tensor],
    empty: dict[str, torch.Tensor],
    rate: float,
    generator: torch.Generator,
) -> list[bool]:
    """Replace a `rate` share of the batch's text tensors with the empty caption's.

    Returns which samples were dropped (a live text encoder drops their captions instead).
    """
    n = batch["latents"].shape[0]
    if rate <= 0:
        return [False] * n  # no draw: the random sequence stays as without dropout
    mask = torch.rand(n, generator=generator) < rate
    for key, value in empty.items():
        batch[key][mask] = value.to(batch[key].dtype)
    return mask.tolist()


class FixedLoss:
    """The loss on fixed samples with fixed noise and timesteps: comparable across steps.

    Raw training loss jumps with each step's random noise and timestep; this one moves only
    when the weights do.
    """

    def __init__(self, data: Any, count: int, batch_size: int, seed: int) -> None:
        by_bucket: dict[Any, list[int]] = defaultdict(list)
        for i, p in enumerate(data.plan.placements[:count]):
            by_bucket[p.bucket].append(i)
        self.data = data
        self.seed = seed
        self.batches = [
            idx[j : j + batch_size]
            for idx in by_bucket.values()
            for j in range(0, len(idx), batch_size)
        ]

    @torch.no_grad()
    def __call__(self, family: Family, comps: Components, device: torch.device | str) -> float:
        generator = torch.Generator().manual_seed(self.seed)
        total, count = 0.0, 0
        for idx in self.batches:
            batch = self.data.load_batch(idx)
            total += float(denoising_loss(family, comps, batch, generator, device)) * len(idx)
            count += len(idx)
        return total / max(1, count)


class EMA:
    """An exponential moving average of the trained weights (diffusers' EMAModel), optionally
    held in CPU memory between steps.

    The decay warms up as diffusers' does by default: (1 + n) / (10 + n) after n updates,
    capped at `decay`. A fixed decay from the first step would keep the average near the
    starting weights for thousands of steps (0.9999 holds 5% of what was learned by step
    1000), and the average is what validation draws and export writes. The update count is
    part of the saved state, so a resumed run continues the ramp where it stopped.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, on_cpu: bool) -> None:
        from diffusers.training_utils import EMAModel

        self.on_cpu = on_cpu
        self.model = EMAModel(params, decay=decay, min_decay=0.0, use_ema_warmup=False)
        if on_cpu:
            self.model.to("cpu")

    def step(self, params: list[torch.nn.Parameter]) -> None:
        """Fold the current weights into the average."""
        if self.on_cpu:
            self.model.to(params[0].device)
        self.model.step(params)
        if self.on_cpu:
            self.model.to("cpu")

    @contextmanager
    def swapped_in(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Within the block, `params` hold the averaged weights; afterwards their own again."""
        self.model.store(params)
        self.model.copy_to(params)
        try:
            yield
        finally:
            self.model.restore(params)

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)
