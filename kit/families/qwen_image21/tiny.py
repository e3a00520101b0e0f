"""The tiny random-init Qwen-Image 2.1 the tests load back through `from_pretrained`, and the
image-only Qwen3-VL processor a base made without torchvision keeps.

Every part keeps the release's structure at a few dozen channels: the block-causal transformer
on unpatched 64-channel latents, the RGBA VAE at 16x (four spatial halvings), a two-layer
Qwen3-VL with its vision tower at the release's 16-pixel patches merged 2×2 (so that one vision
slot covers the 2×2 latent tokens of a 32-pixel tile, as the transformer assumes), and the
system prompt of the pipeline's template as one token per word.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from kit.families import tiny
from kit.families.qwen_image.family import tiny_qwen2_tokenizer, tiny_qwen3_vl_config
from kit.families.qwen_image_edit.family import (
    compile_class,
    component_getattr,
    has_torchvision,
    read_vl_processor,
)

SYSTEM_WORDS = ("Comprehend", "analyze", "provided", "prompt")
"""The words of the pipeline's system prompt the tiny tokenizer keeps whole."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)
"""Qwen's chat form for text messages: the pipeline counts the system message's tokens with it."""

IMAGE_ONLY_MODULE = "image_only_qwen3vl_processor"
"""Where a tiny base made without torchvision keeps `IMAGE_ONLY_SOURCE`: its processor folder,
as diffusers loads a custom component (`from_pretrained(..., trust_remote_code=True)`)."""
IMAGE_ONLY_SOURCE = '''"""Qwen3VLProcessor without its video part, written by the kit's tiny Qwen-Image 2.1.

transformers builds Qwen3VLProcessor's video processor only with torchvision installed; the
pipeline calls the processor on text and images alone, which this does exactly as
Qwen3VLProcessor does, on the same image processor and tokenizer.
"""

from transformers import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
'''


@functools.cache
def image_only_processor_class() -> type:
    """`ImageOnlyQwen3VLProcessor` (`IMAGE_ONLY_SOURCE`)."""
    return compile_class(
        IMAGE_ONLY_SOURCE, IMAGE_ONLY_MODULE, __name__, "ImageOnlyQwen3VLProcessor"
    )


__getattr__ = component_getattr(__name__, "ImageOnlyQwen3VLProcessor", image_only_processor_class)


def load_processor(source: str, revision: str | None = None) -> Any:
    """The base's `processor` folder as the pipeline loads it (Qwen3VLProcessor)."""
    return read_vl_processor("Qwen3VLProcessor", image_only_processor_class, source, revision)


def image_processor() -> Any:
    """Qwen3-VL's image settings: 16-pixel patches merged 2×2, mean and std 0.5, pixel bounds
    wide enough that a ~1 MP reference keeps its 32-pixel-multiple size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 32 * 32, "longest_edge": 16777216},
    )


def qwen3_vl(tokenizer: Any) -> Any:
    """A two-layer `Qwen3VLForConditionalGeneration` sized to `tokenizer`, its vision tower at
    the release's 16-pixel patches (it reads the references)."""
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny_qwen3_vl_config(
        tokenizer,
        text={},
        vision={
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
        },
    )
    return Qwen3VLForConditionalGeneration(config)


def vae() -> Any:
    """A tiny `AutoencoderKLQwenImage21`: RGBA in and out, 16x (four halvings), the release's
    64 latent channels and statistics."""
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=4,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
    )


def transformer() -> Any:
    """A two-block `QwenImage21Transformer2DModel` on the 64 latent channels."""
    from diffusers import QwenImage21Transformer2DModel

    model = QwenImage21Transformer2DModel(
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=32,  # the tiny Qwen3-VL's width
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    )
    # Random weights for the zero-initialised norms and tables too, so a wrong layout shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.normal_(0, 0.1)
    return model


def save(pipe: Any, out_dir: str | Path) -> Path:
    """Save the tiny pipeline; without torchvision its processor is diffusers' custom component
    (its code in the processor folder, loaded with `trust_remote_code`)."""
    out = tiny.save_pipeline(pipe, out_dir)
    index = Path(out) / "model_index.json"
    data = json.loads(index.read_text(encoding="utf-8"))
    if not has_torchvision():
        (Path(out) / "processor" / f"{IMAGE_ONLY_MODULE}.py").write_text(IMAGE_ONLY_SOURCE)
        data["processor"] = [IMAGE_ONLY_MODULE, "ImageOnlyQwen3VLProcessor"]
    else:
        config = Path(out) / "processor" / "processor_config.json"
        proc = json.loads(config.read_text(encoding="utf-8"))
        proc["processor_class"] = "Qwen3VLProcessor"
        config.write_text(json.dumps(proc, indent=2), encoding="utf-8")
        data["processor"] = ["transformers", "Qwen3VLProcessor"]
    index.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return out


def parts(scheduler_config: dict, seed: int = 0) -> dict[str, Any]:
    """The tiny pipeline's parts, by its argument names."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    tokenizer = tiny_qwen2_tokenizer(SYSTEM_WORDS)
    processor = image_only_processor_class()(
        image_processor=image_processor(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    return {
        "transformer": transformer(),
        "vae": vae(),
        "text_encoder": qwen3_vl(tokenizer),
        "processor": processor,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
    }
