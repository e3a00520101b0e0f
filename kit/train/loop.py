"""The training loop: cached data, an adapted denoiser, accelerate, checkpoints, validation."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.data.buckets import epoch_batches
from kit.data.cache import CachedDataset, fill_cache, plan_cache
from kit.data.scan import check_dataset
from kit.errors import KitError
from kit.families import Family, get_family
from kit.families.loading import load_base
from kit.io import write_text
from kit.methods.network import build_network
from kit.optim import make_optimizer, make_scheduler
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from kit.sample.validate import default_prompts, image_specs, run_validation
from kit.train.objective import EMA, FixedLoss, denoising_loss, drop_captions

Callback = Callable[[dict[str, Any]], None]


class StopTraining(Exception):
    """Raised by a callback to end training early: a checkpoint is saved, as after Ctrl-C."""


# Settings that change the sequence of updates: a resume with other values is not exact.
EXACTNESS_KEYS = ("train_batch_size", "gradient_accumulation_steps", "seed", "resolution")


@dataclass
class TrainResult:
    """Where a run ended and what it wrote."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    interrupted: bool = False
    validation_grids: list[Path] = field(default_factory=list)


# Set to 1 to train fp16 (autocast and gradient scaler) on a CPU: slow and of no use for real
# training, but it runs the fp16 path (scaler, overflow skips, NaN stop) where no GPU is.
CPU_FP16_ENV = "KIT_ALLOW_CPU_FP16"


def resolve_precision(requested: str) -> str:
    """The mixed precision this machine can run: the request, or fp32 with a warning."""
    if requested == "no":
        return "no"
    if not torch.cuda.is_available():
        if requested == "fp16" and os.environ.get(CPU_FP16_ENV) == "1":
            return "fp16"
        warnings.warn(
            f"mixed_precision={requested!r} needs a CUDA GPU; none found, training in fp32",
            stacklevel=2,
        )
        return "no"
    if requested == "bf16" and not torch.cuda.is_bf16_supported():
        warnings.warn(
            "this GPU lacks bf16; training in fp32 (try mixed_precision=fp16)", stacklevel=2
        )
        return "no"
    return requested


