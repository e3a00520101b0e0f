"""Fingerprints of a base model's parts, read from configs and files without loading weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


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
