"""What this machine offers for training: versions, devices, precision, memory and disk."""

from __future__ import annotations

import os
import platform
import shutil
import sys
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
            "bf16": cpu_bf16(),  # in hardware: faster than fp32 there
            "fp16": False,
        }
    ]


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX). There bf16 steps ran
    twice as fast as fp32 (benchmarks/README.md, "Training step"); elsewhere torch emulates
    bf16 and it is slower than fp32."""
    import torch

    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
    except RuntimeError:
        return False


def _ram_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def peak_rss_gib() -> float | None:
    """The most host memory this process has held so far, in GiB.

    Loading a base model is what peaks: a real one needs its size in RAM on the way to the GPU
    (and twice that if it were read in fp32 and then cast), which is what runs out on Colab.
    """
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux counts kibibytes, macOS bytes.
        return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 2)
    except (ImportError, OSError, ValueError):
        try:
            import psutil

            info = psutil.Process().memory_info()
            return round(getattr(info, "peak_wset", info.rss) / 2**30, 2)
        except (ImportError, OSError):
            return None


def host_memory() -> dict[str, float | None]:
    """The machine's RAM (total and available now) and this process's peak use, in GiB."""
    out: dict[str, float | None] = {"total_gib": _ram_gib(), "available_gib": None}
    try:
        import psutil

        vm = psutil.virtual_memory()
        out = {
            "total_gib": round(vm.total / 2**30, 1),
            "available_gib": round(vm.available / 2**30, 1),
        }
    except ImportError:
        pass
    out["peak_rss_gib"] = peak_rss_gib()
    return out


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
        "memory": host_memory(),
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
            + (
                " (this CPU has bf16 instructions: mixed_precision bf16 steps a real model about "
                "twice as fast)"
                if dev["bf16"]
                else ""
            )
        )
    elif not dev["bf16"]:
        notes.append(f"{dev['name']} lacks bf16: use mixed_precision=fp16")
    available = rep.get("memory", {}).get("available_gib")
    if available is not None and available < 8:
        notes.append(
            f"only {available} GiB RAM available: a real SDXL or larger base needs several GiB "
            "of host memory while it loads (a single-file base about its file size)"
        )
    if rep["disk_free_gib"] < 10:
        notes.append(
            f"only {rep['disk_free_gib']} GiB free disk: real checkpoints need several GiB"
        )
    return (notes or ["ready"]) + ([_memory_line(rep["memory"])] if "memory" in rep else [])


def _memory_line(mem: dict[str, float | None]) -> str:
    """Host RAM in one line, as `kit env` and notebook 00 show it."""

    def gib(v: float | None) -> str:
        return "?" if v is None else f"{v:g} GiB"

    return (
        f"host RAM: {gib(mem.get('total_gib'))} total, {gib(mem.get('available_gib'))} "
        f"available; this process peaked at {gib(mem.get('peak_rss_gib'))}"
    )
