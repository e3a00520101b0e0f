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
) -> NoiseDraw:
    """Uniform timesteps and Gaussian noise for DDPM-style models; epsilon or v target.

    `noise_offset` adds a per-channel constant to the noise (offset noise); `min_snr_gamma`
    weights each sample by min(SNR, γ) / SNR (epsilon) or min(SNR, γ) / (SNR + 1) (v).
    """
    b = latents.shape[0]
    # Draw on the CPU generator so a run is the same on any device.
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if noise_offset > 0:
        shape = (b, latents.shape[1]) + (1,) * (latents.ndim - 2)
        noise = noise + noise_offset * torch.randn(shape, generator=generator)
    noise = noise.to(latents.device, latents.dtype)
    steps = scheduler.config.num_train_timesteps
    timesteps = torch.randint(0, steps, (b,), generator=generator).to(latents.device)
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
) -> NoiseDraw:
    """Rectified-flow draw: x_t = (1 - σ) x0 + σ ε, target ε - x0; σ sampled as configured.

    `sampling`: `uniform`, `logit_normal` (SD3's default) or `mode` (SD3 paper's mode sampling);
    `shift` > 1 moves σ towards the noisy end, as the schedulers do at sampling time.
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
    sigma = sigma.to(latents.device)
    s = sigma.view(b, *([1] * (latents.ndim - 1))).to(latents.dtype)
    noisy = (1 - s) * latents + s * noise
    return NoiseDraw(noisy, sigma * num_train_timesteps, noise - latents)
