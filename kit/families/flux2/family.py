"""FLUX.2 (dev; klein 4B / 9B and their base models): a flow-matching MMDiT on 2×2 patches of a
32-channel VAE's latents, conditioned on hidden states of an LLM (Mistral Small 3.1 for dev,
Qwen3 for klein).

The cache holds the VAE latents normalised as the pipelines normalise them (patchified, then
the VAE's batch-norm mean and std), unpatchified back to (B, C, H/8, W/8); patchifying,
packing and the 4-axis position ids are built per step exactly as `Flux2Pipeline` builds them.
Which model a base is (dev, klein, base or step-distilled) is read from its `model_index.json`
(the pipeline class and klein's `is_distilled`) and its transformer's config.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kit.errors import ConfigError, DataError
from kit.families import adapter_keys, register
from kit.families.base import posterior_latent
from kit.families.flow import JOINT_ATTENTION, FlowFamily
from kit.families.flux2 import layout as flux2_layout
from kit.families.flux2 import tiny as flux2_tiny
from kit.families.identity import part_config
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import CUSTOM_SIGMA_SAMPLERS
from kit.families.shipped import config_source

if TYPE_CHECKING:
    from kit.config import Config

DEV, KLEIN = "Flux2Pipeline", "Flux2KleinPipeline"
# klein's size by its text width (3 stacked hidden states of Qwen3 4B / 8B).
KLEIN_SIZES = {7680: "4B", 12288: "9B"}
# Reference images: the pipelines take a list of any length; BFL publishes up to 10 for dev
# (klein's guide says 4). Each is shrunk to about a megapixel when larger, then cropped to
# multiples of 16 (the VAE's 8 × the 2×2 patches), as the pipelines' step 4 does.
MAX_REFERENCES = 10
REFERENCE_AREA = 1024 * 1024
REFERENCE_MULTIPLE = 16


@functools.lru_cache(maxsize=32)
def model_index(source: str, revision: str | None = None) -> dict[str, Any]:
    """A base's `model_index.json` (a folder's, the shipped copy's, or downloaded alone);
    empty when it cannot be read (a single file's `model_config`, or no network)."""
    path = Path(config_source(source)) / "model_index.json"
    try:
        if not path.parent.is_dir():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(source, "model_index.json", revision=revision))
        return json.loads(path.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - any failure means: not known here
        return {}


def processor_chat_template(source: str, revision: str | None = None) -> str | None:
    """The chat template a processor folder (`tokenizer/`) keeps in its own file
    (`chat_template.json`, or `.jinja`), which a tokenizer loaded from it does not read."""
    for name in ("chat_template.jinja", "chat_template.json"):
        path = Path(source) / "tokenizer" / name
        try:
            if not Path(source).is_dir():
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(source, name, subfolder="tokenizer", revision=revision))
            text = path.read_text(encoding="utf-8")
        except Exception:  # noqa: BLE001 - absent here: try the other name
            continue
        return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def chat_prompt(tokenizer: Any, caption: str) -> str:
    """A caption as the pipelines wrap it: Qwen3's user turn without thinking (klein), or dev's
    system message and user turn (`format_input`)."""
    if type(tokenizer).__name__.startswith("Qwen2"):
        turn = [{"role": "user", "content": caption}]
        return tokenizer.apply_chat_template(
            turn, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    return tokenizer.apply_chat_template(format_input([caption])[0], tokenize=False)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → (B, 4C, h/2, w/2), each 2×2 patch's values as channels (the pipeline's)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._patchify_latents(latents)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._unpatchify_latents(latents)


def bn_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std over patchified channels, as the pipelines read them."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)


@torch.no_grad()
def encode_normalised(vae: Any, pixels: torch.Tensor, generator=None) -> torch.Tensor:
    """Latents of `pixels` normalised per 2×2 patch by the VAE's batch norm, as the FLUX.2 and
    FLUX.3 pipelines make them. The pixels are laid out channels last, as the pipelines' image
    processor hands a reference to the VAE (its HWC array transposed), so the convolutions
    round as at inference. A copy: a batch of one already counts as channels last, yet its
    batch stride changes the kernel."""
    pixels = pixels.to(vae.device, vae.dtype)
    pixels = torch.empty_like(pixels, memory_format=torch.channels_last).copy_(pixels)
    dist = vae.encode(pixels).latent_dist
    patches = patchify(posterior_latent(dist, generator))
    mean, std = bn_stats(vae, patches)
    return unpatchify((patches - mean) / std)


