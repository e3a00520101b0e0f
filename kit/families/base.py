"""The model-family seam: everything the trainer, estimator and notebooks ask of a model."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class Components:
    """The loaded parts of a base model."""

    denoiser: nn.Module
    vae: nn.Module
    text_encoders: list[nn.Module]
    tokenizers: list[Any]
    noise_scheduler: Any
    source: str
    identity: dict[str, str] = field(default_factory=dict)
    """Part name → a fingerprint of its weights, used to key caches."""

    def frozen_modules(self) -> list[nn.Module]:
        """Every module of the base model."""
        return [self.denoiser, self.vae, *self.text_encoders]


class Family(ABC):
    """One model architecture. Subclass, set the class attributes, register with `@register`."""

    name: str = ""
    """The `model_family` value that selects this family."""
    bucket_step: int = 64
    """Bucket sides are multiples of this."""
    default_lora_targets: tuple[str, ...] = ()
    """Denoiser module names adapted by LoRA when the config names none."""
    kohya_prefix: str = "lora_unet"
    """Key prefix of denoiser weights in the kohya / A1111 naming."""
    base_model_version: str = ""
    """`ss_base_model_version` written into kohya metadata."""
    modelspec_architecture: str = ""
    """`modelspec.architecture` written into kohya metadata."""
    pipeline_class: str = "StableDiffusionPipeline"
    """The diffusers pipeline class that samples this family (and saves its LoRA files)."""
    pipeline_kwargs: dict[str, Any] = {}
    """Extra `from_pretrained` arguments for that pipeline."""

    @abstractmethod
    def load(
        self,
        pretrained: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Components:
        """Load the base model's parts with diffusers / transformers `from_pretrained`."""

    @abstractmethod
    def encode_text(self, comps: Components, captions: list[str]) -> dict[str, torch.Tensor]:
        """Per-caption conditioning tensors (batch first), ready to cache."""

    @abstractmethod
    def encode_images(self, comps: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Scaled latents of images in [-1, 1], shape (B, 3, H, W)."""

    @abstractmethod
    def predict(
        self,
        comps: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The denoiser's output for noisy latents."""

    @abstractmethod
    def noise_and_target(
        self,
        comps: Components,
        latents: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw timesteps and noise; return (noisy latents, timesteps, regression target)."""

    @abstractmethod
    def pipeline(self, comps: Components) -> Any:
        """A diffusers pipeline that samples with these parts."""

    @abstractmethod
    def empty_parts(self, pretrained: str) -> dict[str, nn.Module]:
        """The parts built from their configs on the meta device: shapes only, no weights."""

    @abstractmethod
    def denoiser_inputs(
        self, parts: dict[str, nn.Module], batch: int, height: int, width: int
    ) -> tuple[tuple, dict[str, Any]]:
        """Meta-device arguments for one denoiser forward at this image size."""

    @abstractmethod
    def make_tiny(self, out_dir: str | Path, seed: int = 0) -> Path:
        """Write a tiny random-init copy of this architecture in diffusers layout."""

    def save_diffusers_lora(
        self, state: dict[str, torch.Tensor], adapter_config: dict[str, Any], out_dir: Path
    ) -> Path:
        """Write `pytorch_lora_weights.safetensors` as the family's pipeline saves it."""
        import diffusers
        from diffusers.utils import convert_state_dict_to_diffusers

        cls = getattr(diffusers, self.pipeline_class)
        cls.save_lora_weights(
            out_dir,
            unet_lora_layers=convert_state_dict_to_diffusers(state),
            unet_lora_adapter_metadata=adapter_config,
            safe_serialization=True,
        )
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    def kohya_state_dict(self, state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
        """Adapter weights in the kohya naming that A1111, Forge and ComfyUI load."""
        from diffusers.utils import convert_state_dict_to_kohya

        out = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in state.items()})
        out = {k.replace("lora_unet", self.kohya_prefix, 1): v for k, v in out.items()}
        for k in out:
            if k.endswith(".alpha"):
                out[k] = torch.tensor(float(alpha))
        return out

    def token_counts(self, comps: Components, captions: list[str]) -> list[dict[str, int]]:
        """Tokens per caption and tokenizer, with each tokenizer's limit."""
        out = []
        for caption in captions:
            row = {}
            for i, tok in enumerate(comps.tokenizers):
                row[f"tokens_{i}"] = len(tok(caption).input_ids)
                row[f"limit_{i}"] = tok.model_max_length
            out.append(row)
        return out


def fingerprint(obj: Any) -> str:
    """A short stable hash of JSON-able data."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def weights_identity(source: str, subfolder: str, config: dict, revision: str | None) -> str:
    """Fingerprint a part: its config plus, for a local folder, its weight files' sizes and times."""
    files: list[Any] = []
    folder = Path(source) / subfolder
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".bin"):
                st = f.stat()
                files.append((f.name, st.st_size, st.st_mtime_ns))
    return fingerprint({"source": source, "sub": subfolder, "rev": revision, "cfg": config, "files": files})


def ddpm_noise_and_target(
    scheduler: Any, latents: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform timesteps and Gaussian noise for DDPM-style models; epsilon or v target."""
    b = latents.shape[0]
    # Draw on the CPU generator so a run is the same on any device.
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
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
    return noisy, timesteps, target
