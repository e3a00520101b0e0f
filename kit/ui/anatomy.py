"""One training step as pictures, for teaching: what the denoiser sees, what it should answer.

Every tensor comes from the functions training itself runs: the dataset's cache (`plan_cache`,
`fill_cache`, `load_batch`), the family's `noise_and_target` and `predict`, and the loss from
`denoising_loss`, drawn with the same seed, so the number shown is the number training
minimises for this image, timestep and noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kit.config import Config
from kit.data.cache import fill_cache, plan_cache
from kit.data.pixels import sample_pixels
from kit.families.loading import load_base
from kit.train.objective import denoising_loss

SHOWN_CHANNELS = 4  # latent channels drawn side by side (Flux and SD3 have 16)
OBJECTIVES = {
    "epsilon": "epsilon: the target is the noise that was added",
    "v_prediction": "v: the target mixes noise and image, v = α·noise − σ·latent",
    None: "flow matching: the target is the direction from image to noise, noise − latent",
}
"""What the denoiser is asked for, by the noise scheduler's `prediction_type` (None: flow)."""


@dataclass
class StepPictures:
    """One training step's tensors as arrays: images (H, W, 3) in [0, 1], latents (C, h, w)."""

    caption: str
    image: np.ndarray
    latent: np.ndarray
    noise: np.ndarray
    """The noise as added at this timestep (the noisy latent minus its image part)."""
    noisy_image: np.ndarray
    """The noisy latent decoded by the VAE: what is left of the image at this timestep."""
    target: np.ndarray
    prediction: np.ndarray
    timestep: float
    objective: str
    loss: float

    def figure(self) -> Any:
        """The step as seven panels: input, latent, noise, noisy image; target, answer, error."""
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 4, figsize=(13, 5.6))
        error = (self.prediction - self.target) ** 2
        panels = [
            (self.image, f"1 · the image\n“{_short(self.caption)}”", None),
            (_tile(self.latent), f"2 · its latent ({_channels(self.latent)})", "coolwarm"),
            (_tile(self.noise), f"3 · noise at timestep {self.timestep:.0f}", "coolwarm"),
            (self.noisy_image, "4 · the noisy latent, decoded", None),
            (_tile(self.target), "5 · the target", "coolwarm"),
            (_tile(self.prediction), "6 · the model's prediction", "coolwarm"),
            (_tile(error, symmetric=False), f"7 · squared error: loss {self.loss:.4f}", "magma"),
        ]
        for ax, (array, title, cmap) in zip(axes.flat, panels, strict=False):
            if cmap is None:
                ax.imshow(array)
            else:
                m = float(np.nanmax(np.abs(array))) or 1.0
                lo = -m if cmap == "coolwarm" else 0.0
                ax.imshow(array, cmap=cmap, vmin=lo, vmax=m, interpolation="nearest")
            ax.set_title(title, fontsize=9)
            ax.axis("off")
        last = axes.flat[7]
        last.axis("off")
        last.text(0, 0.5, _wrap(self.objective), fontsize=9, va="center", wrap=True)
        fig.tight_layout()
        plt.close(fig)  # shown once, as the cell's result
        return fig


def one_step(cfg: Config, index: int = 0, seed: int = 0) -> StepPictures:
    """Run one training draw on sample `index` of the dataset, without training, as pictures.

    The base model is loaded in fp32 (on the GPU when there is one); the sample's latent and
    caption come from the run's cache (encoded now if missing, so training reuses them).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    family, comps = load_base(cfg)
    for module in comps.frozen_modules():
        module.to(device)
    identity = family.identity(cfg.model.pretrained_model, cfg.model.revision)
    data = plan_cache(cfg, identity, torch.float32, family=family)
    fill_cache(data, cfg, family, comps, device, progress=False)
    sample, placement = data.samples[index], data.plan.placements[index]
    batch = data.load_batch([index])
    cond = {k: v.to(device) for k, v in batch.items()}
    latents = cond.pop("latents")
    with torch.no_grad():
        draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(seed))
        # The same draw on an all-zero latent leaves only the noise part of the noisy latent:
        # the noise as this timestep adds it, for any objective.
        noise = family.noise_and_target(
            comps, torch.zeros_like(latents), torch.Generator().manual_seed(seed)
        ).noisy
        pred = family.predict(comps, draw.noisy, draw.timesteps, cond)
        loss = denoising_loss(family, comps, batch, torch.Generator().manual_seed(seed), device)
        noisy_image = decode(comps.vae, draw.noisy)
    kind = comps.noise_scheduler.config.get("prediction_type")
    pixels = sample_pixels(sample, placement, cfg.data)
    return StepPictures(
        caption=sample.caption,
        image=_picture(pixels),
        latent=_first(latents),
        noise=_first(noise),
        noisy_image=_picture(noisy_image[0]),
        target=_first(draw.target),
        prediction=_first(pred),
        timestep=float(draw.timesteps[0]),
        objective=OBJECTIVES.get(kind, f"{kind}: the scheduler's prediction type"),
        loss=float(loss),
    )


def decode(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] of latents as the families scale them (the VAE config's factors).

    The inverse of every family's `encode_images`: per-channel statistics where the VAE has
    them (SDXL's newer VAEs, Wan), else the scaling and shift factors. A clip's first frame.
    """
    c = vae.config
    mean, std = c.get("latents_mean"), c.get("latents_std")
    scale = c.get("scaling_factor") or 1.0
    z = latents.float()
    if mean is not None and std is not None:
        shape = (1, -1) + (1,) * (z.ndim - 2)
        z = z * torch.tensor(std).view(shape).to(z) / scale + torch.tensor(mean).view(shape).to(z)
    else:
        z = z / scale + (c.get("shift_factor") or 0.0)
    pixels = vae.decode(z.to(vae.device, vae.dtype)).sample.float()
    return pixels[:, :, 0] if pixels.ndim == 5 else pixels


def _first(t: torch.Tensor) -> np.ndarray:
    """The first sample's first frame, (C, h, w), as float32."""
    x = t[0].float().cpu()
    return (x[:, 0] if x.ndim == 4 else x).numpy()


def _picture(pixels: torch.Tensor) -> np.ndarray:
    """(3, H, W) (or a clip's first frame) in [-1, 1] → (H, W, 3) in [0, 1]."""
    x = pixels.float().cpu()
    x = x[:, 0] if x.ndim == 4 else x
    return ((x.clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()


def _tile(latent: np.ndarray, symmetric: bool = True) -> np.ndarray:
    """The first channels as a 2 × 2 grid, one blank line between them."""
    chans = list(latent[:SHOWN_CHANNELS])
    h, w = chans[0].shape
    fill = 0.0 if symmetric else np.nan
    chans += [np.full((h, w), fill)] * (-len(chans) % 2)
    col = np.full((h, 1), fill)
    rows = [
        np.concatenate([a, col, b], axis=1) for a, b in zip(chans[::2], chans[1::2], strict=True)
    ]
    line = np.full((1, rows[0].shape[1]), fill)
    out = [rows[0]]
    for r in rows[1:]:
        out += [line, r]
    return np.concatenate(out, axis=0)


def _channels(latent: np.ndarray) -> str:
    c = latent.shape[0]
    return f"{c} channels" if c <= SHOWN_CHANNELS else f"{SHOWN_CHANNELS} of {c} channels"


def _short(text: str, n: int = 38) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _wrap(text: str, width: int = 34) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))