def check_reference_counts(family: str, cfg: Config) -> None:
    """Refuse datasets with different reference counts in batches of more than one: a batch
    stacks each reference's latents (FLUX.2's and FLUX.3's), so its samples need one count."""
    # A dataset's references: its control folders, or its source's control columns.
    counts = sorted({len(d.control_dir) + len(d.control_column) for d in cfg.data.datasets})
    if len(counts) > 1 and cfg.train.train_batch_size > 1:
        raise ConfigError(
            f"datasets: their control_dir (or control_column) lists give "
            f"{' or '.join(map(str, counts))} reference image(s) per target, but a {family} batch "
            "takes one count: give every dataset as many controls, or set train_batch_size 1"
        )


def transformer_inputs(
    config: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    guidance_scale: float,
) -> dict[str, Any]:
    """Flux2Transformer2DModel's arguments for unpatchified latents, as the pipelines build them."""
    from diffusers import Flux2Pipeline

    patches = patchify(latents)
    device, dtype = latents.device, latents.dtype
    guidance = None
    if config.guidance_embeds:  # dev: the distilled guidance is an input; klein has none
        guidance = torch.full((latents.shape[0],), guidance_scale, device=device).float()
    return {
        "hidden_states": Flux2Pipeline._pack_latents(patches),
        # The pipelines feed σ in [0, 1] (their timesteps / 1000); the model scales it back.
        "timestep": timesteps.to(dtype) / 1000,
        "guidance": guidance,
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        "txt_ids": Flux2Pipeline._prepare_text_ids(prompt_embeds).to(device),
        "img_ids": Flux2Pipeline._prepare_latent_ids(patches).to(device),
    }


def reference_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) the pipelines feed a reference of this size at: above a megapixel
    shrunk to about one (aspect kept, sides truncated), then cut down to multiples of 16."""
    if width * height > REFERENCE_AREA:
        scale = math.sqrt(REFERENCE_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    m = REFERENCE_MULTIPLE
    return width // m * m, height // m * m


def reference_pixels(image: Any) -> torch.Tensor:
    """A reference image (PIL) as the pipelines feed it to the VAE: their size check, their
    LANCZOS shrink above a megapixel, their centre crop to multiples of 16; (3, H, W) in [-1, 1]."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    try:  # under 64 px a side or beyond 8:1 the pipelines refuse the image
        Flux2ImageProcessor.check_image_input(image)
    except ValueError as e:
        raise DataError(f"reference image refused as the FLUX.2 pipelines refuse it: {e}") from None
    if image.width * image.height > REFERENCE_AREA:
        image = Flux2ImageProcessor._resize_to_target_area(image, REFERENCE_AREA)
    width, height = reference_size(image.width, image.height)
    processor = Flux2ImageProcessor(vae_scale_factor=REFERENCE_MULTIPLE)
    return processor.preprocess(image, height=height, width=width, resize_mode="crop")[0]


def with_references(kwargs: dict[str, Any], references: list[torch.Tensor]) -> dict[str, Any]:
    """`transformer_inputs` with reference latents (unpatchified, normalised, one tensor per
    reference) as the pipelines' `prepare_image_latents` adds them: each patchified and packed,
    all after the target's tokens, with ids whose time coordinate is 10, 20, ... per reference
    (`_prepare_image_ids`'s default scale of 10)."""
    from diffusers import Flux2Pipeline

    if not references:
        return kwargs
    target = kwargs["hidden_states"]
    b, device, dtype = target.shape[0], target.device, target.dtype
    patches = [patchify(r.to(device, dtype)) for r in references]
    # The pipelines build one reference's ids and repeat them over the batch.
    ids = Flux2Pipeline._prepare_image_ids([p[:1] for p in patches]).to(device)
    tokens = [Flux2Pipeline._pack_latents(p) for p in patches]
    return {
        **kwargs,
        "hidden_states": torch.cat([target, *tokens], dim=1),
        "img_ids": torch.cat([kwargs["img_ids"], ids.repeat(b, 1, 1)], dim=1),
    }


