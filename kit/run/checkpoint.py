"""Complete training state on disk: written to a temporary folder, marked, then renamed.

Under DeepSpeed or FSDP every process writes its part of the state into a folder of its own
(`SHARDED_DIR`, `FSDP_DIR`), moved in before the checkpoint is marked complete; the trained
weights are saved whole beside it either way, which is what export reads.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kit.errors import KitError, disk_errno, disk_problem
from kit.io import note_written, share
from kit.run.folder import RunDir, step_of

MARKER = "COMPLETE"
ADAPTER_FILE = "adapter.safetensors"
EMA_FILE = "adapter_ema.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
PROGRESS_FILE = "progress.json"
STATE_FILES = (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, PROGRESS_FILE)
"""What an exact resume reads besides the weights."""
SHARDED_DIR = "deepspeed"
"""Under DeepSpeed ZeRO: every process's part of the optimizer state (the engine's own format),
in place of `optimizer.pt`."""
FSDP_DIR = "fsdp"
"""Under FSDP: every process's shard of the trained weights and of the optimizer state (torch's
distributed checkpoint format), in place of `optimizer.pt`. `adapter.safetensors` beside it holds
the same weights gathered whole."""
PER_PROCESS_DIRS = (SHARDED_DIR, FSDP_DIR)
"""The folders that hold a state split by process; a checkpoint with one has no `optimizer.pt`."""
_CORE = {Path(f).stem for f in (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE)}


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return RunDir(Path(run_dir)).checkpoint(step)


def _step_folders(run_dir: Path) -> list[tuple[int, Path, bool]]:
    """Every checkpoint folder in name order: its step, path and whether it is complete."""
    root = RunDir(Path(run_dir)).checkpoints
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        step = step_of(d)
        if step is not None and d.is_dir():
            out.append((step, d, (d / MARKER).is_file()))
    return out


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are skipped with a warning."""
    out = []
    for step, d, complete in _step_folders(run_dir):
        if complete:
            out.append((step, d))
        else:
            warnings.warn(f"skipping incomplete checkpoint {d} (no {MARKER} marker)", stacklevel=2)
    return [d for _, d in sorted(out, key=lambda p: p[0])]


def complete_checkpoints(run_dir: Path) -> dict[int, Path]:
    """Complete checkpoints by step, oldest first, passing over incomplete ones in silence (a
    reader of a run that may still be writing one)."""
    return dict(sorted((step, d) for step, d, complete in _step_folders(run_dir) if complete))


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """`latest` → newest complete checkpoint (or None); else the named folder, which must be complete."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        for newer, path in zip([None, *found[::-1]], found[::-1], strict=False):
            why = damaged(path)
            if not why:
                if newer is not None:
                    warnings.warn(
                        f"using {path}, the newest checkpoint that reads back whole",
                        stacklevel=2,
                    )
                return path
            warnings.warn(
                f"checkpoint {path} is damaged ({why}); falling back to the one before it",
                stacklevel=2,
            )
        return None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise KitError(f"not a complete checkpoint: {path} (no {MARKER} marker)")
    return path


def damaged(path: Path) -> str:
    """Why a complete checkpoint's files cannot all be read back ("" when they can): a weight
    file whose header does not parse or that is shorter than it says, a `.pt` archive cut
    short, a progress file that is not JSON. Cheap: headers and sizes, never the tensors."""
    for f in sorted(path.iterdir()):
        try:
            if f.suffix == ".safetensors":
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                if f.stat().st_size < 8 + n + max(ends, default=0):
                    return f"{f.name} is cut short"
            elif f.suffix == ".pt":
                with zipfile.ZipFile(f) as z:
                    if any(
                        i.header_offset + i.compress_size > f.stat().st_size for i in z.infolist()
                    ):
                        return f"{f.name} is cut short"
            elif f.name == PROGRESS_FILE:
                json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
            return f"{f.name} does not read"
    return ""


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every random state that training draws from."""
    state = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    """Restore what `rng_state` saved."""
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a (nested) state."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _checkpoint_bytes(
    adapter: dict[str, torch.Tensor],
    optimizer: Any,
    ema_weights: dict[str, torch.Tensor] | None,
    previous: list[Path],
) -> int:
    """About how much a checkpoint needs on disk: the last complete one's size where there is
    one (it holds the same states), else the tensors being written."""
    if previous:
        return sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file())
    total = _tensor_bytes(adapter) + _tensor_bytes(ema_weights or {})
    if optimizer is not None:
        try:
            total += _tensor_bytes(optimizer.state_dict())
        except Exception:  # noqa: BLE001 (an estimate only)
            pass
    return total


