"""The run configuration: nested dataclasses, strict on load, one docstring per field.

A config file may be flat (`{"lora_rank": 16, ...}`) or sectioned (`{"network": {"lora_rank": 16}}`);
field names are unique across sections, so both mean the same.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from PIL import ImageColor

from kit.errors import ConfigError, did_you_mean
from kit.io import absolute_path, read_json_or_yaml, write_json

PATH = {"path": True}  # metadata: resolved relative to the config file's folder


@dataclass
class ModelConfig:
    model_family: str = "sd15"
    """Registered model family (see `kit families`), e.g. `sd15`."""
    pretrained_model: str = "runwayml/stable-diffusion-v1-5"
    """Base model: a local diffusers folder or a hub id."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the base model; ignored for local folders."""
    variant: str | None = None
    """Weights variant of the base model, e.g. `fp16`."""
    max_sequence_length: int = 0
    """Tokens of the T5 text encoder (SD3: 256, up to 512; Flux: 512); 0 takes the family's default."""
    use_t5: bool = True
    """Load the T5 text encoder where the family has one; false leaves it out to save memory."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_sequence_length <= 512:
            raise ConfigError(f"max_sequence_length: {self.max_sequence_length} must be 0..512")


@dataclass
class DataConfig:
    data_backend: Literal["local"] = "local"
    """Where images are read from; `local` is a folder on this machine."""
    image_dir: str = field(default="", metadata=PATH)
    """Folder of training images (png, jpg, jpeg, webp, bmp); subfolders are read too."""
    caption_dir: str = field(default="", metadata=PATH)
    """Folder of same-stem caption files; empty means captions lie beside the images."""
    caption_strategy: Literal["textfile", "filename", "instanceprompt"] = "textfile"
    """Where captions come from: a `.txt` per image, the file name, or `instance_prompt` for all."""
    caption_extension: str = ".txt"
    """Extension of caption files."""
    instance_prompt: str = ""
    """Caption for every image when `caption_strategy` is `instanceprompt`."""
    trigger_words: list[str] = field(default_factory=list)
    """Words that call up the trained concept; written into the exported file's metadata."""
    prior_images: list[str] = field(default_factory=list)
    """Patterns (e.g. `prior_*`, `reg/*`) of images that show what must not change; they train
    with the rest, and the trigger-word checks skip them. A pattern without `/` matches file names."""
    resolution: int = 512
    """Target size: the bucket area is resolution² (`area`) or the short side (`pixel`)."""
    resolution_type: Literal["area", "pixel"] = "area"
    """How `resolution` sizes buckets: constant pixel count (`area`) or short side (`pixel`)."""
    max_aspect_ratio: float = 2.0
    """Widest (and, inverted, tallest) bucket aspect ratio."""
    bucket_step: int = 0
    """Bucket sides are multiples of this; 0 takes the model family's alignment."""
    center_crop: bool = True
    """Crop to the bucket at the centre; false crops at a seeded random offset."""
    cache_dir: str = field(default="", metadata=PATH)
    """Where latents and text embeddings are cached; empty uses `~/.cache/kit`."""
    alpha_background: str = "white"
    """Colour laid under transparent images (a colour name or `#rrggbb`), as they train as RGB."""
    min_image_size: int = 32
    """Images (and clips) shorter than this on their short side are skipped and reported."""
    max_image_pixels: int = 178_956_970
    """Images with more pixels than this (read from the header) are refused as decompression bombs."""
    num_frames: int = 17
    """Frames per training clip (video families); Wan wants 4k+1 (5, 9, 17, 33, 81)."""
    frame_stride: int = 1
    """Take every n-th frame of a clip (video families)."""
    frame_start: Literal["first", "center", "random"] = "first"
    """Where in a longer clip the frames start: at the beginning, centred, or seeded random."""
    caption_shuffle: bool = False
    """Shuffle a caption's comma-separated tags each time it is used (after `keep_tokens`)."""
    keep_tokens: int = 0
    """The first N comma-separated tags of a caption (e.g. the trigger) never move or drop."""
    priority_tags: list[str] = field(default_factory=list)
    """Tags that are never dropped by `tag_dropout` or `tag_count_range`, wherever they stand."""
    tag_dropout: float = 0.0
    """Chance that each tag not kept (by `keep_tokens` or `priority_tags`) is left out; 0 is off."""
    tag_count_range: list[int] = field(default_factory=list)
    """`[min, max]`: keep a uniformly random number of tags in this range; empty is off."""
    caption_variants: int = 1
    """Augmented variants precomputed per caption when text embeddings are cached."""
    buckets: list[list[int]] = field(default_factory=list)
    """Explicit `[[width, height], ...]` buckets (multiples of the bucket step); empty generates
    them from `resolution`, `resolution_type` and `max_aspect_ratio`."""
    max_upscale: float = 2.0
    """Largest factor an image may be enlarged to cover its bucket; smaller images are dropped."""
    random_flip: bool = False
    """Mirror about half the images horizontally (chosen per image by the seed; cached as such)."""
    small_bucket_policy: Literal["drop", "repeat", "merge"] = "repeat"
    """A bucket with fewer images than one effective batch (batch × accumulation × processes):
    `repeat` its images to fill one, `merge` them into the nearest bucket with enough, or `drop`."""

    def __post_init__(self) -> None:
        if self.resolution < 32:
            raise ConfigError(f"resolution: {self.resolution} is too small (at least 32)")
        try:
            parse_color(self.alpha_background)
        except ValueError:
            raise ConfigError(
                f"alpha_background: {self.alpha_background!r} must be a colour name "
                "(white, black, gray...) or #rrggbb"
            ) from None
        if self.min_image_size < 1 or self.max_image_pixels < 1:
            raise ConfigError("min_image_size and max_image_pixels must be at least 1")
        if self.num_frames < 1 or self.frame_stride < 1:
            raise ConfigError("num_frames and frame_stride must be at least 1")
        if self.bucket_step < 0 or self.bucket_step % 8:
            raise ConfigError(
                f"bucket_step: {self.bucket_step} must be 0 or a positive multiple of 8"
            )
        if self.max_aspect_ratio < 1.0:
            raise ConfigError(f"max_aspect_ratio: {self.max_aspect_ratio} must be at least 1.0")
        if self.keep_tokens < 0:
            raise ConfigError(f"keep_tokens: {self.keep_tokens} must be 0 or more")
        if not 0.0 <= self.tag_dropout < 1.0:
            raise ConfigError(f"tag_dropout: {self.tag_dropout} must be in [0, 1)")
        if self.tag_count_range and (
            len(self.tag_count_range) != 2
            or not 0 <= self.tag_count_range[0] <= self.tag_count_range[1]
        ):
            raise ConfigError(
                f"tag_count_range: {self.tag_count_range} must be [] or [min, max], 0 <= min <= max"
            )
        if self.caption_variants < 1:
            raise ConfigError(f"caption_variants: {self.caption_variants} must be at least 1")
        if any(not t.strip() for t in self.priority_tags):
            raise ConfigError(f"priority_tags: {self.priority_tags} holds an empty tag")
        if any(not isinstance(t, str) or not t.strip() for t in self.prior_images):
            raise ConfigError(f"prior_images: {self.prior_images} holds an empty pattern")
        for b in self.buckets:
            if not (
                isinstance(b, list | tuple)
                and len(b) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in b)
            ):
                raise ConfigError(f"buckets: {b!r} must be [width, height] in positive pixels")
            if self.bucket_step and (b[0] % self.bucket_step or b[1] % self.bucket_step):
                raise ConfigError(
                    f"buckets: {list(b)} is not a multiple of bucket_step {self.bucket_step}"
                )
        if self.max_upscale < 1.0:
            raise ConfigError(f"max_upscale: {self.max_upscale} must be at least 1.0")


