"""Architecture configs that ship with the kit, and the hub ids and short names that select them.

With these, the estimator, the network preview and the tests build real architectures (on the
meta device or with random weights) without any download.
"""

from __future__ import annotations

from pathlib import Path

MODEL_CONFIGS = Path(__file__).parent / "model_configs"
"""One diffusers-layout folder of configs (no weights) per shipped architecture."""

SHIPPED = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": "sd15",
    # Removed from the hub in 2024; older configs still name it, and its architecture is this.
    "runwayml/stable-diffusion-v1-5": "sd15",
    "stabilityai/stable-diffusion-xl-base-1.0": "sdxl",
    "stabilityai/stable-diffusion-3.5-medium": "sd35m",
    "black-forest-labs/FLUX.1-dev": "flux-dev",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan21-1.3b",
    "sd15": "sd15",
    "sdxl": "sdxl",
    "sd35m": "sd35m",
    "sd3.5-medium": "sd35m",
    "flux-dev": "flux-dev",
    "wan21-1.3b": "wan21-1.3b",
    "wan2.1-1.3b": "wan21-1.3b",
}
"""Hub id or short name → folder of `MODEL_CONFIGS`."""


def config_source(pretrained: str) -> str:
    """Where configs are read: a local folder, the shipped copy, or the hub id."""
    if Path(pretrained).is_dir():
        return pretrained
    if pretrained in SHIPPED:
        return str(MODEL_CONFIGS / SHIPPED[pretrained])
    return pretrained
