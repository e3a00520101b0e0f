"""How long a read from the network may wait, and how often it is tried again: the data
section's `remote_timeout` and `remote_retries`, given to fsspec's filesystems (S3, HTTP), to
`datasets` (a streamed or downloaded `hf_dataset`) and to `huggingface_hub` (hub downloads), each
through the library's own settings.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from kit.errors import DataError

T = TypeVar("T")

REMOTE = {"timeout": 60.0, "retries": 3}
"""`remote_timeout` and `remote_retries` of the run: set once per process by the scan and the
cache (`kit.data.blob.use_remote`), as every Blob shares its process's filesystems and carries
no config."""

HUB_TIMEOUTS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
"""huggingface_hub's settings (whole seconds) of how long a metadata request and a download's
read wait: read from the environment when it is imported, then from its `constants`."""


def hub_settings(timeout: float, retries: int) -> None:
    """Give `timeout` to huggingface_hub (its `constants` where imported, its environment for
    an import to come and for the processes this one starts) and `retries` to `datasets`'
    streaming reads (where imported: its import reads none of this)."""
    seconds = max(1, math.ceil(timeout))
    for key in HUB_TIMEOUTS:
        os.environ[key] = str(seconds)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        for key in HUB_TIMEOUTS:
            setattr(constants, key, seconds)
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.STREAMING_READ_MAX_RETRIES = config.STREAMING_OPEN_MAX_RETRIES = int(retries)


def timeouts(scheme: str) -> dict[str, Any]:
    """The filesystem options that bound each request by `remote_timeout`: one attempt each,
    so that `remote` does the retrying and says what it waits for."""
    t = REMOTE["timeout"]
    if scheme in ("s3", "s3a"):
        retry = {"total_max_attempts": 1, "mode": "standard"}
        return {"config_kwargs": {"connect_timeout": t, "read_timeout": t, "retries": retry}}
    if scheme in ("http", "https"):
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)
        return {"client_kwargs": {"timeout": timeout}}
    return {}


def dataset_options(name: str) -> dict[str, Any]:
    """What `datasets.load_dataset` (and its builder) take to bound the reads of `name` by
    `remote_timeout` and `remote_retries`: a download config with its URL's filesystem options
    (a hub id's reads take huggingface_hub's timeouts, `hub_settings`)."""
    import datasets

    scheme = name.split("://", 1)[0] if "://" in name else ""
    storage = {scheme: timeouts(scheme)} if timeouts(scheme) else {}
    hub_settings(REMOTE["timeout"], int(REMOTE["retries"]))
    config = datasets.DownloadConfig(max_retries=int(REMOTE["retries"]), storage_options=storage)
    return {"download_config": config}


def timed_out(e: Any) -> bool:
    """Whether an error (or one it was raised from) is a request that got no answer in time;
    False for anything that is no error (a batch's bytes)."""
    for _ in range(16):  # a chain's depth, bounded
        if not isinstance(e, BaseException):
            return False
        if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:
            return True
        e = e.__cause__ or e.__context__
    return False


def no_answer(what: str, tries: int) -> DataError:
    """The error for a read that got no answer, naming what it waited for and the settings."""
    t, r = REMOTE["timeout"], REMOTE["retries"]
    return DataError(
        f"{what}: no answer in {t:g} s, {tries} {'try' if tries == 1 else 'tries'} "
        f"(remote_timeout {t:g}, remote_retries "
        f"{r}); check the endpoint and the network, or raise remote_timeout for a slow store"
    )


def remote(what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, a request to a store: tried again `remote_retries` times when
    it gets no answer in `remote_timeout` seconds, each wait said on stderr."""
    tries = REMOTE["retries"] + 1
    for n in range(1, tries + 1):
        try:
            return call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 — only a timeout is retried; the rest is raised
            if not timed_out(e):
                raise
            if n < tries:
                print(
                    f"waiting for {what}: no answer in {REMOTE['timeout']:g} s; trying again "
                    f"({n} of {tries - 1})",
                    file=sys.stderr,
                )
    raise no_answer(what, tries)
