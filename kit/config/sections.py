"""The sections of the run configuration: one dataclass each, one docstring per field, checks in
`__post_init__`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Literal

from PIL import ImageColor

from kit.config.preservation import PreservationConfig, SliderConfig
from kit.config.sources import SOURCE_FIELDS, RemoteFields, SourceFields
from kit.errors import ConfigError, at_least

PATH = {"path": True}  # metadata: resolved relative to the config file's folder


@dataclass
class GenerateConfig:
    count: int = 0
    """Class images to draw with the base model before training (0: none)."""
    prompt: str = ""
    """The class prompt they are drawn with, e.g. `a photo of a dog`; also their caption."""
    negative_prompt: str = ""
    """Negative prompt for the drawing."""
    num_inference_steps: int = 0
    """Sampler steps per image; 0 takes `validation_num_inference_steps`."""
    guidance_scale: float | None = None
    """Guidance scale; empty takes the family's default."""
    seed: int = 0
    """Image i is drawn with seed `seed + i`, so more images add to the ones already drawn."""

    def __post_init__(self) -> None:
        if self.count < 0 or self.num_inference_steps < 0:
            raise ConfigError("count and num_inference_steps must be 0 or more")
        if self.count and not self.prompt.strip():
            raise ConfigError(f"prompt: class images to draw ({self.count}) need a prompt")


@dataclass
class DatasetConfig(SourceFields):
    name: str = ""
    """What reports call this dataset; empty takes its folder's name."""
    image_dir: str = field(default="", metadata=PATH)
    """Folder of this dataset's images (subfolders are read too)."""
    caption_dir: str = field(default="", metadata=PATH)
    """Folder of same-stem caption files; empty means captions lie beside the images."""
    mask_dir: str | None = field(default=None, metadata=PATH)
    """Folder of same-stem masks for `masked_loss`; empty takes the data section's."""
    control_dir: list[str] = field(default_factory=list, metadata=PATH)
    """Edit models: the control (reference) images' folder, or one per reference, paired with
    `image_dir`'s images (the targets) by relative path and stem."""
    masked_loss: bool | None = None
    """This dataset's images train with their masks, or (false) whole; empty takes the data
    section's. A regularisation set without masks beside masked instance images sets false."""
    repeats: int = 1
    """How many times each image trains per epoch (e.g. 3 for a small character set beside a
    large regularisation set)."""
    role: Literal["instance", "prior"] = "instance"
    """`instance`: what the run teaches; `prior`: what must not change (regularisation or
    class images), weighted by `loss_weight` and skipped by the trigger-word checks."""
    loss_weight: float = 1.0
    """Weight of this dataset's samples in the loss (DreamBooth's prior-preservation weight)."""
    target: Literal["noise", "base_prediction"] = "noise"
    """What a prior dataset's images train toward: their noise, or the base model's prediction."""
    generate: GenerateConfig | None = None
    """A prior dataset's class images drawn by the base model into `image_dir` before training
    (`{"count": 200, "prompt": "a photo of a dog"}`); drawn once, kept like any image."""
    caption_strategy: Literal["textfile", "filename", "instanceprompt"] | None = None
    """Empty takes the data section's (as do the fields below)."""
    caption_extension: str | None = None
    instance_prompt: str | None = None
    caption_shuffle: bool | None = None
    keep_tokens: int | None = None
    priority_tags: list[str] | None = None
    tag_dropout: float | None = None
    tag_count_range: list[int] | None = None
    resolution: int | None = None
    resolution_type: Literal["area", "pixel"] | None = None
    max_aspect_ratio: float | None = None
    buckets: list[list[int]] | None = None
    center_crop: bool | None = None
    alpha_background: str | None = None
    min_image_size: int | None = None
    max_upscale: float | None = None
    num_frames: int | None = None
    frame_stride: int | None = None

    def __post_init__(self) -> None:
        self.check_source()
        if self.repeats < 1:
            raise ConfigError(f"repeats: {self.repeats} must be at least 1")
        if not self.loss_weight >= 0 or self.loss_weight == float("inf"):
            raise ConfigError(f"loss_weight: {self.loss_weight} must be 0 or more")
        if self.generate is not None and self.generate.count and self.role != "prior":
            raise ConfigError("generate: class images are drawn for a dataset of role prior")
        if self.target != "noise" and self.role != "prior":
            raise ConfigError(f"target: {self.target} is for a dataset of role prior")

    def overrides(self) -> dict[str, object]:
        """The data-section fields this dataset sets for itself."""
        own = {"name", "image_dir", "caption_dir", "mask_dir", "repeats", "role", "loss_weight"}
        own.update(("target", "control_dir", *SOURCE_FIELDS))
        out: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in dataclass_fields(self)
            if f.name not in own | {"generate"} and getattr(self, f.name) is not None
        }
        if self.mask_dir is not None:
            out["mask_dir"] = self.mask_dir
        return out


