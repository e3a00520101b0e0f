"""Shared fixtures: each family's tiny model written once per session, and the short run config
that training tests start from."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kit.logs import quiet_libraries

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "datasets_example"

quiet_libraries()


def lazy_module(name: str, reason: str | None = None) -> ModuleType:
    """Module `name`, imported when a test first uses it rather than at collection (where
    every module's imports add up before the first test runs); skips the calling test module
    when it is not installed, as `pytest.importorskip` does."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        pytest.skip(reason or f"could not import {name!r}", allow_module_level=True)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Every run in the suite, in this process and in the ones it starts, uses one fixed thread
# count: a count chosen from the machine's load (kit.run.threads) could differ between two runs
# that a test compares bit for bit. tests/test_threads.py takes the variable away to test that.
# Under pytest-xdist each worker takes its share of the cores, so that workers never
# oversubscribe them (threads that wait for a core spin and slow everyone).
if "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


TINY_CACHE = Path(os.environ.get("KIT_TEST_CACHE", ROOT / ".cache" / "tests"))
"""Where tiny bases are kept between sessions and shared by pytest-xdist workers."""


def builder_hash(name: str) -> str:
    """A key for family `name`'s tiny base: the sources that may build it (every family module:
    a builder may import another family's pieces) and the versions of the libraries that write
    it."""
    import hashlib
    from importlib.metadata import version

    families = ROOT / "kit" / "families"
    digest = hashlib.sha256()
    for lib in ("torch", "diffusers", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{lib}={version(lib)};".encode())
    for path in sorted(families.rglob("*.py")):
        digest.update(str(path.relative_to(families)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_base():
    """`tiny_base(name)`: the family's tiny random-init model (as `kit tiny <name>` writes it),
    built once and kept on disk keyed by `builder_hash`, so every worker and later session
    shares it; a test reads it and never writes into it."""
    import fcntl

    from kit.families import get_family

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = TINY_CACHE / f"tiny-{name}-{builder_hash(name)}"
            TINY_CACHE.mkdir(parents=True, exist_ok=True)
            # One worker builds while the others wait; make_tiny writes its folder atomically.
            with open(TINY_CACHE / f".{out.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not out.is_dir():
                    get_family(name).make_tiny(out, seed=0)
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_sd15(tiny_base) -> Path:
    """The tiny random-init SD1.5-architecture model."""
    return tiny_base("sd15")


@pytest.fixture(scope="session")
def family_dataset(tmp_path_factory):
    """`family_dataset(name)`: a few captioned samples of the family's kind (images, or clips for
    a video family), written once per session; a test that changes them copies them first."""
    from kit.families import get_family

    made: dict[bool, Path] = {}

    def get(name: str) -> Path:
        video = get_family(name).video
        if video not in made:
            out = tmp_path_factory.mktemp("clips" if video else "images") / "data"
            if video:
                from kit.toy.world import write_example_clips

                write_example_clips(out, n=4, frames=9, seed=0)
            else:
                out.mkdir()
                for image in sorted((EXAMPLE / "images").glob("zorbic_00[0-3].png")):
                    shutil.copy(image, out / image.name)
                    shutil.copy(image.with_suffix(".txt"), out / f"{image.stem}.txt")
            made[video] = out
        return made[video]

    return get


@pytest.fixture()
def dataset(tmp_path, dataset_template) -> Path:
    """24 captioned toy images (`zorbic_000.png` ...) in five aspect ratios, for a test to change."""
    dst = tmp_path / "data"
    shutil.copytree(dataset_template, dst)
    return dst


@pytest.fixture(scope="session")
def dataset_template(tmp_path_factory) -> Path:
    """The images behind `dataset`, drawn once: the example's concept without its prior images."""
    from kit.toy.world import EXAMPLE_SIZES, write_example_dataset

    out = tmp_path_factory.mktemp("dataset") / "data"
    write_example_dataset(out, n=24, priors=0, sizes=EXAMPLE_SIZES)
    return out


def write_config(path: Path, **fields) -> Path:
    """Write a flat JSON config file and return its path."""
    path.write_text(json.dumps(fields, indent=1))
    return path


TINY_RUN = {
    "resolution": 64,
    "bucket_step": 32,
    "lora_rank": 4,
    "learning_rate": 1e-3,
    "train_batch_size": 2,
    "max_train_steps": 4,
    "checkpointing_steps": 2,
    "validation_steps": 0,
    "validation_prompt": ["a red zorbstar"],
    "validation_seeds": [0],
    "validation_num_inference_steps": 2,
    "report_to": "none",
}
"""A short run at a small size, quick on a CPU: what every training test starts from."""


def write_run_config(
    path: Path, *, base: Path, data: Path, family: str = "sd15", **overrides
) -> Path:
    """Write the config of a short run (`TINY_RUN`) on a tiny base model; keyword arguments
    override. The run and its cache go beside the file, in `run/` and `cache/`, unless set."""
    from kit.families import family_class

    if family_class(family).needs_control and "control_dir" not in overrides:
        overrides["control_dir"] = str(paired_controls(Path(data)))
    fields = {
        "model_family": family,
        "pretrained_model": str(base),
        "output_dir": str(path.parent / "run"),
        "image_dir": str(data),
        "cache_dir": str(path.parent / "cache"),
        **TINY_RUN,
        **overrides,
    }
    return write_config(path, **fields)


def short_clips(family: str) -> dict[str, int]:
    """`num_frames: 5` (short clips, quick to train and sample) for a family that trains on
    clips; nothing for a family of images, which refuses frame keys."""
    from kit.families import family_info

    return {"num_frames": 5} if family_info(family).video else {}


def paired_controls(data: Path) -> Path:
    """A control image for each image of `data` (its mirror image, so an edit model has a pair
    to learn), written once beside the folder as `<data>_controls`."""
    from PIL import Image, ImageOps

    out = data.parent / f"{data.name}_controls"
    if not out.is_dir():
        tmp = data.parent / f".{data.name}_controls.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for image in sorted(p for p in data.rglob("*.png") if not p.name.startswith(".")):
            dest = tmp / image.relative_to(data)
            dest.parent.mkdir(parents=True, exist_ok=True)
            ImageOps.mirror(Image.open(image).convert("RGB")).save(dest)
        tmp.rename(out)
    return out


TEXTUAL_INVERSION = {
    "network_type": "textual_inversion",
    "placeholder_tokens": ["<zorb>"],
    "initializer_token": "star",
    "learning_rate": 5e-2,
    "caption_dropout": 0.2,
}
"""Textual inversion of `<zorb>`: captions must call the concept by that placeholder."""


@pytest.fixture()
def make_config(tmp_path, tiny_sd15, dataset):
    """Factory: a short run's config on the tiny SD1.5 and `dataset`; keyword arguments override."""

    def make(name: str = "config.json", **overrides) -> Path:
        return write_run_config(tmp_path / name, base=tiny_sd15, data=dataset, **overrides)

    return make


@pytest.fixture()
def nan_at_call(monkeypatch):
    """`nan_at_call(n)`: the SD1.5 denoiser's n-th prediction comes out NaN, the others real."""
    from kit.families.sd15.family import SD15

    def poison(n: int) -> None:
        real, calls = SD15.predict, {"n": 0}

        def poisoned(self, comps, noisy, timesteps, cond):
            calls["n"] += 1
            out = real(self, comps, noisy, timesteps, cond)
            return out * float("nan") if calls["n"] == n else out

        monkeypatch.setattr(SD15, "predict", poisoned)

    return poison


@pytest.fixture()
def two_processes_and_one(tmp_path, make_config):
    """`two_processes_and_one(**fields)`: train the same short run on two gloo processes and on
    one process with twice the accumulation (the same batches per step); return both run folders."""
    import os
    import subprocess
    import sys

    def run(**fields) -> tuple[Path, Path]:
        ddp, one = tmp_path / "ddp", tmp_path / "one"
        ddp_cfg = make_config(
            "ddp.json", output_dir=str(ddp), gradient_accumulation_steps=1, **fields
        )
        one_cfg = make_config(
            "one.json", output_dir=str(one), gradient_accumulation_steps=2, **fields
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        for cmd in ([*launch, "-m", "kit", "train", str(ddp_cfg)],
                    [sys.executable, "-m", "kit", "train", str(one_cfg)]):  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            assert out.returncode == 0, out.stderr[-3000:]
        return ddp, one

    return run


@pytest.fixture()
def cpu_fp16(monkeypatch):
    """Allow fp16 on this CPU-only machine (`KIT_ALLOW_CPU_FP16`)."""
    import torch

    from kit.train.accel import CPU_FP16_ENV

    if torch.cuda.is_available():
        pytest.skip("these tests run the CPU fp16 path")
    monkeypatch.setenv(CPU_FP16_ENV, "1")


@pytest.fixture(scope="module")
def module_trace_cache(tmp_path_factory):
    """No network, and one VRAM-trace cache for the module that asks for it, so that each
    architecture and shape is traced once there (a module's autouse fixture takes it)."""
    from kit.preflight import estimate as estimating

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("KIT_VRAM_CACHE", str(tmp_path_factory.mktemp("vram")))
        estimating.forget_traces()
        yield
    estimating.forget_traces()


def lora_loads_exactly(family, comps, pipe, folder: Path) -> dict:
    """Random weights in the adapter attached to `comps.denoiser`, written as the family's
    diffusers file into `folder` and loaded through `pipe`'s own `load_lora_weights`: the
    pipeline's transformer holds exactly those weights. Returns them."""
    import torch
    from peft.utils import get_peft_model_state_dict

    from kit.methods.adapters import adapter_state_dict

    generator = torch.Generator().manual_seed(0)
    state = {
        k: torch.randn(v.shape, generator=generator) * 0.1
        for k, v in adapter_state_dict(comps.denoiser).items()
    }
    adapter_cfg = comps.denoiser.peft_config["default"].to_dict()
    family.save_diffusers_lora({"denoiser": state}, {"denoiser": adapter_cfg}, folder)
    pipe.load_lora_weights(str(folder))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    return state


def resumed_equals_straight(tmp_path: Path, b: Path, stop: int = 2, end: int = 4) -> None:
    """Train config `b` to step `stop`, interrupt it, resume it to `end`: it ends on the weights
    of the straight run already trained into tmp_path / "a"."""
    import torch
    from safetensors.torch import load_file

    from kit.config import load_config
    from kit.run import checkpoint as ckpt
    from kit.train.loop import train

    def interrupt(event):
        if event["kind"] == "checkpoint" and event["step"] == stop:
            raise KeyboardInterrupt

    cfg_b = load_config(b)
    assert train(cfg_b, callbacks=[interrupt]).interrupted
    assert train(cfg_b, resume="latest").step == end
    wa = load_file(str(ckpt.checkpoint_dir(tmp_path / "a", end) / ckpt.ADAPTER_FILE))
    wb = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", end) / ckpt.ADAPTER_FILE))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def transformer_calls(pipe, **call) -> list[dict]:
    """The keyword inputs of every transformer call during `pipe(**call)`, cloned: what a
    family's training inputs are compared with, tensor for tensor."""
    import torch

    calls = []
    forward = pipe.transformer.forward

    def record(**kwargs):
        calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        return forward(**kwargs)

    pipe.transformer.forward = record
    try:
        pipe(**call)
    finally:
        pipe.transformer.forward = forward
    return calls


def assert_same_inputs(kit: dict, pipeline: dict) -> None:
    """Every input the kit builds is the pipeline's: tensors equal with their dtype, the rest
    equal."""
    import torch

    for name, ours in kit.items():
        theirs = pipeline[name]
        if torch.is_tensor(ours) or torch.is_tensor(theirs):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
        else:
            assert ours == theirs, name
