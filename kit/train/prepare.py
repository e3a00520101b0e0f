"""Everything before the first step: data scanned and cached, the base loaded, the method
attached, the optimizer, accelerate, a resume; the run folder's own files written."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.data.blob import use_remote
from kit.data.cache import CachedDataset, fill_cache, plan_cache
from kit.data.scan import ScanReport, check_dataset
from kit.errors import ConfigError, KitError
from kit.families import Family, get_family
from kit.families import quantize as quant
from kit.families.loading import load_base
from kit.families.source import check_base
from kit.families.training_adapter import TrainingAdapter, read_training_adapter
from kit.io import write_text
from kit.methods import get_method
from kit.optim import check_optimizer, make_optimizer, make_scheduler
from kit.precision import torch_dtype
from kit.run import checkpoint as ckpt
from kit.run import threads
from kit.run.folder import RunDir
from kit.run.owned import LEDGER, clear_run, note_outputs, refuse_mixed_runs
from kit.sample.embedded import embedded_keys, prompt_texts, takes_embeddings
from kit.sample.validate import default_prompts, image_specs, pair_prompts
from kit.train.accel import deepspeed_launch, fsdp_launch, is_fsdp, make_accelerator
from kit.train.agreement import check_agreement
from kit.train.classes import draw_class_images, wanted
from kit.train.log import emitter, start_trackers
from kit.train.objective import EMA, FixedLoss, elementwise_loss
from kit.train.offload import block_swap, check_block_swap, place
from kit.train.preserve import Preserver, check_preservation, check_triggers
from kit.train.resume import check_resume, check_shape, restore, truncate_metrics
from kit.train.sizes import refuse_impossible_sizes
from kit.train.slider import Slider
from kit.train.state import Callback, TrainResult, TrainState
from kit.train.step import check_compile, compile_denoiser


def prepare(
    cfg: Config,
    *,
    resume: str | None = None,
    force: bool = False,
    overwrite: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> TrainState:
    """Set up one run and return it ready for `fit`; `resume="latest"` picks up the newest
    checkpoint."""
    started_at = time.time()  # wall clock, for the run archive
    t, o = cfg.train, cfg.objective
    run = RunDir(Path(t.output_dir))
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)  # a pair that cannot be trained is refused here
    check_preservation(cfg, method)
    use_remote(cfg.data.remote_timeout, cfg.data.remote_retries)  # the base's download too
    # A base that is missing, gated or of another family: one line, before any scan or cache.
    check_base(family, cfg.model.pretrained_model, cfg.model.revision)
    refuse_impossible_sizes(cfg)  # before anything loads: else the system kills the process
    _refuse_deepspeed_with_several_models(method)
    _refuse_under_fsdp(cfg, method)
    accelerator, precision = make_accelerator(cfg, run, unused_parameters=method.leaves_unused)
    device = accelerator.device
    weight_dtype = torch_dtype(precision)  # the frozen base's; trained weights stay fp32
    kind = cfg.model.base_quantization  # the frozen base stored quantized, or "none"
    quant.check_quantization(
        kind,
        device,
        method=method,
        deepspeed=deepspeed_launch(),
    )
    if cfg.model.text_encoder_quantization != "none":
        quant.check_quantization(
            cfg.model.text_encoder_quantization,
            device,
            deepspeed=deepspeed_launch(),
            key="text_encoder_quantization",
        )
    check_compile(t.compile, t.blocks_to_swap, deepspeed_launch(), device)
    check_optimizer(t, deepspeed_launch())  # a missing package, before anything loads

    resume_from = ckpt.resolve_resume(run.root, resume) if resume else None
    check_shape(cfg, resume_from)  # another adapter's checkpoint: refused before any work
    refuse_mixed_runs(run, resume, overwrite)
    # Before the run writes anything: what it creates is its own, and the ledger's lines past
    # `mark` are this run's files (kept by --overwrite, which removes the earlier run's).
    mark = note_outputs(run) if accelerator.is_main_process else 0
    # Before any work on the CPU (class images, the cache): see kit.run.threads.
    cpu = threads.for_run(t.cpu_threads, resume_from)
    if cpu.changed:
        accelerator.print(cpu.describe())
    # A dataset without one usable file fails here, before any download or deletion. This is
    # the run's only scan: the cache plan below buckets its samples.
    if wanted(cfg):  # a prior dataset's class images, drawn once by the base model
        if accelerator.is_main_process:
            draw_class_images(cfg, family, device, weight_dtype, accelerator.print)
        accelerator.wait_for_everyone()
    scanned = check_dataset(cfg.data, family)
    check_triggers(cfg, scanned.samples)  # a trigger in no caption would preserve nothing
    # Every process on the same config and images, before anything is cached or trained.
    check_agreement(cfg, scanned.samples, _gather_object, accelerator.num_processes)
    # The cache is planned first: parts whose every entry is cached are never loaded.
    identity = family.identity(cfg.model.pretrained_model, cfg.model.revision)
    dropout = o.caption_dropout > 0  # only caption dropout needs the empty caption
    # Text is cached in the dtype the encoders run in: fp32 where one of them trains.
    text_dtype = torch.float32 if method.trained_text_encoders() else weight_dtype
    data = plan_cache(
        cfg,
        identity,
        text_dtype,
        num_processes=accelerator.num_processes,
        empty=dropout,
        family=family,
        scanned=scanned,
    )
    holdout = _holdout(cfg, identity, text_dtype, family)
    # An edit model with no validation prompt draws its first training pairs: control → result
    # (one whose prompts are read with their controls, its prompts on the first pair's).
    edits = pair_prompts(cfg, family, data.kept(), folder=run.validation_controls)
    if edits:
        v = replace(cfg.validation, validation_prompts=edits, validation_prompt=[])
        cfg = replace(cfg, validation=v)
    # Prompts from the captions of what is taught, never of a prior (regularisation) dataset.
    taught = [x.caption for x in data.samples if not data.roles or data.roles[x.dataset] != "prior"]
    prompts = default_prompts(cfg, taught or [x.caption for x in data.samples])
    # A family whose prompts depend on their controls draws its grids with its encoder.
    cached_prompts = not method.live_text and not family.prompt_controls
    if cached_prompts:
        # The grids' prompts are cached with the captions: validation then needs no encoder.
        data.add_prompts(prompt_texts(family, image_specs(cfg, family, prompts)))
    # Frozen parts load straight in the half dtype they run in, never in fp32 first; what
    # trains whole, and the VAE that encodes the cache, load in fp32 (see below).
    dtypes = {"*": weight_dtype, "vae": torch.float32}
    for i in method.trained_text_encoders():
        dtypes[family.text_subfolders[i]] = torch.float32
    if method.whole_denoiser:
        dtypes["denoiser"] = torch.float32
    # The cache fills first, with only the encoders and the VAE loaded; the denoiser, the
    # largest part, is loaded afterwards, so the setup never holds both.
    if t.blocks_to_swap:  # refused before caching, on the architecture alone
        check_block_swap(
            cfg, family, method, family.empty_parts(cfg.model.pretrained_model)["denoiser"]
        )
    parts = _parts_needed(method, data, holdout)
    _, comps = load_base(cfg, dtype=dtypes, parts=parts[1:], family=family)
    # What trains whole stays fp32 (diffusers' examples do the same): a trained text encoder,
    # a fully trained denoiser. The VAE encodes the cache in fp32 (fill_cache), then joins the
    # frozen parts in the half dtype; the pipelines upcast it to decode when its config asks.
    keep = [comps.text_encoders[i] for i in method.trained_text_encoders()]
    text_kind = cfg.model.text_encoder_quantization
    for part in comps.frozen_modules():
        keeps = any(part is k for k in keep) or part is comps.vae
        if text_kind != "none" and not keeps and part is not comps.vae:
            # Layer by layer on the device: the encoder is never there whole in bf16.
            q = quant.quantize(part, text_kind, device=device, dtype=weight_dtype)
            accelerator.print(q.describe("text encoder"))
            continue
        part.to(device, dtype=None if keeps else weight_dtype)
    _fill_shared(accelerator, data, cfg, family, comps)
    if holdout is not None:
        _fill_shared(accelerator, holdout, cfg, family, comps)
    embedded = cached_prompts and takes_embeddings(
        family.pipeline_class, embedded_keys(family, data.store.get(data.text_files[0]))
    )
    if embedded and comps.text_encoders:
        # Every text is cached, the grids' prompts too: the encoders leave the GPU and the
        # host's memory before the denoiser loads (a 7-24 B LLM encoder would not fit beside it).
        comps.text_encoders = []
        release_memory(device)
    if is_fsdp(accelerator):
        # FSDP draws no images while training, and every text is cached: the encoders and the
        # VAE give their GPU memory to the sharded denoiser (the estimate counts them so).
        for part in comps.frozen_modules():
            part.to("cpu")
    _, rest = load_base(cfg, dtype=dtypes, parts=("denoiser",), family=family)
    comps.take_parts(rest)
    adapter = _training_adapter(cfg, family, comps.denoiser, accelerator.print)
    swapped = check_block_swap(cfg, family, method, comps.denoiser)
    if method.whole_denoiser:
        keep.append(comps.denoiser)
    # Layer by layer on the device: a quantized denoiser is never there whole in full precision.
    quantized = {
        "denoiser": quant.quantize(comps.denoiser, kind, device=device, dtype=weight_dtype)
    }
    if swapped:
        # The swapped blocks' weights stay in CPU memory from the start.
        place(comps.denoiser, swapped, t.blocks_to_swap, device, weight_dtype)
    else:
        comps.denoiser.to(device, dtype=None if method.whole_denoiser else weight_dtype)
    # The T5 once the cache is filled: cached embeddings stay the full-precision encoder's,
    # as an unquantized run (whose cache key is the same) computes them.
    quantized.update(quant.quantize_text_encoders(family, comps, kind, device=device))
    for part, q in quantized.items():
        if q.layers:
            accelerator.print(q.describe(part))
    if comps.vae is not None:
        comps.vae.to(dtype=weight_dtype)
    if adapter is not None:  # on the stored (quantized, swapped) modules, before the method's
        adapter.attach(comps.denoiser, device)
    report = _data_report(scanned, data)
    empty_text = {k: v.float() for k, v in data.empty_text().items()} if dropout else {}
    check_resume(run, cfg, data, resume_from, force, identity=comps.identity)
    if overwrite and not resume and accelerator.is_main_process:
        _, kept = clear_run(run, since=mark)
        if kept:  # what a user expects: their files stay, and they are told so
            accelerator.print(
                f"--overwrite removed the earlier run's files (those {LEDGER} lists) and kept "
                f"{len(kept)} of yours among them, e.g. {kept[0]}"
            )

    torch.manual_seed(t.seed)  # adapter initialisation, the same whichever parts were loaded
    summary = method.attach(comps)
    groups = method.param_groups(comps)
    params = [p for g in groups for p in g["params"]]
    for p in params:
        p.data = p.data.float()  # trained weights stay fp32 whatever the base's dtype
    if t.gradient_checkpointing:
        comps.denoiser.enable_gradient_checkpointing()
    comps.denoiser.train()
    if t.compile:
        compile_denoiser(comps.denoiser)  # in place: names and hooks stay; warm-up at step 1
    optimizer = make_optimizer(groups, t)
    scheduler = make_scheduler(optimizer, t, accelerator.num_processes)
    # Before accelerate: the swap keeps its stored weights in CPU memory, and accelerate is
    # told to leave a swapped denoiser where it is.
    swap = block_swap(cfg, family, method, comps.denoiser, device)
    trained, optimizer, scheduler = _prepare_trained(
        accelerator, method, comps, optimizer, scheduler, keep_placement=swap is not None
    )
    if is_fsdp(accelerator):
        # FSDP replaced each parameter by its shard; the optimizer holds the new ones.
        params = [p for g in optimizer.param_groups for p in g["params"]]
    ema = EMA(params, o.ema_decay, o.ema_on_cpu) if o.ema_decay > 0 else None
    # Saved in checkpoints; batches draw from streams of their own.
    generator = torch.Generator().manual_seed(t.seed)
    fixed = FixedLoss(data, t.stable_loss_samples, t.train_batch_size, t.seed + 1)
    fixed_holdout = (
        FixedLoss(holdout, len(holdout.samples), t.train_batch_size, t.seed + 2)
        if holdout
        else None
    )
    s = TrainState(
        cfg=cfg,
        run=run,
        accelerator=accelerator,
        precision=precision,
        family=family,
        comps=comps,
        method=method,
        summary=summary,
        params=params,
        denoiser=comps.denoiser,
        trained=trained,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=ema,
        data=data,
        fixed=fixed,
        fixed_holdout=fixed_holdout,
        empty_text=empty_text,
        report=report,
        prompts=prompts,
        embedded_prompts=embedded,
        training_adapter=adapter,
        emit=emitter(callbacks),
        started_at=started_at,
        result=TrainResult(run.root, 0, resume_from),
        resume_from=resume_from,
        generator=generator,
    )
    if o.slider is not None:
        s.regular = Slider(cfg, method, data)
    elif o.preservation is not None or data.base_targets:
        s.regular = Preserver(
            cfg, method, lambda p, q: elementwise_loss(p, q, o.loss_type, o.huber_c)
        )
    if resume_from is not None:
        restore(s, resume_from)
        accelerator.print(f"resumed from {resume_from} at step {s.step}")
    elif resume == "latest":
        accelerator.print("no checkpoint to resume from; starting at step 0")
        if s.main:  # rows an earlier attempt logged before its first checkpoint are trained again
            truncate_metrics(s.run, 0)
    s.result.step = s.step
    _write_run_files(s)
    start_trackers(accelerator, cfg)
    return s


def _refuse_deepspeed_with_several_models(method: Any) -> None:
    """accelerate gives DeepSpeed one model per engine; a run that trains several (a text
    encoder beside the denoiser, or two text encoders) cannot run under it."""
    count = int(method.trains_denoiser) + len(method.trained_text_encoders())
    if deepspeed_launch() and count > 1:
        raise KitError(
            f"network_type {method.name} trains {count} models here (the denoiser and/or text "
            "encoders), and DeepSpeed under accelerate trains one; launch it without DeepSpeed "
            "(kit accelerate-config without --deepspeed-stage), or train fewer parts "
            "(train_text_encoder: false)"
        )


def _refuse_under_fsdp(cfg: Config, method: Any) -> None:
    """What an FSDP launch cannot train, refused before anything loads, naming the keys."""
    if not fsdp_launch():
        return
    count = int(method.trains_denoiser) + len(method.trained_text_encoders())
    refusals = {
        "blocks_to_swap": cfg.train.blocks_to_swap > 0
        and (
            f"blocks_to_swap: {cfg.train.blocks_to_swap} moves whole blocks between CPU and "
            "GPU, while FSDP keeps each block split across the processes; set blocks_to_swap: 0 "
            "(FSDP's own --fsdp-offload keeps the shards in CPU memory)"
        ),
        "base_quantization": cfg.model.base_quantization != "none"
        and (
            f"base_quantization: {cfg.model.base_quantization} stores the base in packed "
            "tensors that FSDP cannot split; set base_quantization: none (FSDP splits the "
            "full-precision base instead), or launch without FSDP"
        ),
        "compile": cfg.train.compile
        and (
            "compile: true is not tried with FSDP's sharded blocks by the kit; set compile: "
            "false, or launch without FSDP"
        ),
        "ema_decay": cfg.objective.ema_decay > 0
        and (
            f"ema_decay: {cfg.objective.ema_decay} keeps an average of the trained weights, "
            "which the kit does not shard under FSDP; set ema_decay: 0, or launch without FSDP"
        ),
        "network_type": (count != 1 or not method.trains_denoiser)
        and (
            f"network_type {method.name} trains {count} model(s) here, not the denoiser "
            "alone, and the kit shards the denoiser under FSDP; train the denoiser only "
            "(train_text_encoder: false), or launch without FSDP"
        ),
    }
    found = [why for why in refusals.values() if why]
    if found:
        raise KitError("cannot train under FSDP: " + "; ".join(found))


def _gather_object(records: list[Any]) -> list[Any]:
    """Every process's list, joined in rank order (accelerate's collective)."""
    from accelerate.utils import gather_object

    return gather_object(records)


def _prepare_trained(
    accelerator: Any,
    method: Any,
    comps: Any,
    optimizer: Any,
    scheduler: Any,
    keep_placement: bool = False,
) -> tuple[list[Any], Any, Any]:
    """Give accelerate the modules that hold trained parameters (and the optimizer and schedule),
    so that their gradients are averaged across processes: the trained modules as wrapped, the
    optimizer and the schedule. The family then calls whatever accelerate wrapped.

    A module without a trained parameter is left out: DDP refuses one.
    """
    encoders = method.trained_text_encoders()
    models = ([comps.denoiser] if method.trains_denoiser else []) + [
        comps.text_encoders[i] for i in encoders
    ]
    # Under DeepSpeed too accelerate steps this schedule (the engine steps only its own kinds).
    # A block-swapped denoiser is already where it must be: accelerate would move it whole.
    # (Only then is a placement given: accelerate refuses one under DeepSpeed, which the swap
    # refuses too.)
    placement = (
        {"device_placement": [m is not comps.denoiser for m in models] + [True, True]}
        if keep_placement
        else {}
    )
    *wrapped, optimizer, scheduler = accelerator.prepare(*models, optimizer, scheduler, **placement)
    if method.trains_denoiser:
        comps.denoiser = wrapped[0]
    for i, m in zip(encoders, wrapped[len(wrapped) - len(encoders) :], strict=True):
        comps.text_encoders[i] = m
    return wrapped, optimizer, scheduler


def _holdout(
    cfg: Config, identity: dict[str, str], dtype: torch.dtype, family: Family
) -> CachedDataset | None:
    """The planned cache of the held-out images (`validation_image_dir`), or None."""
    folder = cfg.validation.validation_image_dir
    if not folder:
        return None
    if family.needs_control:
        raise ConfigError(
            f"validation_image_dir: {family.name} scores pairs, and held-out pairs are not read "
            "yet; leave validation_image_dir empty (the grids show control → result)"
        )
    # Every held-out image counts: a small bucket is kept whole, never dropped or moved.
    # Held-out images are scored whole: their loss is a measure, not a lesson, and they seldom
    # come with masks.
    held = cfg.replace(
        image_dir=folder,
        caption_dir="",
        datasets=[],
        masked_loss=False,
        mask_dir="",
        small_bucket_policy="repeat",
    )
    return plan_cache(held, identity, dtype, family=family)


def _fill_shared(
    accelerator: Any, data: CachedDataset, cfg: Config, family: Family, comps: Any
) -> None:
    """Fill the cache with every process encoding its own share, so caching time falls with the
    process count. Each process writes its entries (its own shards) atomically; once all are
    done, each reads what the others wrote and runs the whole pass, which encodes nothing new
    (it drops undecodable images everywhere alike, and fills any share left unfinished).

    `data.stats` counts what this process encoded, and what was cached before the run."""
    n, device = accelerator.num_processes, accelerator.device
    if n > 1:
        fill_cache(data, cfg, family, comps, device, share=(accelerator.process_index, n))
        own = dict(data.stats)
        accelerator.wait_for_everyone()
        data.store.refresh()
    fill_cache(data, cfg, family, comps, device)
    if n > 1:
        data.stats = {k: v + data.stats[k] if k.endswith("_encoded") else v for k, v in own.items()}


def _training_adapter(
    cfg: Config, family: Family, denoiser: Any, say: Any
) -> TrainingAdapter | None:
    """The configured training adapter, read while the denoiser is still plain; on a
    step-distilled base without one, a warning that says why and the two ways out."""
    m = cfg.model
    distilled = family.distillation(m.pretrained_model)
    if m.training_adapter:
        adapter = read_training_adapter(family, denoiser, m.training_adapter)
        say(
            f"training adapter: {len(adapter.layers)} LoRA layers of {m.training_adapter} run "
            "inside the base while training; the export leaves them out"
        )
        return adapter
    if distilled:
        say(
            f"warning: {distilled.rstrip('.')}. A LoRA trained on it straight comes out weak or grainy at "
            "its few steps. Either set training_adapter to a de-distilling LoRA made for this "
            "base (run inside it while training, left out of the export), or train on the "
            "non-distilled base and use the LoRA on either"
        )
    return None


def release_memory(device: torch.device) -> None:
    """Hand memory that was just let go back: to the host (a collection, since modules hold
    reference cycles) and, on a GPU, to the device from PyTorch's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _parts_needed(
    method: Any, data: CachedDataset, holdout: CachedDataset | None
) -> tuple[str, ...]:
    """The base model's parts this run needs now: encoders only for what is not cached yet."""
    missing = data.missing()
    if holdout is not None:
        missing = {k: v + holdout.missing()[k] for k, v in missing.items()}
    parts = ["denoiser"]  # first: `prepare` loads it apart, after the cache is filled
    if missing["latents"]:
        parts.append("vae")
    if missing["text"] or method.live_text:
        parts.append("text_encoders")
    return tuple(parts)


def _data_report(scanned: ScanReport, data: CachedDataset) -> ScanReport:
    """The scan as training uses it: the samples kept after bucketing, and the images whose
    headers read fine but whose pixels did not (found while caching) among the unreadable."""
    return replace(scanned, samples=data.kept(), unreadable=scanned.unreadable + data.skipped)


def _write_run_files(s: TrainState) -> None:
    """The config, the dataset manifest and the data report, in the run folder (main process)."""
    run = s.run
    if s.main:
        run.root.mkdir(parents=True, exist_ok=True)
        s.cfg.save(run.config)
        run.manifest.write_text(json.dumps(s.data.manifest(), indent=1))
        write_text(run.data_report, json.dumps(s.report.entries(), indent=1, ensure_ascii=False))
        run.logs.mkdir(parents=True, exist_ok=True)
    if s.report.entries():
        s.accelerator.print(
            f"data: {s.report.summary()}; every file and reason in {run.data_report}"
        )