@dataclass
class NetworkConfig:
    network_type: Literal["lora", "loha", "lokr", "dora", "full", "textual_inversion"] = "lora"
    """What is trained: adapters (`lora`, `loha`, `lokr`, `dora`), the whole denoiser (`full`),
    or new token embeddings (`textual_inversion`)."""
    lora_rank: int = 16
    """Rank of each adapter update (LoRA, DoRA, LoHa, LoKr)."""
    lora_alpha: float | None = None
    """Adapter scale numerator (update scale = alpha / rank); empty means alpha = rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA / DoRA input during training."""
    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA); the same as `network_type: dora`."""
    lokr_factor: int = -1
    """LoKr Kronecker factor; -1 picks the most balanced factorisation."""
    lokr_decompose_both: bool = False
    """LoKr: also decompose the smaller Kronecker factor into low rank."""
    module_dropout: float = 0.0
    """LoHa / LoKr: probability of skipping a whole adapted module in a training step."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Module names to adapt; empty takes the model family's defaults (attention projections)."""
    only_if_contains: list[str] = field(default_factory=list)
    """Adapt only modules whose full name contains one of these substrings."""
    ignore_if_contains: list[str] = field(default_factory=list)
    """Never adapt modules whose full name contains one of these (wins over `only_if_contains`)."""
    train_text_encoder: bool = False
    """`full`: train the (first) text encoder too."""
    placeholder_tokens: list[str] = field(default_factory=list)
    """`textual_inversion`: the new token(s) to learn, e.g. `<zorb>`."""
    initializer_token: str = ""
    """`textual_inversion`: an existing single-token word whose embedding starts the new ones."""

    def __post_init__(self) -> None:
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank: {self.lora_rank} must be at least 1")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout: {self.lora_dropout} must be in [0, 1)")
        if not 0.0 <= self.module_dropout < 1.0:
            raise ConfigError(f"module_dropout: {self.module_dropout} must be in [0, 1)")