def references_of(cond: dict[str, Any]) -> list[torch.Tensor]:
    """A batch's reference latents in order (the cache's `control_latents_0`, `_1`, ...)."""
    out = []
    while f"control_latents_{len(out)}" in cond:
        out.append(cond[f"control_latents_{len(out)}"])
    return out


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed patch tokens back to unpatchified (B, C, height, width) latents."""
    b, _, channels = tokens.shape
    return unpatchify(tokens.transpose(1, 2).reshape(b, channels, height // 2, width // 2))


@register
class Flux2(FlowFamily):
    """FLUX.2 dev (guidance embedding, Mistral3) or klein (Qwen3), read from the base's configs."""

    name = "flux2"
    scale_kwarg = "attention_kwargs"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    samplers = CUSTOM_SIGMA_SAMPLERS
    size_multiple = 16
    native_resolution = 1024
    hub_id = "black-forest-labs/FLUX.2-dev"
    bucket_step = 64
    # The double blocks' attention, and the single blocks' fused q, k, v and MLP input (their
    # `attn.to_out` is not named: `to_out` would also match the double blocks' ModuleList).
    default_lora_targets = (*JOINT_ATTENTION, "to_qkv_mlp_proj")
    # Both pipelines sample with 4.0 by default: dev's distilled guidance input, klein base's
    # CFG scale (klein's step-distilled pipeline ignores it).
    # The guidance fed to dev in training: its pipeline's default (diffusers' FLUX.2 LoRA script
    # keeps FLUX.1's 3.5 as its `--guidance_scale` default; `train_guidance_scale` sets either).
    default_train_guidance_scale = 4.0
    # Flux2LoraLoaderMixin loads LoRA into the transformer only.
    kohya_text_prefixes = ()
    diffusers_reads_kohya = True  # `_convert_kohya_flux2_lora_to_diffusers`
    kohya_dora = False  # a fused qkv's DoRA would need the untrained parts' norms
    base_model_version = "flux2"
    modelspec_implementation = "https://github.com/black-forest-labs/flux2"
    export_formats = ("diffusers", "kohya")
    variants = ("dev", "klein 4B", "klein 9B", "klein base 4B", "klein base 9B")
    # Reference images are optional: a dataset with `control_dir` (one folder per reference)
    # trains with them, one without trains text-to-image.
    control_images = MAX_REFERENCES
    needs_control = False

    def __init__(self, cfg: Config | None = None) -> None:
        super().__init__(cfg)
        check_reference_counts(self.name, self.cfg)

    # ------------------------------------------------------------ variants

    def _index(self, pretrained: str) -> dict[str, Any]:
        return model_index(self.model_source(pretrained), self.cfg.model.revision)

    @property
    def pipeline_class(self) -> str:  # type: ignore[override]
        """Flux2Pipeline for dev, Flux2KleinPipeline for klein: the configured base's class."""
        found = self._index(self.cfg.model.pretrained_model).get("_class_name")
        return found if found in (DEV, KLEIN) else DEV

    def variant_of(self, pretrained: str) -> str:
        index = self._index(pretrained)
        if index.get("_class_name") != KLEIN:
            return "dev"
        width = part_config(config_source(self.model_source(pretrained)), "transformer").get(
            "joint_attention_dim"
        )
        size = KLEIN_SIZES.get(width, f"({width}-wide text)")
        return f"klein {size}" if index.get("is_distilled", False) else f"klein base {size}"

    def distillation(self, pretrained: str) -> str:
        # klein's pipeline config says `is_distilled` (Flux2KleinPipeline then skips CFG); dev
        # is guidance-distilled only (it still samples in ~50 steps), the base models not at all.
        variant = self.variant_of(pretrained)
        if variant.startswith("klein") and "base" not in variant:
            return (
                f"FLUX.2 {variant} is step-distilled (its model_index.json says is_distilled: it "
                "samples in about 4 steps without CFG); the klein base models are not"
            )
        return ""

    def _distilled(self) -> bool:
        return bool(self.distillation(self.cfg.model.pretrained_model or self.hub_id))

    @property
    def default_num_inference_steps(self) -> int:  # type: ignore[override]
        """The pipelines' 50 steps; a step-distilled klein draws in 4, as its model card does."""
        return 4 if self._distilled() else 50

    @property
    def default_guidance_scale(self) -> float:  # type: ignore[override]
        """The pipelines' 4.0; a step-distilled klein samples without guidance (1.0)."""
        return 1.0 if self._distilled() else 4.0

    def version_metadata(self) -> dict[str, str]:
        variant = self.variant_of(self.cfg.model.pretrained_model)
        return {
            **super().version_metadata(),
            "modelspec.architecture": "flux-2-" + variant.replace(" ", "-").lower(),
        }

    def client_label(self, client):
        klein = "klein" in self.variant_of(self.cfg.model.pretrained_model)
        since = flux2_layout.COMFYUI_SINCE["klein" if klein else "dev"]
        title = "FLUX.2 klein" if klein else "FLUX.2"
        return f"{client} ≥ {since} ({title})" if client == "ComfyUI" else client

    def train_guidance_scale(self) -> float:
        """The guidance fed to a guidance-embedding model in training: configured, else 4.0."""
        configured = self.cfg.objective.train_guidance_scale
        return self.default_train_guidance_scale if configured is None else float(configured)

    # ------------------------------------------------------------ loading

    # dev's Mistral3 encoder; klein's is a Qwen3, named by its model_index (`part_class`).
    parts = (
        denoiser("Flux2Transformer2DModel"),
        vae("AutoencoderKLFlux2"),
        *text("Mistral3ForConditionalGeneration", "AutoTokenizer"),
        scheduler(),
    )

    quantized_text_encoders = ("text_encoder",)  # a 24B / 4B / 8B LLM, only ever read frozen
    # BFL's transformer file (ComfyUI's diffusion_models): FLUX.2's global modulation.
    single_file_markers = ("single_stream_modulation.lin.weight",)

    def part_class(self, part, pretrained):
        if part.role != "text_encoder":
            return super().part_class(part, pretrained)
        import transformers

        entry = self._index(pretrained).get("text_encoder") or []
        return getattr(transformers, entry[1]) if len(entry) == 2 else part.cls()

    def read_tokenizer(self, part, source, revision):
        # dev's `tokenizer` folder is a Pixtral processor; for text-only prompts the pipeline
        # uses its text tokenizer and chat template alone, which load without torchvision
        # (the processor's own chat-template call adds no special tokens either).
        tokenizer = super().read_tokenizer(part, source, revision)
        if tokenizer.chat_template is None:  # a processor's template, which tokenizers skip
            tokenizer.chat_template = processor_chat_template(source, revision)
        return tokenizer

    def token_limit(self, encoder, tokenizer):
        # The chat template (and dev's system message) take their tokens out of the same
        # length: what is left is the caption's.
        return self.max_sequence_length() - len(tokenizer(chat_prompt(tokenizer, "")).input_ids)

    # ------------------------------------------------------------ encoding

    def encode_text(self, comps, captions):
        # The pipeline's own encode_prompt (chat template, system message for dev, the stacked
        # hidden layers). Every caption is padded to max_sequence_length and the transformer
        # takes no mask (as at sampling), so the embeddings have a fixed shape.
        pipe = self._text_pipeline(comps)
        embeds, _ = pipe.encode_prompt(
            captions,
            device=comps.text_encoders[0].device,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"prompt_embeds": embeds}

    def encode_images(self, comps, pixels, generator=None):
        # Differs from FlowFamily's: channels last, and normalised per 2×2 patch (BatchNorm).
        return encode_normalised(comps.vae, pixels, generator)

    # ------------------------------------------------------------ training

    def dynamic_mu(self, scheduler_config, tokens):
        # The pipelines take mu from BFL's `compute_empirical_mu` for the sequence length and
        # the step count; training uses their default step count (50; above 4300 tokens,
        # about 1.2 MP, mu no longer depends on it).
        from diffusers import Flux2Pipeline
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        steps = inspect.signature(Flux2Pipeline.__call__).parameters["num_inference_steps"]
        return compute_empirical_mu(tokens, steps.default)

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        config = getattr(transformer, "module", transformer).config  # unwrapped under DDP
        kwargs = transformer_inputs(
            config, noisy, timesteps, cond["prompt_embeds"], self.train_guidance_scale()
        )
        tokens = kwargs["hidden_states"].shape[1]
        kwargs = with_references(kwargs, references_of(cond))
        # The pipelines keep the target's tokens of the prediction: the references' follow.
        out = transformer(**kwargs, return_dict=False)[0][:, :tokens]
        return unpack(out, noisy.shape[-2], noisy.shape[-1])

    def control_size(self, width, height):
        return reference_size(width, height)

    def control_pixels(self, image):
        return reference_pixels(image)

    def swap_blocks(self, denoiser):
        # The double-stream blocks run first, then the single-stream ones.
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # ------------------------------------------------------------ sampling

    def build_pipeline(self, comps, cls=None, text_only=False, **extra):
        # The loaded base's own class: klein's (a Qwen3 encoder) with its `is_distilled`.
        import diffusers

        index = model_index(comps.source, self.cfg.model.revision)  # where these parts came from
        klein = type(comps.text_encoders[0]).__name__.startswith("Qwen3")
        if klein:
            extra = {"is_distilled": bool(index.get("is_distilled", False)), **extra}
        cls = cls or getattr(diffusers, KLEIN if klein else DEV)
        return super().build_pipeline(comps, cls, text_only, **extra)

    def call_kwargs(self, spec):
        # Neither pipeline takes a negative prompt (klein base draws its CFG against "").
        kwargs = super().call_kwargs(spec)
        if spec.control:
            # The files, so the sidecar can record them; `sample` opens them for the pipeline.
            kwargs["image"] = list(spec.control)
        return kwargs

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        meta = {"device": "meta"}
        latents = self.packed_meta_latents(parts, batch, height, width)
        embeds = torch.zeros(batch, self.max_sequence_length(), config.joint_attention_dim, **meta)
        kwargs = transformer_inputs(
            config, latents, torch.zeros(batch, **meta), embeds, self.train_guidance_scale()
        )
        # Configured references count as the target's size, resized by the pipelines' rule.
        rw, rh = reference_size(width, height)
        n = self._references_configured()
        references = [self.packed_meta_latents(parts, batch, rh, rw) for _ in range(n)]
        kwargs = with_references(kwargs, references)
        # The packed image tokens go first: the estimator counts positional inputs as block inputs.
        return (kwargs.pop("hidden_states"),), kwargs

    def _references_configured(self) -> int:
        """The most reference folders (or columns) a dataset of the config gives each target."""
        data = self.cfg.data
        given = (len(d.control_dir) + len(d.control_column) for d in data.datasets)
        return max([len(data.control_dir), *given])

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0, kind: str = "dev"):
        """A tiny random-init FLUX.2 `kind`: "dev" (Mistral3, guidance input), "klein" (Qwen3,
        step-distilled) or "klein base"."""
        return flux2_tiny.make(out_dir, seed, kind)

    # ------------------------------------------------------------ export

    def kohya_state_dict(self, state, alpha):
        # One LoRA per fused BFL weight (q, k, v → a double block's qkv).
        return flux2_layout.kohya_lora(state, alpha)

    def lycoris_naming(self):
        return flux2_layout.LYCORIS_PREFIX, flux2_layout.lycoris_module

    def client_models(self, comps):
        # ComfyUI holds FLUX.2 in BFL's layout; its diffusers-name map covers the q, k, v parts.
        state = comps.denoiser.state_dict()
        model = adapter_keys.prefixed("diffusion_model.", flux2_layout.to_original(state))
        return {"ComfyUI": (model, flux2_layout.comfy_aliases(state))}

    def single_file_state_dict(self, comps):
        # The transformer alone, in BFL's layout: ComfyUI's diffusion model file.
        return flux2_layout.to_original(comps.denoiser.state_dict())

    def single_file_pipeline(self, path, config_source):
        import diffusers

        transformer = diffusers.Flux2Transformer2DModel.from_single_file(
            str(path), config=str(config_source), subfolder="transformer", local_files_only=True
        )
        name = model_index(str(config_source)).get("_class_name", DEV)
        cls = getattr(diffusers, name if name in (DEV, KLEIN) else DEV)
        return cls.from_pretrained(str(config_source), transformer=transformer)
