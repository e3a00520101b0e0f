"""Keep the libraries' own chatter out of the way of the kit's output."""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

LIBRARY_LOGGING = ("diffusers.utils.logging", "transformers.utils.logging")
"""The logging modules of the libraries whose verbosity and loading bars the kit turns down."""


def quiet_libraries() -> None:
    """Silence per-file loading bars and advice that users cannot act on.

    diffusers and transformers are not imported for this (together about two seconds, more
    than `kit buckets` needs in all): each is quieted the moment it is first imported, or now
    if it already is.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # wandb's banner, offline-sync advice and end-of-run sparklines (on stderr, beside the
    # progress bar); the kit prints the run's address itself. WANDB_SILENT=false brings it back.
    os.environ.setdefault("WANDB_SILENT", "true")
    for name in LIBRARY_LOGGING:
        if name in sys.modules:
            _silence(sys.modules[name])
        else:
            _AFTER_IMPORT.add(name, _silence)
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").addFilter(_without_cpu_probe)
    for pattern in (".*torchvision.*", ".*should be kept in float32.*"):
        warnings.filterwarnings("ignore", message=pattern)
    quiet_writer_threads()


def quiet_writer_threads() -> None:
    """Drop the traceback of TensorBoard's event-writing thread when a write fails (a full
    disk): the thread keeps its error, and the writer raises it in the training thread at its
    next call, where the kit reports it in one line. Other threads' failures print as before."""
    previous = threading.excepthook
    if getattr(previous, "kit_quiet", False):
        return

    def hook(args: Any) -> None:
        thread = args.thread
        kept = getattr(thread, "exception", None) is args.exc_value
        if kept and type(thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.kit_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _without_cpu_probe(record: logging.LogRecord) -> bool:
    """Drop DeepSpeed's accelerator probe on a CPU machine, and only that record.

    DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were
    unable to detect it." whenever it is first imported without a GPU: accelerate imports it
    inside `unwrap_model` (before each validation) when it is installed, DeepSpeed or not. On a
    CPU the kit has already said it trains in fp32; every other DeepSpeed message stays.
    """
    return not record.getMessage().startswith("Setting accelerator to CPU")


def _silence(log_module: ModuleType) -> None:
    """Errors only, and no loading bars, from one library's logging module."""
    try:
        log_module.set_verbosity_error()
        log_module.disable_progress_bar()
    except AttributeError:
        pass  # a release that moved these: its chatter is cosmetic, its import must not fail


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after its first import, without importing it.

    It finds nothing itself: it asks the finders after it for the module's spec and wraps the
    spec's loader, so the module loads as it would have, and then the function runs on it.
    """

    def __init__(self) -> None:
        self.actions: dict[str, Callable[[ModuleType], None]] = {}

    def add(self, name: str, action: Callable[[ModuleType], None]) -> None:
        self.actions[name] = action
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        action = self.actions.pop(fullname, None)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRun(spec.loader, action)
        return spec


class _ThenRun(importlib.abc.Loader):
    """A module's own loader, then one function on the loaded module."""

    def __init__(self, loader: Any, action: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.action = action

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader: resources and reloads go to it, not to this wrapper.
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.action(module)


_AFTER_IMPORT = _AfterImport()