@dataclass
class ObjectiveConfig:
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = "logit_normal"
    """How flow-matching families (sd3, flux, wan) draw σ; DDPM families draw timesteps uniformly."""
    logit_mean: float = 0.0
    """Mean of the logit-normal σ distribution."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal σ distribution."""
    mode_scale: float = 1.29
    """Scale of `mode` σ sampling (SD3 paper)."""
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Per-sample loss weight for flow matching; `none` lets the σ sampling do the weighting."""
    flow_shift: float = 0.0
    """σ shift for flow matching (>1 favours noisy steps); 0 takes the family's rule."""
    train_guidance_scale: float = 1.0
    """Guidance value given to guidance-distilled models (Flux dev's guidance embedding) in training."""
    min_snr_gamma: float = 0.0
    """Min-SNR-γ loss weighting for epsilon / v models (5 is usual); 0 turns it off."""
    noise_offset: float = 0.0
    """Offset noise strength (0.05–0.1 helps very dark or bright images); 0 turns it off."""
    caption_dropout: float = 0.0
    """Share of samples trained on the empty caption's embedding (helps guidance); 0 turns it off."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the trained weights with this decay (e.g. 0.999)."""
    ema_on_cpu: bool = False
    """Hold the EMA copy in CPU memory instead of on the GPU."""

    def __post_init__(self) -> None:
        if self.logit_std <= 0:
            raise ConfigError(f"logit_std: {self.logit_std} must be positive")
        if self.flow_shift < 0:
            raise ConfigError(
                f"flow_shift: {self.flow_shift} must be 0 (family default) or positive"
            )
        for name in ("caption_dropout", "ema_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name}: {getattr(self, name)} must be in [0, 1)")
        if self.min_snr_gamma < 0 or self.noise_offset < 0:
            raise ConfigError("min_snr_gamma and noise_offset must be 0 (off) or positive")


