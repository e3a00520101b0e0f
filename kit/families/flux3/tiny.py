"""The tiny random-init FLUX.3 klein the tests load back through `from_pretrained`.

Every part keeps the release's structure at a few channels: a Qwen3-VL text encoder with the 32
layers whose hidden states (4, 8, ..., 32) the pipeline stacks, each 16 wide (so the transformer
reads 8 × 16 channels), the FLUX.2 VAE's batch-normalised 2×2 patches, one per-mode and one
joint block, and the pipeline's constant-shift scheduler. `distilled` adds the flow map's target
timestep embedder (`flow_map`), which is how the release tells its step-distilled model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kit.families import tiny
from kit.families.qwen_image.family import tiny_qwen2_tokenizer, tiny_qwen3_vl_config
from kit.io import atomic_dir

# Qwen3-VL Instruct's template reduced to what the pipeline sends: one user turn of text, then
# the assistant's turn opened (no thinking block: the Instruct model has none).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHIFT = 6.93
"""The constant σ shift `Flux3SetTimestepsStep` configures its scheduler with."""


def text_encoder(tokenizer: Any) -> Any:
    """A 32-layer, 16-wide `Qwen3VLForConditionalGeneration` (the pipeline's class)."""
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny_qwen3_vl_config(
        tokenizer,
        text={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        # A small tower, never run on text: only saved and loaded.
        vision={"patch_size": 2, "num_position_embeddings": 16, "out_hidden_size": 16},
    )
    return Qwen3VLForConditionalGeneration(config)


def make(out_dir: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """Write a tiny FLUX.3 klein base (or, `distilled`, the step-distilled klein)."""
    import diffusers

    torch.manual_seed(seed)
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    encoder = text_encoder(tokenizer)
    vae = tiny.flux2_vae()
    transformer = diffusers.Flux3Transformer2DModel(
        in_channels=32,  # 8 latent channels × a 2×2 patch
        cond_in_channels=32,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=8 * 16,  # eight stacked hidden states of the 16-wide encoder
        timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        flow_map=distilled,
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    parts = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }
    with atomic_dir(out_dir) as tmp_dir:
        for name, part in parts.items():
            part.save_pretrained(Path(tmp_dir) / name)
        (Path(tmp_dir) / "model_index.json").write_text(json.dumps(model_index(parts)), "utf-8")
        modular = modular_index(parts, distilled)
        (Path(tmp_dir) / "modular_model_index.json").write_text(json.dumps(modular), "utf-8")
    return Path(out_dir)


def model_index(parts: dict[str, Any]) -> dict[str, Any]:
    """The pipeline index of `parts` (library and class of each), as the release writes it."""
    index: dict[str, Any] = {"_class_name": "Flux3ModularPipeline"}
    for name, part in parts.items():
        library = type(part).__module__.split(".")[0]
        index[name] = [library, type(part).__name__]
    return index


def modular_index(parts: dict[str, Any], distilled: bool) -> dict[str, Any]:
    """The modular pipeline's index (`modular_model_index.json`, as `save_pretrained` writes
    it): the blocks and pipeline class of the model, and each part's subfolder."""
    index: dict[str, Any] = {
        "_blocks_class_name": "Flux3DistilledAutoBlocks" if distilled else "Flux3AutoBlocks",
        "_class_name": "Flux3DistilledModularPipeline" if distilled else "Flux3ModularPipeline",
    }
    for name, part in parts.items():
        if name == "scheduler":  # the blocks make their scheduler from its config
            continue
        library, cls = type(part).__module__.split(".")[0], type(part).__name__
        spec = {"pretrained_model_name_or_path": None, "revision": None, "subfolder": name}
        index[name] = [library, cls, {**spec, "type_hint": [library, cls], "variant": None}]
    return index
