"""FLUX.3's client key layout: none yet but diffusers'.

The kit writes a FLUX.3 adapter as the diffusers file that `Flux3LoraLoaderMixin` reads
(diffusers 0.42, `loaders/lora_pipeline.py`), and no other: it never writes a file that no
client reads. ComfyUI has no FLUX.3 model as of `COMFYUI_CHECKED` (the newest ComfyUI
`comfy/model_detection.py` stored here: no detection of FLUX.3's transformer keys,
`early_stream_modulations.*`, and no `comfy/ldm/flux3`), so its LoRA naming for FLUX.3 is
unknown; A1111 and Forge have none either. When a client adds the model, its layout goes here,
written from that client's loading code, with the release its support starts at.
"""

COMFYUI_CHECKED = "d415a44fe698d8ba6d1a35dd4592dc52d838933e"
"""The ComfyUI commit (of `comfy/model_detection.py`) checked for FLUX.3 support: none."""
CLIENTS: tuple[str, ...] = ("diffusers",)
"""The clients that read a FLUX.3 adapter file: diffusers' FLUX.3 loader alone."""
