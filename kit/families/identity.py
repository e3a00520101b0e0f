"""Where a base model's parts are read from, and fingerprints of them for the caches.

A base is a diffusers folder, a hub id, or one checkpoint file as A1111, ComfyUI and model sites
share them. A file is read part by part through diffusers' own single-file converters, its
architecture (and whatever part it lacks) taken from `model_config`; its fingerprint is a hash of
its bytes, so a renamed or moved file keeps its caches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kit.errors import KitError
from kit.families.shipped import SHIPPED, shipped_dir
from kit.io import write_text

CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft")
"""File endings that make `pretrained_model` (or `vae_model`) one checkpoint file."""
VAE_PREFIXES = ("first_stage_model.", "vae.")
"""Where a whole checkpoint keeps its VAE (diffusers' `LDM_VAE_KEYS`)."""
DENOISER_PREFIX = "model.diffusion_model."
"""Where a whole checkpoint keeps its denoiser; files of the denoiser alone have no prefix."""


def saved_scheduler(source: str, default: str) -> Any:
    """The sampler saved with the base model (what plain diffusers would use); `default` names
    the diffusers class to read it with when the config does not name one."""
    import diffusers

    fallback = getattr(diffusers, default)
    config = fallback.load_config(source, subfolder="scheduler")
    return getattr(diffusers, config.get("_class_name", ""), fallback).from_config(config)


def fingerprint(obj: Any) -> str:
    """A short stable hash of JSON-able data."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def part_config(source: str, subfolder: str, revision: str | None = None) -> dict[str, Any]:
    """A part's saved `config.json` (a local folder's, or downloaded alone from the hub)."""
    path = Path(source) / subfolder / "config.json"
    if not Path(source).is_dir():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(source, "config.json", subfolder=subfolder, revision=revision))
    return json.loads(path.read_text(encoding="utf-8"))


def tokenizer_identity(source: str, revision: str | None = None) -> str:
    """Fingerprint the tokenizers: for a local folder their files' names, sizes and contents."""
    files: list[Any] = []
    root = Path(source)
    if root.is_dir():
        for folder in sorted(root.glob("tokenizer*")):
            for f in sorted(folder.iterdir()):
                if f.is_file():
                    files.append((folder.name, f.name, hashlib.sha256(f.read_bytes()).hexdigest()))
    return fingerprint({"source": source, "rev": revision, "files": files})


def weights_identity(source: str, subfolder: str, config: dict, revision: str | None) -> str:
    """Fingerprint a part: its config plus, for a local folder, its weight files' sizes and times."""
    files: list[Any] = []
    folder = Path(source) / subfolder
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".bin"):
                st = f.stat()
                files.append((f.name, st.st_size, st.st_mtime_ns))
    return fingerprint(
        {"source": source, "sub": subfolder, "rev": revision, "cfg": config, "files": files}
    )


