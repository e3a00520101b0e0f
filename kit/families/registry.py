"""The family registry: every family by name, and what the data commands need of one.

Scanning, bucketing, caption reports and planning ask a family only a few plain facts (its
bucket alignment, whether it reads clips and which frame counts it accepts, its native size and
hub repository). Answering them must not cost the import of torch (about a second, more than a
scan of thousands of images), so each family's facts are written down here, beside the module
that holds its class; the class is imported only when `get_family` is asked for it.

The facts are written twice (here and as the class's attributes), so `register` checks that the
two agree whenever a family's module is imported: a mismatch fails on the first import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kit.config.model import DEFAULT_BASES
from kit.errors import ConfigError, KitError, did_you_mean
from kit.families.shipped import ARCHITECTURES, SHIPPED

if TYPE_CHECKING:
    from kit.config import Config
    from kit.families.base import Family


class FamilyFacts(Protocol):
    """What the data path reads of a family: a `FamilyInfo`, or a loaded `Family` itself."""

    name: str
    bucket_step: int
    native_resolution: int
    hub_id: str
    video: bool
    control_images: int
    needs_control: bool

    def frame_count(self, available: int) -> int: ...


@dataclass(frozen=True)
class FamilyInfo:
    """A family's plain facts, known without importing its module (or torch)."""

    name: str
    """The `model_family` value that selects this family."""
    module: str
    """The module whose import registers the family's class."""
    bucket_step: int = 64
    """Bucket sides are multiples of this (the class's `bucket_step`)."""
    native_resolution: int = 512
    """The side, in pixels, the released base model was trained at."""
    hub_id: str = ""
    """The hub repository of the maintained base model in diffusers layout."""
    video: bool = False
    """True when the family trains on clips (and so the scan reads them)."""
    control_images: int = 0
    """How many control (reference) images a training pair may have (the class's
    `control_images`): 0 for a family that takes none."""
    needs_control: bool = False
    """Whether every dataset must have its controls (an edit model; the class's `needs_control`)."""
    frame_stride: int = 1
    """A clip's frame count is `frame_stride · k + 1`: a VAE that compresses time by 4 (Wan)
    takes 4k+1 frames; 1 accepts any count."""

    def frame_count(self, available: int) -> int:
        """The most frames (≤ `available`) a clip may have; 0 when none fits."""
        if self.frame_stride <= 1:
            return available
        if available <= 0:
            return 0
        return (available - 1) // self.frame_stride * self.frame_stride + 1


# The families of this package. Each one's class repeats these facts as attributes.
FAMILIES: dict[str, FamilyInfo] = {
    info.name: info
    for info in (
        FamilyInfo(
            "sd15",
            "kit.families.sd15",
            bucket_step=64,
            native_resolution=512,
            hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
        ),
        FamilyInfo(
            "sdxl",
            "kit.families.sdxl",
            bucket_step=64,
            native_resolution=1024,
            hub_id="stabilityai/stable-diffusion-xl-base-1.0",
        ),
        FamilyInfo(
            "sd3",
            "kit.families.sd3",
            bucket_step=64,
            native_resolution=1024,
            hub_id="stabilityai/stable-diffusion-3.5-medium",
        ),
        FamilyInfo(
            "flux",
            "kit.families.flux",
            bucket_step=64,
            native_resolution=1024,
            hub_id="black-forest-labs/FLUX.1-dev",
        ),
        FamilyInfo(
            "flux_kontext",
            "kit.families.flux_kontext",
            bucket_step=64,
            native_resolution=1024,
            hub_id="black-forest-labs/FLUX.1-Kontext-dev",
            control_images=1,
            needs_control=True,
        ),
        FamilyInfo(
            "chroma",
            "kit.families.chroma",
            bucket_step=64,
            native_resolution=1024,
            hub_id="lodestones/Chroma1-HD",
        ),
        FamilyInfo(
            "flux2",
            "kit.families.flux2",
            bucket_step=64,
            native_resolution=1024,
            hub_id="black-forest-labs/FLUX.2-dev",
            control_images=10,  # optional reference images (flux2.MAX_REFERENCES)
        ),
        FamilyInfo(
            "wan",
            "kit.families.wan",
            bucket_step=16,
            native_resolution=480,
            hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            video=True,
            frame_stride=4,
        ),
        FamilyInfo(
            "qwen_image",
            "kit.families.qwen_image",
            bucket_step=64,
            native_resolution=1024,
            hub_id="Qwen/Qwen-Image",
        ),
        FamilyInfo(
            "qwen_image_edit",
            "kit.families.qwen_image_edit",
            bucket_step=64,
            native_resolution=1024,
            hub_id="Qwen/Qwen-Image-Edit",
            control_images=3,
            needs_control=True,
        ),
        FamilyInfo(
            "zimage",
            "kit.families.zimage",
            bucket_step=64,
            native_resolution=1024,
            hub_id="Tongyi-MAI/Z-Image-Turbo",
        ),
    )
}

