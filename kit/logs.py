"""Keep the libraries' own chatter out of the way of the kit's output."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Silence per-file loading bars and advice that users cannot act on."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    for pattern in (".*torchvision.*", ".*should be kept in float32.*"):
        warnings.filterwarnings("ignore", message=pattern)
