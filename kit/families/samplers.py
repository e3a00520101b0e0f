"""What a validation image is drawn with: its spec, and the samplers a family may draw it with.

A sampler is a short name (`euler_a`, `dpm++_2m_karras`, `flow_unipc`, ...) for a diffusers
scheduler class and the few settings that make it that sampler. It is always built
`from_config` of the pipeline's own scheduler, so everything else the base model's scheduler
says (beta schedule, prediction type, timestep spacing, flow shift) carries over, as a diffusers
user swapping schedulers would get. `default` keeps the base model's scheduler as it is.

DDPM families (noise prediction over a beta schedule) and flow-matching families take different
samplers: a flow model needs σ from its flow schedule, so only schedulers that diffusers can run
on flow sigmas are offered to it, and only those its pipeline can call (FluxPipeline hands the
scheduler custom sigmas, which Heun's `set_timesteps` does not take).
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError, did_you_mean
from kit.families.registry import family_class

if TYPE_CHECKING:
    from PIL import Image

    from kit.config import Config


@dataclass
class ImageSpec:
    """Everything plain diffusers needs to draw the same image again."""

    prompt: str
    negative_prompt: str
    seed: int
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    adapter_scale: float = 1.0
    generator_device: str = "cpu"
    control: tuple[str, ...] = ()
    """Edit models: the control (reference) image files the prompt edits, one per reference."""
    sampler: str = "default"
    """A name of `SAMPLERS` (`default`: the pipeline's own scheduler); `draw` applies it, while
    `Family.sample` draws with whatever scheduler the pipeline holds."""


DEFAULT = "default"

SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    DEFAULT: ("", {}),
    # DDPM families: the samplers A1111 and ComfyUI users know, as diffusers names them.
    "euler": ("EulerDiscreteScheduler", {"use_karras_sigmas": False}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {"use_karras_sigmas": False}),
    "dpm++_2m": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "dpm++_2m_karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "unipc": ("UniPCMultistepScheduler", {"use_flow_sigmas": False}),
    "ddpm": ("DDPMScheduler", {}),
    # Flow-matching families: σ from the flow schedule, shifted by the base model's shift.
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),
    "flow_heun": ("FlowMatchHeunDiscreteScheduler", {}),
    "flow_unipc": (
        "UniPCMultistepScheduler",
        {"use_flow_sigmas": True, "prediction_type": "flow_prediction"},
    ),
    "flow_dpm++_2m": (
        "DPMSolverMultistepScheduler",
        {
            "use_flow_sigmas": True,
            "prediction_type": "flow_prediction",
            "algorithm_type": "dpmsolver++",
            "solver_order": 2,
        },
    ),
}
"""Sampler name → (diffusers scheduler class, the settings that make it that sampler)."""

DDPM_SAMPLERS = (
    DEFAULT,
    "euler",
    "euler_a",
    "heun",
    "dpm++_2m",
    "dpm++_2m_karras",
    "ddim",
    "pndm",
    "unipc",
    "ddpm",
)
"""The samplers of DDPM families (a family's `samplers` attribute)."""
FLOW_SAMPLERS = (DEFAULT, "flow_euler", "flow_heun", "flow_unipc", "flow_dpm++_2m")
"""The samplers of flow-matching families whose pipeline takes any of them."""
CUSTOM_SIGMA_SAMPLERS = tuple(s for s in FLOW_SAMPLERS if s != "flow_heun")
"""The flow samplers of pipelines that hand the scheduler custom sigmas (Flux's, FLUX.2's),
which the flow Heun scheduler's `set_timesteps` cannot take."""


def samplers_for(family: str) -> tuple[str, ...]:
    """The sampler names family `family` can draw with (its class's `samplers`)."""
    return family_class(family).samplers


def check_validation(family: Any, cfg: Config) -> None:
    """Refuse `validation_prompts` entries this family cannot draw: an unknown sampler, or a
    size its pipeline would refuse or round (so a long run does not fail at its first grid)."""
    choices, multiple = family.samplers, family.size_multiple
    references = getattr(family, "control_images", 0)
    family = family.name
    for i, entry in enumerate(cfg.validation.validation_prompts):
        where = f"validation_prompts[{i}]"
        if len(entry.control) > references:
            raise ConfigError(
                f"{where}.control: {len(entry.control)} control image(s), but {family} takes "
                + (f"at most {references}" if references else "none (it is no edit model)")
            )
        for file in entry.control:
            if not Path(file).is_file():
                raise ConfigError(f"{where}.control: {file} is not an image file")
        if entry.scheduler is not None and entry.scheduler not in choices:
            raise ConfigError(
                f"{where}.scheduler: {entry.scheduler!r} is not a sampler {family} can draw "
                f"with (choose from {', '.join(choices)}){did_you_mean(entry.scheduler, choices)}"
            )
        for key in ("width", "height"):
            value = getattr(entry, key)
            if value is not None and value % multiple:
                lower = max(multiple, value - value % multiple)
                raise ConfigError(
                    f"{where}.{key}: {value} is not a multiple of {multiple}, which {family} "
                    f"draws at (e.g. {lower} or {lower + multiple})"
                )


def build_scheduler(family: Any, scheduler: Any, name: str) -> Any:
    """The scheduler that draws with sampler `name`: `scheduler` itself for `default`, else a
    new one `from_config` of its config with the sampler's own settings.

    The σ shift of a flow model is carried across the two ways diffusers spells it (`shift`
    for the flow Euler schedulers, `flow_shift` for the multistep ones on flow sigmas).
    """
    if name not in family.samplers:
        choices = ", ".join(family.samplers)
        raise ConfigError(f"sampler {name!r}: {family.name} draws with one of {choices}")
    if name == DEFAULT:
        return scheduler
    import diffusers

    class_name, settings = SAMPLERS[name]
    config = dict(scheduler.config)
    settings = dict(settings)
    shift = base_shift(type(scheduler).__name__, scheduler.config)
    if shift is not None:
        key = "flow_shift" if settings.get("use_flow_sigmas") else "shift"
        settings[key] = shift
    return getattr(diffusers, class_name).from_config(config, **settings)


def base_shift(class_name: str, config: Any) -> float | None:
    """The static σ shift a flow scheduler (class and config) samples with; None for a DDPM
    scheduler."""
    if class_name.startswith("FlowMatch"):
        return float(config.get("shift", 1.0))
    if config.get("use_flow_sigmas"):
        return float(config.get("flow_shift", 1.0))
    return None


def _shift_used(class_name: str, config: dict[str, Any], mu: float | None) -> float | None:
    """The σ shift a schedule was drawn with: with dynamic shifting (Flux dev), the one the
    pipeline set for the image size (`mu`, exponential or linear), else the static one."""
    if config.get("use_dynamic_shifting") and mu is not None:
        return float(mu) if config.get("time_shift_type") == "linear" else math.exp(float(mu))
    return base_shift(class_name, config)


class Clip(list):
    """A drawn clip's frames (a list, as every family's `sample` returns) with the sound drawn
    with them: `sound` (channels, samples) floats in [-1, 1] at `sample_rate`; what a family
    whose pipeline makes sound (LTX-2) returns, and what the MP4 writer plays."""

    def __init__(self, frames: list[Image.Image], sound: Any, sample_rate: int) -> None:
        super().__init__(frames)
        self.sound = sound
        self.sample_rate = sample_rate


def draw(family: Any, pipe: Any, spec: ImageSpec) -> tuple[list[Image.Image], dict[str, Any]]:
    """Draw `spec` with its sampler: the frames, and what the sidecar records of the sampling
    (`sampler`, the `scheduler`'s class and config as it was built, and the σ `shift` used).

    The pipeline's own scheduler is put back afterwards, so specs drawn one after another never
    see each other's sampler.
    """
    return draw_batch(family, pipe, [spec])[0]


def draw_batch(
    family: Any, pipe: Any, specs: list[ImageSpec]
) -> list[tuple[list[Image.Image], dict[str, Any]]]:
    """`draw` for specs of one sampler, in as few pipeline calls as `Family.sample_batch` can."""
    samplers = {spec.sampler for spec in specs}
    if len(samplers) != 1:
        raise ValueError(f"draw_batch takes specs of one sampler, not {sorted(samplers)}")
    own = pipe.scheduler
    scheduler = build_scheduler(family, own, specs[0].sampler)
    record: dict[str, Any] = {
        "sampler": specs[0].sampler,
        "scheduler": {"class": type(scheduler).__name__, "config": dict(scheduler.config)},
    }
    # The pipeline computes a dynamic shift (`mu`) from the image size when it sets the
    # timesteps; it is read here as the scheduler receives it.
    seen: dict[str, Any] = {}
    original = type(scheduler).set_timesteps

    @functools.wraps(original)  # pipelines read its signature
    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return original(self, *args, **kwargs)

    # A method bound to the scheduler, so that a pipeline's copy of it (LTX-2 deep-copies its
    # scheduler for the sound) sets its own timesteps, not this one's.
    scheduler.set_timesteps = types.MethodType(recording, scheduler)
    pipe.scheduler = scheduler
    try:
        drawn = family.sample_batch(pipe, specs)
    finally:
        pipe.scheduler = own
        del scheduler.set_timesteps
    record["shift"] = _shift_used(
        record["scheduler"]["class"], record["scheduler"]["config"], seen.get("mu")
    )
    return [(frames, dict(record)) for frames in drawn]


__all__ = [
    "Clip",
    "DEFAULT",
    "DDPM_SAMPLERS",
    "CUSTOM_SIGMA_SAMPLERS",
    "FLOW_SAMPLERS",
    "SAMPLERS",
    "ImageSpec",
    "base_shift",
    "build_scheduler",
    "check_validation",
    "draw",
    "draw_batch",
    "open_named_images",
    "samplers_for",
]


def open_named_images(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A pipeline call's keyword arguments with the images they name by file (`image`: one file
    or a list) opened as RGB, each file read whole and closed."""
    from PIL import Image

    def opened(path: str) -> Any:
        with Image.open(path) as im:
            return im.convert("RGB")

    named = kwargs.get("image")
    if isinstance(named, str):
        kwargs["image"] = opened(named)
    elif isinstance(named, (list, tuple)):
        kwargs["image"] = [opened(f) if isinstance(f, str) else f for f in named]
    return kwargs
