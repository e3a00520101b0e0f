"""The planner: starting settings from the task and the scanned dataset, each with its reason.

The rules are the usual ones of LoRA guides, made explicit: rank by task; an effective batch of
8–16 (gradient accumulation where memory is short, checked with the VRAM estimator); the
learning rate by method at an effective batch of 8, scaled by the square root of the batch;
steps from the dataset size and the views per image the task needs; cosine decay with a 5%
warm-up; validation and checkpoints at eight points, with three groups of prompts. A run no
single card holds (a full fine-tune of a large model) is planned over several GPUs, with the
launch that splits it (`Plan.launch`).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kit.config import Config, from_dict
from kit.data.buckets import group_name, plan_buckets
from kit.data.datasets import views
from kit.data.pixels import undecodable
from kit.data.scan import load_samples
from kit.data.store import AUTO_SHARDS
from kit.errors import DataError, KitError
from kit.families import get_family
from kit.io import write_json
from kit.methods import get_method, unread_keys
from kit.optim import scale_learning_rate
from kit.preflight.advice import advise, format_changes
from kit.preflight.estimate import GIB, GPUS, estimate

TASKS = ("character", "style", "concept")


@dataclass(frozen=True)
class TaskRule:
    """What a task needs: capacity, how often each image is seen, and the step bounds."""

    rank: int
    views: int
    """Times each image is seen (epochs)."""
    min_steps: int
    max_steps: int
    why: str


RULES = {
    "character": TaskRule(16, 100, 300, 3000, "a face or figure needs detail but little capacity"),
    "style": TaskRule(
        32, 50, 500, 4000, "a style touches every layer and colour; more rank holds it"
    ),
    "concept": TaskRule(16, 80, 300, 3000, "one object or idea: the usual starting rank"),
}
LR_BATCH = 8  # the batch each method's `base_learning_rate` is given at
NO_BF16 = ("T4",)  # cards without bf16: fp16 with a loss scaler instead
VALIDATION_POINTS = 8
NEW_CONTEXTS = {
    "character": [
        "a photo of {t} reading a book in a cafe",
        "{t} as a watercolor painting, on a beach",
    ],
    "style": [
        "a lighthouse on a cliff at sunset, in the style of {t}",
        "a bowl of fruit on a table, {t}",
    ],
    "concept": ["a {t} on a wooden table in a kitchen", "a {t} floating in space, digital art"],
}
UNRELATED = ["a photo of a city street at night", "a bowl of fruit on a wooden table"]
COMMON = set(
    """a an the and or of on in at to with by for from as is are was this that it its his her
    their there here over under near behind front left right center centre top bottom side up
    down photo picture image painting drawing art artwork illustration render style background
    foreground close closeup view shot portrait full body face man woman person people girl boy
    child standing sitting wearing holding looking white black gray grey red green blue yellow
    purple orange pink brown small large big little tall short light dark bright one two three
    wall floor table room outside inside day night sky""".split()
)


@dataclass
class Proposal:
    """Settings proposed together, and why, in one line with its numbers."""

    fields: dict[str, Any]
    reason: str

    def line(self) -> str:
        """`key=value, …: reason`."""
        values = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{values}: {self.reason}"


@dataclass
class Plan:
    """A config the trainer accepts unchanged, the reasons for it, and the dataset's numbers."""

    config: Config
    proposals: list[Proposal]
    dataset: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    """Where one card cannot hold the run: the processes, layout, per-GPU GiB and the
    `kit accelerate-config` command of the multi-GPU launch planned (empty on one card)."""

    def to_dict(self) -> dict[str, Any]:
        """The sectioned config, with the reasons under `_plan` (the loader skips `_` keys)."""
        launch = {"_launch": self.launch} if self.launch else {}
        return {
            "_plan": [p.line() for p in self.proposals],
            "_dataset": self.dataset,
            **launch,
            **self.config.to_dict(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the config file (atomic)."""
        write_json(path, self.to_dict())
        return Path(path)

    def reasons(self) -> list[str]:
        """One line per proposal."""
        return [p.line() for p in self.proposals]

    def rows(self, current: Config | None = None) -> list[dict[str, Any]]:
        """Table rows: setting, planned value (and the current config's), reason."""
        out = []
        for p in self.proposals:
            for k, v in p.fields.items():
                row = {"setting": k, "planned": v}
                if current is not None:
                    row["yours"] = current.get(k)
                out.append({**row, "reason": p.reason})
        return out


def _words(caption: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[\w'-]+", caption)]


def guess_trigger(captions: list[str]) -> tuple[str, int] | None:
    """The uncommon word found in the most captions (at least half), with its count."""
    counts = Counter(w for c in captions for w in set(_words(c)))
    found = [
        (n, w)
        for w, n in counts.items()
        if w not in COMMON and len(w) >= 3 and not w.isdigit() and n >= len(captions) / 2
    ]
    if not found:
        return None
    n, w = max(found)
    return w, n


def _gpu_budget(gpu: str | None, budget_gib: float | None) -> tuple[str, float] | None:
    """The memory to plan for: a named card, a budget, or the GPU in this machine."""
    if budget_gib is not None:
        return f"a {budget_gib:g} GiB budget", float(budget_gib)
    if gpu:
        if gpu not in GPUS:
            raise KitError(f"unknown gpu '{gpu}' (known: {', '.join(GPUS)})")
        return gpu, float(GPUS[gpu])
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory / 2**30
    return None


def plan(
    image_dir: str | Path,
    task: str,
    *,
    base: Config | None = None,
    family: str | None = None,
    pretrained_model: str | None = None,
    gpu: str | None = None,
    budget_gib: float | None = None,
    trigger: str | None = None,
    output_dir: str | None = None,
) -> Plan:
    """Plan a run for `task` on the images in `image_dir`; `base` supplies everything not planned."""
    if task not in TASKS:
        raise KitError(f"unknown task '{task}' (choose one of {', '.join(TASKS)})")
    rule = RULES[task]
    flat = (base or Config()).to_dict(flat=True)
    fam_name = family or (base.model.model_family if base else "sd15")
    several = bool(base and base.data.datasets)
    if several == bool(image_dir):
        raise KitError(
            "plan: the config lists `datasets`; plan them without a folder argument"
            if several
            else "plan: give the folder of images to plan for (or a config with `datasets`)"
        )
    image_dir = Path(image_dir or views(base.data)[0].data.image_dir).resolve()
    flat.update(model_family=fam_name)
    if not several:
        flat.update(image_dir=str(image_dir))
    if pretrained_model:
        flat["pretrained_model"] = pretrained_model
    elif base is None or fam_name != base.model.model_family:
        flat["pretrained_model"] = get_family(fam_name).hub_id or flat["pretrained_model"]
    flat["output_dir"] = str(
        Path(
            output_dir or (base.train.output_dir if base else f"runs/{image_dir.name}-{task}")
        ).resolve()
    )
    props: list[Proposal] = []

    def propose(reason: str, **fields: Any) -> None:
        flat.update(fields)
        props.append(Proposal(fields, reason))

    cfg = from_dict(flat)
    fam = get_family(fam_name, cfg)
    samples = load_samples(cfg.data, fam)
    # A file whose header reads but whose pixels do not (cut short) is left out by the cache:
    # the plan counts what trains.
    unreadable = undecodable(samples, cfg.data)
    samples = [s for s in samples if Path(s.image) not in unreadable]
    if not samples:
        first = next(iter(unreadable.values()))
        raise DataError(f"no image of the dataset decodes ({first})")
    seen = views(cfg.data)
    # Prior (regularisation) images train too, but the plan is sized by what is taught.
    taught = [s for s in samples if not seen[s.dataset].prior] or samples
    n = sum(seen[s.dataset].repeats for s in taught)

    # Resolution: the family's native size, unless the images are smaller.
    native = fam.native_resolution
    short = statistics.median(min(s.width, s.height) for s in samples)
    step = cfg.data.bucket_step or fam.bucket_step
    if short < native:
        res = max(step, int(short) // step * step)
        propose(
            f"the median image is {short:g} px on its short side, below {fam_name}'s native "
            f"{native}; training above the images' size only upscales them",
            resolution=res,
        )
    else:
        res = native
        propose(
            f"{fam_name}'s native size; the median image's short side is {short:g} px",
            resolution=res,
        )
    distilled = fam.distillation(cfg.model.pretrained_model)
    if distilled and not cfg.model.training_adapter:
        propose(
            f"{distilled.rstrip('.')}. A LoRA trained on it straight comes out weak or grainy: set "
            "training_adapter to a de-distilling LoRA made for it (run inside the base while "
            "training, left out of the export), or plan on the non-distilled base "
            "(--pretrained-model)",
            training_adapter="",
        )
    buckets = plan_buckets(samples, from_dict(flat).data, fam.bucket_step, cfg.train.seed)
    # Per group, how many samples an epoch trains (with each dataset's repeats).
    counts = {k: buckets.occurrences(idx) for k, idx in buckets.groups().items()}

    # Captions: the trigger word and how many captions carry it.
    captions = [s.caption for s in taught]
    triggers = [trigger] if trigger else list(cfg.data.trigger_words)
    if triggers:
        have = sum(any(t.lower() in _words(c) for t in triggers) for c in captions)
        propose(f"given; {have} of {len(captions)} captions contain it", trigger_words=triggers)
    elif (guess := guess_trigger(captions)) is not None:
        triggers = [guess[0]]
        propose(
            f"guessed: '{guess[0]}' is in {guess[1]} of {len(captions)} captions and is not a "
            "common word "
            "(pass --trigger to choose)",
            trigger_words=triggers,
        )

    # Network: kind, rank and alpha; a config that asks for a full fine-tune keeps it.
    rank = rule.rank if n >= 10 else rule.rank // 2
    small = f"; halved as {n} images (<10) carry little detail" if n < 10 else ""
    if (
        base is not None
        and get_method(base, get_family(base.model.model_family, base)).whole_denoiser
    ):
        kind = base.network.network_type
        propose(
            f"the config trains every weight of the denoiser (network_type {kind}); no rank",
            network_type=kind,
        )
    else:
        propose(
            f"{task}: rank {rule.rank} ({rule.why}){small}; alpha = rank keeps the update scale "
            "at 1.0, so the learning rate below means what the usual tables mean; LoRA loads "
            "everywhere",
            network_type="lora",
            lora_rank=rank,
            lora_alpha=float(rank),
            **unread_keys(from_dict(flat), "lora"),  # what only the config's kind read
        )

    # Batch, accumulation and memory.
    target = 16 if n >= 64 else 8
    target = min(target, n)
    largest = max(counts.values())
    gpu_name = _gpu_budget(gpu, budget_gib)
    precision = "no"
    if gpu_name is not None:
        precision = "fp16" if any(c in gpu_name[0] for c in NO_BF16) else "bf16"
        propose(
            f"{gpu_name[0]}: bf16 halves weight and activation memory without fp16's overflows"
            if precision == "bf16"
            else f"{gpu_name[0]} lacks bf16; fp16 with a loss scaler",
            mixed_precision=precision,
        )
    batch, ckpt, fit_note, storage, launch = _fit_batch(
        from_dict(flat), target, largest, gpu_name, precision
    )
    procs = launch.get("processes", 1)
    accum = max(1, target // (batch * procs))
    eff = batch * accum * procs
    over = f" × {procs} GPUs" if procs > 1 else ""
    propose(
        f"effective batch {batch} × {accum}{over} = {eff} (aim: 8–16, at most the {n} images); "
        f"{fit_note}",
        train_batch_size=batch,
        gradient_accumulation_steps=accum,
        gradient_checkpointing=ckpt,
        **storage,
    )

    # Learning rate: by method, square-root scaled from an effective batch of 8. The method
    # also refuses a family it cannot finish on, before anything else is planned on it.
    method = get_method(from_dict(flat), fam)
    base_lr = method.base_learning_rate
    lr = float(f"{scale_learning_rate(base_lr, LR_BATCH, eff):.2g}")
    propose(
        f"{method.title} starts at {base_lr:g} at effective batch {LR_BATCH}; batch {eff} → "
        f"×√({eff}/{LR_BATCH}) = {math.sqrt(eff / LR_BATCH):.2f} → {lr:g}",
        learning_rate=lr,
    )

    # Steps: views per image over the epoch length, within the task's bounds.
    micro = sum(math.ceil(c / batch) for c in counts.values())
    per_epoch = micro / accum
    steps = math.ceil(rule.views * per_epoch)
    what = f"{n} images" if not several else f"{n} samples per epoch (with repeats)"
    why = (
        f"{what} in {len(counts)} bucket(s) → {micro} batches of ≤{batch} per epoch / "
        f"accumulation {accum} → {per_epoch:g} steps per epoch; × {rule.views} epochs "
        f"({task}: each image seen ~{rule.views} times) → {steps} steps"
    )
    if steps < rule.min_steps or steps > rule.max_steps:
        bound = min(max(steps, rule.min_steps), rule.max_steps)
        why += f", {'raised' if bound > steps else 'capped'} to {bound} ({bound / per_epoch:.0f} epochs)"
        steps = bound
    propose(why, max_train_steps=steps)

    warm = max(1, round(0.05 * steps))
    propose(
        f"cosine decay to 0 over {steps} steps, with {warm} warm-up steps (5%) so Adam's first "
        "steps are small",
        lr_scheduler="cosine",
        lr_warmup_steps=warm,
    )
    every = max(1, steps // VALIDATION_POINTS)
    propose(
        f"{steps} steps / {VALIDATION_POINTS} → every {every} steps: {VALIDATION_POINTS} grids to "
        "compare, each with a checkpoint to pick and a stable loss to read",
        validation_steps=every,
        checkpointing_steps=every,
        stable_loss_steps=every,
    )

    if len(samples) >= AUTO_SHARDS and cfg.data.cache_format == "files":
        propose(
            f"{len(samples):,} images: a file per cache entry is {2 * len(samples):,}+ files; "
            f"shards of 500 keep it near {2 * len(samples) // 500 + 2:,}",
            cache_format="shards",
        )

    # Validation prompts: the three groups.
    prompts = _prompts(captions, triggers[0] if triggers else "", task)
    flat["validation_prompt"] = [p for group in prompts.values() for p in group]
    props.append(
        Proposal(
            {"validation_prompt": flat["validation_prompt"]},
            f"{len(prompts['training'])} training caption(s) (does it learn them?), "
            f"{len(prompts['new_contexts'])} with the trigger in new contexts (does it generalise?), "
            f"{len(prompts['unrelated'])} unrelated (does the base stay itself?)",
        )
    )
    flat["validation_seeds"] = [0, 1]
    dataset = {
        "images": n,
        "buckets": {group_name(k): c for k, c in sorted(counts.items())},
        "datasets": {v.name: sum(s.dataset == v.index for s in samples) for v in seen},
        "distinct_captions": len(set(captions)),
        "unreadable": {str(k): v for k, v in unreadable.items()},
        "median_short_side": short,
        "prompt_groups": prompts,
    }
    return Plan(from_dict(flat), props, dataset, launch)


def _fit_batch(
    cfg: Config, target: int, largest: int, gpu: tuple[str, float] | None, precision: str
) -> tuple[int, bool, str, dict[str, Any], dict[str, Any]]:
    """The largest batch (≤ target and the largest bucket) that fits, without checkpointing
    first; where not even batch 1 with checkpointing fits, the cheapest other settings the
    advice finds (a quantized base, block swap, …), as config keys; where no setting fits one
    card, the fewest such cards that hold the run, with the launch (the last item)."""
    sizes = [b for b in (16, 8, 4, 2, 1) if b <= min(target, largest)] or [1]
    if gpu is None:
        b = min(sizes[0], 2)
        why = "no GPU given or found: batch not checked against memory (pass --gpu)"
        return b, False, why, {}, {}
    name, gib = gpu
    last = None
    try:
        for ckpt, b in itertools.product((False, True), sizes):
            est = estimate(
                cfg, batch_size=b, gradient_checkpointing=ckpt, mixed_precision=precision
            )
            last = est.peak_bytes / GIB
            if est.fits(gib):
                how = " with gradient checkpointing" if ckpt else ""
                return (
                    b,
                    ckpt,
                    f"batch {b}{how} fits {name} ({last:.2f} of {gib:g} GiB estimated)",
                    {},
                    {},
                )
            if est.floor_bytes > gib * GIB:
                break  # the weights alone are too much: no batch or checkpointing helps
        one = cfg.replace(
            train_batch_size=1,
            gradient_accumulation_steps=1,
            gradient_checkpointing=True,
            mixed_precision=precision,
        )
        rows = advise(one, gib, top=1)
        last = estimate(one).peak_bytes / GIB
    except Exception as e:  # the base model's configs are not reachable
        return (
            min(sizes[0], 2),
            False,
            f"memory not checked ({type(e).__name__}: {str(e)[:80]})",
            {},
            {},
        )
    if rows and "launch" in rows[0]:
        row = rows[0]
        changes = {
            k: v
            for k, v in row["set"].items()
            if k not in ("train_batch_size", "gradient_accumulation_steps")
        }
        ckpt = changes.pop("gradient_checkpointing", True)
        how = " with" if ckpt else " without"
        more = f" and {format_changes(changes)}" if changes else ""
        launch = {k: v for k, v in row["launch"].items() if k != "summary"}
        return (
            1,
            ckpt,
            (
                f"batch 1 with gradient checkpointing needs {last:.2f} GiB, more than {name}'s "
                f"{gib:g}, and no setting fits one card; {row['launch']['summary']} (of "
                f"{gib:g}), batch 1{how} gradient checkpointing{more}: launch with "
                f"`{launch['command']}`"
            ),
            changes,
            launch,
        )
    if rows:
        changes = dict(rows[0]["set"])
        ckpt = changes.pop("gradient_checkpointing", True)
        how = " with" if ckpt else " without"
        return (
            1,
            ckpt,
            (
                f"batch 1 with gradient checkpointing needs {last:.2f} GiB, more than {name}'s "
                f"{gib:g}; batch 1{how} gradient checkpointing and {format_changes(changes)} fits "
                f"({rows[0]['peak_gib']:.2f} GiB estimated, about {rows[0]['slowdown']:g}x the "
                "time per image)"
            ),
            changes,
            {},
        )
    return (
        1,
        True,
        (
            f"does not fit {name} even at batch 1 with gradient checkpointing, a quantized base "
            f"or block swap ({last:.2f} GiB estimated), nor on up to 16 of them: lower the "
            "resolution"
        ),
        {},
        {},
    )


def _prompts(captions: list[str], trigger: str, task: str) -> dict[str, list[str]]:
    """Two training captions far apart, the trigger in new contexts, and unrelated prompts."""
    distinct = list(dict.fromkeys(c for c in captions if c))
    # Captions with the trigger, where there are any: the others may be prior images.
    with_trigger = [c for c in distinct if trigger and trigger.lower() in _words(c)]
    distinct = with_trigger or distinct
    training = distinct[:1]
    if len(distinct) > 1:
        first = set(_words(distinct[0]))
        training.append(min(distinct[1:], key=lambda c: len(first & set(_words(c)))))
    new = [p.format(t=trigger) for p in NEW_CONTEXTS[task]] if trigger else []
    return {"training": training, "new_contexts": new, "unrelated": list(UNRELATED)}
