"""The model section of the run configuration: which base model, from where, stored how."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kit.config.sources import HUB_OR_PATH
from kit.errors import ConfigError

DEFAULT_BASES: dict[str, str] = {}
"""Each family's maintained base by `model_family`: what an empty `pretrained_model` stands for
(the hub id `kit families` prints). The family registry (`kit.families.registry`) fills it as
it is imported; this layer knows no family."""


@dataclass
class ModelConfig:
    model_family: str = "sd15"
    """Registered model family (see `kit families`), e.g. `sd15`."""
    pretrained_model: str = field(default="", metadata=HUB_OR_PATH)
    """Base model: a local diffusers folder, a hub id, or one `.safetensors` / `.ckpt` file
    (as A1111, ComfyUI and model sites share them; see `model_config`); empty takes the
    family's maintained base (the hub id `kit families` prints)."""
    model_config: str = field(default="", metadata=HUB_OR_PATH)
    """For a single-file `pretrained_model`: where the architecture's configs, the tokenizers,
    the scheduler and any part the file lacks come from: a diffusers folder or hub id of the same
    architecture, or a config the kit ships (`kit families` lists them: `sd15`, `sdxl`,
    `flux-dev`, `zimage-turbo`, `wan22-t2v-a14b`, ...); empty takes the family's shipped config.
    The shipped configs hold no tokenizers or weights: they describe the architecture
    (estimates, previews), and training needs a folder or hub id."""
    vae_model: str = field(default="", metadata=HUB_OR_PATH)
    """Another VAE to use (a diffusers folder, hub id or single file), e.g. an fp16-safe SDXL
    VAE; empty keeps the base model's."""
    base_quantization: Literal["none", "int8", "fp8", "nf4"] = "none"
    """Store the frozen denoiser (and T5, where there is one) quantized: `int8` and `fp8`
    weights, or `nf4` (4-bit, CUDA only); adapters train in full precision on top."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the base model (of `model_config`, for a
    single-file base); ignored for local folders."""
    variant: str | None = None
    """Weights variant of the base model, e.g. `fp16`."""
    max_sequence_length: int = 0
    """Tokens of the T5 text encoder (SD3: 256, up to 512; Flux: 512); 0 takes the family's default."""
    use_t5: bool = True
    """Load the T5 text encoder where the family has one; false leaves it out to save memory."""
    text_encoder_quantization: Literal["none", "int8", "fp8", "nf4"] = "none"
    """Store the text encoders quantized while they fill the cache (and after, where they stay),
    so that a 7-24 B LLM encoder fits the card: `int8` / `fp8` take half of bf16, `nf4` (CUDA
    only) a quarter. The cached embeddings are then the quantized encoder's, keyed apart."""
    train_experts: Literal["", "high", "low", "both"] = ""
    """For a base with two experts (Wan 2.2 A14B: a high-noise `transformer`, a low-noise
    `transformer_2`): train `high`, `low` or `both` (each step the expert of its timesteps);
    empty trains both. Refused for a base with one transformer."""
    training_adapter: str = field(default="", metadata=HUB_OR_PATH)
    """A LoRA (file, folder or hub id) run inside a step-distilled base while training (e.g. a
    de-distilling adapter made for Z-Image Turbo or FLUX.2 klein) and left out of every export:
    the trained LoRA is then used on the distilled base alone. Validation draws both ways."""

    def __post_init__(self) -> None:
        if not self.pretrained_model:
            self.pretrained_model = DEFAULT_BASES.get(self.model_family, "")
        if not 0 <= self.max_sequence_length <= 512:
            raise ConfigError(f"max_sequence_length: {self.max_sequence_length} must be 0..512")