def public_name(pretrained: str) -> str:
    """The base model as a shared file may name it: a hub id, or a local folder's or file's name.

    Exports, model cards and logs that users share carry this, never a local path (which would
    show the user's folder layout). A folder inside the hub cache
    (`…/models--org--name/snapshots/<hash>`) is named by the hub id it was downloaded from.
    """
    path = Path(pretrained).expanduser()
    if not (path.is_absolute() or pretrained.startswith((".", "~")) or path.exists()):
        return pretrained  # a hub id ("org/name") or a shipped short name
    for part in reversed(path.parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return path.stem if path.suffix in (".safetensors", ".ckpt", ".pt", ".bin") else path.name


# ------------------------------------------------------------------ single files


def single_file(source: str) -> bool:
    """Whether `source` names one checkpoint file rather than a diffusers folder or hub id."""
    path = Path(source).expanduser()
    return path.suffix.lower() in CHECKPOINT_SUFFIXES and not path.is_dir()


def _local(source: str) -> bool:
    """Whether `source` is written as a local path (never a hub id)."""
    return Path(source).is_absolute() or source.startswith((".", "~")) or Path(source).exists()


def model_source(pretrained: str, model_config: str, default: str) -> str:
    """Where a base's configs, tokenizers, scheduler and any part its file lacks are read:
    `pretrained` itself, unless it is one file; then `model_config` (a folder, a hub id, or the
    short name of a config the kit ships), else the shipped config named `default`."""
    if not single_file(pretrained):
        return pretrained
    chosen = model_config or default
    if not chosen:
        raise KitError(
            f"model_config: empty, and the kit ships no config for this family; set it to the "
            f"diffusers folder or hub id whose architecture {pretrained} holds"
        )
    if "/" not in chosen and chosen in SHIPPED:
        return str(shipped_dir(SHIPPED[chosen]))
    if _local(chosen) and not Path(chosen).expanduser().is_dir():
        raise KitError(
            f"model_config: folder not found: {chosen} (for pretrained_model {pretrained})"
        )
    return str(Path(chosen).expanduser()) if _local(chosen) else chosen


def require_tokenizers(source: str, pretrained: str, subfolders: Iterable[str]) -> None:
    """Refuse a local config folder without the tokenizers (the kit's shipped configs have
    none), naming what to set instead."""
    root = Path(source)
    missing = [s for s in subfolders if not (root / s).is_dir()]
    if root.is_dir() and missing:
        raise KitError(
            f"model_config: '{source}' has no {missing[0]}/ folder; a single-file base "
            f"({pretrained}) reads its tokenizers from model_config, so set model_config to a "
            "diffusers folder or hub id that holds them (the configs the kit ships hold none)"
        )


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _digest_store() -> Path:
    """Where file hashes are kept between runs: `$XDG_CACHE_HOME/kit/file-hashes`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kit" / "file-hashes"


def file_digest(path: str | Path, purpose: str = "pretrained_model") -> str:
    """SHA-256 of a file's bytes, computed once per version of the file: memoised by path,
    size and modification time, in this process and on disk (a base checkpoint is gigabytes).
    `purpose` names the setting in the error for a missing file."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise KitError(f"{purpose}: file not found: {path}")
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        stored = _digest_store() / f"{fingerprint(list(key))}.sha256"
        digest = stored.read_text().strip() if stored.is_file() else ""
        if len(digest) != 64:
            h = hashlib.sha256()
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
            digest = h.hexdigest()
            try:
                write_text(stored, digest)
            except OSError:
                pass  # a read-only home: hashed again next time
        _DIGESTS[key] = digest
    return _DIGESTS[key]


def check_layout(pretrained: str, family: Any) -> Checkpoint:
    """The single-file base `pretrained`, refused unless its keys show `family`'s denoiser
    (its `single_file_markers`, none of its `single_file_excludes`)."""
    file = Checkpoint(pretrained, "pretrained_model")
    markers, excludes = family.single_file_markers, family.single_file_excludes
    if not file.has(markers) or any(file.has([k]) for k in excludes):
        raise KitError(
            f"pretrained_model: {pretrained} does not hold a {family.name} model: its keys "
            f"(e.g. {', '.join(file.keys[:3]) or 'none'}) match no {family.name} checkpoint "
            "layout; check model_family, or the file"
        )
    return file


class Checkpoint:
    """One checkpoint file: its keys, and its tensors read a part at a time (a `.safetensors`
    file lazily, so a part's tensors are freed once it is loaded)."""

    def __init__(self, path: str, purpose: str) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] | None = None
        if not Path(path).is_file():
            raise KitError(f"{purpose}: file not found: {path}")
        try:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, "pt") as f:
                    self.keys = list(f.keys())
            else:
                from diffusers.loaders.single_file_utils import load_single_file_checkpoint

                self._tensors = load_single_file_checkpoint(path, local_files_only=True)
                self.keys = list(self._tensors)
        except Exception as e:  # noqa: BLE001 (safetensors' own error is no OSError)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise KitError(
                f"{purpose}: cannot read {path} as a checkpoint ({first}); the file is damaged "
                "or cut short: copy or download it again"
            ) from None

    def has(self, markers: Iterable[str]) -> bool:
        """Whether some key ends with each of `markers`."""
        return all(any(k.endswith(m) for k in self.keys) for m in markers)

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys`."""
        if self._tensors is not None:
            return {k: self._tensors[k] for k in keys}
        from safetensors import safe_open

        with safe_open(self.path, "pt") as f:
            return {k: f.get_tensor(k) for k in keys}

    def split(self, text_prefixes: tuple[str, ...]) -> dict[str, list[str]]:
        """Keys by part: `vae`, each text encoder's prefix, and `denoiser` (under the whole
        checkpoint's denoiser prefix, or else every key no other part claims)."""
        parts: dict[str, list[str]] = {"vae": [], **{p: [] for p in text_prefixes}}
        rest = []
        for k in self.keys:
            owner = next((p for p in text_prefixes if k.startswith(p)), None)
            if owner is None and k.startswith(VAE_PREFIXES):
                owner = "vae"
            (parts[owner] if owner is not None else rest).append(k)
        prefixed = [k for k in rest if k.startswith(DENOISER_PREFIX)]
        parts["denoiser"] = prefixed or rest
        return parts


def unloaded(module: nn.Module) -> list[str]:
    """Names of a module's tensors that no weight filled (left on the meta device)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [n for n, t in tensors if t.device.type == "meta"]


def module_from_file(
    cls: Any,
    state: dict[str, torch.Tensor],
    *,
    what: str,
    source: str,
    subfolder: str,
    dtype: torch.dtype,
) -> nn.Module:
    """Part `subfolder` (a diffusers or transformers class) built from `source`'s config and
    filled from `state` (the file's tensors of that part) by diffusers' single-file converters;
    a KitError naming the file (`what`) and the config when the two do not fit."""
    import diffusers
    from diffusers.loaders import single_file_utils as sfu

    where = f"{what} and model_config '{source}' ({subfolder})"
    try:
        if issubclass(cls, diffusers.ModelMixin):
            model = _diffusers_part(cls, state, where, source, subfolder, dtype)
        elif "T5" in cls.__name__:
            model = sfu.create_diffusers_t5_model_from_checkpoint(
                cls, state, subfolder=subfolder, config=source, torch_dtype=dtype
            )
        else:
            model = sfu.create_diffusers_clip_model_from_ldm(
                cls, state, subfolder=subfolder, config=source, torch_dtype=dtype
            )
    except (KeyError, IndexError, ValueError, RuntimeError, sfu.SingleFileComponentError) as e:
        raise KitError(f"{where} do not fit: {str(e).splitlines()[0][:300]}") from None
    missing = unloaded(model)
    if missing:
        raise KitError(
            f"{where} do not fit: the file fills {len(missing)} weight(s) of the config's "
            f"{cls.__name__} with nothing (e.g. {', '.join(missing[:3])}); model_config must "
            "describe the file's architecture"
        )
    return model.eval()


def _diffusers_part(
    cls: Any, state: dict, where: str, source: str, subfolder: str, dtype: torch.dtype
) -> nn.Module:
    """A diffusers model from a checkpoint's tensors: converted with the class's own single-file
    converter, checked against the config's architecture, then loaded by `from_single_file`."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    name = next((c.__name__ for c in cls.__mro__ if c.__name__ in SINGLE_FILE_LOADABLE_CLASSES), "")
    if not name:
        raise KitError(f"{where}: diffusers reads no {cls.__name__} from a single file")
    config = cls.load_config(source, subfolder=subfolder)
    converted = SINGLE_FILE_LOADABLE_CLASSES[name]["checkpoint_mapping_fn"](
        checkpoint=state, config=config
    )
    with init_empty_weights():
        empty = cls.from_config(config).state_dict()
    extra = sorted(set(converted) - set(empty))
    lacking = sorted(set(empty) - set(converted))
    if extra or lacking:
        shown = ", ".join((extra or lacking)[:3])
        raise KitError(
            f"{where} do not fit: {len(extra)} weight(s) of the file have no place in the "
            f"config's {name} and {len(lacking)} of its weights are not in the file (e.g. {shown})"
        )
    for key, value in converted.items():
        if tuple(value.shape) != tuple(empty[key].shape):
            raise KitError(
                f"{where} do not fit: {key} is {tuple(value.shape)} in the file but "
                f"{tuple(empty[key].shape)} in the config's {name}"
            )
    return cls.from_single_file(converted, config=source, subfolder=subfolder, torch_dtype=dtype)


def vae_from(cls: Any, vae_model: str, source: str, dtype: torch.dtype) -> nn.Module:
    """The VAE `vae_model` names, as class `cls`: one file (read with the base's VAE config
    from `source`), a folder with `config.json` at its root or in `vae/`, or a hub id."""
    if single_file(vae_model):
        state = Checkpoint(vae_model, "vae_model")
        return module_from_file(
            cls,
            state.tensors(state.keys),
            what=f"vae_model {vae_model}",
            source=source,
            subfolder="vae",
            dtype=dtype,
        )
    folder = Path(vae_model).expanduser()
    try:
        if _local(vae_model):
            if (folder / "config.json").is_file():
                return cls.from_pretrained(str(folder), torch_dtype=dtype).eval()
            if (folder / "vae" / "config.json").is_file():
                return cls.from_pretrained(str(folder), subfolder="vae", torch_dtype=dtype).eval()
            raise KitError(f"vae_model: {vae_model} has no config.json at its root or in vae/")
        try:
            return cls.from_pretrained(vae_model, torch_dtype=dtype).eval()
        except OSError:
            return cls.from_pretrained(vae_model, subfolder="vae", torch_dtype=dtype).eval()
    except (OSError, ValueError) as e:
        raise KitError(f"vae_model: cannot load '{vae_model}': {e}") from None


def vae_identity(vae_model: str) -> str:
    """Fingerprint of another VAE: a file's content hash, a folder's config and weight files,
    or a hub id."""
    if single_file(vae_model):
        return fingerprint({"vae_file": file_digest(vae_model, "vae_model")})
    folder = Path(vae_model).expanduser()
    if folder.is_dir():
        sub = "" if (folder / "config.json").is_file() else "vae"
        return weights_identity(str(folder), sub, part_config(str(folder), sub), None)
    return fingerprint({"vae_model": vae_model})


# ------------------------------------------------------------------ reading the parts

DtypeSpec = torch.dtype | Mapping[str, torch.dtype]
"""One dtype for every part, or one per part: `denoiser`, `vae`, a text encoder's subfolder,
and `*` for the rest (fp32 where none is given)."""


def part_dtype(dtype: DtypeSpec, part: str) -> torch.dtype:
    """The dtype `part` loads in under `dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return dtype.get(part, dtype.get("*", torch.float32))