@dataclass
class ValidationPrompt:
    prompt: str = ""
    """The prompt."""
    negative_prompt: str | None = None
    """Its negative prompt; empty takes `validation_negative_prompt`."""
    guidance_scale: float | None = None
    """Its guidance scale; empty takes `validation_guidance_scale`, else the family's default."""
    num_inference_steps: int | None = None
    """Its sampler steps; empty takes `validation_num_inference_steps`."""
    seed: int | None = None
    """One image with this seed; empty draws one per `validation_seeds`."""
    width: int | None = None
    """Image width in pixels; empty takes `validation_resolution`."""
    height: int | None = None
    """Image height in pixels; empty takes `validation_resolution`."""
    scheduler: str | None = None
    """The sampler to draw with, built from the base model's own scheduler config: `euler`,
    `euler_a`, `heun`, `dpm++_2m`, `dpm++_2m_karras`, `ddim`, `pndm`, `unipc`, `ddpm` (SD 1.5,
    SDXL) or `flow_euler`, `flow_heun` (not Flux), `flow_unipc`, `flow_dpm++_2m` (SD3, Flux,
    Wan); empty (or `default`) keeps the base model's scheduler. The sidecar names it as
    `sampler` beside the scheduler config used."""

    control: list[str] = field(default_factory=list, metadata=PATH)
    """Edit models: the control (reference) image(s) the prompt edits, one per reference."""

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ConfigError("prompt: a validation prompt entry needs a non-empty prompt")
        if self.num_inference_steps is not None and self.num_inference_steps < 1:
            raise ConfigError(f"num_inference_steps: {self.num_inference_steps} must be 1 or more")
        for key in ("width", "height"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{key}: {value} must be a positive number of pixels")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ConfigError(f"guidance_scale: {self.guidance_scale} must be 0 or more")


@dataclass
class DataConfig(RemoteFields):
    data_backend: Literal["local"] = "local"
    """`local`; where images live is each dataset's own (a folder or URL, `hf_dataset`, `shards`)."""
    image_dir: str = field(default="", metadata=PATH)
    """Folder (or fsspec URL, `s3://bucket/prefix`) of training images; subfolders are read too."""
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
    cache_format: Literal["auto", "files", "shards"] = "auto"
    """How cache entries are stored: a safetensors file per entry (`files`), or shards of 500 with
    an index per folder (`shards`: about N/500 files for N images, checked against checksums once
    per run, a damaged one rebuilt); `auto`: shards from 2,000 images on (files below, or where a
    files cache exists). The two hold the same tensors: a run trains alike on either."""
    cache_compression: Literal["none", "zlib"] = "none"
    """`shards`: zlib-compress each entry (`zlib`), lossless: smaller (30% on the cache
    benchmark's entries), slower to write, and slower to read than uncompressed shards."""
    latent_sampling: Literal["mean", "sample"] = "mean"
    """What the cache keeps of the VAE's posterior: its `mean`, or one `sample` per image
    (seeded by `seed` and the image, as kohya and diffusers' caching scripts draw). A single cached
    sample is one fixed jitter, not fresh noise per epoch, so the mean stays the default."""
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
    frame_sampling: Literal["head", "uniform", "chunk", "slide"] = "head"
    """How training windows of `num_frames` are taken from a clip: one window (`head`, placed
    by `frame_start`), `frame_windows` windows spread evenly (`uniform`), back-to-back windows
    (`chunk`), or windows every `window_stride` frames (`slide`)."""
    frame_windows: int = 1
    """`uniform`: windows per clip; `chunk` / `slide`: the most windows per clip (0: all)."""
    window_stride: int = 0
    """`slide`: frames between the starts of consecutive windows; 0 takes the window's span."""
    condition_frame: int | None = None
    """Image-to-video: the frame conditioning each window (empty: 0; TI2V-5B: none, text-to-video)."""
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
    """Augmented versions of each caption, drawn once from the seed and cached; each step draws
    one per sample. A fixed pool for the whole run (live text too): with 1, every sample trains
    on one augmented caption throughout, so raise it for augmentation that varies."""
    buckets: list[list[int]] = field(default_factory=list)
    """Explicit `[[width, height], ...]` buckets (multiples of the bucket step); empty generates
    them from `resolution`, `resolution_type` and `max_aspect_ratio`."""
    max_upscale: float = 2.0
    """Largest factor an image may be enlarged to cover its bucket; smaller images are dropped."""
    random_flip: bool = False
    """Mirror images horizontally, each epoch a seeded coin per image (both orientations are
    cached; SDXL's crop conditioning is mirrored with them)."""
    masked_loss: bool = False
    """Weight the loss by a mask: white trains, black is ignored. The mask is the image's alpha
    channel, or a same-stem image in `mask_dir`; it is cropped, flipped and resized with the
    image to the latent grid."""
    mask_dir: str = field(default="", metadata=PATH)
    """Folder of same-stem mask images (greyscale; white = learn) for `masked_loss`; empty
    takes each image's alpha channel."""
    control_dir: list[str] = field(default_factory=list, metadata=PATH)
    """Edit models (flux_kontext): folder of control images, or a list (one per reference),
    each paired with the target image of the same relative path and stem in `image_dir`."""
    datasets: list[DatasetConfig] = field(default_factory=list)
    """Several image folders in one run, each with its own `repeats`, `role`, `loss_weight`
    and, where they differ, caption settings and resolution (see `DatasetConfig`); empty
    trains on `image_dir` alone. With datasets, `image_dir` and `caption_dir` stay empty."""
    small_bucket_policy: Literal["keep", "drop", "repeat", "merge"] = "keep"
    """A bucket with fewer images than one effective batch (batch × accumulation × processes):
    `keep` it, its images in a short batch (as kohya's trainer does), `repeat` its images to fill
    one (oversampling that aspect ratio), `merge` them into the nearest bucket with enough, or
    `drop`."""

    def __post_init__(self) -> None:
        self.check_remote()
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
        if self.datasets and (self.image_dir or self.caption_dir or self.control_dir):
            raise ConfigError(
                "datasets: with a list of datasets, image_dir, caption_dir and control_dir go in "
                f"each entry (image_dir is {self.image_dir!r})"
            )
        if self.frame_windows < 0 or self.window_stride < 0:
            raise ConfigError("frame_windows and window_stride must be 0 or more")
        if self.frame_sampling == "uniform" and self.frame_windows == 0:
            raise ConfigError(
                "frame_windows: 0 means every window for chunk and slide; frame_sampling uniform "
                "spreads a number of windows over each clip, so give it 1 or more"
            )


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
    """Train the text encoder(s) too: `full` trains the first one whole; `lora` and `dora` put
    an adapter on the encoders named by `text_encoders`."""
    text_encoders: list[int] = field(default_factory=list)
    """`lora` / `dora` with `train_text_encoder`: which text encoders get an adapter (0-based,
    in the family's order, e.g. `[0, 1]` for SDXL's two CLIPs); empty takes every encoder the
    family's clients load a LoRA for."""
    text_encoder_target_modules: list[str] = field(default_factory=list)
    """Text-encoder modules to adapt; empty takes the attention projections
    (`q_proj`, `k_proj`, `v_proj`, `out_proj`), as diffusers' DreamBooth LoRA script does."""
    text_encoder_lr: float | None = None
    """Learning rate of the text-encoder adapters; empty takes `learning_rate`. Text encoders
    usually want a lower one (e.g. half)."""
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
        if self.text_encoder_lr is not None and not 0 < self.text_encoder_lr < float("inf"):
            raise ConfigError(f"text_encoder_lr: {self.text_encoder_lr} must be positive")
        if any(i < 0 for i in self.text_encoders):
            raise ConfigError(f"text_encoders: {self.text_encoders} must be encoder indices ≥ 0")


@dataclass
class ObjectiveConfig:
    loss_type: Literal["mse", "huber", "smooth_l1"] = "mse"
    """The per-element loss: `mse`, or the robust `huber` / `smooth_l1` (less pull from outliers,
    e.g. noisy or mislabelled images), with `huber_c`."""
    huber_c: float = 0.1
    """The Huber / smooth-L1 threshold: errors below it count quadratically, above it linearly."""
    min_timestep: int = 0
    """The smallest training timestep drawn, of 0…1000 (flow-matching families: σ·1000)."""
    max_timestep: int = 1000
    """The largest training timestep drawn (exclusive), of 0…1000 (flow-matching: σ·1000)."""
    timestep_sampling: Literal["auto", "uniform", "logit_normal", "mode"] = "auto"
    """How flow-matching families (sd3, flux, wan) draw σ; `auto` is `logit_normal`, or `uniform`
    when `loss_weighting` is set (as diffusers pairs them); refused on DDPM families."""
    logit_mean: float = 0.0
    """Mean of the logit-normal σ distribution."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal σ distribution."""
    mode_scale: float = 1.29
    """Scale of `mode` σ sampling (SD3 paper)."""
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Per-sample loss weight for flow matching; `none` lets the σ sampling do the weighting.
    A weighting already favours the middle σ: with `logit_normal` too it weights them twice."""
    flow_shift: float = 0.0
    """σ shift for flow matching (>1 favours noisy steps); 0 takes the family's rule."""
    train_guidance_scale: float | None = None
    """Guidance value given to guidance-distilled models (Flux dev's guidance embedding) in
    training; empty takes the family's default (Flux: 3.5, as diffusers' and kohya's trainers)."""
    min_snr_gamma: float = 0.0
    """Min-SNR-γ loss weighting of DDPM (epsilon / v) families, 5 is usual; 0 turns it off."""
    noise_offset: float = 0.0
    """DDPM families' offset noise (0.05–0.1 helps very dark or bright images); 0 turns it off."""
    caption_dropout: float = 0.0
    """Share of samples trained on the empty caption's embedding (helps guidance); 0 turns it off."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the trained weights with this decay (e.g. 0.999);
    the decay ramps up as (1 + n) / (10 + n) over the first updates n, as in diffusers."""
    ema_on_cpu: bool = False
    """Hold the EMA copy in CPU memory instead of on the GPU."""
    preservation: PreservationConfig | None = None
    """Keep the base model's output on class-word or empty prompts (`PreservationConfig`)."""
    slider: SliderConfig | None = None
    """Train the adapter as a slider from a prompt pair (`SliderConfig`), not from the images."""

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
        if not 0 <= self.min_timestep < 1000:
            raise ConfigError(f"min_timestep: {self.min_timestep} must be in 0…999")
        if not self.min_timestep < self.max_timestep <= 1000:
            raise ConfigError(
                f"max_timestep: {self.max_timestep} must be above min_timestep "
                f"({self.min_timestep}) and at most 1000 (it is exclusive)"
            )
        if not self.huber_c > 0:
            raise ConfigError(f"huber_c: {self.huber_c} must be positive")


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
    """Optimizer steps of linear warm-up (with `optimizer: schedulefree`, its own warm-up)."""
    lr_num_cycles: int = 1
    """Hard restarts of `cosine_with_restarts`."""
    lr_power: float = 1.0
    """Power of the `polynomial` decay."""
    lr_step_rules: str = ""
    """`piecewise_constant` rules, e.g. `1:10,0.1:20,0.01` (multiplier:until step, …, last)."""
    optimizer: Literal[
        "adamw", "adamw8bit", "adafactor", "prodigy", "lion", "came", "schedulefree"
    ] = "adamw"
    """AdamW; AdamW 8-bit (bitsandbytes, CUDA); Adafactor; Prodigy; Lion (a learning rate 3-10x
    below AdamW's); CAME; schedule-free AdamW (constant `lr_scheduler`; images, EMA and checkpoints
    take its averaged weights). The last four: pip install -e ".[optimizers]" (docs/guides/training.md)."""
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
    compile: bool = False
    """Compile the denoiser with `torch.compile`: faster steps after a warm-up of a minute or
    more (reported in the log); each new bucket shape compiles once more. Needs a C++ compiler
    on the CPU and triton on a CUDA GPU; refused with `blocks_to_swap` and under DeepSpeed."""
    cpu_threads: int = 0
    """Threads of torch's CPU operators; 0: the CPUs this process may use (its affinity and its
    container's quota) less those other jobs keep busy when the run starts. A resume keeps the
    count its checkpoint was saved with; `OMP_NUM_THREADS` also sets it."""
    blocks_to_swap: int = 0
    """Keep this many of the denoiser's transformer blocks in CPU memory and bring each to the
    GPU only for its forward and backward (Flux, SD3, Wan): less VRAM, slower steps."""
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
    report_to: Literal["tensorboard", "wandb", "none"] = "tensorboard"
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
        if self.cpu_threads < 0:
            raise ConfigError(f"cpu_threads: {self.cpu_threads} must be 0 (auto) or positive")
        if not self.learning_rate > 0 or self.learning_rate == float("inf"):
            raise ConfigError(f"learning_rate: {self.learning_rate} must be positive")
        if self.mixed_precision == "fp32":
            self.mixed_precision = "no"
        if self.optimizer == "schedulefree" and not self.lr_scheduler.startswith("constant"):
            raise ConfigError(
                f"lr_scheduler: {self.lr_scheduler} with optimizer schedulefree, which averages "
                "its weights in place of a schedule: use constant (it warms up lr_warmup_steps)"
            )
        at_least(self, 0, "checkpointing_steps", "checkpoints_total_limit", "stable_loss_steps")
        at_least(self, 0, "lr_warmup_steps", "blocks_to_swap")
        at_least(self, 1, "logging_steps")
        if not self.output_dir.strip():
            raise ConfigError(
                "output_dir: empty; set it to a folder of its own for the run (e.g. runs/my-lora)"
            )


@dataclass
class ValidationConfig:
    validation_steps: int = 0
    """Sample the validation prompts every this many steps (0: only at the end)."""
    validation_prompt: list[str] = field(default_factory=list)
    """Prompts to sample (a string or a list); empty uses a few training captions."""
    validation_prompts: list[ValidationPrompt] = field(default_factory=list)
    """Prompts with settings of their own (`[{"prompt": ..., "negative_prompt": ...,
    "guidance_scale": ..., "num_inference_steps": ..., "seed": ..., "width": ..., "height": ...,
    "scheduler": ...}]`), drawn after the `validation_prompt` ones."""
    validation_negative_prompt: str = ""
    """Negative prompt for every validation image."""
    validation_seeds: list[int] = field(default_factory=lambda: [0, 1])
    """One image per seed and prompt; the grid has a column per seed."""
    validation_num_inference_steps: int = 0
    """Sampler steps per validation image; 0 takes the family's default (25; fewer for a
    step-distilled base, as its pipeline draws)."""
    validation_guidance_scale: float | None = None
    """Classifier-free guidance scale (Flux dev: its distilled guidance); empty takes the family's
    default, what its diffusers pipeline draws with: sd15 7.5, sdxl 5, sd3 7, wan 5, flux 3.5.
    The value used is written into each image's sidecar."""
    validation_resolution: int = 0
    """Side of the square validation images; 0 uses `resolution`."""
    validation_image_dir: str = field(default="", metadata=PATH)
    """Held-out images with captions (same layout as `image_dir`); their loss is logged with the
    stable loss."""

    def __post_init__(self) -> None:
        # 0 means the end only, `resolution`, and the family's steps.
        at_least(
            self, 0, "validation_steps", "validation_resolution", "validation_num_inference_steps"
        )


_HEX = re.compile(r"#[0-9a-fA-F]{6}")


def parse_color(value: str) -> tuple[int, int, int]:
    """An (r, g, b) colour from a colour name (`white`) or `#rrggbb`, or a ValueError."""
    text = value.strip().lower()
    if not (_HEX.fullmatch(text) or text in ImageColor.colormap):
        raise ValueError(f"{value!r} is not a colour name or #rrggbb")
    return ImageColor.getrgb(text)[:3]
