"""Validation prompts drawn from cached text embeddings, so that a run whose text encoders are
large (Qwen2.5-VL 7B, Mistral Small 24B, Qwen3) lets them go once the cache is filled.

The prompts and negative prompts of the validation grid are cached beside the captions, by the
same encoder call (`Family.encode_text`, the pipeline's own `encode_prompt`), and the pipeline
is then called with `prompt_embeds` (and the family's other text tensors) in place of the
strings, the way a diffusers user passes precomputed embeddings. The tensors keep the names
the family caches them under, which are the pipeline call's own; the negative prompt's take the
pipeline's `negative_` prefix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from kit.families.samplers import ImageSpec

PROMPT_KEYS = (("prompt", ""), ("negative_prompt", "negative_"))
SCALE_KEYS = ("cross_attention_kwargs", "joint_attention_kwargs", "attention_kwargs")
"""Where pipelines take the LoRA scale (`{"scale": s}`)."""
"""Each string argument of a pipeline call, and the prefix of the embeddings that replace it."""


def prompt_texts(family: Any, specs: list[ImageSpec]) -> list[str]:
    """Every text a validation pipeline call would encode for these specs, once each."""
    texts: dict[str, None] = {}
    for spec in specs:
        kwargs = family.call_kwargs(spec)
        for key, _ in PROMPT_KEYS:
            if isinstance(kwargs.get(key), str):
                texts[kwargs[key]] = None
    return list(texts)


def takes_embeddings(pipeline_class: type | str, text_keys: list[str]) -> bool:
    """Whether the pipeline's call (a class, or its name in diffusers) takes each cached text
    tensor, for the prompt and, where it takes a negative prompt, for that too
    (`prompt_embeds`, `negative_prompt_embeds`, ...)."""
    if isinstance(pipeline_class, str):
        import diffusers

        pipeline_class = getattr(diffusers, pipeline_class)
    params = inspect.signature(pipeline_class.__call__).parameters
    # A pipeline without a negative prompt (FLUX.2's) is never handed one to replace.
    prefixes = [p for key, p in PROMPT_KEYS if key in params]
    return all(f"{prefix}{k}" in params for k in text_keys for prefix in prefixes)


def draws_from_embeddings(family: Any, method: Any) -> bool:
    """Whether a run of this method on this family draws its grids from cached embeddings, and
    so lets its text encoders go once the cache is filled: not while a text encoder trains or
    text is encoded live (textual inversion), nor where a prompt's embedding depends on its
    control images (`Family.prompt_controls`), and only through a pipeline that takes them."""
    if method.live_text or family.prompt_controls:
        return False
    return takes_embeddings(family.pipeline_class, ["prompt_embeds"])


def embedded_keys(family: Any, text: dict[str, torch.Tensor]) -> list[str]:
    """The pipeline call's keywords that a cached text entry becomes (`Family.prompt_kwargs`)."""
    return list(family.prompt_kwargs(batch_of_one(text)))


class EmbeddedPrompts:
    """A pipeline whose calls take cached embeddings in place of the prompt strings.

    Everything else (attributes, the scheduler a sampler swaps in) reads and writes through to
    the wrapped pipeline; `text_of(text)` gives a text's cached tensors (unbatched).
    """

    def __init__(
        self, pipe: Any, text_of: Callable[[str], dict[str, torch.Tensor]], family: Any
    ) -> None:
        object.__setattr__(self, "wrapped", pipe)
        object.__setattr__(self, "_text_of", text_of)
        object.__setattr__(self, "_family", family)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.wrapped, name, value)

    def __call__(self, **kwargs: Any) -> Any:
        from diffusers.utils import scale_lora_layers, unscale_lora_layers

        # The adapter scale goes to the denoisers here, not through the call: a pipeline that
        # is given a LoRA scale also scales its text encoder's LoRA layers, and has none.
        scale = None
        for key in SCALE_KEYS:
            extra = kwargs.get(key)
            if extra and "scale" in extra:
                extra = {k: v for k, v in extra.items() if k != "scale"}
                scale = kwargs[key]["scale"]
                kwargs[key] = extra or None
        denoisers = [
            getattr(self.wrapped, n, None) for n in ("unet", "transformer", "transformer_2")
        ]
        denoisers = [d for d in denoisers if d is not None]
        if scale is not None:
            for d in denoisers:
                scale_lora_layers(d, scale)
        try:
            return self._call(kwargs)
        finally:
            if scale is not None:
                for d in denoisers:
                    unscale_lora_layers(d, scale)

    def _call(self, kwargs: dict[str, Any]) -> Any:
        device, dtype = _place(self.wrapped)
        for key, prefix in PROMPT_KEYS:
            if key not in kwargs:
                continue
            text = kwargs.pop(key)
            kwargs.update(
                (f"{prefix}{name}", value)
                for name, value in self._family.prompt_kwargs(
                    batch_of_one(self._text_of(text), device, dtype)
                ).items()
            )
        return self.wrapped(**kwargs)


def batch_of_one(
    text: dict[str, torch.Tensor], device: Any = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A cached text entry as a batch of one on `device`, its floating tensors in `dtype`."""
    out = {}
    for name, value in text.items():
        value = value.unsqueeze(0).to(device)
        out[name] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    return out


def _place(pipe: Any) -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype the pipeline's denoiser runs: the embeddings go there."""
    for name in ("transformer", "unet"):
        module = getattr(pipe, name, None)
        if module is not None:
            p = next(module.parameters())
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32