@dataclass
class TrainConfig:
    output_dir: str = field(default="runs/run", metadata=PATH)
    """Run folder: checkpoints, logs, validation images and exports go here."""
    seed: int = 42
    """Seed for data order, noise and timesteps; the same seed gives the same run."""
    learning_rate: float = 1e-4
    """Peak learning rate."""
    lr_scheduler: Literal[
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "piecewise_constant",
    ] = "constant"
    """Learning-rate schedule (diffusers `get_scheduler`)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_num_cycles: int = 1
    """Hard restarts of `cosine_with_restarts`."""
    lr_power: float = 1.0
    """Power of the `polynomial` decay."""
    lr_step_rules: str = ""
    """`piecewise_constant` rules, e.g. `1:10,0.1:20,0.01` (multiplier:until step, …, last)."""
    optimizer: Literal["adamw", "adamw8bit", "adafactor", "prodigy"] = "adamw"
    """AdamW; AdamW 8-bit (bitsandbytes, CUDA); Adafactor; Prodigy (pip install prodigyopt)."""
    train_batch_size: int = 1
    """Images per batch (per process)."""
    gradient_accumulation_steps: int = 1
    """Batches whose gradients add up before one optimizer step."""
    max_train_steps: int = 1000
    """Optimizer steps to train."""
    mixed_precision: Literal["no", "fp32", "fp16", "bf16"] = "no"
    """Compute precision; falls back to fp32 with a warning where the hardware lacks it."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% slower."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_weight_decay: float = 1e-2
    """AdamW decoupled weight decay."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this norm; 0 turns clipping off."""
    checkpointing_steps: int = 500
    """Save the full training state every this many steps (0: only at the end)."""
    checkpoints_total_limit: int = 0
    """Keep only the newest this many checkpoints (0 keeps all)."""
    logging_steps: int = 1
    """Log loss, learning rate and gradient norm every this many steps."""
    report_to: Literal["tensorboard", "none"] = "tensorboard"
    """Tracker for metrics besides the JSONL log."""
    grad_scaler_init_scale: float = 65536.0
    """fp16: initial loss scale of the gradient scaler."""
    grad_scaler_growth_factor: float = 2.0
    """fp16: the scale grows by this factor after `grad_scaler_growth_interval` good steps."""
    grad_scaler_backoff_factor: float = 0.5
    """fp16: the scale shrinks by this factor after an overflow."""
    grad_scaler_growth_interval: int = 2000
    """fp16: good steps between scale increases."""
    stable_loss_steps: int = 0
    """Every this many steps, log the loss on fixed samples with fixed noise (0: off)."""
    stable_loss_samples: int = 4
    """Training samples used for the stable loss."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)} must be at least 1")
        if not self.learning_rate > 0 or self.learning_rate == float("inf"):
            raise ConfigError(f"learning_rate: {self.learning_rate} must be positive")
        if self.mixed_precision == "fp32":
            self.mixed_precision = "no"


@dataclass
class ValidationConfig:
    validation_steps: int = 0
    """Sample the validation prompts every this many steps (0: only at the end)."""
    validation_prompt: list[str] = field(default_factory=list)
    """Prompts to sample (a string or a list); empty uses a few training captions."""
    validation_negative_prompt: str = ""
    """Negative prompt for every validation image."""
    validation_seeds: list[int] = field(default_factory=lambda: [0, 1])
    """One image per seed and prompt; the grid has a column per seed."""
    validation_num_inference_steps: int = 25
    """Sampler steps per validation image."""
    validation_guidance_scale: float = 7.5
    """Classifier-free guidance scale."""
    validation_resolution: int = 0
    """Side of the square validation images; 0 uses `resolution`."""
    validation_image_dir: str = field(default="", metadata=PATH)
    """Held-out images with captions (same layout as `image_dir`); their loss is logged with the
    stable loss."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def to_dict(self, flat: bool = False) -> dict[str, Any]:
        """The config as plain data, sectioned or flat."""
        d = dataclasses.asdict(self)
        return flat_config(d) if flat else d

    def get(self, name: str) -> Any:
        """A field by its unique name, whatever its section."""
        return getattr(getattr(self, field_section(name)), name)

    def replace(self, **changes: Any) -> Config:
        """A copy with fields changed by name (checked like a file's keys)."""
        return from_dict({**self.to_dict(flat=True), **changes})

    def save(self, path: str | Path) -> None:
        """Write the config as sectioned JSON (atomic)."""
        write_json(path, self.to_dict())


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)
}


@cache
def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (sec, f)
    return index


def field_section(name: str) -> str:
    """The section that holds field `name`."""
    try:
        return _field_index()[name][0]
    except KeyError:
        raise ConfigError(_unknown(name, list(_field_index()))) from None


@cache
def field_docs() -> dict[str, str]:
    """Field name → its docstring, read from this module's source."""
    docs: dict[str, str] = {}
    for cls in SECTIONS.values():
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


SECRET_KEYS = {"token", "hf_token", "hub_token", "huggingface_token", "access_token", "auth_token"}
"""Keys refused with a pointer to the environment: a config is saved into the run folder."""


