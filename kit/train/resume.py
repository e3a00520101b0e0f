"""Resuming a run exactly, and keeping a new run out of an old one's folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.data.buckets import epoch_batches
from kit.data.cache import CachedDataset
from kit.errors import KitError
from kit.families.identity import fingerprint as id_digest
from kit.families.identity import public_name
from kit.io import write_text
from kit.optim import train_weights
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.run.owned import refuse_foreign_files
from kit.train.accel import is_fsdp, load_fsdp, load_sharded
from kit.train.state import TrainState

# Settings that change the sequence of updates: a resume with other values is not exact.
EXACTNESS_KEYS = ("train_batch_size", "gradient_accumulation_steps", "seed", "resolution")


# Settings that shape what a checkpoint holds: a resume with other values cannot load it.
SHAPE_KEYS = (
    "model_family",
    "network_type",
    "lora_rank",
    "use_dora",
    "lora_target_modules",
    "train_text_encoder",
    "text_encoder_target_modules",
)


def adapter_shape(cfg: Config) -> dict[str, Any]:
    """The settings that decide the trained weights' names and shapes (those the config has)."""
    out = {}
    for k in SHAPE_KEYS:
        with contextlib.suppress(KitError):
            out[k] = cfg.get(k)
    return out


def base_record(cfg: Config, identity: dict[str, str]) -> dict[str, str]:
    """The base a checkpoint was trained on: its public name and a digest of its parts' configs
    and files (no local path)."""
    return {"name": public_name(cfg.model.pretrained_model), "digest": id_digest(identity)}


def fingerprint(
    cfg: Config, data: CachedDataset, identity: dict[str, str] | None = None
) -> dict[str, Any]:
    """What a resume must find unchanged to continue exactly: the settings, the images, the
    adapter's shape and (given the loaded base's `identity`) the base model."""
    out = {
        "settings": {k: cfg.get(k) for k in EXACTNESS_KEYS},
        "dataset": sorted(data.digests),
        "captions": caption_digests(data),
        "adapter": adapter_shape(cfg),
    }
    if identity is not None:
        out["base"] = base_record(cfg, identity)
    return out


def caption_digests(data: CachedDataset) -> dict[str, str]:
    """Each trained image's captions, by the image's digest (its name may move): a short digest
    of the caption text, so that a caption edited after a checkpoint is found on resume."""
    texts: dict[str, list[str]] = {}
    for s, d in zip(data.kept(), data.digests, strict=False):
        texts.setdefault(d, []).append(s.caption)
    return {
        d: hashlib.sha256("\n".join(sorted(t)).encode()).hexdigest()[:16] for d, t in texts.items()
    }


def changed_captions(saved: Any, data: CachedDataset) -> list[str]:
    """The images (file names) whose caption changed since `saved` (a checkpoint's record)."""
    if not isinstance(saved, dict):
        return []  # a checkpoint from before captions were recorded
    now = caption_digests(data)
    names = {
        d: s.blob.name if s.blob is not None else str(s.image)
        for s, d in zip(data.kept(), data.digests, strict=False)
    }
    return sorted(names[d] for d, c in now.items() if d in saved and saved[d] != c)


