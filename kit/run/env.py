"""What this machine offers for training: versions, devices, precision, memory and disk."""

from __future__ import annotations

import os
import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from kit.run import colab

PACKAGES = (
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",
    "safetensors",
    "ipywidgets",
    "papermill",
    "matplotlib",
)


def versions() -> dict[str, str]:
    """Installed version of each package the kit builds on."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def devices() -> list[dict[str, Any]]:
    """Each accelerator with its memory and precisions; the CPU when there is none."""
    import torch

    if torch.cuda.is_available():
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(
                {
                    "device": f"cuda:{i}",
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "bf16": torch.cuda.is_bf16_supported(),
                    "fp16": True,
                }
            )
        return out
    return [
        {
            "device": "cpu",
            "name": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "memory_gib": _ram_gib(),
            "bf16": False,
            "fp16": False,
        }
    ]


def _ram_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def in_colab() -> bool:
    """True inside Google Colab."""
    return colab.in_colab() or "COLAB_RELEASE_TAG" in os.environ


def report(path: str | Path = ".") -> dict[str, Any]:
    """Everything above plus free disk space where runs are written."""
    free = shutil.disk_usage(Path(path).resolve().anchor or "/").free
    return {
        "versions": versions(),
        "devices": devices(),
        "disk_free_gib": round(free / 2**30, 1),
        "colab": in_colab(),
        "platform": platform.platform(),
    }


def advice(rep: dict[str, Any]) -> list[str]:
    """Plain-language notes on what this machine means for training."""
    notes = []
    missing = [k for k, v in rep["versions"].items() if v == "missing"]
    if missing:
        notes.append(f"missing packages: {', '.join(missing)} (pip install -e .)")
    dev = rep["devices"][0]
    if dev["device"] == "cpu":
        notes.append(
            "no GPU: training runs in fp32 on the CPU; fine for the tiny demo, slow for real models"
        )
    elif not dev["bf16"]:
        notes.append(f"{dev['name']} lacks bf16: use mixed_precision=fp16")
    if rep["disk_free_gib"] < 10:
        notes.append(
            f"only {rep['disk_free_gib']} GiB free disk: real checkpoints need several GiB"
        )
    return notes or ["ready"]
