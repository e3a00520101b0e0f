"""FLUX.3 klein (base, and step-distilled): a flow-matching DiT with per-mode blocks (image,
reference image, text) before joint single blocks, on 2×2 patches of the FLUX.2 VAE's latents,
conditioned on eight stacked hidden states of Qwen3-VL-4B.

diffusers samples it with modular pipelines (`Flux3AutoBlocks`, `Flux3DistilledAutoBlocks`): the
kit builds their blocks without the prompt upsampler (captions are encoded as written), takes
their components from the loaded parts, and calls the blocks' own functions to build what
training feeds the transformer. The cache holds the VAE latents normalised as the pipeline
normalises them (patchified, the VAE's batch-norm mean and std), unpatchified back to
(B, C, H/8, W/8), and each caption's embeddings as the text step builds them (one caption per
call, right-padded to a multiple of 80 tokens), zero-padded to the configured length with a mask
that marks the pipeline's own length. Which model a base is, is read from its transformer's
config: `flow_map` marks the step-distilled klein.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kit.families import register
from kit.families.exports import FamilyExports
from kit.families.flow import FlowFamily
from kit.families.flux2.family import (
    check_reference_counts,
    encode_normalised,
    patchify,
    processor_chat_template,
    unpatchify,
)
from kit.families.flux3 import layout as flux3_layout
from kit.families.flux3 import tiny as flux3_tiny
from kit.families.identity import part_config
from kit.families.parts import denoiser, scheduler, text, vae
from kit.families.samplers import DEFAULT
from kit.families.shipped import config_source

BASE, DISTILLED = "klein base", "klein"
PAD_MULTIPLE = 80
"""`Flux3TextEncoderStep`'s padding: each caption right-padded to a multiple of 80 tokens."""
ROPE_SCALE = 0.5
"""The image position ids' scale (`Flux3PrepareLatentsStep`'s `image_rope_scale`)."""
FILL_AREA, CROP_AREA = 4 * 1024 * 1024, 1024 * 1024


class TextProcessor:
    """The text half of the release's `tokenizer` (a Qwen3-VL processor), which is all the text
    step reads of it: the chat template and the tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """The tokenizer's chat template, as the processor renders a text-only turn."""
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def image_ids(height: int, width: int, reference: int = -1) -> torch.Tensor:
    """Position ids of an image's token grid: the target's (`reference` −1) or the `reference`-th
    reference's (its `l` coordinate −1, −2, ...), as the pipeline's steps build them."""
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    return _prepare_image_ids(height, width, ROPE_SCALE, l_coord=-(1 + reference))


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """Unpatchified (B, C, h, w) latents as the pipeline's (B, h/2 · w/2, 4C) tokens."""
    return patchify(latents).flatten(2).transpose(1, 2)