def _accelerator(cfg: Config, run: RunDir) -> tuple[Any, str]:
    """accelerate's Accelerator for this run, and the precision actually used."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs, ProjectConfiguration

    t = cfg.train
    precision = resolve_precision(t.mixed_precision)
    handlers = []
    if precision == "fp16":
        handlers.append(
            GradScalerKwargs(
                init_scale=t.grad_scaler_init_scale,
                growth_factor=t.grad_scaler_growth_factor,
                backoff_factor=t.grad_scaler_backoff_factor,
                growth_interval=t.grad_scaler_growth_interval,
            )
        )
    on_cpu = not torch.cuda.is_available()
    deepspeed = _deepspeed_launch()
    if on_cpu and deepspeed:
        # accelerate drops DeepSpeed when told `cpu=True`; without it, it must be told that the
        # processes talk over gloo, or each one takes itself for the only process.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision") != precision:
        # accelerate keeps one precision per process; a later run in the same process (a
        # notebook kernel, a test session) may ask for another. The process group is kept.
        AcceleratorState._reset_state()
    accelerator = Accelerator(
        # Without a GPU, `cpu=True` is what makes accelerate join a multi-process (gloo) launch.
        cpu=on_cpu and not deepspeed,
        mixed_precision=precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=None if t.report_to == "none" else t.report_to,
        project_config=ProjectConfiguration(project_dir=str(run.root), logging_dir=str(run.logs)),
        kwargs_handlers=handlers,
    )
    if precision == "fp16" and accelerator.device.type == "cpu":
        # accelerate builds neither autocast nor a scaler for fp16 on a CPU; torch has both,
        # and accelerate uses them once they are set, before `prepare`.
        accelerator.scaler = torch.amp.GradScaler("cpu", **handlers[0].to_kwargs())
        accelerator.native_amp = True
    if accelerator.state.deepspeed_plugin is not None:
        # Batches are not given to `prepare` as a DataLoader, so DeepSpeed is told their size.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = t.train_batch_size
    return accelerator, precision


def train(
    cfg: Config,
    *,
    resume: str | None = None,
    force: bool = False,
    overwrite: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> TrainResult:
    """Train the configured network; `resume="latest"` continues the newest checkpoint."""
    started_at = time.time()  # wall clock, for the run archive
    t, o = cfg.train, cfg.objective
    run = RunDir(Path(t.output_dir))
    accelerator, precision = _accelerator(cfg, run)
    device = accelerator.device
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)

    resume_from = ckpt.resolve_resume(run.root, resume) if resume else None
    _refuse_mixed_runs(run, resume, overwrite)
    family = get_family(cfg.model.model_family, cfg)
    # A dataset without one usable file fails here, before any download or deletion.
    scanned = check_dataset(cfg.data, family)
    # The cache is planned first: parts whose every entry is cached are never loaded.
    identity = family.identity(cfg.model.pretrained_model, cfg.model.revision)
    dropout = o.caption_dropout > 0  # only caption dropout needs the empty caption
    data = plan_cache(
        cfg, identity, weight_dtype, num_processes=accelerator.num_processes, empty=dropout
    )
    holdout = _holdout(cfg, identity, weight_dtype)
    family, comps = load_base(cfg, parts=_parts_needed(cfg, family, data, holdout))
    for m in comps.frozen_modules():
        m.to(device, dtype=weight_dtype)
    fill_cache(data, cfg, family, comps, device)
    if holdout is not None:
        fill_cache(holdout, cfg, family, comps, device)
    scanned.unreadable += data.skipped  # headers that read fine over pixels that did not
    scanned.samples = data.samples
    empty_text = {k: v.float() for k, v in data.empty_text().items()} if dropout else {}
    _check_resume(run, cfg, data, resume_from, force)
    if overwrite and not resume and accelerator.is_main_process:
        _clear_run(run)

    torch.manual_seed(t.seed)  # adapter initialisation, the same whichever parts were loaded
    net = build_network(cfg, family)
    summary = net.attach(comps)
    unet = comps.denoiser
    params = net.parameters(comps)
    for p in params:
        p.data = p.data.float()  # trained weights stay fp32 whatever the base's dtype
    if t.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    optimizer = make_optimizer(params, t)
    lr_scheduler = make_scheduler(optimizer, t, accelerator.num_processes)
    # Under DeepSpeed too accelerate steps this schedule (the engine steps only its own kinds).
    deepspeed = accelerator.state.deepspeed_plugin is not None
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    comps.denoiser = unet  # the family calls whatever accelerate wrapped
    ema = EMA(params, o.ema_decay, o.ema_on_cpu) if o.ema_decay > 0 else None
    generator = torch.Generator().manual_seed(t.seed)  # saved in checkpoints; batches use their own
    rank, world = accelerator.process_index, accelerator.num_processes
    fixed = FixedLoss(data, t.stable_loss_samples, t.train_batch_size, t.seed + 1)
    fixed_holdout = (
        FixedLoss(holdout, len(holdout.samples), t.train_batch_size, t.seed + 2)
        if holdout
        else None
    )

    step, epoch, position = 0, 0, 0
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from)
        net.load_state_dict(comps, state["adapter"])
        if deepspeed:
            _load_sharded(unet, resume_from)
        elif state["optimizer"] is None:
            raise KitError(
                f"{resume_from} was saved under DeepSpeed: its optimizer state is split across "
                "processes; resume it with the same accelerate config file (accelerate launch "
                "--config_file ...)"
            )
        else:
            optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"], generator)
        if ema is not None and "ema" in state["extras"]:
            ema.load_state_dict(state["extras"]["ema"])
        if accelerator.scaler is not None and "scaler" in state["extras"]:
            accelerator.scaler.load_state_dict(state["extras"]["scaler"])
        step, epoch, position = (state["progress"][k] for k in ("step", "epoch", "position"))
        if accelerator.is_main_process:
            _truncate_metrics(run, step)
        accelerator.print(f"resumed from {resume_from} at step {step}")
    elif resume == "latest":
        accelerator.print("no checkpoint to resume from; starting at step 0")

    if accelerator.is_main_process:
        run.root.mkdir(parents=True, exist_ok=True)
        cfg.save(run.config)
        (run.manifest).write_text(json.dumps(data.manifest(), indent=1))
        write_text(run.data_report, json.dumps(scanned.entries(), indent=1, ensure_ascii=False))
        run.logs.mkdir(parents=True, exist_ok=True)
    if scanned.entries():
        accelerator.print(f"data: {scanned.summary()}; every file and reason in {run.data_report}")
    if accelerator.log_with:
        accelerator.init_trackers("kit", config=_scalar_config(cfg))

    prompts = default_prompts(cfg, [s.caption for s in data.samples])
    emit = _emitter(callbacks)
    emit(kind="start", step=step, max_steps=t.max_train_steps, network=summary, data=data.stats)

    def ema_weights() -> dict[str, torch.Tensor] | None:
        if ema is None:
            return None
        with ema.swapped_in(params):
            return net.state_dict(comps)

    def save(at_step: int) -> Path | None:
        """Save a checkpoint: on the main process, or on every process under DeepSpeed."""
        if not deepspeed:
            return write_checkpoint(at_step) if accelerator.is_main_process else None
        # Each process writes its part of the optimizer state, then the main process moves the
        # whole into the checkpoint before marking it complete.
        staged = run.root / "checkpoints" / f".step-{at_step:06d}.{ckpt.SHARDED_DIR}.tmp"
        if accelerator.is_main_process:
            shutil.rmtree(staged, ignore_errors=True)
        accelerator.wait_for_everyone()
        unet.save_checkpoint(str(staged), tag=SHARDED_TAG, exclude_frozen_parameters=True)
        accelerator.wait_for_everyone()
        path = write_checkpoint(at_step, staged) if accelerator.is_main_process else None
        accelerator.wait_for_everyone()  # no process goes on before the checkpoint is complete
        return path

    def write_checkpoint(at_step: int, staged: Path | None = None) -> Path:
        # The data position of the last finished optimizer step: batches of a step that an
        # interrupt cut short are trained again after a resume.
        at_epoch, at_position = cursor
        progress = {
            "step": at_step,
            "epoch": at_epoch,
            "position": at_position,
            **_fingerprint(cfg, data),
        }
        extras: dict[str, Any] = {}
        if ema is not None:
            extras["ema"] = ema.state_dict()
        if accelerator.scaler is not None:
            extras["scaler"] = accelerator.scaler.state_dict()
        path = ckpt.save_checkpoint(
            run.root,
            at_step,
            net.state_dict(comps),
            None if staged else optimizer,
            lr_scheduler,
            generator,
            progress,
            keep=t.checkpoints_total_limit,
            extras=extras,
            ema_weights=ema_weights(),
            folders={ckpt.SHARDED_DIR: staged} if staged else None,
        )
        result.checkpoint = path
        emit(kind="checkpoint", step=at_step, path=path)
        return path

    def validate(at_step: int) -> Path:
        # With EMA, the images show the averaged weights: the ones that get exported.
        swap = ema.swapped_in(params) if ema is not None else contextlib.nullcontext()
        if comps.missing_parts():
            # Trained from a full cache: the encoders load now, for sampling only.
            _, rest = load_base(cfg, parts=comps.missing_parts())
            for m in rest.frozen_modules():
                m.to(device, dtype=weight_dtype)
            comps.take_parts(rest)
        pipe = family.pipeline(replace(comps, denoiser=accelerator.unwrap_model(unet)))
        unet.eval()
        with swap, accelerator.autocast():
            grid = run_validation(
                family,
                pipe,
                image_specs(cfg, prompts),
                run.validation_step(at_step),
                cols=len(cfg.validation.validation_seeds),
                meta={"base_model": cfg.model.pretrained_model, "step": at_step},
            )
        unet.train()
        emit(kind="validation", step=at_step, grid=grid)
        return grid

    def fixed_losses() -> dict[str, float]:
        unet.eval()
        with accelerator.autocast():
            out = {"stable_loss": fixed(family, comps, device)}
            if fixed_holdout is not None:
                out["validation_loss"] = fixed_holdout(family, comps, device)
        unet.train()
        return out

    cursor = (epoch, position)
    result = TrainResult(run.root, step, resume_from)
    progress_bar = _progress(accelerator, step, t.max_train_steps)
    micro_losses: list[float] = []
    started = time.perf_counter()
    restore_signals = _sigterm_as_interrupt()
    try:
        while step < t.max_train_steps:
            # Each process takes every world-th batch (the tail that cannot go to every process
            # is already left out), so all processes step together.
            batches = epoch_batches(data.plan, t.train_batch_size, t.seed, epoch, world)
            usable = len(batches)
            if usable == 0:
                raise KitError(
                    f"fewer batches per epoch than the {world} processes that share them; "
                    "lower train_batch_size or use fewer processes (see `kit buckets`)"
                )
            while position < usable and step < t.max_train_steps:
                mine = position + rank
                indices = batches[mine]
                if world > 1:
                    _audit(run, rank, {"epoch": epoch, "batch": mine, "samples": indices})
                position += world
                # Noise, timesteps, dropout, caption variants and caption dropout come from this
                # batch's own stream: the same numbers whichever process draws it, before or
                # after a resume.
                generator = _batch_generator(t.seed, epoch, mine)
                variants = data.draw_variants(len(indices), generator)
                batch = data.load_batch(indices, variants)
                dropped = drop_captions(batch, empty_text, o.caption_dropout, generator)
                with accelerator.accumulate(unet):
                    if net.live_text:
                        captions = [
                            "" if d else data.variant_texts[i][variants[j] if variants else 0]
                            for j, (i, d) in enumerate(zip(indices, dropped, strict=True))
                        ]
                        batch.update(family.encode_text(comps, captions))
                    loss = denoising_loss(family, comps, batch, generator, device)
                    accelerator.backward(loss)
                    grad_norm = None
                    if accelerator.sync_gradients:
                        clip = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
                        norm = accelerator.clip_grad_norm_(params, clip)
                        # DeepSpeed clips inside its own step and may report no norm here.
                        grad_norm = None if norm is None else float(norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                micro_losses.append(float(accelerator.reduce(loss.detach().float(), "mean")))
                if not accelerator.sync_gradients:
                    continue
                step += 1
                cursor = (epoch, position)
                net.after_step(comps)
                if ema is not None:
                    ema.step(params)
                loss_value = sum(micro_losses) / len(micro_losses)
                micro_losses.clear()
                scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
                _guard_finite(loss_value, grad_norm, step, precision, scale, result.checkpoint)
                row = {
                    "step": step,
                    "epoch": epoch,
                    "loss": loss_value,
                    "lr": lr_scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "time": round(time.perf_counter() - started, 3),
                }
                if scale is not None:
                    row["loss_scale"] = scale
                if torch.cuda.is_available():
                    row["memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
                last = step == t.max_train_steps
                if t.stable_loss_steps and (step % t.stable_loss_steps == 0 or last):
                    row.update(fixed_losses())
                if step % t.logging_steps == 0 or last or "stable_loss" in row:
                    _log(accelerator, run, row)
                progress_bar.update(1)
                progress_bar.set_postfix(loss=f"{loss_value:.4f}")
                emit(kind="step", **row)
                if t.checkpointing_steps and step % t.checkpointing_steps == 0 and not last:
                    save(step)
                v_every = cfg.validation.validation_steps
                if accelerator.is_main_process and (last or (v_every and step % v_every == 0)):
                    result.validation_grids.append(validate(step))
            if position >= usable:
                epoch, position = epoch + 1, 0
                if not micro_losses:
                    cursor = (epoch, position)
        save(step)
        if world > 1:
            _audit(
                run, rank, {"final_step": step, "weights_sha256": _digest(net.state_dict(comps))}
            )
        accelerator.wait_for_everyone()
    except (KeyboardInterrupt, StopTraining):
        # Stopped by the user: keep what was learned, then stop cleanly.
        saved = result.checkpoint is not None and result.checkpoint.name == f"step-{step:06d}"
        if deepspeed and step > 0 and not saved:
            # A DeepSpeed checkpoint needs every process at the same point, which an interrupt
            # does not promise: the last periodic checkpoint is the one to resume from.
            accelerator.print("under DeepSpeed no checkpoint is saved on an interrupt")
        elif accelerator.is_main_process and step > 0 and not saved:
            save(step)
        result.interrupted = True
        accelerator.print(f"interrupted at step {step}; checkpoint: {result.checkpoint}")
    finally:
        restore_signals()
        progress_bar.close()
        accelerator.end_training()
        if accelerator.is_main_process:
            from kit.report.doctor import write_report

            # Also when training stopped on an error: the report then explains it.
            write_report(run.root, error=sys.exc_info()[1])
            # The archive must never replace the run's own error with one of its own.
            with contextlib.suppress(Exception):
                from kit.report.archive import write_archive

                write_archive(
                    run.root,
                    started=started_at,
                    error=sys.exc_info()[1],
                    interrupted=result.interrupted,
                )
    result.step = step
    if accelerator.is_main_process:
        from kit.report.plots import plot_metrics

        plot_metrics(run.read_metrics(), run.loss_plot)
    emit(kind="end", step=step, result=result)
    return result


SHARDED_TAG = "zero"
"""The DeepSpeed engine's name for its state inside a checkpoint's `ckpt.SHARDED_DIR`."""


def _deepspeed_launch() -> bool:
    """Whether `accelerate launch` started this process with a DeepSpeed config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _load_sharded(engine: Any, checkpoint: Path) -> None:
    """Load this process's part of the optimizer state (and the trained weights) under DeepSpeed."""
    folder = checkpoint / ckpt.SHARDED_DIR
    if not (folder / SHARDED_TAG).is_dir():
        raise KitError(
            f"{checkpoint} was not saved under DeepSpeed (no {ckpt.SHARDED_DIR}/ folder): its "
            "optimizer state cannot be split across processes; resume it without DeepSpeed"
        )
    # Only the trained weights were saved: the frozen base is not in the file. The schedule is
    # accelerate's, not the engine's, and comes back from the checkpoint's scheduler.pt.
    loaded, _ = engine.load_checkpoint(
        str(folder), tag=SHARDED_TAG, load_module_strict=False, load_lr_scheduler_states=False
    )
    if loaded is None:
        raise KitError(f"DeepSpeed could not load the state in {folder}")