class PartSource:
    """Where a family's `load` reads each part of a base: a single file's own tensors
    where the file holds the part (through diffusers' converters), else `source` with
    `from_pretrained`; the configured `vae_model` in place of the VAE.

    `family` gives `name`, `cfg` and the file layout (`single_file_markers`,
    `single_file_excludes`, `file_text_prefixes`); `needed` opens the file (no part asked for,
    no file read).
    """

    def __init__(
        self,
        pretrained: str,
        family: Any,
        *,
        revision: str | None,
        variant: str | None,
        needed: bool = True,
    ) -> None:
        self.pretrained = pretrained
        self.source = family.model_source(pretrained)
        self.vae_model = family.cfg.model.vae_model
        self.revision, self.variant = revision, variant
        self.file: Checkpoint | None = None
        self.keys: dict[str, list[str]] = {}
        if single_file(pretrained) and needed:
            self.file = check_layout(pretrained, family)
            self.keys = self.file.split(family.file_text_prefixes)

    def read(
        self, cls: Any, subfolder: str, part: str, in_file: str | None, dtype: DtypeSpec
    ) -> nn.Module:
        """Part `subfolder` as class `cls` in its dtype (`part` keys `dtype`); `in_file` names
        its keys in the file (`denoiser`, `vae` or a text encoder's prefix; None: not there)."""
        dt = part_dtype(dtype, part)
        if part == "vae" and self.vae_model:
            return vae_from(cls, self.vae_model, self.source, dt)
        keys = self.keys.get(in_file or "")
        if self.file is not None and keys:
            return module_from_file(
                cls,
                self.file.tensors(keys),
                what=f"pretrained_model {self.pretrained}",
                source=self.source,
                subfolder=subfolder,
                dtype=dt,
            )
        if self.file is not None:
            self._require_weights(subfolder)
        key = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
        return cls.from_pretrained(
            self.source,
            subfolder=subfolder,
            revision=self.revision,
            variant=self.variant,
            **{key: dt},
        )

    def _require_weights(self, subfolder: str) -> None:
        """Refuse a local `model_config` without the weights of a part the file lacks."""
        folder = Path(self.source) / subfolder
        files = folder.iterdir() if folder.is_dir() else ()
        if Path(self.source).is_dir() and not any(
            f.suffix in (".safetensors", ".bin") for f in files
        ):
            raise KitError(
                f"pretrained_model {self.pretrained} holds no {subfolder}, and model_config "
                f"'{self.source}' has no {subfolder} weights either; set model_config to a "
                "diffusers folder or hub id that has them"
            )


