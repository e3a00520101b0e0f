"""Is `pretrained_model` there, and is it this family's? Asked before anything is scanned,
cached or loaded, so a missing, misspelt, gated or foreign base is one line, not a traceback
from deep inside the hub client after a minute of work.

Which family a diffusers folder (or hub repository) belongs to is read from its
`model_index.json` `_class_name` and each registered family's own `pipeline_class`: a new
family is covered by its class attribute, with no table here.
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kit.errors import KitError
from kit.families.identity import CHECKPOINT_SUFFIXES, check_layout, single_file
from kit.families.registry import FAMILIES, family_class

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""`owner/name`, the form of a hub repository id."""


def looks_local(value: str) -> bool:
    """Whether `value` is written as a local path: absolute, starting with `.` or `~`, ending
    in a checkpoint suffix, with more than one separator, or existing here; anything else of
    the form `owner/name` is a hub id."""
    if value.startswith((".", "/", "~")) or Path(value).expanduser().exists():
        return True
    if Path(value).suffix.lower() in CHECKPOINT_SUFFIXES or "\\" in value:
        return True
    return not HUB_ID.fullmatch(value)


def pipeline_families() -> dict[str, str]:
    """Diffusers pipeline class -> the family that trains it, from every registered family's
    `pipeline_class` (families imported here: this runs once per run, before loading)."""
    out: dict[str, str] = {}
    for name in FAMILIES:
        try:
            cls = family_class(name)
        except Exception:  # noqa: BLE001 (a family that cannot import names nothing here)
            continue
        out.setdefault(cls.pipeline_class, name)
    return out


def _read_index(path: Path, where: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise KitError(f"{where}: {path} is not UTF-8 text; the folder is damaged") from None
    except ValueError as e:
        raise KitError(f"{where}: {path} is not valid JSON ({e}); the folder is damaged") from None
    return data if isinstance(data, dict) else {}


def check_family(index: dict[str, Any], family: Any, where: str, shown: str) -> None:
    """Refuse a model whose pipeline class is another registered family's, naming it."""
    found = str(index.get("_class_name", ""))
    if not found or found == family.pipeline_class:
        return
    owner = pipeline_families().get(found)
    if owner and owner != family.name:
        raise KitError(
            f"{where}: {shown} is a {found} model (model_family {owner}), not "
            f"{family.name}'s {family.pipeline_class}; set model_family: {owner}, or point "
            f"{where} at a {family.name} model"
        )


def check_base(family: Any, pretrained: str, revision: str | None = None) -> None:
    """Refuse a base model that is not there or not `family`'s, with the fix, before any work:
    a local path that does not exist ("not found", never a hub lookup), an empty folder or one
    without `model_index.json`, a folder or file of another family, and on the hub a model that
    is missing, gated, or unreachable offline."""
    where = "pretrained_model"
    if not pretrained or not pretrained.strip():
        raise KitError(f"{where}: empty; set it to a diffusers folder, a hub id or a checkpoint")
    if not looks_local(pretrained):
        _check_hub(family, pretrained, revision)
        return
    path = Path(pretrained).expanduser()
    if single_file(pretrained):
        if not path.exists():
            raise KitError(f"{where}: file not found: {pretrained}")
        check_layout(str(path), family)  # keys of another family, or a damaged file
        return
    if not path.exists():
        raise KitError(
            f"{where}: folder not found: {pretrained} (a local path is never looked up on the "
            "hub; check the spelling)"
        )
    if not path.is_dir():
        raise KitError(
            f"{where}: {pretrained} is a file, but not a checkpoint (one of "
            f"{', '.join(CHECKPOINT_SUFFIXES)}); give a diffusers folder or a checkpoint file"
        )
    entries = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if not entries:
        raise KitError(f"{where}: {pretrained} is an empty folder; copy the model into it")
    index = path / "model_index.json"
    if not index.is_file():
        if "config.json" in entries:
            kind = "one part of a model (it has a config.json of its own)"
        else:
            kind = "not a diffusers model folder"
        raise KitError(
            f"{where}: {pretrained} is {kind}: no model_index.json (it holds "
            f"{', '.join(entries[:6])}{', ...' if len(entries) > 6 else ''}); point it at the "
            "folder with model_index.json, or at one checkpoint file"
        )
    check_family(_read_index(index, where), family, where, pretrained)


def _hub_reachable() -> bool:
    """Whether the hub's host answers within a few seconds (no retries)."""
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return False
    return True


def _check_hub(family: Any, repo: str, revision: str | None) -> None:
    """A hub id: its model_index.json from the cache or the hub, each failure one line."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    where = f"pretrained_model '{repo}'"
    local = (
        " (no local folder of that name exists either)"
        if not Path(repo).exists() and "/" in repo
        else ""
    )
    cached = try_to_load_from_cache(repo, "model_index.json", revision=revision)
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE") in ("1", "true")
    if not isinstance(cached, str):
        if offline:
            raise KitError(
                f"{where}: not in the local hub cache, and HF_HUB_OFFLINE is set; download it "
                f"online first (huggingface-cli download {repo}), unset HF_HUB_OFFLINE, or point "
                f"pretrained_model at a local copy{local}"
            )
        if not _hub_reachable():
            raise KitError(
                f"{where}: not in the local hub cache, and the hub cannot be reached (no "
                f"network?); download it online first (huggingface-cli download {repo}), or "
                f"point pretrained_model at a local copy{local}"
            )
    if isinstance(cached, str) and (offline or not _hub_reachable()):
        check_family(_read_index(Path(cached), where), family, "pretrained_model", repo)
        if not offline:
            go_offline(repo)
        return
    try:
        got = hf_hub_download(repo, "model_index.json", revision=revision)
    except Exception as e:  # noqa: BLE001 (every hub failure becomes one line below)
        raise KitError(hub_error(e, repo, revision) + local) from None
    check_family(_read_index(Path(got), where), family, "pretrained_model", repo)


def go_offline(repo: str) -> None:
    """The hub cannot be reached but `repo` is in the local cache: load it from there at once.
    Without this, every file the loaders ask for is retried against the hub first (about 25 s
    each time before the cache is used). Set for this process and the processes it starts."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # read at each request (`constants.is_offline_mode`)
    warnings.warn(
        f"the hub cannot be reached: '{repo}' is loaded from the local hub cache (offline)",
        stacklevel=3,
    )


def hub_error(e: BaseException, repo: str, revision: str | None = None) -> str:
    """One line for a hub client error about `repo`, with the fix."""
    names = {c.__name__ for c in type(e).__mro__}
    where = f"pretrained_model '{repo}'"
    if "GatedRepoError" in names:
        return (
            f"{where} is gated on the hub: accept its licence at "
            f"https://huggingface.co/{repo} and log in (huggingface-cli login, or HF_TOKEN), "
            "or point pretrained_model at a local copy"
        )
    if "RevisionNotFoundError" in names:
        return f"{where}: revision '{revision}' not found on the hub; check revision"
    if "RepositoryNotFoundError" in names:
        return (
            f"{where}: no such model on the hub (misspelt? a private one needs a login: "
            "huggingface-cli login); check the id, or point pretrained_model at a local folder"
        )
    if "LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names:
        return (
            f"{where}: not in the local hub cache, and the hub cannot be reached (offline, or "
            "HF_HUB_OFFLINE set); download it online first, or point pretrained_model at a "
            "local copy"
        )
    if "EntryNotFoundError" in names:
        return (
            f"{where} has no model_index.json: it is not a diffusers model repository; use the "
            "diffusers version of the model, or one checkpoint file with model_config"
        )
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return f"{where}: the hub refused it ({first}); check the id and your login"
