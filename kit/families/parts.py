"""A family's parts, declared once as a table (`PartTable.parts`).

Each row names a part of the base model in diffusers layout: its pipeline argument (which is
also its subfolder), its library class as a dotted string (imported only when the part is
read), its role, and whether a method may train it. Loading, the tokenizers, the meta-device
build the estimator measures, the pipeline that samples and the cache's fingerprints all read
this one table; a family overrides only the step its model does differently.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kit.families.identity import DtypeSpec, PartSource

ROLES = ("denoiser", "vae", "text_encoder", "tokenizer", "processor", "scheduler", "held")
"""What a part does: the i-th tokenizer belongs to the i-th text encoder; a `held` part is a
frozen module the pipeline takes that `Components` has no place for (LTX-2's text connectors,
audio VAE and vocoder): the family loads and keeps it (`FlowFamily.held`)."""


@dataclass(frozen=True)
class Part:
    """One part of a base model: `Part("transformer", "diffusers.FluxTransformer2DModel",
    "denoiser", trainable=True)`."""

    name: str
    """Its pipeline argument, e.g. `transformer`, `text_encoder_2`, `tokenizer_2`."""
    library_class: str
    """The class that reads it, as `module.Class` (`transformers.T5EncoderModel`)."""
    role: str
    """One of `ROLES`."""
    trainable: bool = False
    """Whether a method may train it (or an adapter on it); frozen parts are only read."""
    subfolder: str = ""
    """Its folder in the diffusers layout, when that differs from `name`."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Part {self.name}: role {self.role!r} is not one of {ROLES}")
        if "." not in self.library_class:
            raise ValueError(f"Part {self.name}: name its class as module.Class")

    @property
    def folder(self) -> str:
        """The subfolder it is read from."""
        return self.subfolder or self.name

    def cls(self) -> type:
        """The library class (imported now)."""
        module, _, name = self.library_class.rpartition(".")
        return getattr(importlib.import_module(module), name)


def denoiser(cls: str, name: str = "transformer") -> Part:
    """The trained denoiser: a diffusers model class."""
    return Part(name, f"diffusers.{cls}", "denoiser", trainable=True)


def vae(cls: str = "AutoencoderKL") -> Part:
    """The autoencoder: a diffusers model class."""
    return Part("vae", f"diffusers.{cls}", "vae")


def scheduler(cls: str = "FlowMatchEulerDiscreteScheduler") -> Part:
    """The training noise scheduler: a diffusers scheduler class."""
    return Part("scheduler", f"diffusers.{cls}", "scheduler")


def text(
    encoder: str, tokenizer: str, index: int = 1, trainable: bool = False
) -> tuple[Part, Part]:
    """The `index`-th text encoder and its tokenizer (transformers classes), named as diffusers
    names them: `text_encoder`, `tokenizer`, then `text_encoder_2`, `tokenizer_2`, ..."""
    suffix = "" if index == 1 else f"_{index}"
    return (
        Part(f"text_encoder{suffix}", f"transformers.{encoder}", "text_encoder", trainable),
        Part(f"tokenizer{suffix}", f"transformers.{tokenizer}", "tokenizer"),
    )


@dataclass
class Components:
    """The loaded parts of a base model."""

    denoiser: nn.Module | None
    vae: nn.Module | None
    """None when loaded without it (training from a full cache needs no VAE)."""
    text_encoders: list[nn.Module]
    """Empty when loaded without them (tokenizers are always there)."""
    tokenizers: list[Any]
    noise_scheduler: Any
    source: str
    identity: dict[str, str] = field(default_factory=dict)
    """Part name → a fingerprint of its weights, used to key caches."""
    subfolders: dict[str, str] = field(default_factory=dict)
    """Each loaded module's diffusers subfolder, which is also its pipeline argument's name:
    `denoiser`, `vae`, and `text_encoders.<i>` → e.g. `unet`, `vae`, `text_encoder_2`."""

    def frozen_modules(self) -> list[nn.Module]:
        """Every loaded module of the base model."""
        return [m for m in (self.denoiser, self.vae, *self.text_encoders) if m is not None]

    def missing_parts(self) -> tuple[str, ...]:
        """The parts (of `PARTS`) that were not loaded."""
        have = (self.denoiser is not None, self.vae is not None, bool(self.text_encoders))
        return tuple(p for p, loaded in zip(PARTS, have, strict=True) if not loaded)

    def take_parts(self, other: Components) -> None:
        """Fill the parts this lacks from `other` (a later, partial load of the same model)."""
        if self.vae is None:
            self.vae = other.vae
        if not self.text_encoders:
            self.text_encoders = other.text_encoders
        if self.denoiser is None:
            self.denoiser = other.denoiser


PARTS = ("denoiser", "vae", "text_encoders")
"""The loadable parts of a base model; the scheduler and tokenizers always load."""


def frozen(*modules: nn.Module | None) -> None:
    """Freeze and switch to eval mode every given (loaded) module."""
    for m in modules:
        if m is not None:
            m.requires_grad_(False).eval()


