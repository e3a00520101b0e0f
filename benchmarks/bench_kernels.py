"""The kernels under the kit's step, measured on this device: which attention backend and memory
layout to use, and what `compile: true` gives.

Two parts, each reported as ratios against torch's default in the same run:

- attention: `scaled_dot_product_attention` forward and backward at the shapes SD1.5 and SDXL
  training runs (self-attention at the UNet's first levels, cross-attention to 77 tokens), with
  torch's own choice of backend against each backend forced in turn (math, flash,
  memory-efficient, cuDNN); "none here" where a backend has no kernel for the device, dtype or
  shape;
- `--unet`: one LoRA training step (forward, backward, fused AdamW) of the real SD1.5 UNet,
  built from the shipped config with random weights, in the default layout against
  `channels_last` (weights and input), and, with `--compile`, against `torch.compile` (its
  warm-up reported apart); the variants' steps alternate.

The kit keeps torch's default backend and layout unless a row here shows another faster on the
device it runs on (benchmarks/README.md, "Training step").

Usage: python benchmarks/bench_kernels.py [--device cpu|cuda] [--dtype float32|bfloat16|float16]
       [--unet [--px 256] [--compile]] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a checkout that is not installed (a lent GPU machine)

ATTENTION_SHAPES = (
    # name, heads, query tokens, key tokens, head dim (batch 1)
    ("SD1.5 256 px, level 1 self", 8, 1024, 1024, 40),
    ("SD1.5 256 px, level 1 cross", 8, 1024, 77, 40),
    ("SD1.5 512 px, level 1 self", 8, 4096, 4096, 40),
    ("SDXL 1024 px, level 2 self", 10, 4096, 4096, 64),
    ("SDXL 1024 px, level 3 self", 20, 1024, 1024, 64),
    ("SDXL 1024 px, level 2 cross", 10, 4096, 77, 64),
)
"""Where the UNets attend: SD1.5 has 8 heads of 40 at its first level (320 channels), SDXL 10 of
64 at its second (640) and 20 of 64 at its third (1280); a 256 px image is 32×32 latents."""

BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def attention_rows(device: str, dtype: Any, repeats: int) -> list[dict[str, Any]]:
    """Forward and backward of each shape with torch's choice and with each backend forced."""
    rows = []
    for shape in ATTENTION_SHAPES:
        rows.append(attention_row(shape, device, dtype, repeats))
        print(f"attention {rows[-1]}", flush=True)
    return rows


def attention_row(shape: tuple, device: str, dtype: Any, repeats: int) -> dict[str, Any]:
    """One shape: seconds per forward and backward, by backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name, heads, q_len, kv_len, dim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, heads, n, dim, generator=gen, device=device, dtype=dtype)
        for n in (q_len, kv_len, kv_len, q_len)
    )
    for x in (q, k, v):
        x.requires_grad_()

    def step() -> None:
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v).backward(grad)

    def forced(kind: Any) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel([kind]):
                step()

        return run

    # Each backend once (a warm-up, and whether it has a kernel here), then the timed calls
    # of all of them alternating, so that the machine's drift falls on all alike.
    runs: dict[str, Callable[[], None]] = {"default": step}
    row: dict[str, Any] = {"shape": name}
    for backend in BACKENDS:
        kind = getattr(SDPBackend, backend, None)
        if kind is None:
            row[backend] = "not in this torch"
            continue
        try:
            forced(kind)()
        except RuntimeError:  # no kernel of this backend for the device, dtype or shape
            row[backend] = "none here"
            continue
        runs[backend] = forced(kind)
    step()
    times = alternating(device, repeats, runs)
    row.update({k: statistics.median(v) for k, v in times.items()})
    return row


def alternating(
    device: str, repeats: int, runs: dict[str, Callable[[], None]]
) -> dict[str, list[float]]:
    """Seconds of each of `runs`, called in turn `repeats` times (A B C A B C …)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for key, fn in runs.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - start)
    return times


def attention_table(rows: list[dict[str, Any]]) -> str:
    """Milliseconds per forward and backward, each backend's ratio to the default's time."""
    head = "| shape | default | " + " | ".join(b.lower() for b in BACKENDS) + " |"
    lines = [head, "|" + "---|" * (2 + len(BACKENDS))]
    for r in rows:
        cells = [f"{r['default'] * 1e3:.2f} ms"]
        for b in BACKENDS:
            v = r[b]
            cells.append(
                f"{v * 1e3:.2f} ms ({v / r['default']:.2f}×)" if isinstance(v, float) else v
            )
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def unet_rows(device: str, dtype: Any, px: int, repeats: int, compile_: bool) -> list[dict]:
    """One LoRA step of the real SD1.5 UNet per variant, as the kit trains it (the frozen base
    in `dtype`, the LoRA weights in fp32, autocast to `dtype` for half types). The variants'
    steps alternate, A B A B, so that a machine's drift (clock, neighbours) falls on all of
    them alike: measured one after the other, a 3% difference once read as 21%."""

    variants = ["default", "channels_last"] + (["compile"] if compile_ else [])
    steps, rows = {}, {}
    for variant in variants:
        start = time.perf_counter()
        steps[variant] = unet_step(variant, device, dtype, px)
        steps[variant]()
        rows[variant] = {"variant": variant, "first": time.perf_counter() - start, "times": []}
    for variant, times in alternating(device, repeats, steps).items():
        rows[variant]["times"] = times
    out = []
    for variant in variants:
        row = rows[variant]
        out.append({**row, "step": statistics.median(row.pop("times"))})
        print(f"unet {out[-1]}", flush=True)
    return out


def unet_step(variant: str, device: str, dtype: Any, px: int) -> Callable[[], None]:
    """A LoRA step of a freshly built UNet in one variant: `channels_last` puts its weights and
    its input in that memory format (the weights alone gain nothing), `compile` compiles it."""
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from kit.families.shipped import shipped_dir

    torch.manual_seed(0)
    config = UNet2DConditionModel.load_config(shipped_dir("sd15") / "unet")
    unet = UNet2DConditionModel.from_config(config).to(device, dtype)
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    )
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    side = px // 8
    x = torch.randn(1, 4, side, side, device=device, dtype=dtype)
    t = torch.tensor([500], device=device)
    c = torch.randn(1, 77, 768, device=device, dtype=dtype)
    if variant == "channels_last":
        unet.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if variant == "compile":
        unet.compile()
    half = dtype != torch.float32

    def step() -> None:
        with torch.autocast(device, dtype) if half else contextlib.nullcontext():
            out = unet(x, t, c).sample
        torch.nn.functional.mse_loss(out.float(), x.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def unet_table(rows: list[dict[str, Any]], px: int) -> str:
    base = rows[0]["step"]
    lines = [
        f"| SD1.5 UNet LoRA step, {px} px, batch 1 | built and first step | later step (median) | ratio |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['first']:.2f} s | {r['step']:.3f} s | "
            f"{r['step'] / base:.2f}× the time |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
    parser.add_argument("--unet", action="store_true", help="also the real SD1.5 UNet's step")
    parser.add_argument("--px", type=int, default=256, help="the UNet step's image side")
    parser.add_argument("--compile", action="store_true", help="with --unet: also compiled")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    dtype = getattr(torch, args.dtype)
    where = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    text = (
        f"Device: {where}; {args.dtype}; torch {torch.__version__}; median of {args.repeats}.\n\n"
    )
    text += attention_table(attention_rows(args.device, dtype, args.repeats))
    if args.unet:
        rows = unet_rows(args.device, dtype, args.px, args.repeats, args.compile)
        text += "\n" + unet_table(rows, args.px)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
