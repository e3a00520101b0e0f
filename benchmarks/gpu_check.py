"""Real-size training on a lent GPU, held against the VRAM estimate: one command, no downloads.

For SD1.5 and SDXL LoRA (512 and 1024 px, bf16 and fp16), textual inversion in bf16, and Flux-dev
LoRA at 512 px with the base stored in nf4, in fp8, or with blocks swapped to the CPU, each case:

1. builds the architecture from the configs the kit ships (kit/families/<family>/configs) with
   random weights, written once per architecture as a diffusers folder (tokenizers made offline,
   CLIP's sized to the full 49,408-token vocabulary so textual inversion grows the same table);
2. trains it with the kit's own `kit.train.loop.train` for a few steps on a few synthetic
   images, in a process of its own with its own time limit, so an error or an out-of-memory
   case does not stop the others;
3. records the peak `torch.cuda.max_memory_allocated` of the training steps (reset once the
   model is loaded and the cache filled, read before the final validation image), steady
   steps/s after warm-up, and whether every loss and the validation image stayed finite.

The estimate (`kit.preflight.estimate.estimate` of the same config) runs on the CPU in a process
beside the cases. The table, with the machine, versions and date, goes to `benchmarks/gpu_check.md`
and into the "GPU check" section of benchmarks/README.md.

`--compare-sdxl` first runs the kit against the SDXL LoRA script on the same job (bench_step.py's
`sdxl` job: 1024 px, bf16, 8 steps of which 3 warm-up, on the SDXL folder the cases use) and adds
its "kit vs script" table: steps/s, peak VRAM, MFU; `--no-cases` runs that comparison alone.

`--dry-run` prints the plan, builds every case's config and runs the estimator, without a GPU.
`--tiny --device cpu` runs the same path end to end on the families' tiny models (a smoke test).

Any other shipped architecture (a folder of kit/families/<family>/configs with its shipped.json,
such as a new family's) gets LoRA cases at 512 and 1024 px in bf16 with `--arch FOLDER`; its
time limits and disk space are sized from its denoiser's published size until measured.

Usage: python benchmarks/gpu_check.py [--quick] [--cases PATTERN[,PATTERN]] [--arch FOLDER] [--dry-run]
       [--budget SECONDS] [--out FILE] [--tiny] [--device cuda|cpu] [--fill-readme FILE]
       [--compare-sdxl [--no-cases]]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the lent machine runs the checkout as it is, uninstalled

GIB = 2**30
RESULT = "GPU-CHECK-RESULT "  # marks the one stdout line a child reports on
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
PROMPT = "a red square on a blue background"
TOKEN, INIT_TOKEN = "<gpucheck>", "square"  # textual inversion: the new token, its first value
SOURCE_KEY = "gpu_check_source.sha256"  # in a built folder: the configs it was built from
MIN_LEFT_S = 20  # a case that would start with less of the budget left is skipped
EXTRA_PACKAGES = ("bitsandbytes", "torchao")  # base quantization may need them
COMPARE_STEPS, COMPARE_WARMUP = 8, 3  # the kit-vs-script comparison's steps, per side
COMPARE_SIDE_S = {
    False: 120,
    True: 60,
}  # one side's run at most (real, --tiny): load, steps, sample
COMPARE_BUILD_S = {False: 150, True: 30}  # the SDXL folder's build, when not already there


SHIPPED_DIRS = {
    path.parent.name: path.parent
    for path in (ROOT / "kit" / "families").glob("*/configs/*/shipped.json")
}
"""The shipped architectures' folders by name (`<family>/configs/<name>/`), each described by its
`shipped.json` (read here as kit.families.shipped reads it, without importing the kit into the
parent process)."""


@dataclass(frozen=True)
class Arch:
    """One shipped architecture: its family, its configs, how its random weights are stored, and
    how long a case and the one-time build of its folder may take."""

    family: str
    shipped: str
    dtype: str
    case_timeout_s: int
    build_timeout_s: int
    disk_gib: float
    billions: float = 0.0
    """The published denoiser size (the larger figure), in billions of parameters."""


def shipped_arch(folder: str, **measured: Any) -> Arch:
    """The architecture of a shipped config folder: its family and size from its shipped.json;
    dtype, time limits and disk from `measured` where runs have told them, else sized from the
    denoiser (bf16 weights; a case's load, steps and sample, and the build, grow with it; the
    folder holds about three bytes per denoiser parameter with its text encoders)."""
    meta = json.loads((SHIPPED_DIRS[folder] / "shipped.json").read_text(encoding="utf-8"))
    b = float(max(meta["denoiser_billions"]))
    sized = {
        "dtype": "bfloat16",
        "case_timeout_s": int(120 + 20 * b),
        "build_timeout_s": int(150 + 25 * b),
        "disk_gib": round(1 + 3 * b, 1),
    }
    return Arch(meta["family"], folder, billions=b, **{**sized, **measured})


MEASURED = {
    "sd15": shipped_arch(
        "sd15", dtype="float16", case_timeout_s=150, build_timeout_s=180, disk_gib=3
    ),
    "sdxl": shipped_arch(
        "sdxl", dtype="float16", case_timeout_s=210, build_timeout_s=300, disk_gib=8
    ),
    "flux": shipped_arch("flux-dev", case_timeout_s=360, build_timeout_s=420, disk_gib=36),
}
"""The architectures of the standing cases, by the short name their cases use."""

ARCHS = {
    **MEASURED,
    **{
        name: shipped_arch(name)
        for name in sorted(SHIPPED_DIRS)
        if name not in {a.shipped for a in MEASURED.values()}
    },
}
"""Every shipped architecture: the measured ones by short name, the others by folder name (a new
family's folder is here once it ships; `--arch FOLDER` gives it its cases)."""


@dataclass(frozen=True)
class Case:
    """One training run: batch 1, AdamW; LoRA rank 16 on the family's default targets."""

    name: str
    arch: str
    method: str
    px: int
    precision: str
    quantization: str = "none"
    swap: int = 0
    checkpointing: bool = False
    quick: bool = False


def all_cases(arches: list[str] | tuple[str, ...] = ()) -> list[Case]:
    """Every case in the order they run: the `--quick` set first, so that a budget that runs out
    still leaves one case of each kind measured; then those of `arches` (`arch_cases`)."""
    flux = {"arch": "flux", "method": "lora", "px": 512, "precision": "bf16", "checkpointing": True}
    first = [
        Case("sd15-lora-512-bf16", "sd15", "lora", 512, "bf16", quick=True),
        Case("sd15-ti-512-bf16", "sd15", "textual_inversion", 512, "bf16", quick=True),
        Case("sdxl-lora-1024-fp16", "sdxl", "lora", 1024, "fp16", quick=True),
        Case("flux-lora-512-bf16-nf4", **flux, quantization="nf4", quick=True),
        Case("flux-lora-512-bf16-fp8", **flux, quantization="fp8"),
        Case("flux-lora-512-bf16-swap18", **flux, swap=18),
    ]
    rest = [
        Case(f"{arch}-lora-{px}-{precision}", arch, "lora", px, precision)
        for arch in ("sd15", "sdxl")
        for px in (512, 1024)
        for precision in ("bf16", "fp16")
    ]
    rest.append(Case("sdxl-ti-1024-bf16", "sdxl", "textual_inversion", 1024, "bf16"))
    names = {c.name for c in first}
    return (
        first
        + [c for c in rest if c.name not in names]
        + [c for arch in arches for c in arch_cases(arch)]
    )


ARCH_PX = (512, 1024)
"""The resolutions an architecture's own cases train at."""
CHECKPOINTING_ABOVE = 4.0
"""Billions of denoiser parameters above which an architecture's cases checkpoint activations
(as the Flux cases do: a 12B model's 1024 px activations fill any card otherwise)."""


def arch_cases(arch: str) -> list[Case]:
    """The cases of a shipped architecture the standing list leaves out (`--arch`): LoRA at
    512 and 1024 px in bf16, its activations checkpointed when its denoiser is large."""
    if arch not in ARCHS:
        known = ", ".join(sorted(ARCHS))
        raise SystemExit(f"--arch {arch!r} is no shipped architecture; they are: {known}")
    big = ARCHS[arch].billions > CHECKPOINTING_ABOVE
    return [
        Case(f"{arch}-lora-{px}-bf16", arch, "lora", px, "bf16", checkpointing=big)
        for px in ARCH_PX
    ]


def select(cases: list[Case], patterns: list[str], quick: bool) -> list[Case]:
    """The cases named by `patterns` (shell globs, e.g. `flux-*`), or the quick set, or all."""
    if quick:
        cases = [c for c in cases if c.quick]
    if not patterns:
        return cases
    for p in patterns:
        if not any(fnmatch.fnmatchcase(c.name, p) for c in cases):
            names = ", ".join(c.name for c in cases)
            raise SystemExit(f"--cases {p!r} matches no case; the cases are: {names}")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def case_px(case: Case, tiny: bool) -> int:
    """The training resolution: the case's, or an eighth of it on the tiny models."""
    return case.px // 8 if tiny else case.px


def case_config(case: Case, base: str | Path, work: Path, steps: int, tiny: bool) -> Any:
    """The case's run config, checked like a config file (a key the kit lacks is refused)."""
    from kit.config import from_dict

    px = case_px(case, tiny)
    run = work / "runs" / case.name
    ti = case.method == "textual_inversion"
    flat: dict[str, Any] = {
        "model_family": ARCHS[case.arch].family,
        "pretrained_model": str(base),
        "image_dir": str(dataset_dir(work, px, ti)),
        "cache_dir": str(run / "cache"),  # fresh per case, so the encoders load as in a first run
        "output_dir": str(run / "run"),
        "resolution": px,
        "network_type": case.method,
        "lora_rank": 16,
        "train_batch_size": 1,
        "max_train_steps": steps,
        "mixed_precision": case.precision,
        "gradient_checkpointing": case.checkpointing,
        "learning_rate": 5e-4 if ti else 1e-4,
        "checkpointing_steps": 0,
        "report_to": "none",
        "seed": 0,
        "validation_prompt": [f"{TOKEN} {PROMPT}" if ti else PROMPT],
        "validation_seeds": [0],
        "validation_num_inference_steps": 1,
    }
    if ti:
        flat.update(placeholder_tokens=[TOKEN], initializer_token=INIT_TOKEN)
    # Set only where used: the other cases run whether or not the kit has these keys.
    if case.quantization != "none":
        flat["base_quantization"] = case.quantization
    if case.swap:
        # The tiny Flux has two blocks: it swaps one.
        flat["blocks_to_swap"] = min(case.swap, 1) if tiny else case.swap
    return from_dict(flat)


# ---------------------------------------------------------------- models and data


def write_full_clip_tokenizer(out: Path, vocab_size: int, max_length: int = 77) -> Any:
    """A CLIP tokenizer built offline (the tiny BPE's words and merges) and padded with unused
    entries to `vocab_size`, its start and end tokens last, as in CLIP's own vocabulary.

    A real-size text encoder then meets the token ids it expects, and textual inversion resizes
    its embedding table from the real size, not down to a tiny vocabulary.
    """
    from transformers import CLIPTokenizer

    from kit.families.tiny import write_clip_tokenizer_files

    specials = ["<|startoftext|>", "<|endoftext|>"]
    with tempfile.TemporaryDirectory() as tmp:
        write_clip_tokenizer_files(tmp)
        vocab = json.loads((Path(tmp) / "vocab.json").read_text(encoding="utf-8"))
        words = [t for t in sorted(vocab, key=vocab.__getitem__) if t not in specials]
        filler = [f"<|unused{i}|>" for i in range(max(0, vocab_size - len(words) - 2))]
        tokens = words + filler + specials
        (Path(tmp) / "vocab.json").write_text(
            json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8"
        )
        tok = CLIPTokenizer.from_pretrained(tmp, model_max_length=max_length)
    shutil.rmtree(out, ignore_errors=True)
    tok.save_pretrained(str(out))
    return tok


def build_model(family: str, source: Path, out: Path, dtype: str, device: str) -> Path:
    """Write a random-init diffusers folder of the architecture whose configs are in `source`.

    The family's tiny model gives the folder's layout and its offline tokenizers; then every
    model part of `source`'s model_index is built from its config on `device` (fast on a GPU,
    in fp32, seeded), stored in `dtype`, and the scheduler and model_index are `source`'s.
    """
    import importlib

    import torch

    from kit.families import get_family

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    get_family(family).make_tiny(tmp, seed=0)
    index = json.loads((source / "model_index.json").read_text())
    shutil.copy(source / "model_index.json", tmp / "model_index.json")
    shutil.copytree(source / "scheduler", tmp / "scheduler", dirs_exist_ok=True)
    for i, (sub, spec) in enumerate(sorted(index.items())):
        if sub.startswith("_") or not isinstance(spec, list) or spec[1] is None:
            continue
        library, class_name = spec
        if "Scheduler" in class_name:
            continue
        if "Tokenizer" in class_name:
            encoder = source / sub.replace("tokenizer", "text_encoder") / "config.json"
            if class_name.startswith("CLIPTokenizer") and encoder.is_file():
                enc = json.loads(encoder.read_text())
                size = enc.get("text_config", enc)["vocab_size"]
                write_full_clip_tokenizer(tmp / sub, size, enc.get("max_position_embeddings", 77))
            continue  # other tokenizers (T5's) stay the tiny one: its ids fit any T5 table
        cls = getattr(importlib.import_module(library), class_name)
        torch.manual_seed(i)
        with torch.device(device):
            if library == "diffusers":
                model = cls.from_config(cls.load_config(source / sub))
            else:
                model = cls(cls.config_class.from_pretrained(source / sub))
        model = model.to(device=device, dtype=getattr(torch, dtype)).to("cpu")
        shutil.rmtree(tmp / sub, ignore_errors=True)
        model.save_pretrained(str(tmp / sub), safe_serialization=True)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    (tmp / SOURCE_KEY).write_text(source_key(source))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def source_key(source: Path) -> str:
    """A digest of every config in `source`: a folder built from other configs is rebuilt."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(source.rglob("*.json")):
        h.update(str(f.relative_to(source)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def dataset_dir(work: Path, px: int, ti: bool) -> Path:
    return work / "data" / f"{px}{'-ti' if ti else ''}"


def write_dataset(folder: Path, px: int, ti: bool) -> Path:
    """Four captioned images of plain shapes on plain backgrounds, `px` square (kept if there)."""
    from PIL import Image, ImageDraw

    if (folder / "done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    looks = [
        ("red", "square", "blue"),
        ("green", "circle", "white"),
        ("yellow", "square", "black"),
        ("purple", "circle", "gray"),
    ]
    for i, (fg, shape, bg) in enumerate(looks):
        im = Image.new("RGB", (px, px), bg)
        draw = ImageDraw.Draw(im)
        box = (px // 4, px // 4, 3 * px // 4, 3 * px // 4)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=fg)
        im.save(folder / f"img_{i}.png")
        caption = f"a {fg} {shape} on a {bg} background"
        (folder / f"img_{i}.txt").write_text(f"{TOKEN} {caption}" if ti else caption)
    (folder / "done").write_text("")
    return folder


# ---------------------------------------------------------------- child processes


def child_build(spec: dict[str, Any]) -> None:
    from kit.logs import quiet_libraries

    quiet_libraries()
    out = build_model(
        spec["family"], Path(spec["source"]), Path(spec["out"]), spec["dtype"], spec["device"]
    )
    print(RESULT + json.dumps({"path": str(out)}), flush=True)


def child_case(spec: dict[str, Any]) -> None:
    """Train one case and print what was measured (also on an error, before raising it)."""
    from kit.config import from_dict

    cfg = from_dict(spec["config"])  # a config the kit refuses fails before the heavy imports
    import torch

    from kit.logs import quiet_libraries
    from kit.train.loop import train

    quiet_libraries()
    cuda = torch.cuda.is_available()
    rec: dict[str, Any] = {"losses": [], "times": [], "peak_bytes": None, "start_bytes": None}

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "start" and cuda:
            # The model is loaded and the cache filled: from here on, the training steps.
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            rec["start_bytes"] = torch.cuda.memory_allocated()
        elif event["kind"] == "step":
            rec["times"].append(time.perf_counter())
            rec["losses"].append(event["loss"])
            rec["loss_scale"] = event.get("loss_scale")
            if cuda:  # read before the final validation image is drawn
                rec["peak_bytes"] = torch.cuda.max_memory_allocated()

    out: dict[str, Any] = {"device": device_info()}
    started = time.perf_counter()
    try:
        result = train(cfg, callbacks=[on_event])
        out["image"] = image_state(result.validation_grids)
    except BaseException as e:
        if cuda and rec["peak_bytes"] is None and rec["start_bytes"] is not None:
            rec["peak_bytes"] = torch.cuda.max_memory_allocated()
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        raise
    finally:
        out.update(rec, seconds=time.perf_counter() - started)
        print(RESULT + json.dumps(out), flush=True)


def child_estimate(specs: list[dict[str, Any]]) -> None:
    """Estimate each case's config (on the CPU), one JSON line each as it is done."""
    from kit.config import from_dict
    from kit.logs import quiet_libraries
    from kit.preflight.estimate import estimate

    quiet_libraries()
    for spec in specs:
        print(RESULT + json.dumps(estimate_one(spec["name"], from_dict(spec["config"]), estimate)))
        sys.stdout.flush()


def child_compare(spec: dict[str, Any]) -> None:
    """The kit against the SDXL script (bench_step.py's `compare_sdxl`); its result."""
    result = bench_step().compare_sdxl(**spec)
    print(RESULT + json.dumps(result), flush=True)


def bench_step() -> Any:
    """benchmarks/bench_step.py, imported by path (this folder is not a package)."""
    import importlib.util

    if "bench_step" not in sys.modules:
        path = Path(__file__).with_name("bench_step.py")
        spec = importlib.util.spec_from_file_location("bench_step", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_step"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_step"]


def estimate_one(name: str, cfg: Any, estimate: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        est = estimate(cfg)
    except Exception as e:  # one case's failure is that case's result, not the run's
        return {"name": name, "error": f"{type(e).__name__}: {e}"[:300]}
    weights = sum(v for k, v in est.components.items() if k.endswith("_weights"))
    return {
        "name": name,
        "allocated_bytes": est.allocated_bytes,
        "weights_bytes": weights,
        "total_bytes": est.total_bytes,
        "seconds": time.perf_counter() - start,
    }


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, memory_gib=round(p.total_memory / GIB, 1))
    else:
        info["name"] = "cpu"
    return info


def image_state(grids: list[Path]) -> str:
    """`ok`, or `black` when every pixel of the last validation grid is 0 (NaN decodes so)."""
    from PIL import Image

    if not grids:
        return "none"
    with Image.open(grids[-1]) as im:
        return "ok" if max(hi for _, hi in im.convert("RGB").getextrema()) > 0 else "black"


def child_env(device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


_LIVE: list[subprocess.Popen] = []  # children still running, ended if this process stops


def spawn(role: str, spec: Any, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """This script as a child `role` (in a process group of its own) on `spec`, written beside
    `log`; its output in `log`.out and .err."""
    log.parent.mkdir(parents=True, exist_ok=True)
    spec_file = log.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec))
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), f"--child-{role}", str(spec_file)],
            stdout=out,
            stderr=err,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    _LIVE.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` s; on expiry kill the process's whole group. True if it timed out."""
    try:
        proc.wait(timeout=max(timeout, 0.1))
        timed_out = False
    except subprocess.TimeoutExpired:
        kill(proc)
        timed_out = True
    if proc in _LIVE:
        _LIVE.remove(proc)
    return timed_out


def kill(proc: subprocess.Popen) -> None:
    """End the child and whatever it started (its process group), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def reports(log: Path) -> list[dict[str, Any]]:
    """The JSON lines a child printed after the result mark."""
    path = log.with_suffix(".out")
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [
        json.loads(line[len(RESULT) :]) for line in text.splitlines() if line.startswith(RESULT)
    ]


def last_error(log: Path) -> str:
    """The error a child died of: the last line of its stderr that names an exception."""
    path = log.with_suffix(".err")
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    named = [ln for ln in lines if "Error" in ln or "Exception" in ln or "Killed" in ln]
    return (named or lines or ["no output"])[-1].strip()[:300]


def run_child(
    role: str, spec: Any, log: Path, timeout: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run one child to its end or its timeout: its report, with `status` and `seconds`."""
    start = time.monotonic()
    proc = spawn(role, spec, log, env)
    timed_out = finish(proc, timeout)
    got = reports(log)
    out: dict[str, Any] = got[-1] if got else {}
    out["seconds"] = round(time.monotonic() - start, 1)
    err = log.with_suffix(".err")
    oom = err.is_file() and "out of memory" in err.read_text(errors="replace").lower()
    if timed_out:
        out["status"] = f"timeout after {timeout:.0f} s"
    elif proc.returncode == 0 and "error" not in out:
        out["status"] = "ok"
    elif oom:
        out["status"] = "OOM"
    elif proc.returncode == -signal.SIGKILL:
        out["status"] = "killed (out of host memory?)"
    else:
        out["status"] = "failed: " + (out.get("error") or last_error(log))
    return out


# ---------------------------------------------------------------- the run


def versions() -> dict[str, str]:
    from importlib import metadata

    from kit.run.env import versions as kit_versions

    out = kit_versions()
    for name in EXTRA_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def machine(device: dict[str, Any]) -> str:
    """The GPU as nvidia-smi names it (this process makes no CUDA context), else as a child
    saw it (`device_info`), with CUDA's version and the CPUs."""
    gpu = f"{device['name']} ({device['memory_gib']} GiB), " if device.get("memory_gib") else ""
    if shutil.which("nvidia-smi"):
        q = "--query-gpu=name,memory.total,driver_version"
        with_nvsmi = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True
        )
        if with_nvsmi.returncode == 0 and with_nvsmi.stdout.strip():
            name, mem, driver = (s.strip() for s in with_nvsmi.stdout.splitlines()[0].split(","))
            gpu = f"{name} ({mem}, driver {driver}), "
    cuda = f"CUDA {device['cuda']}, " if device.get("cuda") and gpu else ""
    return f"{gpu}{cuda}{os.cpu_count()} CPU cores"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def sources(arches: set[str], work: Path, tiny: bool) -> dict[str, Path]:
    """Each architecture's configs: the shipped ones, or (`--tiny`) a tiny model's."""
    from kit.families import get_family
    from kit.families.shipped import shipped_dir

    out = {}
    for arch in sorted(arches):
        if not tiny:
            out[arch] = shipped_dir(ARCHS[arch].shipped)
            continue
        folder = work / "tiny-configs" / arch
        if not (folder / "model_index.json").is_file():
            get_family(ARCHS[arch].family).make_tiny(folder, seed=0)
        out[arch] = folder
    return out


def model_dir(work: Path, arch: str, tiny: bool) -> Path:
    return work / "models" / f"{arch}{'-tiny' if tiny else ''}"


def ensure_model(
    arch: str, source: Path, work: Path, args: argparse.Namespace, timeout: float
) -> tuple[Path | None, str]:
    """The architecture's random-init folder, built in a child unless already there."""
    a = ARCHS[arch]
    out = model_dir(work, arch, args.tiny)
    key = out / SOURCE_KEY
    if key.is_file() and key.read_text() == source_key(source):
        return out, "reused"
    free = shutil.disk_usage(work).free / GIB
    if not args.tiny and free < a.disk_gib:
        return None, f"model build: {free:.0f} GiB free in {work}, {a.disk_gib:.0f} GiB needed"
    spec = {"family": a.family, "source": str(source), "out": str(out), "dtype": a.dtype}
    spec["device"] = args.device
    log = work / "logs" / f"build-{arch}"
    got = run_child("build", spec, log, timeout, child_env(args.device))
    if got["status"] != "ok":
        return None, f"model build {got['status']}"
    return out, f"built in {got['seconds']:.0f} s"


def plan_lines(cases: list[Case], args: argparse.Namespace) -> list[str]:
    lines = [
        f"{len(cases)} cases, {args.steps} steps each ({args.warmup} warm-up), "
        f"budget {args.budget:.0f} s, device {args.device}{', tiny models' if args.tiny else ''}"
    ]
    for c in cases:
        extra = [f"base {c.quantization}"] if c.quantization != "none" else []
        extra += [f"blocks_to_swap {c.swap}"] if c.swap else []
        extra += ["checkpointing"] if c.checkpointing else []
        lines.append(
            f"  {c.name:<28} {c.method:<17} {case_px(c, args.tiny):>5} px {c.precision} "
            f"{' '.join(extra)}  (timeout {ARCHS[c.arch].case_timeout_s} s)"
        )
    return lines


def dry_run(cases: list[Case], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Build every case's config and estimate it here: no GPU, no weights written."""
    from kit.preflight.estimate import estimate

    src = sources({c.arch for c in cases}, work, args.tiny)
    rows = []
    for c in cases:
        try:
            cfg = case_config(c, src[c.arch], work, args.steps, args.tiny)
        except Exception as e:  # the kit may lack a key yet: say so and go on
            row = {"name": c.name, "error": f"config: {type(e).__name__}: {e}"[:300]}
        else:
            row = estimate_one(c.name, cfg, estimate)
        rows.append(row)
        if "error" in row:
            print(f"  {c.name:<28} {row['error']}", flush=True)
        else:
            print(
                f"  {c.name:<28} estimate {row['allocated_bytes'] / GIB:7.2f} GiB allocated, "
                f"{row['total_bytes'] / GIB:7.2f} GiB total ({row['seconds']:.1f} s)",
                flush=True,
            )
    return rows


def run_all(
    cases: list[Case], args: argparse.Namespace, work: Path, deadline: float | None = None
) -> list[dict[str, Any]]:
    """Every case in a child of its own, within the budget; the estimates in a child beside."""
    deadline = deadline or time.monotonic() + args.budget
    env = child_env(args.device)
    src = sources({c.arch for c in cases}, work, args.tiny)
    results: dict[str, dict[str, Any]] = {c.name: {"name": c.name} for c in cases}
    specs = []
    for c in cases:
        px, ti = case_px(c, args.tiny), c.method == "textual_inversion"
        write_dataset(dataset_dir(work, px, ti), px, ti)
        try:
            cfg = case_config(c, src[c.arch], work, args.steps, args.tiny)
        except Exception as e:
            results[c.name]["status"] = f"config: {type(e).__name__}: {e}"[:300]
            continue
        specs.append({"name": c.name, "config": cfg.to_dict()})
    est_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "4")}
    est_log = work / "logs" / "estimates"
    estimator = spawn("estimate", specs, est_log, est_env)
    models: dict[str, tuple[Path | None, str]] = {}
    for c in cases:
        r = results[c.name]
        if "status" in r:
            continue
        left = deadline - time.monotonic()
        if left < MIN_LEFT_S:
            r["status"] = "skipped: time budget spent"
            continue
        if c.arch not in models:
            a = ARCHS[c.arch]
            models[c.arch] = ensure_model(
                c.arch, src[c.arch], work, args, min(a.build_timeout_s, left)
            )
            print(f"model {c.arch}: {models[c.arch][1]}", flush=True)
        folder, why = models[c.arch]
        if folder is None:
            r["status"] = f"failed: {why}"
            continue
        left = deadline - time.monotonic()
        if left < MIN_LEFT_S:
            r["status"] = "skipped: time budget spent"
            continue
        shutil.rmtree(work / "runs" / c.name, ignore_errors=True)
        cfg = case_config(c, folder, work, args.steps, args.tiny)
        spec = {"name": c.name, "config": cfg.to_dict()}
        timeout = min(ARCHS[c.arch].case_timeout_s, left)
        r.update(run_child("case", spec, work / "logs" / c.name, timeout, env))
        print(f"{c.name}: {r['status']} in {r['seconds']:.0f} s", flush=True)
    timed_out = finish(estimator, max(10.0, deadline - time.monotonic()))
    got = {e["name"]: e for e in reports(est_log)}
    missing = "not estimated in time" if timed_out else f"estimator: {last_error(est_log)}"
    for name, r in results.items():
        r["estimate"] = got.get(name, {"error": missing})
    return [results[c.name] for c in cases]


# ---------------------------------------------------------------- kit vs script


def compare_cost(tiny: bool, built: bool) -> int:
    """Seconds the comparison is budgeted (conservatively): both sides' runs, and the SDXL
    folder's build when it is not there yet."""
    return 2 * COMPARE_SIDE_S[tiny] + (0 if built else COMPARE_BUILD_S[tiny])


def compare_line(args: argparse.Namespace, work: Path) -> str:
    """The comparison in the plan: what it runs and what it is budgeted."""
    spec = bench_step().sdxl_spec(args.tiny, COMPARE_STEPS, COMPARE_WARMUP)
    built = model_built(work, "sdxl", args.tiny)
    return (
        f"  {'compare-sdxl':<28} kit vs script, SDXL LoRA {spec['resolution']} px "
        f"{spec['precision']} rank {spec['rank']}, {spec['steps']} steps "
        f"({spec['warmup']} warm-up) each; budgeted {compare_cost(args.tiny, built)} s"
        + ("" if built else " (with the SDXL build)")
    )


def model_built(work: Path, arch: str, tiny: bool) -> bool:
    """Whether the architecture's folder is already built from its current configs."""
    key = model_dir(work, arch, tiny) / SOURCE_KEY
    src = sources({arch}, work, tiny)[arch]
    return key.is_file() and key.read_text() == source_key(src)


def dry_run_compare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The comparison's kit config, checked, and its model FLOPs per step; no weights."""
    from kit.config import load_config

    bench = bench_step()
    spec = bench.sdxl_spec(args.tiny, COMPARE_STEPS, COMPARE_WARMUP)
    src = sources({"sdxl"}, work, args.tiny)["sdxl"]
    out = work / "compare-sdxl" / "dry-run"
    try:
        load_config(bench.sdxl_kit_config(src, work / "compare-sdxl" / "images", out, spec))
        flops = bench.unet_step_flops(src, spec)
    except Exception as e:  # say so and go on, as the cases' dry run does
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"  {'compare-sdxl':<28} {row['error']}", flush=True)
        return row
    print(
        f"  {'compare-sdxl':<28} kit config checked; model FLOPs per step "
        f"{flops / 1e12:.4g} TFLOP (UNet forward and backward)",
        flush=True,
    )
    return {"flops_per_step": flops}


def run_compare(args: argparse.Namespace, work: Path, deadline: float) -> dict[str, Any]:
    """The kit against the SDXL script in a child, if the budget left holds its cost; on the
    SDXL folder the cases use (built here when not there yet)."""
    built = model_built(work, "sdxl", args.tiny)
    cost, left = compare_cost(args.tiny, built), deadline - time.monotonic()
    if left < cost:
        return {"status": f"skipped: budgeted {cost} s, {left:.0f} s of the budget left"}
    src = sources({"sdxl"}, work, args.tiny)["sdxl"]
    timeout = min(ARCHS["sdxl"].build_timeout_s, left)
    folder, why = ensure_model("sdxl", src, work, args, timeout)
    print(f"model sdxl: {why}", flush=True)
    if folder is None:
        return {"status": f"failed: {why}"}
    runs = work / "compare-sdxl"
    for path in [*runs.glob("kit-*"), *runs.glob("script-*")]:  # the images are kept
        shutil.rmtree(path, ignore_errors=True)
    spec = {"tiny": args.tiny, "device": args.device, "steps": COMPARE_STEPS}
    spec.update(warmup=COMPARE_WARMUP, base=str(folder), work=str(runs))
    timeout = min(2 * COMPARE_SIDE_S[args.tiny] + 60, deadline - time.monotonic())
    got = run_child(
        "compare", spec, work / "logs" / "compare-sdxl", timeout, child_env(args.device)
    )
    print(f"compare-sdxl: {got['status']} in {got['seconds']:.0f} s", flush=True)
    return got


def render_compare(r: dict[str, Any]) -> str:
    """The comparison's section of the markdown: its table, or why there is none."""
    head = "Kit vs script (SDXL LoRA, `--compare-sdxl`):"
    if r.get("status") != "ok":
        return f"{head} {r.get('status', 'not run')}.\n"
    return f"{head}\n\n{bench_step().sdxl_table(r)}"


# ---------------------------------------------------------------- kernels

KERNELS_S = 240
"""The most seconds `--kernels` may take: SDPA's backends at SD1.5 and SDXL shapes, and the
real SD1.5 UNet's LoRA step at 512 px in bf16, default against channels_last and compiled."""


def run_kernels(args: argparse.Namespace, work: Path, deadline: float) -> str:
    """benchmarks/bench_kernels.py on this GPU in bf16, in a child within what the budget
    leaves (at most KERNELS_S); its markdown, or why there is none."""
    head = "Kernels (`--kernels`, benchmarks/bench_kernels.py):"
    left = min(KERNELS_S, deadline - time.monotonic())
    if left < 60:
        return f"{head} skipped: {left:.0f} s of the budget left.\n"
    out = work / "kernels.md"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--device", args.device]
    # On the CPU (a smoke run) a small step and no compile: the GPU's is what is measured.
    cmd += ["--dtype", "bfloat16", "--unet", "--out", str(out)]
    cmd += (
        ["--px", "512", "--compile"] if args.device == "cuda" else ["--px", "64", "--repeats", "1"]
    )
    log = work / "logs" / "kernels.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=child_env(args.device),
            start_new_session=True,  # `finish` ends its whole group on a timeout
        )
        _LIVE.append(proc)
        timed_out = finish(proc, left)
    if timed_out or not out.is_file():
        why = f"timed out after {left:.0f} s" if timed_out else f"failed: {last_error(log)}"
        return f"{head} {why}.\n"
    return f"{head}\n\n{out.read_text(encoding='utf-8')}"


# ---------------------------------------------------------------- the table


def steady_rate(times: list[float], warmup: int) -> float | None:
    """Steps/s from the end of step `warmup` to the last step."""
    if len(times) <= max(warmup, 1):
        return None
    first = times[warmup - 1] if warmup else times[0]
    n = len(times) - (warmup if warmup else 1)
    return n / (times[-1] - first) if times[-1] > first else None


def _gib(v: float | None) -> str:
    """GiB with two decimals; two significant digits below 0.1 GiB (the tiny models)."""
    if v is None:
        return "–"
    return f"{v / GIB:.2f}" if v >= 0.1 * GIB else f"{v / GIB:.2g}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any], warmup: int) -> str:
    """The markdown: where and when it ran, then one row per case and the failures' reasons."""
    v = meta["versions"]
    names = ("python", "torch", "diffusers", "transformers", "peft", "accelerate", *EXTRA_PACKAGES)
    models = (
        "The families' tiny models rebuilt with random weights (a smoke run)"
        if meta["tiny"]
        else "Real-size models built from the shipped configs with random weights"
    )
    lines = [
        f"Run {meta['date']} on {meta['machine']} (`{meta['mode']}`), kit commit {meta['commit']}; "
        + ", ".join(f"{n} {v.get(n, '?')}" for n in names)
        + f". Took {meta['seconds']:.0f} s.",
        "",
    ]
    if rows:
        lines += [
            f"{models}; batch 1, AdamW, LoRA rank 16 on the family's default targets, "
            f"{meta['steps']} steps (steps/s after {warmup} warm-up steps); Flux with gradient "
            "checkpointing. Measured: the peak `torch.cuda.max_memory_allocated` of the training "
            "steps, against the estimate's allocated bytes; weights: the estimate's weights "
            "against what was allocated when training started.",
            "",
            "| case | status | steps/s | estimate GiB | measured GiB | error | weights GiB "
            "(estimate / at start) | loss first → last | image | s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    reasons = []
    for r in rows:
        est = r.get("estimate", {})
        peak, predicted = r.get("peak_bytes"), est.get("allocated_bytes")
        status = r.get("status", "not run")
        ok = status == "ok"  # an OOM's or a failure's peak is not the step's
        error = f"{predicted / peak - 1:+.1%}" if ok and peak and predicted else "–"
        rate = steady_rate(r.get("times", []), warmup)
        losses = r.get("losses", [])
        bad = [x for x in losses if not math.isfinite(x)]
        loss = f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "–"
        loss += f" ({len(bad)} not finite)" if bad else ""
        short = status if len(status) <= 24 else status[:21] + "…"
        if short != status or "error" in est:
            reasons.append(
                f"- {r['name']}: {status}"
                + (f"; estimate: {est['error']}" if "error" in est else "")
            )
        lines.append(
            f"| {r['name']} | {short} | {'–' if rate is None else f'{rate:.2f}'} | "
            f"{_gib(predicted)} | {_gib(peak)} | {error} | "
            f"{_gib(est.get('weights_bytes'))} / {_gib(r.get('start_bytes'))} | {loss} | "
            f"{r.get('image', '–')} | {r.get('seconds', 0):.0f} |"
        )
    if reasons:
        lines += ["", *reasons]
    return "\n".join(lines) + "\n"


def fill_readme(body: str, readme: Path = README) -> None:
    """Put `body` between the GPU-check marks of the benchmarks README."""
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} … {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{body.strip()}\n{END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for hidden in ("--child-case", "--child-build", "--child-estimate", "--child-compare"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one case of each kind, fewer steps")
    parser.add_argument("--cases", action="append", default=[], help="globs, comma-separated")
    parser.add_argument(
        "--arch",
        action="append",
        default=[],
        help="shipped architecture folders (comma-separated) to add LoRA cases for, e.g. a new "
        "family's: --arch FOLDER --cases 'FOLDER-*'",
    )
    parser.add_argument("--dry-run", action="store_true", help="plan, configs, estimates; no GPU")
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole run")
    parser.add_argument("--steps", type=int, help="training steps per case (10; --quick 6)")
    parser.add_argument("--warmup", type=int, help="steps left out of steps/s (3; --quick 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the families' tiny models (smoke)")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "kit-gpu-check"))
    parser.add_argument("--out", help="the markdown table (default benchmarks/gpu_check.md)")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md as it is")
    parser.add_argument("--fill-readme", metavar="FILE", help="put a saved table in README.md")
    parser.add_argument("--compare-sdxl", action="store_true", help="kit vs the SDXL script first")
    parser.add_argument("--no-cases", action="store_true", help="with --compare-sdxl: only that")
    parser.add_argument(
        "--kernels", action="store_true", help="SDPA backends, channels_last, compile"
    )
    args = parser.parse_args(argv)
    roles = [("case", child_case), ("build", child_build), ("estimate", child_estimate)]
    for role, run in [*roles, ("compare", child_compare)]:
        spec_file = getattr(args, f"child_{role}")
        if spec_file:
            run(json.loads(Path(spec_file).read_text()))
            return
    if args.fill_readme:
        fill_readme(Path(args.fill_readme).read_text(encoding="utf-8"))
        return
    args.steps = args.steps or (6 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    patterns = [p.strip() for arg in args.cases for p in arg.split(",") if p.strip()]
    if args.no_cases and not (args.compare_sdxl or args.kernels):
        raise SystemExit("--no-cases leaves nothing to run without --compare-sdxl or --kernels")
    arches = [a.strip() for arg in args.arch for a in arg.split(",") if a.strip()]
    cases = [] if args.no_cases else select(all_cases(arches), patterns, args.quick)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KIT_VRAM_CACHE", tempfile.mkdtemp(prefix="vram-", dir=work))
    print("\n".join(plan_lines(cases, args)), flush=True)
    if args.compare_sdxl:
        print(compare_line(args, work), flush=True)
    if args.dry_run:
        if args.compare_sdxl:
            dry_run_compare(args, work)
        rows = dry_run(cases, args, work)
        failed = [r["name"] for r in rows if "error" in r]
        print(f"dry run: {len(rows) - len(failed)} of {len(rows)} cases estimated", flush=True)
        return
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("--device cpu trains the tiny models only: add --tiny (or --dry-run)")
    if args.device == "cuda" and not args.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                "no CUDA GPU here: --dry-run plans and estimates without one, and "
                "--tiny --device cpu runs the whole path on the tiny models"
            )
    start = time.monotonic()
    try:
        deadline = start + args.budget
        compare = run_compare(args, work, deadline) if args.compare_sdxl else None
        kernels = run_kernels(args, work, deadline) if args.kernels else None
        rows = run_all(cases, args, work, deadline) if cases else []
    finally:
        for proc in list(_LIVE):  # stopped early (Ctrl-C): no child outlives the run
            kill(proc)
    flags = ["--quick"] * args.quick + ["--tiny"] * args.tiny + [f"--device {args.device}"]
    flags += ["--compare-sdxl"] * args.compare_sdxl + ["--no-cases"] * args.no_cases
    flags += ["--kernels"] * args.kernels
    mode = " ".join(flags)
    dev = next((r["device"] for r in rows if r.get("device")), {})
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(dev),
        "mode": mode,
        "tiny": args.tiny,
        "commit": git_commit(),
        "versions": versions(),
        "steps": args.steps,
        "seconds": time.monotonic() - start,
    }
    table = render(rows, meta, args.warmup)
    if compare is not None:
        table += "\n" + render_compare(compare)
    if kernels is not None:
        table += "\n" + kernels
    print(table, flush=True)
    real = args.device == "cuda" and not args.tiny
    out = (
        Path(args.out)
        if args.out
        else (ROOT / "benchmarks" / "gpu_check.md" if real else work / "gpu_check.md")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table, encoding="utf-8")
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "cases": rows, "compare": compare}, indent=1)
    )
    if real and not args.no_readme:
        fill_readme(table)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
