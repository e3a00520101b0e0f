"""Looking at the weights mid-run: validation images and losses on fixed noise."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from kit.families import quantize as quant
from kit.families.identity import public_name
from kit.families.loading import load_base
from kit.sample.clips import index_run
from kit.sample.embedded import EmbeddedPrompts
from kit.sample.validate import image_specs, run_validation
from kit.train.state import TrainState


def validate(s: TrainState, step: int) -> Path:
    """Draw the validation grid of `step` (main process); return its path."""
    cfg, comps = s.cfg, s.comps
    # With EMA, the images show the averaged weights: the ones that get exported.
    swap = s.ema.swapped_in(s.params) if s.ema is not None else contextlib.nullcontext()
    missing = comps.missing_parts()
    if s.embedded_prompts:  # the prompts' embeddings are cached: no encoder is needed
        missing = tuple(p for p in missing if p != "text_encoders")
    if missing:
        # Trained from a full cache: the encoders load now, for sampling only.
        # Loaded straight in the dtype they draw in, never in fp32 first.
        _, rest = load_base(cfg, dtype=s.weight_dtype, parts=missing, family=s.family)
        for m in rest.frozen_modules():
            m.to(s.device, dtype=s.weight_dtype)
        # Quantized as training's own encoders would have been, had they been loaded.
        quant.quantize_text_encoders(s.family, rest, cfg.model.base_quantization, device=s.device)
        comps.take_parts(rest)
    bare = s.accelerator.unwrap_model
    # Without its encoders, the pipeline is built with None in their places.
    encoders = [bare(e) for e in comps.text_encoders] or [None] * len(comps.tokenizers)
    pipe = s.family.pipeline(replace(comps, denoiser=bare(s.denoiser), text_encoders=encoders))
    if s.embedded_prompts:
        pipe = EmbeddedPrompts(pipe, s.data.prompt_text, s.family)
    s.denoiser.eval()
    specs = image_specs(cfg, s.family, s.prompts)
    slider, cols = cfg.objective.slider, len(cfg.validation.validation_seeds)
    if slider is not None:  # a slider's grid: its target prompt, a row per scale
        specs = [
            replace(x, prompt=slider.target, adapter_scale=k)
            for k in slider.scales
            for x in specs[:cols]
        ]
    meta = {"base_model": cfg.model.pretrained_model}
    adapter = s.training_adapter
    # The step's own grid is what the exported LoRA draws: without a training adapter.
    without = adapter.switched_off() if adapter is not None else contextlib.nullcontext()
    with swap, s.accelerator.autocast():
        with without:
            grid = run_validation(
                s.family, pipe, specs, s.run.validation_step(step), cols, {**meta, "step": step}
            )
        if adapter is not None:
            meta = {**meta, "step": step, "training_adapter": public_name(adapter.source)}
            run_validation(s.family, pipe, specs, s.run.validation_with_adapter(step), cols, meta)
    s.denoiser.train()
    index_run(s.run)  # the run's validation/index.json lists this step's images and clips
    s.emit(kind="validation", step=step, grid=grid)
    return grid


def fixed_losses(s: TrainState) -> dict[str, float]:
    """The loss on fixed training samples and noise, and on the held-out images if any."""
    s.denoiser.eval()
    with s.accelerator.autocast():
        out = {"stable_loss": s.fixed(s.family, s.comps, s.device)}
        if s.fixed_holdout is not None:
            out["validation_loss"] = s.fixed_holdout(s.family, s.comps, s.device)
    s.denoiser.train()
    return out
