"""Keep the libraries' own chatter out of the way of the kit's output."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Silence per-file loading bars and advice that users cannot act on."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # wandb's banner, offline-sync advice and end-of-run sparklines (on stderr, beside the
    # progress bar); the kit prints the run's address itself. WANDB_SILENT=false brings it back.
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:
        pass
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:
        pass
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").addFilter(_without_cpu_probe)
    for pattern in (".*torchvision.*", ".*should be kept in float32.*"):
        warnings.filterwarnings("ignore", message=pattern)


def _without_cpu_probe(record: logging.LogRecord) -> bool:
    """Drop DeepSpeed's accelerator probe on a CPU machine, and only that record.

    DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were
    unable to detect it." whenever it is first imported without a GPU: accelerate imports it
    inside `unwrap_model` (before each validation) when it is installed, DeepSpeed or not. On a
    CPU the kit has already said it trains in fp32; every other DeepSpeed message stays.
    """
    return not record.getMessage().startswith("Setting accelerator to CPU")
