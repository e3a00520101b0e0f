"""Noise draws for training: DDPM (epsilon or v) and rectified flow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class NoiseDraw:
    """One training draw: what the denoiser sees and what it should output."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor | None = None
    """Per-sample loss weight (e.g. a flow-matching density correction); None means 1."""


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
    """
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    noise = noise.to(latents.device, latents.dtype)
    if sampling == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(b, generator=generator))
    elif sampling == "mode":
        u = torch.rand(b, generator=generator)
        u = 1 - u - mode_scale * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)
    elif sampling == "uniform":
        u = torch.rand(b, generator=generator)
    else:
        raise ValueError(f"unknown timestep sampling {sampling!r}")
    sigma = shift * u / (1 + (shift - 1) * u)
    lo, hi = min_timestep / 1000, max_timestep / 1000
    if (lo, hi) != (0.0, 1.0):  # the full range leaves σ as drawn, bit for bit
        sigma = lo + (hi - lo) * sigma
    sigma = sigma.to(latents.device)
    s = sigma.view(b, *([1] * (latents.ndim - 1))).to(latents.dtype)
    noisy = (1 - s) * latents + s * noise
    return NoiseDraw(noisy, sigma * num_train_timesteps, noise - latents)
