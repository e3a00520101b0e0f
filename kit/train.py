"""The training loop: cached data, an adapted denoiser, accelerate, checkpoints, validation."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kit import checkpoint as ckpt
from kit.config import Config
from kit.data import CachedDataset, build_cache, epoch_batches, load_samples
from kit.errors import KitError
from kit.families import Components, Family, get_family
from kit.io import write_text
from kit.network import build_network
from kit.objective import EMA, FixedLoss, denoising_loss, drop_captions
from kit.optim import make_optimizer, make_scheduler
from kit.runs import RunDir
from kit.validate import default_prompts, image_specs, run_validation

Callback = Callable[[dict[str, Any]], None]

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


def resolve_precision(requested: str) -> str:
    """The mixed precision this machine can run: the request, or fp32 with a warning."""
    if requested == "no":
        return "no"
    if not torch.cuda.is_available():
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


def load_base(cfg: Config, dtype: torch.dtype = torch.float32) -> tuple[Family, Components]:
    """The configured family and its loaded base model."""
    family = get_family(cfg.model.model_family, cfg)
    try:
        comps = family.load(
            cfg.model.pretrained_model,
            revision=cfg.model.revision,
            variant=cfg.model.variant,
            dtype=dtype,
        )
    except (OSError, ValueError) as e:
        raise KitError(
            f"cannot load pretrained_model '{cfg.model.pretrained_model}': {e}"
        ) from None
    return family, comps


def _accelerator(cfg: Config, run: RunDir) -> tuple[Any, str]:
    """accelerate's Accelerator for this run, and the precision actually used."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs, ProjectConfiguration

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
    accelerator = Accelerator(
        # Without a GPU, `cpu=True` is what makes accelerate join a multi-process (gloo) launch.
        cpu=not torch.cuda.is_available(),
        mixed_precision=precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=None if t.report_to == "none" else t.report_to,
        project_config=ProjectConfiguration(project_dir=str(run.root), logging_dir=str(run.logs)),
        kwargs_handlers=handlers,
    )
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
    t, o = cfg.train, cfg.objective
    run = RunDir(Path(t.output_dir))
    accelerator, precision = _accelerator(cfg, run)
    device = accelerator.device
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)

    resume_from = ckpt.resolve_resume(run.root, resume) if resume else None
    _refuse_mixed_runs(run, resume, overwrite)
    load_samples(
        cfg.data, get_family(cfg.model.model_family, cfg)
    )  # bad data fails here, before any download or deletion
    torch.manual_seed(t.seed)  # adapter initialisation
    family, comps = load_base(cfg)
    for m in comps.frozen_modules():
        m.to(device, dtype=weight_dtype)
    data = build_cache(cfg, family, comps, device)
    holdout = _holdout(cfg, family, comps, device)
    empty_text = {k: v[0].float().cpu() for k, v in family.encode_text(comps, [""]).items()}
    _check_resume(run, cfg, data, resume_from, force)
    if overwrite and not resume and accelerator.is_main_process:
        _clear_run(run)

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
        run.logs.mkdir(parents=True, exist_ok=True)
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

    def save(at_step: int) -> Path:
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
            optimizer,
            lr_scheduler,
            generator,
            progress,
            keep=t.checkpoints_total_limit,
            extras=extras,
            ema_weights=ema_weights(),
        )
        result.checkpoint = path
        emit(kind="checkpoint", step=at_step, path=path)
        return path

    def validate(at_step: int) -> Path:
        # With EMA, the images show the averaged weights: the ones that get exported.
        swap = ema.swapped_in(params) if ema is not None else contextlib.nullcontext()
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
            batches = epoch_batches(data.plan, t.train_batch_size, t.seed, epoch)
            # Each process takes every world-th batch; a tail that cannot go to every process
            # waits for the next epoch's shuffle, so all processes step together.
            usable = len(batches) - len(batches) % world
            if usable == 0:
                raise KitError(
                    f"{len(batches)} batch(es) per epoch cannot be shared by {world} processes; "
                    "lower train_batch_size or use fewer processes"
                )
            while position < usable and step < t.max_train_steps:
                mine = position + rank
                indices = batches[mine]
                if world > 1:
                    _audit(run, rank, {"epoch": epoch, "batch": mine, "samples": indices})
                batch = data.load_batch(indices)
                position += world
                # Noise, timesteps, dropout and caption dropout come from this batch's own
                # stream: the same numbers whichever process draws it, before or after a resume.
                generator = _batch_generator(t.seed, epoch, mine)
                dropped = drop_captions(batch, empty_text, o.caption_dropout, generator)
                with accelerator.accumulate(unet):
                    if net.live_text:
                        captions = [
                            "" if d else data.samples[i].caption
                            for i, d in zip(indices, dropped, strict=True)
                        ]
                        batch.update(family.encode_text(comps, captions))
                    loss = denoising_loss(family, comps, batch, generator, device)
                    accelerator.backward(loss)
                    grad_norm = None
                    if accelerator.sync_gradients:
                        clip = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
                        grad_norm = float(accelerator.clip_grad_norm_(params, clip))
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
                    if accelerator.is_main_process:
                        save(step)
                v_every = cfg.validation.validation_steps
                if accelerator.is_main_process and (last or (v_every and step % v_every == 0)):
                    result.validation_grids.append(validate(step))
            if position >= usable:
                epoch, position = epoch + 1, 0
                if not micro_losses:
                    cursor = (epoch, position)
        if accelerator.is_main_process:
            save(step)
        if world > 1:
            _audit(
                run, rank, {"final_step": step, "weights_sha256": _digest(net.state_dict(comps))}
            )
        accelerator.wait_for_everyone()
    except KeyboardInterrupt:
        # Stopped by the user: keep what was learned, then stop cleanly.
        saved = result.checkpoint is not None and result.checkpoint.name == f"step-{step:06d}"
        if accelerator.is_main_process and step > 0 and not saved:
            save(step)
        result.interrupted = True
        accelerator.print(f"interrupted at step {step}; checkpoint: {result.checkpoint}")
    finally:
        restore_signals()
        progress_bar.close()
        accelerator.end_training()
        if accelerator.is_main_process:
            from kit.doctor import write_report

            # Also when training stopped on an error: the report then explains it.
            write_report(run.root, error=sys.exc_info()[1])
    result.step = step
    if accelerator.is_main_process:
        from kit.plots import plot_metrics

        plot_metrics(run.read_metrics(), run.loss_plot)
    emit(kind="end", step=step, result=result)
    return result


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


def _holdout(cfg: Config, family: Family, comps: Components, device: Any) -> CachedDataset | None:
    """Cached held-out images (`validation_image_dir`), or None."""
    folder = cfg.validation.validation_image_dir
    if not folder:
        return None
    return build_cache(cfg.replace(image_dir=folder, caption_dir=""), family, comps, device)


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