def save_checkpoint(
    run_dir: Path,
    step: int,
    adapter: dict[str, torch.Tensor],
    optimizer: Any,
    lr_scheduler: Any,
    generator: torch.Generator,
    progress: dict[str, Any],
    keep: int = 0,
    extras: dict[str, Any] | None = None,
    ema_weights: dict[str, torch.Tensor] | None = None,
    folders: dict[str, Path] | None = None,
) -> Path:
    """Write the full state of `step`; the folder appears only once complete.

    `extras` are further states (EMA, gradient scaler), each saved as `<name>.pt`;
    `ema_weights` are the averaged trained weights, saved beside the raw ones. `folders` are
    finished folders (name → where they were written) moved in before the checkpoint is marked
    complete: the DeepSpeed or FSDP state that every process wrote. `optimizer` is None when
    that state holds the optimizer's.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = RunDir(Path(run_dir)).staged_checkpoint(step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file(adapter, str(tmp / ADAPTER_FILE))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        torch.save(lr_scheduler.state_dict(), tmp / SCHEDULER_FILE)
        torch.save(rng_state(generator), tmp / RNG_FILE)
        for name, state in (extras or {}).items():
            torch.save(state, tmp / f"{name}.pt")
        if ema_weights is not None:
            save_file(ema_weights, str(tmp / EMA_FILE))
        (tmp / PROGRESS_FILE).write_text(json.dumps(progress, indent=2))
        for name, folder in (folders or {}).items():
            shutil.move(str(folder), str(tmp / name))
        (tmp / MARKER).write_text(str(step))
    except Exception as e:
        # torch and safetensors report a full disk as their own errors, not as an OSError.
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
        if not isinstance(e, OSError) and disk_errno(e) is None:
            raise
        previous = list_checkpoints(run_dir)
        kept = (
            f"the previous checkpoint {previous[-1]} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        need = _checkpoint_bytes(adapter, optimizer, ema_weights, previous)
        why = disk_problem(e, tmp.parent, needed=need) or str(e)
        raise KitError(
            f"could not write the checkpoint of step {step} ({why}); the partial one was "
            f"removed; {kept}"
        ) from None
    share(tmp)  # safetensors writes its files 0600: a checkpoint is shared as any file
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    note_written(final)  # the run's ledger: --overwrite removes these files, and only these
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint folder back into memory (extras under `extras`).

    `optimizer` is None for a DeepSpeed or FSDP checkpoint: its optimizer state is in
    `SHARDED_DIR` or `FSDP_DIR`, split by process, and only that launch reads it back
    (`sharded_by`).
    """
    try:
        return _load(path)
    except Exception as e:  # noqa: BLE001 (a damaged file, whichever library reads it)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise KitError(
            f"checkpoint {path} does not read back ({first}); resume from an earlier one "
            "(--resume <its folder>)"
        ) from None


def _load(path: Path) -> dict[str, Any]:
    optimizer = path / OPTIMIZER_FILE
    return {
        "adapter": load_file(str(path / ADAPTER_FILE)),
        "ema_weights": load_file(str(path / EMA_FILE)) if (path / EMA_FILE).is_file() else None,
        "optimizer": torch.load(optimizer, weights_only=True) if optimizer.is_file() else None,
        "scheduler": torch.load(path / SCHEDULER_FILE, weights_only=True),
        "rng": torch.load(path / RNG_FILE, weights_only=True),
        "progress": json.loads((path / PROGRESS_FILE).read_text()),
        "extras": {
            f.stem: torch.load(f, weights_only=True)
            for f in sorted(path.glob("*.pt"))
            if f.stem not in _CORE
        },
    }


def sharded_by(path: Path) -> str | None:
    """Which launch split a checkpoint's state by process: `deepspeed`, `fsdp`, or None."""
    for name in PER_PROCESS_DIRS:
        if (path / name).is_dir():
            return name
    return None


def exported_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights to export from a checkpoint: the EMA average when there is one."""
    ema = path / EMA_FILE
    return load_file(str(ema if ema.is_file() else path / ADAPTER_FILE))
