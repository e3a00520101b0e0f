"""Noise draws for training: DDPM (epsilon or v) and rectified flow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kit.errors import KitError

OBJECTIVES = {"ddpm": "DDPM (epsilon or v prediction)", "flow": "flow matching"}
"""The kinds of training draw, each a family's `objective`, as a message names them."""
DRAW_KEYS = {
    "ddpm": ("min_snr_gamma", "noise_offset"),
    "flow": (
        "timestep_sampling",
        "logit_mean",
        "logit_std",
        "mode_scale",
        "loss_weighting",
        "flow_shift",
    ),
}
"""The objective keys that only one kind of draw reads (both read `min_timestep` and
`max_timestep`): set on a family of the other kind, they would do nothing, so they are refused."""


@dataclass
class NoiseDraw:
    """One training draw: what the denoiser sees and what it should output."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor | None = None
    """Per-sample loss weight (e.g. a flow-matching density correction); None means 1."""
    part: str = ""
    """The exported file (`Family.denoiser_files`) whose model this draw trains, where the
    denoiser is several and a draw trains one (a Wan 2.2 expert); "" trains them all."""
    joint: dict[str, NoiseDraw] = field(default_factory=dict)
    """The draws of the family's `joint_latents` (LTX-2's sound), at these same timesteps; each
    one's `weight` is its own per-sample loss weight (0 for a silent clip's sound)."""


def flow_sampling(sampling: str, loss_weighting: str) -> str:
    """The σ sampling a flow-matching run uses: `auto` becomes logit-normal, or uniform when a
    loss weighting is chosen.

    diffusers pairs `sigma_sqrt` and `cosmap` with uniform σ: the weight is the density
    correction, so on top of logit-normal draws it would weight the middle twice.
    """
    if sampling != "auto":
        return sampling
    return "logit_normal" if loss_weighting == "none" else "uniform"


def ddpm_noise_and_target(
    scheduler: Any,
    latents: torch.Tensor,
    generator: torch.Generator,
    *,
    min_snr_gamma: float = 0.0,
    noise_offset: float = 0.0,
    min_timestep: int = 0,
    max_timestep: int = 1000,
) -> NoiseDraw:
    """Uniform timesteps and Gaussian noise for DDPM-style models; epsilon or v target.

    `noise_offset` adds a per-channel constant to the noise (offset noise); `min_snr_gamma`
    weights each sample by min(SNR, γ) / SNR (epsilon) or min(SNR, γ) / (SNR + 1) (v).
    Timesteps are drawn uniformly from the integers in [`min_timestep`, `max_timestep`), as
    sd-scripts' `--min_timestep` / `--max_timestep` do; the bounds count 0…1000 and are scaled
    to the scheduler's own `num_train_timesteps` where that is not 1000.
    """
    b = latents.shape[0]
    # Draw on the CPU generator so a run is the same on any device.
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if noise_offset > 0:
        shape = (b, latents.shape[1]) + (1,) * (latents.ndim - 2)
        noise = noise + noise_offset * torch.randn(shape, generator=generator)
    noise = noise.to(latents.device, latents.dtype)
    steps = scheduler.config.num_train_timesteps
    lo, hi = ddpm_timestep_range(steps, min_timestep, max_timestep)
    timesteps = torch.randint(lo, hi, (b,), generator=generator).to(latents.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        target = noise
    elif kind == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"unsupported prediction_type {kind!r}")
    weight = None
    if min_snr_gamma > 0:
        alphas = scheduler.alphas_cumprod.to(torch.float32)[timesteps.cpu()]
        snr = alphas / (1 - alphas)
        clipped = torch.clamp(snr, max=min_snr_gamma)
        weight = clipped / (snr + 1 if kind == "v_prediction" else snr)
    return NoiseDraw(noisy, timesteps, target, weight)


def ddpm_timestep_range(steps: int, min_timestep: int, max_timestep: int) -> tuple[int, int]:
    """The integer timesteps [lo, hi) of a scheduler with `steps` training steps that the
    0…1000 bounds select; never empty, so a narrow window on a coarse scheduler still draws."""
    if steps == 1000:
        return min_timestep, max_timestep
    lo = min(steps - 1, min_timestep * steps // 1000)
    hi = max(lo + 1, -(-max_timestep * steps // 1000))
    return lo, hi


def flow_noise_and_target(
    latents: torch.Tensor,
    generator: torch.Generator,
    *,
    sampling: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
    num_train_timesteps: int = 1000,
    min_timestep: int = 0,
    max_timestep: int = 1000,
    accept: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> NoiseDraw:
    """Rectified-flow draw: x_t = (1 - σ) x0 + σ ε, target ε - x0; σ sampled as configured.

    `sampling`: `uniform`, `logit_normal` (SD3's default) or `mode` (SD3 paper's mode sampling);
    `shift` > 1 moves σ towards the noisy end, as the schedulers do at sampling time.

    `min_timestep` / `max_timestep` (σ·1000) confine σ to [min/1000, max/1000): the draw is
    made and shifted over the whole of [0, 1] first, then mapped linearly into the interval,
    as sd-scripts' SD3 and musubi-tuner's trainers apply their bounds. So the shift shapes
    the distribution inside the interval (with shift > 1 more of the draws land near its
    noisy end) but never moves the bounds themselves: σ stays inside whatever the shift.
    Every draw is kept (no rejection sampling), so the random sequence is the same for any
    bounds; σ meets the upper bound only where an unbounded draw would give σ = 1 exactly.

    `accept` (timesteps σ·num_train_timesteps → a bool per draw) keeps only the draws it
    accepts, drawing more until the batch is full: the configured distribution conditioned on
    the accepted set (a Wan 2.2 expert's side of its boundary). Without it nothing changes.
    """
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    noise = noise.to(latents.device, latents.dtype)
    options = {
        "sampling": sampling,
        "logit_mean": logit_mean,
        "logit_std": logit_std,
        "mode_scale": mode_scale,
        "shift": shift,
        "min_timestep": min_timestep,
        "max_timestep": max_timestep,
    }
    sigma = flow_sigmas(b, generator, **options)
    if accept is not None:
        sigma = _accepted(sigma, accept, num_train_timesteps, generator, options)
    sigma = sigma.to(latents.device)
    s = sigma.view(b, *([1] * (latents.ndim - 1))).to(latents.dtype)
    noisy = (1 - s) * latents + s * noise
    return NoiseDraw(noisy, sigma * num_train_timesteps, noise - latents)


def flow_sigmas(
    n: int,
    generator: torch.Generator,
    *,
    sampling: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
    min_timestep: int = 0,
    max_timestep: int = 1000,
) -> torch.Tensor:
    """`n` flow-matching σ on the CPU as `flow_noise_and_target` draws them (its options)."""
    if sampling == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    elif sampling == "mode":
        u = torch.rand(n, generator=generator)
        u = 1 - u - mode_scale * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)
    elif sampling == "uniform":
        u = torch.rand(n, generator=generator)
    else:
        raise ValueError(f"unknown timestep sampling {sampling!r}")
    sigma = shift * u / (1 + (shift - 1) * u)
    lo, hi = min_timestep / 1000, max_timestep / 1000
    if (lo, hi) != (0.0, 1.0):  # the full range leaves σ as drawn, bit for bit
        sigma = lo + (hi - lo) * sigma
    return sigma


MAX_REDRAWS = 1000
"""Rounds of rejection before a σ range is called empty (for any range a run would use, a
handful of rounds fill a batch)."""


def _accepted(
    sigma: torch.Tensor,
    accept: Callable[[torch.Tensor], torch.Tensor],
    num_train_timesteps: int,
    generator: torch.Generator,
    options: dict[str, Any],
) -> torch.Tensor:
    """The first len(sigma) draws of the stream `sigma`, then fresh draws, that `accept` keeps."""
    n = sigma.shape[0]
    kept = sigma[accept(sigma * num_train_timesteps)]
    for _ in range(MAX_REDRAWS):
        if kept.shape[0] >= n:
            return kept[:n]
        more = flow_sigmas(n, generator, **options)
        kept = torch.cat([kept, more[accept(more * num_train_timesteps)]])
    raise KitError(
        f"no timestep in {MAX_REDRAWS * n} draws fell where this run trains (the expert's side "
        "of the boundary within min_timestep / max_timestep); widen min_timestep / max_timestep "
        "or train the other expert"
    )