def pipeline_parts(comps: Any) -> dict[str, Any]:
    """A family's loaded `Components` as a diffusers pipeline's arguments: each loaded module
    under its subfolder's name (`unet`, `text_encoder_2`, ...), with the tokenizers when the
    text encoders are there; nothing for no components."""
    out: dict[str, Any] = {}
    if not comps:
        return out
    modules = {"denoiser": comps.denoiser, "vae": comps.vae}
    modules.update({f"text_encoders.{i}": e for i, e in enumerate(comps.text_encoders)})
    out.update({comps.subfolders[k]: m for k, m in modules.items() if m is not None})
    if comps.text_encoders:
        names = ["tokenizer", *(f"tokenizer_{i + 2}" for i in range(len(comps.tokenizers)))]
        out.update(zip(names, comps.tokenizers, strict=False))
    return out


def base_identity(
    pretrained: str,
    source: str,
    text_subfolders: tuple[str, ...],
    revision: str | None,
    extras: Any,
    vae_model: str,
) -> dict[str, str]:
    """A family's cache fingerprints (`Family.identity`): `vae`, and `text` (the encoders,
    their tokenizers and `extras`), read from `source`'s configs and weight files; a single
    file adds its content hash to every part, and `vae_model` is the VAE's own fingerprint."""
    digest = file_digest(pretrained) if single_file(pretrained) else None

    def part(sub: str) -> str:
        ident = weights_identity(source, sub, part_config(source, sub, revision), revision)
        return ident if digest is None else fingerprint([ident, digest])

    text = [part(sub) for sub in text_subfolders]
    return {
        "vae": vae_identity(vae_model) if vae_model else part("vae"),
        "text": fingerprint([text, tokenizer_identity(source, revision), extras]),
    }