def _audit(run: RunDir, rank: int, record: dict[str, Any]) -> None:
    """Per-process record of a multi-process run: which samples it saw, what it ended with."""
    run.logs.mkdir(parents=True, exist_ok=True)
    with open(run.logs / f"process-{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A random stream of its own for one batch; also seeds the global RNG (dropout layers)."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{index}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    torch.manual_seed(value)
    return torch.Generator().manual_seed(value)


def _sigterm_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM stop training like Ctrl-C (checkpoint, then exit); return the undo."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals can only be handled on the main thread

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _holdout(cfg: Config, identity: dict[str, str], dtype: torch.dtype) -> CachedDataset | None:
    """The planned cache of the held-out images (`validation_image_dir`), or None."""
    folder = cfg.validation.validation_image_dir
    if not folder:
        return None
    # Every held-out image counts: a small bucket is kept whole, never dropped or moved.
    held = cfg.replace(image_dir=folder, caption_dir="", small_bucket_policy="repeat")
    return plan_cache(held, identity, dtype)


def _parts_needed(
    cfg: Config, family: Family, data: CachedDataset, holdout: CachedDataset | None
) -> tuple[str, ...]:
    """The base model's parts this run needs now: encoders only for what is not cached yet."""
    missing = data.missing()
    if holdout is not None:
        missing = {k: v + holdout.missing()[k] for k, v in missing.items()}
    parts = ["denoiser"]
    if missing["latents"]:
        parts.append("vae")
    if missing["text"] or build_network(cfg, family).live_text:
        parts.append("text_encoders")
    return tuple(parts)


def _guard_finite(
    loss: float,
    grad_norm: float | None,
    step: int,
    precision: str,
    scale: float | None,
    last_good: Path | None,
) -> None:
    """Stop on a non-finite loss (or, without a gradient scaler, a non-finite gradient)."""
    bad_grad = grad_norm is not None and not math.isfinite(grad_norm) and scale is None
    if math.isfinite(loss) and not bad_grad:
        return
    what = f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
    scale_note = f", loss scale {scale:g}" if scale is not None else ""
    keep = (
        f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
    )
    raise KitError(
        f"{what} at step {step} (mixed_precision={precision}{scale_note}); {keep}. "
        "Usual fixes: a lower learning_rate, max_grad_norm 1.0, bf16 instead of fp16, "
        "or checking the data for broken images."
    )


def _fingerprint(cfg: Config, data: CachedDataset) -> dict[str, Any]:
    """What a resume must find unchanged to continue exactly."""
    return {
        "settings": {k: cfg.get(k) for k in EXACTNESS_KEYS},
        "dataset": sorted(data.digests),
    }


def _check_resume(
    run: RunDir, cfg: Config, data: CachedDataset, resume_from: Path | None, force: bool
) -> None:
    if resume_from is None:
        return
    saved = json.loads((resume_from / "progress.json").read_text())
    now = _fingerprint(cfg, data)
    changes = [
        f"{k}: {saved['settings'].get(k)!r} → {v!r}"
        for k, v in now["settings"].items()
        if saved["settings"].get(k) != v
    ]
    if saved.get("dataset") != now["dataset"]:
        before, after = set(saved.get("dataset", [])), set(now["dataset"])
        changes.append(
            f"dataset: {len(after - before)} image(s) added or changed, {len(before - after)} removed"
        )
    if changes and not force:
        raise KitError(
            f"cannot resume {resume_from} exactly; changed since it was saved: "
            + "; ".join(changes)
            + " (pass --force to resume anyway)"
        )
    if changes:
        warnings.warn("resuming despite changes: " + "; ".join(changes), stacklevel=2)


def _old_run_files(run: RunDir) -> list[Path]:
    return [p for p in (run.root / "checkpoints", run.metrics, run.validation) if p.exists()]


def _refuse_mixed_runs(run: RunDir, resume: str | None, overwrite: bool) -> None:
    """A new run may not write into an old one's folder unless asked to replace it."""
    if not resume and not overwrite and _old_run_files(run):
        raise KitError(
            f"{run.root} already holds a run; resume it (--resume latest), "
            "choose another output_dir, or pass --overwrite to replace it"
        )


def _clear_run(run: RunDir) -> None:
    """Delete an earlier run's checkpoints, logs and images (only once the new run can start)."""
    for p in _old_run_files(run):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _truncate_metrics(run: RunDir, step: int) -> None:
    """Drop logged rows past the resumed step: those steps are trained again."""
    rows = [r for r in run.read_metrics() if r.get("step", 0) <= step]
    write_text(run.metrics, "".join(json.dumps(r) + "\n" for r in rows))


def _scalar_config(cfg: Config) -> dict[str, Any]:
    """The flat config with lists as strings (trackers take scalars only)."""
    out = {}
    for k, v in cfg.to_dict(flat=True).items():
        out[k] = v if isinstance(v, int | float | str | bool) else json.dumps(v)
    return out


def _log(accelerator: Any, run: RunDir, row: dict[str, Any]) -> None:
    if not accelerator.is_main_process:
        return
    with open(run.metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    if accelerator.log_with:
        scalars = {k: v for k, v in row.items() if isinstance(v, int | float) and k != "step"}
        accelerator.log(scalars, step=row["step"])


def _progress(accelerator: Any, start: int, total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )


def _emitter(callbacks: list[Callback] | tuple[Callback, ...]) -> Callable[..., None]:
    def emit(**event: Any) -> None:
        for cb in callbacks:
            cb(event)

    return emit