def _unknown(key: str, valid: list[str], where: str = "") -> str:
    if key.lower().replace("-", "_") in SECRET_KEYS:
        return (
            f"config key '{key}'{where} is refused: access tokens never go in a config file, "
            "which is copied into the run folder; set the HF_TOKEN environment variable instead "
            "(or run `hf auth login`)"
        )
    return f"unknown config key '{key}'{where}{did_you_mean(key, valid)}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[-1] if len(errors) == 1 else f"{key}: {value!r} has the wrong type"
        )
    if origin is Literal:
        if value not in args:
            hint = did_you_mean(str(value), [str(a) for a in args])
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {value!r} is not one of {choices}{hint}")
        return value
    if origin is list:
        (inner,) = args
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]  # a single prompt or seed stands for a list of one
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def flat_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config's plain data, sectioned or flat, as one flat mapping, taking every key as it is:
    unlike loading, it reads a config saved by another version of the kit."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge sectioned and flat keys into one flat dict, refusing unknown and doubled keys."""
    index = _field_index()
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(SECTIONS[key])]
            for sub, v in value.items():
                if sub.startswith("_"):
                    continue  # comments
                if sub not in names:
                    if sub in index:
                        raise ConfigError(
                            f"config key '{sub}' belongs in section '{index[sub][0]}', not '{key}'"
                        )
                    raise ConfigError(_unknown(sub, names, f" in section '{key}'"))
                if sub in flat:
                    raise ConfigError(f"config key '{sub}' is given twice")
                flat[sub] = v
        elif key in SECTIONS:
            raise ConfigError(
                f"config section '{key}' must be an object of fields, got {type(value).__name__}"
            )
        elif key in index:
            if key in flat:
                raise ConfigError(f"config key '{key}' is given twice")
            flat[key] = value
        elif key.startswith("_") or key == "$schema":
            continue  # comments such as "_comment" are allowed
        else:
            raise ConfigError(_unknown(key, list(index) + list(SECTIONS)))
    return flat


def from_dict(raw: dict[str, Any], base_dir: str | Path | None = None) -> Config:
    """Build a checked Config from a flat or sectioned dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    flat = _flatten(raw)
    index = _field_index()
    hints = {sec: typing.get_type_hints(cls) for sec, cls in SECTIONS.items()}
    per_section: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
    for key, value in flat.items():
        sec, f = index[key]
        value = _coerce(key, value, hints[sec][key])
        if base_dir is not None and f.metadata.get("path") and value:
            value = str(absolute_path(value, base_dir))
        per_section[sec][key] = value
    if base_dir is not None and "pretrained_model" in flat:
        per_section["model"]["pretrained_model"] = resolve_model_path(
            flat["pretrained_model"], base_dir
        )
    return Config(**{sec: SECTIONS[sec](**vals) for sec, vals in per_section.items()})


def resolve_model_path(value: str, base_dir: str | Path) -> str:
    """A local path (made absolute) when the value names one, else the hub id unchanged."""
    looks_local = value.startswith((".", "/", "~")) or (Path(base_dir) / value).exists()
    return str(absolute_path(value, base_dir)) if looks_local else value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Read a JSON (or YAML) config file; relative paths are taken from the file's folder."""
    path = Path(path)
    raw = read_json_or_yaml(path)
    try:
        raw = _flatten(raw) if isinstance(raw, dict) else raw
        if overrides:
            for key in overrides:
                field_section(key)
            raw = {**raw, **overrides}
        return from_dict(raw, base_dir=path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a command-line `key=value`; the value is JSON when it parses, else a string."""
    if "=" not in text:
        raise ConfigError(f"expected key=value, got '{text}'")
    key, value = text.split("=", 1)
    field_section(key.strip())
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


_HEX = re.compile(r"#[0-9a-fA-F]{6}")


def parse_color(value: str) -> tuple[int, int, int]:
    """An (r, g, b) colour from a colour name (`white`) or `#rrggbb`, or a ValueError."""
    text = value.strip().lower()
    if not (_HEX.fullmatch(text) or text in ImageColor.colormap):
        raise ValueError(f"{value!r} is not a colour name or #rrggbb")
    return ImageColor.getrgb(text)[:3]