def check_shape(cfg: Config, resume_from: Path | None) -> None:
    """Refuse, before anything loads, a resume whose checkpoint holds another adapter (family,
    network, rank, targets): its weights would not fit (`--force` cannot help)."""
    if resume_from is None:
        return
    try:
        progress = json.loads((resume_from / ckpt.PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return  # read again (and refused by name) when the checkpoint loads
    check_position(resume_from, progress)
    saved = progress.get("adapter", {}) if isinstance(progress, dict) else {}
    now = adapter_shape(cfg)
    changed = [f"{k}: {v!r} → {now[k]!r}" for k, v in saved.items() if k in now and now[k] != v]
    if changed:
        raise KitError(
            f"cannot resume {resume_from}: it holds another adapter than this config trains ("
            + "; ".join(changed)
            + "); set them back to resume, or start a new run in another output_dir"
        )


POSITION_KEYS = ("step", "epoch", "position")
"""Where a checkpoint's run stood: its step, and the epoch and batch it reads next."""


def _damaged_position(checkpoint: Path, key: str, why: str) -> KitError:
    return KitError(
        f"checkpoint {checkpoint}: {ckpt.PROGRESS_FILE} key '{key}' {why}; the saved state is "
        "damaged: resume from another checkpoint (--resume <its folder>) or start again "
        "(--overwrite)"
    )


def check_position(
    checkpoint: Path, progress: Any, batches: int | None = None, accumulation: int = 0
) -> None:
    """Refuse a checkpoint whose saved position is missing, of the wrong shape or out of range
    (an edited or damaged file would otherwise resume silently at the wrong place). Once the
    data is planned: `batches` in the epoch it stands in, `accumulation` batches per step."""
    if not isinstance(progress, dict):
        raise _damaged_position(checkpoint, "step", "is missing: the file holds no record")
    for key in POSITION_KEYS:
        value = progress.get(key)
        if key not in progress:
            raise _damaged_position(checkpoint, key, "is missing")
        if type(value) is not int:
            raise _damaged_position(checkpoint, key, f"is {value!r}, not a whole number")
        if value < 0:
            raise _damaged_position(checkpoint, key, f"is {value}, below 0")
    named = ckpt.step_of(checkpoint)
    if named is not None and progress["step"] != named:
        raise _damaged_position(
            checkpoint, "step", f"is {progress['step']}, not the {named} the folder is named for"
        )
    # Every epoch takes at least one batch of each process, every step `accumulation` of them.
    if accumulation and progress["epoch"] > progress["step"] * accumulation:
        raise _damaged_position(
            checkpoint, "epoch", f"is {progress['epoch']}, more epochs than the steps trained"
        )
    if batches is not None and progress["position"] > batches:
        raise _damaged_position(
            checkpoint,
            "position",
            f"is {progress['position']}, past the {batches} batches of epoch {progress['epoch']}",
        )


def base_change(saved: dict[str, Any] | None, now: dict[str, str]) -> str:
    """How the base differs from the one a checkpoint was trained on ("" when the same)."""
    if not saved or saved.get("digest") == now["digest"]:
        return ""
    if saved.get("name") != now["name"]:
        return f"base model: {saved.get('name')} → {now['name']}"
    return f"base model: {now['name']} holds other weights or configs than when it was saved"


def check_resume(
    run: RunDir,
    cfg: Config,
    data: CachedDataset,
    resume_from: Path | None,
    force: bool,
    identity: dict[str, str] | None = None,
) -> None:
    """Refuse (or, with `force`, warn about) a resume whose settings, images or base model
    have changed."""
    if resume_from is None:
        return
    check_shape(cfg, resume_from)
    saved = json.loads((resume_from / "progress.json").read_text())
    now = fingerprint(cfg, data, identity)
    settings = saved.get("settings", {})
    changes = [
        f"{k}: {settings.get(k)!r} → {v!r}"
        for k, v in now["settings"].items()
        if settings.get(k) != v
    ]
    if saved.get("dataset") != now["dataset"]:
        before, after = set(saved.get("dataset", [])), set(now["dataset"])
        changes.append(
            f"dataset: {len(after - before)} image(s) added or changed, {len(before - after)} removed"
        )
    if not changes:  # the checkpoint's own epochs: its position must lie inside one
        t = cfg.train
        epoch = epoch_batches(data.plan, t.train_batch_size, t.seed, saved["epoch"])
        check_position(resume_from, saved, len(epoch), t.gradient_accumulation_steps)
    if "base" in now and base_change(saved.get("base"), now["base"]):
        changes.append(base_change(saved.get("base"), now["base"]))
    edited = changed_captions(saved.get("captions"), data)
    if edited:
        shown = ", ".join(Path(n).name for n in edited[:5])
        more = f" and {len(edited) - 5} more" if len(edited) > 5 else ""
        changes.append(f"captions of {len(edited)} image(s) edited: {shown}{more}")
    if changes and not force:
        raise KitError(
            f"cannot resume {resume_from} exactly; changed since it was saved: "
            + "; ".join(changes)
            + " (pass --force to resume on them as they are now, or --overwrite to start again)"
        )
    if changes:
        warnings.warn("resuming despite changes: " + "; ".join(changes), stacklevel=2)


def restore(s: TrainState, checkpoint: Path) -> None:
    """Put a checkpoint's weights, optimizer, schedule, random streams and position back."""
    state = ckpt.load_checkpoint(checkpoint)
    if is_fsdp(s.accelerator):
        # The sharded model takes its weights from the shards, with the optimizer's.
        load_fsdp(s.trained[0], s.optimizer, checkpoint)
    else:
        s.method.load_state_dict(s.comps, state["adapter"])
    if s.deepspeed:
        load_sharded(s.trained[0], checkpoint)  # the DeepSpeed engine
    elif is_fsdp(s.accelerator):
        pass  # loaded above
    elif state["optimizer"] is None:
        how = {ckpt.FSDP_DIR: "FSDP"}.get(ckpt.sharded_by(checkpoint) or "", "DeepSpeed")
        raise KitError(
            f"{checkpoint} was saved under {how}: its optimizer state is split across "
            "processes; resume it with the same accelerate config file (accelerate launch "
            "--config_file ...)"
        )
    else:
        s.optimizer.load_state_dict(state["optimizer"])
    # A schedule-free optimizer was saved in eval mode, beside the weights it averaged; the
    # weights its next step starts from follow from those and its state.
    train_weights(s.optimizer)
    s.scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"], s.generator)
    if s.ema is not None and "ema" in state["extras"]:
        s.ema.load_state_dict(state["extras"]["ema"])
    scaler = s.accelerator.scaler
    if scaler is not None and "scaler" in state["extras"]:
        scaler.load_state_dict(state["extras"]["scaler"])
    s.step, s.epoch, s.position = (state["progress"][k] for k in ("step", "epoch", "position"))
    s.drawn = dict(state["progress"].get("drawn", {}))
    s.cursor = (s.epoch, s.position)
    if s.main:
        truncate_metrics(s.run, s.step)


def truncate_metrics(run: RunDir, step: int) -> None:
    """Drop logged rows past the resumed step: those steps are trained again."""
    rows = [r for r in run.read_metrics() if r.get("step", 0) <= step]
    write_text(run.metrics, "".join(json.dumps(r) + "\n" for r in rows))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_dir(cfg: Config) -> None:
    """Refuse an output_dir a run must not write into: empty (the current folder), the current
    folder itself, an existing file, or a folder inside one of the run's dataset folders (the
    next scan would train on the run's own grids)."""
    given = cfg.train.output_dir
    if not given.strip():
        raise KitError(
            "output_dir: empty; set it to a folder of its own for the run (e.g. runs/my-lora)"
        )
    out = Path(given).expanduser().resolve()
    if out == Path.cwd().resolve():
        raise KitError(
            f"output_dir: {given} is the current folder; a run writes checkpoints, logs and "
            "grids into its folder: give it a folder of its own (e.g. runs/my-lora)"
        )
    if out.exists() and not out.is_dir():
        raise KitError(f"output_dir: {given} is a file, not a folder; choose a folder for the run")
    run = RunDir(out)
    refuse_foreign_files(run)
    if run.config.is_file() and not run.manifest.is_file():
        raise KitError(
            f"output_dir: {given} holds a {run.config.name} that no run wrote (no "
            f"{run.manifest.name} beside it); the run would replace it: give the run a folder "
            "of its own (e.g. runs/my-lora)"
        )
    d = cfg.data
    folders = {
        "image_dir": d.image_dir,
        "caption_dir": d.caption_dir,
        "mask_dir": d.mask_dir,
        "validation_image_dir": cfg.validation.validation_image_dir,
    }
    for i, ds in enumerate(d.datasets):
        folders.update(
            {
                f"datasets[{i}].{k}": getattr(ds, k) or ""
                for k in ("image_dir", "caption_dir", "mask_dir")
            }
        )
    for key, folder in folders.items():
        if folder and _inside(out, Path(folder).expanduser().resolve()):
            raise KitError(
                f"output_dir: {given} is inside {key} ({folder}); the run's grids would be "
                "scanned as training images: put the run folder outside the dataset"
            )