DEFAULT_BASES.update({name: info.hub_id for name, info in FAMILIES.items()})

CHECKED = ("bucket_step", "native_resolution", "hub_id", "video")
"""The facts `register` compares between a class and its entry in `FAMILIES`."""

_CLASSES: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family selectable by its `name`.

    A family of this package must have an entry in `FAMILIES` whose facts match the class's
    attributes; a family defined elsewhere (a user's own module) needs none, as its module is
    already imported when it registers.
    """
    if not cls.name or cls.name in _CLASSES:
        raise ValueError(f"family name {cls.name!r} is empty or taken")
    info = FAMILIES.get(cls.name)
    if info is None and cls.__module__.startswith(f"{__package__}."):
        raise ValueError(
            f"family {cls.name!r} ({cls.__module__}) has no entry in {__name__}.FAMILIES: "
            "add one with its bucket step, native resolution, hub id and video facts"
        )
    if info is not None:
        if info.module != cls.__module__:
            raise ValueError(
                f"family {cls.name!r} is registered by {cls.__module__}, but {__name__}.FAMILIES "
                f"names {info.module}"
            )
        for key in CHECKED:
            if getattr(cls, key) != getattr(info, key):
                raise ValueError(
                    f"family {cls.name!r}: {key} is {getattr(cls, key)!r} in {cls.__module__} "
                    f"but {getattr(info, key)!r} in {__name__}.FAMILIES; make them agree"
                )
    _CLASSES[cls.name] = cls
    DEFAULT_BASES.setdefault(cls.name, cls.hub_id)
    return cls


def family_names() -> list[str]:
    """Every family name: this package's and any registered from elsewhere."""
    return sorted(set(FAMILIES) | set(_CLASSES))


def _unknown(name: str) -> ConfigError:
    names = family_names()
    return ConfigError(
        f"model_family: unknown family '{name}' (known: {', '.join(names)})"
        f"{did_you_mean(name, names)}"
    )


def family_info(name: str) -> FamilyFacts:
    """The facts of family `name` without importing it: what scans and bucket plans need.

    A family registered from outside this package has no entry; its (already imported) class
    answers instead.
    """
    info = FAMILIES.get(name)
    if info is not None:
        return info
    if name in _CLASSES:
        return _CLASSES[name]()
    raise _unknown(name)


def family_class(name: str) -> type[Family]:
    """The class of family `name`, importing its module (and torch) the first time."""
    if name not in _CLASSES:
        info = FAMILIES.get(name)
        if info is None:
            raise _unknown(name)
        importlib.import_module(info.module)
        if name not in _CLASSES:
            raise KitError(f"model_family: {info.module} did not register a family '{name}'")
    return _CLASSES[name]


def get_family(name: str, cfg: Config | None = None) -> Family:
    """The family registered as `name`, set up with the run's config (defaults when None) as
    a config of `name`: an empty `pretrained_model`, or one left at another family's default,
    is this family's own base; a base the kit knows as another family's is refused."""
    cls = family_class(name)
    if cfg is not None and cfg.model.model_family != name:
        cfg = cfg.replace(model_family=name)  # a base left at the other family's follows
    if cfg is not None and not cfg.model.pretrained_model:
        cfg = cfg.replace(pretrained_model=cls.hub_id)
    if cfg is not None:
        check_base(name, cfg.model.pretrained_model, cfg.model.model_config)
    return cls(cfg)


def check_base(name: str, pretrained: str, model_config: str = "") -> None:
    """Refuse a base (or `model_config`) that the kit ships as another family's model."""
    for key, value in (("pretrained_model", pretrained), ("model_config", model_config)):
        arch = ARCHITECTURES.get(SHIPPED.get(value, ""))
        if arch is not None and arch.family != name:
            own = FAMILIES[name].hub_id if name in FAMILIES else _CLASSES[name].hub_id
            raise ConfigError(
                f"{key}: {value} is a {arch.family} model ({arch.title}), but model_family is "
                f"{name}; set model_family: {arch.family}, or {key} to a {name} base such as "
                f"{own}"
            )