class PartTable:
    """What a family does with its `parts` table: load them, build them empty, name them.

    A mixin of `Family`, which gives `cfg`, `model_source`, `identity` and `file_text_prefixes`.
    """

    parts: tuple[Part, ...] = ()
    """The base model's parts in diffusers layout (see `Part`): one denoiser, one VAE, one
    scheduler, the text encoders in the order their embeddings are built, each followed or
    preceded by its tokenizer, and any processor."""
    meta_buffers: bool | None = None
    """Whether `empty_parts` puts buffers on the meta device too (None: accelerate's default);
    true where a buffer is as large as activations (positional or rotary tables)."""

    def active_parts(self) -> tuple[Part, ...]:
        """The parts this configuration uses: all, unless the config leaves one out."""
        return self.parts

    def parts_of(self, role: str) -> tuple[Part, ...]:
        """The used parts with this role, in table order."""
        return tuple(p for p in self.active_parts() if p.role == role)

    def part(self, role: str) -> Part:
        """The one used part with this role (`denoiser`, `vae`, `scheduler`)."""
        (found,) = self.parts_of(role)
        return found

    @property
    def text_subfolders(self) -> tuple[str, ...]:
        """Subfolders of the text encoders whose embeddings are cached."""
        return tuple(p.folder for p in self.parts_of("text_encoder"))

    def part_class(self, part: Part, pretrained: str) -> type:
        """The class that reads `part` of the base `pretrained`: the table's, unless the base's
        own configs name the class (a family with several)."""
        return part.cls()

    # ------------------------------------------------------------ loading

    def load(
        self,
        pretrained: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        dtype: DtypeSpec = torch.float32,
        parts: tuple[str, ...] = PARTS,
    ) -> Components:
        """Load the base model's parts with diffusers / transformers `from_pretrained`, or from
        one checkpoint file with diffusers' single-file converters (`model_source`).

        Only the `parts` named (of `PARTS`) are loaded; the others are None (or no encoders),
        each frozen. Each loads straight in its dtype (`part_dtype`), never in fp32 first;
        `vae_model` replaces the VAE. Tokenizers and the scheduler always load.
        """
        tokenizers = list(self.read_tokenizers(pretrained, revision).values())
        noise_scheduler = self.load_scheduler(pretrained, revision)
        dn, ae = self.part("denoiser"), self.part("vae")
        encoders = self.parts_of("text_encoder")
        src = PartSource(pretrained, self, revision=revision, variant=variant, needed=bool(parts))
        prefixes = [*self.file_text_prefixes, *[None] * len(encoders)]

        def read(p: Part, key: str, in_file: str | None) -> nn.Module:
            return src.read(self.part_class(p, pretrained), p.folder, key, in_file, dtype)

        text = [
            read(p, p.folder, prefix)
            for p, prefix in zip(encoders, prefixes, strict=False)
            if "text_encoders" in parts
        ]
        model = read(dn, "denoiser", "denoiser") if "denoiser" in parts else None
        autoencoder = read(ae, "vae", "vae") if "vae" in parts else None
        frozen(*text, autoencoder, model)
        names = {"denoiser": dn.name, "vae": ae.name}
        names.update({f"text_encoders.{i}": p.name for i, p in enumerate(encoders)})
        identity = self.identity(pretrained, revision)
        comps = Components(
            model, autoencoder, text, tokenizers, noise_scheduler, src.source, identity, names
        )
        if text:
            self.text_loaded(comps, revision)
        return comps

    def text_loaded(self, comps: Components, revision: str | None) -> None:
        """What a family does once `load` has read its text encoders: a fix to them, or a part
        that runs with them and loads beside them (none by default)."""

    def load_scheduler(self, pretrained: str, revision: str | None) -> Any:
        """The training noise scheduler, as the base saved it."""
        part = self.part("scheduler")
        return part.cls().from_pretrained(
            self.model_source(pretrained), subfolder=part.folder, revision=revision
        )

    def load_tokenizers(self, pretrained: str) -> dict[str, Any]:
        """Text encoder name → its tokenizer (cheap: no weights)."""
        return self.read_tokenizers(pretrained, None)

    def read_tokenizers(self, pretrained: str, revision: str | None) -> dict[str, Any]:
        """Each used text encoder's subfolder → its tokenizer, read at `revision`."""
        toks = self.parts_of("tokenizer")
        source = self.model_source(pretrained, tuple(t.folder for t in toks))
        encoders = self.parts_of("text_encoder")
        return {
            enc.folder: self.read_tokenizer(tok, source, revision)
            for enc, tok in zip(encoders, toks, strict=True)
        }

    def read_tokenizer(self, part: Part, source: str, revision: str | None) -> Any:
        """One tokenizer of the base at `source`."""
        return part.cls().from_pretrained(source, subfolder=part.folder, revision=revision)

    # ------------------------------------------------------------ memory estimate

    def empty_parts(self, pretrained: str) -> dict[str, nn.Module]:
        """The parts built from their configs on the meta device: shapes only, no weights.

        Keyed `denoiser`, `vae` and each text encoder's subfolder.
        """
        from accelerate import init_empty_weights

        source = self.model_source(pretrained)
        configs = [
            (cls, cls.load_config(source, subfolder=sub))
            for p in (self.part("denoiser"), self.part("vae"))
            for cls, sub in [(self.part_class(p, pretrained), p.folder)]
        ]
        text = {
            p.folder: (cls, cls.config_class.from_pretrained(source, subfolder=p.folder))
            for p in self.parts_of("text_encoder")
            for cls in [self.part_class(p, pretrained)]
        }
        with init_empty_weights(include_buffers=self.meta_buffers):
            (dn_cls, dn_cfg), (vae_cls, vae_cfg) = configs
            built = {
                "denoiser": dn_cls.from_config(dn_cfg),
                "vae": vae_cls.from_config(vae_cfg),
                **{sub: cls(cfg) for sub, (cls, cfg) in text.items()},
            }
        # `from_pretrained` ties shared weights (T5's token embedding is one tensor under two
        # names); a bare constructor does not, which would count it twice. Tying must happen
        # outside `init_empty_weights`, which re-creates every parameter assigned inside it.
        for sub in text:
            built[sub].tie_weights()
        return built