def untokens(out: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`tokens`' inverse: tokens back to (B, C, height, width) latents (latent pixels)."""
    b, _, channels = out.shape
    grid = out.transpose(1, 2).reshape(b, channels, height // 2, width // 2)
    return unpatchify(grid)


def transformer_inputs(
    config: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    references: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Flux3Transformer2DModel's arguments for unpatchified latents at `timesteps` (σ · 1000),
    as the pipeline's steps build them for one denoising step: tokens of 2×2 patches, σ in the
    latents' dtype, text ids along the `l` axis, each reference's tokens and ids after the last.
    A flow map (the distilled klein) is asked for the velocity at σ itself: its target time
    equals its time, so the jump it predicts is the flow-matching target's."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

    device, dtype = latents.device, latents.dtype
    timestep = (timesteps.to(device) / 1000).to(dtype)
    kwargs: dict[str, Any] = {
        "hidden_states": tokens(latents),
        "encoder_hidden_states": prompt_embeds.to(device, dtype),
        "timestep": timestep,
        "img_ids": image_ids(latents.shape[-2] // 2, latents.shape[-1] // 2).to(device),
        "txt_ids": Flux3TextRoPEInputsStep._prepare_text_ids(prompt_embeds).to(device),
    }
    if references:
        grids = [patchify(r.to(device, dtype)) for r in references]
        kwargs["image_cond_hidden_states"] = torch.cat(
            [g.flatten(2).transpose(1, 2) for g in grids], 1
        )
        ids = [image_ids(*g.shape[-2:], reference=i) for i, g in enumerate(grids)]
        kwargs["image_cond_ids"] = torch.cat(ids, dim=0).to(device)
    if config.flow_map:
        kwargs["target_timestep"] = timestep
    return kwargs


def references_of(cond: dict[str, Any]) -> list[torch.Tensor]:
    """A batch's reference latents in order (the cache's `control_latents_0`, `_1`, ...)."""
    out = []
    while f"control_latents_{len(out)}" in cond:
        out.append(cond[f"control_latents_{len(out)}"])
    return out


@register
class Flux3(FlowFamily):
    """FLUX.3 klein base or step-distilled klein, read from the transformer's config."""

    name = "flux3"
    scale_kwarg = "attention_kwargs"
    bucket_multiple = 16  # packing needs an even latent side: 2 × the VAE's 8x
    # The blocks set the scheduler's sigmas themselves and step it as given.
    samplers = (DEFAULT, "flow_euler")
    size_multiple = 16
    native_resolution = 1024  # Flux3PrepareLatentsStep's default size
    # diffusers' single-file default repository for FLUX.3 (`flux-3-image`): the base model.
    hub_id = "black-forest-labs/flux-3-image-klein-base"
    bucket_step = 64
    variants = (BASE, DISTILLED)
    variant_steps = {BASE: 50, DISTILLED: 16}
    """The blocks' default steps: `Flux3SetTimestepsStep`'s 50, the distilled blocks' 16."""
    variant_guidance = {BASE: 3.5, DISTILLED: 1.0}
    """`Flux3LoopDenoiser`'s CFG scale; the distilled blocks have no guider (1.0: none)."""
    distilled_variants = {
        DISTILLED: "FLUX.3 klein is step-distilled (its transformer config says flow_map: it "
        "samples in 16 steps without CFG); FLUX.3 klein base is not"
    }
    # Attention's q, k, v and output, and the SwiGLU's two linears, in every per-mode and joint
    # block (the per-mode blocks hold separate q, k, v; the joint ones too).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")
    pipeline_class = "Flux3ModularPipeline"
    kohya_text_prefixes = ()  # Flux3LoraLoaderMixin loads LoRA into the transformer only
    base_model_version = "flux3"
    modelspec_architecture = "flux-3-klein-base"
    modelspec_implementation = "https://github.com/black-forest-labs/flux-3-image-klein"
    # No client but diffusers reads FLUX.3 adapters yet (layout.py names the ComfyUI checked).
    export_formats = flux3_layout.CLIENTS
    full_refusal = (
        "its export is a whole pipeline folder, which diffusers' modular FLUX.3 pipeline saves "
        "without its tokenizer (a Qwen3-VL processor) and loads without its parts"
    )
    control_images = 10  # the prompt upsampler's "at most 10" references of an edit
    needs_control = False

    parts = (
        denoiser("Flux3Transformer2DModel"),
        vae("AutoencoderKLFlux2"),
        *text("Qwen3VLForConditionalGeneration", "AutoTokenizer"),
        scheduler(),
    )
    quantized_text_encoders = ("text_encoder",)  # Qwen3-VL-4B, only ever read frozen
    # BFL's transformer file: the key diffusers' single-file loader tells FLUX.3 by.
    single_file_markers = ("early_stream_modulations.image.lin.weight",)

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        check_reference_counts(self.name, self.cfg)

    # ------------------------------------------------------------ variants

    def variant_of(self, pretrained: str) -> str:
        source = config_source(self.model_source(pretrained))
        try:
            return DISTILLED if part_config(source, "transformer").get("flow_map") else BASE
        except Exception:  # noqa: BLE001 - no transformer config to read here: its name
            name = str(pretrained).lower()
            return DISTILLED if "klein" in name and "base" not in name else BASE

    def version_metadata(self) -> dict[str, str]:
        variant = self.configured_variant().replace(" ", "-")
        return {**super().version_metadata(), "modelspec.architecture": f"flux-3-{variant}"}

    # ------------------------------------------------------------ encoding

    def identity_extras(self, pretrained, revision):
        return [self.max_sequence_length(), PAD_MULTIPLE]

    def read_tokenizer(self, part, source, revision):
        # The release's `tokenizer` folder is a Qwen3-VL processor: its chat template may sit in
        # the processor's own file, which a tokenizer loaded from the folder does not read.
        tokenizer = super().read_tokenizer(part, source, revision)
        if tokenizer.chat_template is None:
            tokenizer.chat_template = processor_chat_template(source, revision)
        return tokenizer

    def token_limit(self, encoder, tokenizer):
        # The chat template's tokens come out of the same length.
        turn = [{"role": "user", "content": ""}]
        template = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        return self.max_sequence_length() - len(tokenizer(template).input_ids)

    def encode_text(self, comps, captions):
        # The text step's own function, one caption per call as the step takes them; each is
        # zero-padded to the configured length and its mask marks the pipeline's length.
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        encoder, length = comps.text_encoders[0], self.max_sequence_length()
        embeds, masks = [], []
        for caption in captions:
            one = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
                encoder,
                TextProcessor(comps.tokenizers[0]),
                caption,
                device=encoder.device,
                max_sequence_length=length,
                pad_multiple=PAD_MULTIPLE,
            )
            n = one.shape[1]
            embeds.append(torch.nn.functional.pad(one, (0, 0, 0, length - n)))
            masks.append(torch.arange(length, device=one.device)[None] < n)
        return {"prompt_embeds": torch.cat(embeds), "prompt_embeds_mask": torch.cat(masks).long()}

    def prompt_kwargs(self, text):
        # The blocks take the embeddings at the pipeline's own length.
        n = int(text["prompt_embeds_mask"].sum(1).max())
        return {"prompt_embeds": text["prompt_embeds"][:, :n]}

    def encode_images(self, comps, pixels, generator=None):
        # Normalised per 2×2 patch (the VAE's batch norm), as the pipeline's VAE step does.
        return encode_normalised(comps.vae, pixels, generator)

    # ------------------------------------------------------------ training

    def predict(self, comps, noisy, timesteps, cond):
        transformer = comps.denoiser
        config = getattr(transformer, "module", transformer).config  # unwrapped under DDP
        # A batch's captions cut back to its longest pipeline length (a batch of one: exactly
        # the pipeline's; a shorter caption beside a longer one keeps zeros past its own).
        n = int(cond["prompt_embeds_mask"].sum(1).max())
        kwargs = transformer_inputs(
            config, noisy, timesteps, cond["prompt_embeds"][:, :n], references_of(cond)
        )
        out = transformer(**kwargs, return_dict=False)[0]
        return untokens(out, noisy.shape[-2], noisy.shape[-1])

    def _references_configured(self) -> int:
        """The most reference folders (or columns) a dataset of the config gives each target."""
        data = self.cfg.data
        given = (len(d.control_dir) + len(d.control_column) for d in data.datasets)
        return max([len(data.control_dir), *given])

    def _reference_mode(self) -> str:
        # One reference is kept whole (reflect-padded); several are cropped (the VAE step's).
        return "fill" if self._references_configured() <= 1 else "crop"

    def control_pixels(self, image):
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

        return Flux3ImageProcessor().preprocess(image, resize_mode=self._reference_mode())[0][0]

    def control_size(self, width, height):
        from PIL import Image

        pixels = self.control_pixels(Image.new("RGB", (width, height)))
        return pixels.shape[-1], pixels.shape[-2]

    def swap_blocks(self, denoiser):
        # The per-mode blocks run first (text, image, references), then the joint ones.
        modes = denoiser.mode_blocks
        return [
            *denoiser.txt_mode_blocks,
            *modes["image"],
            *modes["image_cond"],
            *denoiser.single_transformer_blocks,
        ]

    # ------------------------------------------------------------ sampling

    def base_pipeline(self, dtype=torch.float32):
        # The blocks over the base's parts, each read by its own class's `from_pretrained`: a
        # modular pipeline's `from_pretrained` leaves its components to `load_components`,
        # whose `tokenizer` spec (a Qwen3-VL processor) needs torchvision for its video half.
        m = self.cfg.model
        comps = self.load(m.pretrained_model, revision=m.revision, variant=m.variant, dtype=dtype)
        return self.build_pipeline(comps)

    def build_pipeline(self, comps, cls=None, text_only=False, **extra):
        # The blocks of this model (base or distilled) over the loaded parts, without the
        # prompt upsampler (prompts are encoded as written); without a text encoder (drawing
        # from cached embeddings), without the text step too: the blocks take the embeddings.
        import diffusers

        distilled = bool(comps.denoiser is not None and comps.denoiser.config.flow_map)
        blocks = (diffusers.Flux3DistilledAutoBlocks if distilled else diffusers.Flux3AutoBlocks)()
        blocks.sub_blocks.pop("prompt_upsampler")
        encoder = comps.text_encoders[0] if comps.text_encoders else None
        if encoder is None:
            blocks.sub_blocks.pop("text_encoder")
        pipe = blocks.init_pipeline()
        parts = {
            "transformer": comps.denoiser,
            "vae": comps.vae,
            "text_encoder": encoder,
            "tokenizer": TextProcessor(comps.tokenizers[0]) if comps.tokenizers else None,
            "scheduler": type(comps.noise_scheduler).from_config(comps.noise_scheduler.config),
        }
        pipe.update_components(**{k: v for k, v in parts.items() if v is not None}, **extra)
        return pipe

    def call_kwargs(self, spec):
        kwargs = {**super().call_kwargs(spec), "output": "images"}  # the blocks' images alone
        if spec.control:
            kwargs["image"] = list(spec.control)
        if self.configured_variant() == BASE:  # the base's CFG draws against the negative prompt
            kwargs["negative_prompt"] = spec.negative_prompt
        return kwargs

    def sample(self, pipe, spec):
        # The blocks take their CFG scale as the guider's setting and return the images. They
        # warn of the inputs no block reads (the scale; the text settings where embeddings are
        # given): those are recorded with the call, and ignored as they should be.
        from diffusers import ClassifierFreeGuidance

        kwargs = self.pipeline_call(spec)
        if "guider" in pipe.components:
            guider = ClassifierFreeGuidance(guidance_scale=kwargs["guidance_scale"])
            pipe.update_components(guider=guider)
        generator = torch.Generator(spec.generator_device).manual_seed(spec.seed)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Unexpected input", UserWarning)
            images = pipe(**kwargs, generator=generator)
        return [images[0]]

    # ------------------------------------------------------------ single file

    def single_file_state_dict(self, comps):
        # diffusers converts BFL's FLUX.3 file to its names, not back: refused, not mislabelled.
        return FamilyExports.single_file_state_dict(self, comps)

    # ------------------------------------------------------------ memory estimate

    def denoiser_inputs(self, parts, batch, height, width):
        config = parts["denoiser"].config
        latents = self.packed_meta_latents(parts, batch, height, width)
        embeds = torch.zeros(
            batch, self.max_sequence_length(), config.joint_attention_dim, device="meta"
        )
        n = self._references_configured()
        references = [self.packed_meta_latents(parts, batch, height, width) for _ in range(n)]
        kwargs = transformer_inputs(
            config, latents, torch.zeros(batch, device="meta"), embeds, references
        )
        return (kwargs.pop("hidden_states"),), kwargs

    # ------------------------------------------------------------ tiny copy

    def make_tiny(self, out_dir, seed=0, distilled: bool = False):
        """A tiny random-init FLUX.3 klein base (or, `distilled`, the step-distilled klein)."""
        return flux3_tiny.make(out_dir, seed, distilled)
