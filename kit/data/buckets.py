"""Aspect buckets: which bucket and crop each sample gets, and the batches of an epoch."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kit.config import Config, DataConfig
from kit.data import bounds, video
from kit.data.datasets import views
from kit.data.scan import Sample, ScanReport, load_samples
from kit.errors import ConfigError, DataError
from kit.families import family_info


def make_buckets(
    resolution: int, resolution_type: str, step: int, max_aspect_ratio: float
) -> list[tuple[int, int]]:
    """(width, height) buckets, multiples of `step`, from square to `max_aspect_ratio`.

    With `area`, no bucket holds more than `resolution`² pixels: the memory estimate and the
    step time assume that, and a bigger bucket would only upscale the image.
    """
    if resolution_type == "area":
        # The largest square within the area is always there, so square images are never cropped.
        side = max(step, resolution // step * step)
        out: set[tuple[int, int]] = {(side, side)}
        area = resolution * resolution
        for w in range(step, int(resolution * math.sqrt(max_aspect_ratio)) + step + 1, step):
            # Rounded down, never up: the bucket stays within the area (none if that is < step).
            h = area // w // step * step
            if h < step:
                continue
            if max(w / h, h / w) <= max_aspect_ratio + 1e-6:
                out.add((w, h))
                out.add((h, w))
    else:
        short = max(step, round(resolution / step) * step)
        out = {(short, short)}
        long = short
        while long / short <= max_aspect_ratio + 1e-6:
            out.add((long, short))
            out.add((short, long))
            long += step
    return sorted(out, key=lambda wh: (wh[0] / wh[1], wh[0]))


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest (in log space) to the image's."""
    ar = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ar), -b[0] * b[1]))


@dataclass
class Placement:
    """How one image (or clip) is fitted to its bucket."""

    bucket: tuple[int, int]
    resized: tuple[int, int]
    crop: tuple[int, int]
    """(top, left) of the crop in the resized image."""
    original: tuple[int, int]
    frames: tuple[int, ...] = ()
    """The clip's frames taken, in order; empty for an image."""
    flip: bool = False
    """Mirrored left to right before the crop: `crop` is then the offset in the mirrored image,
    as SDXL's crop conditioning must see it (see `mirrored`)."""

    @property
    def num_frames(self) -> int:
        """Frames of the sample: 1 for an image."""
        return len(self.frames) or 1

    def record(self) -> dict[str, Any]:
        """As plain data; fields at their defaults are left out, so older cache keys still match."""
        d = asdict(self)
        if not self.frames:
            del d["frames"]
        if not self.flip:
            del d["flip"]
        return d


def place(
    sample: Sample,
    bucket: tuple[int, int],
    center: bool,
    seed: int,
    frame_stride: int = 1,
    frame_start: str = "first",
) -> Placement:
    """Resize to cover the bucket, then crop at the centre or a seeded offset; pick a clip's frames.

    Never mirrored: `mirrored` gives the other orientation of the same crop.
    """
    bw, bh = bucket
    scale = max(bw / sample.width, bh / sample.height)
    rw, rh = max(bw, math.ceil(sample.width * scale)), max(bh, math.ceil(sample.height * scale))
    if center:
        top, left = (rh - bh) // 2, (rw - bw) // 2
    else:
        rng = random.Random(f"{seed}-{sample.image.as_posix()}")
        top, left = rng.randint(0, rh - bh), rng.randint(0, rw - bw)
    frames: tuple[int, ...] = ()
    if sample.clip and sample.window_start is not None:
        frames = video.window_frames(sample.window_start, sample.frames, frame_stride)
    elif sample.clip:
        key = f"{seed}-{sample.image.as_posix()}-frames"
        frames = video.select_frames(
            sample.total_frames, sample.frames, frame_stride, frame_start, key
        )
    return Placement(bucket, (rw, rh), (top, left), (sample.width, sample.height), frames)


def clip_windows(sample: Sample, cfg: DataConfig, seed: int) -> list[Sample]:
    """The samples a clip trains as: one per window of `frame_sampling` (each with its
    `window_start`), or the clip itself under `head` (its frames placed by `frame_start`).

    An image, and a sample already split into windows, is returned as it is. `cfg` is the
    sample's own dataset's data section, whose `frame_stride` `place` must use too.
    """
    if not sample.clip or sample.window_start is not None or cfg.frame_sampling == "head":
        return [sample]
    starts = video.window_starts(
        sample.total_frames,
        sample.frames,
        cfg.frame_stride,
        cfg.frame_sampling,
        cfg.frame_windows,
        cfg.window_stride,
        cfg.frame_start,
        f"{seed}-{sample.image.as_posix()}-frames",
    )
    return [replace(sample, window_start=b) for b in starts]


def mirrored(p: Placement) -> Placement:
    """The same crop of the image, mirrored left to right: its left offset counts from the other
    edge of the resized image, so the recorded crop describes the pixels trained on."""
    (rw, _), (bw, _) = p.resized, p.bucket
    top, left = p.crop
    return replace(p, crop=(top, rw - left - bw), flip=True)


def upscale_needed(sample: Sample, bucket: tuple[int, int]) -> float:
    """How much the sample must be enlarged to cover the bucket (below 1: it is shrunk)."""
    return max(bucket[0] / sample.width, bucket[1] / sample.height)


GroupKey = tuple[int, int, int]
"""(width, height, frames): the samples a batch may be drawn from together."""


@dataclass
class BucketPlan:
    """Every kept sample's bucket and crop, what was dropped and why, and what repeats."""

    buckets: list[tuple[int, int]]
    placements: list[Placement]
    samples: list[Sample] = field(default_factory=list)
    """The samples kept, in the order of `placements`."""
    dropped: list[tuple[Path, str]] = field(default_factory=list)
    """(file, reason) of each sample left out of training."""
    repeats: dict[GroupKey, int] = field(default_factory=dict)
    """Group → how many times each of its samples appears per epoch (absent: once)."""
    group_size: int = 1
    """Samples in one effective batch (batch × accumulation × processes)."""
    dataset_repeats: list[int] = field(default_factory=lambda: [1])
    """Per dataset (by `Sample.dataset`), how many times each of its samples trains per epoch."""
    flip_twins: bool = False
    """The second half of `samples` and `placements` mirrors the first, sample by sample (see
    `with_mirrored`): each epoch a seeded coin per sample picks which of the two trains."""

    @property
    def size(self) -> int:
        """Distinct samples: a mirrored twin is the same sample in the other orientation."""
        return len(self.placements) // 2 if self.flip_twins else len(self.placements)

    def counts(self) -> dict[tuple[int, int], int]:
        """Images (and clips) per bucket."""
        return dict(Counter(p.bucket for p in self.placements[: self.size]))

    def frame_counts(self) -> dict[GroupKey, int]:
        """Samples per (width, height, frames): the groups batches are drawn from."""
        return dict(Counter(_group(p) for p in self.placements[: self.size]))

    def repeats_of(self, i: int) -> int:
        """How many times sample `i` trains per epoch by its dataset's `repeats`."""
        return self.dataset_repeats[self.samples[i].dataset]

    def occurrences(self, idx: list[int]) -> int:
        """How many times these samples train per epoch, counting their datasets' repeats."""
        return sum(self.repeats_of(i) for i in idx)

    def groups(self) -> dict[GroupKey, list[int]]:
        """Sample indices per group, in sample order (a twin's group is its sample's)."""
        out: dict[GroupKey, list[int]] = defaultdict(list)
        for i, p in enumerate(self.placements[: self.size]):
            out[_group(p)].append(i)
        return dict(out)


def with_mirrored(plan: BucketPlan) -> BucketPlan:
    """The plan with every sample's mirrored twin after the samples (sample i's twin is i + n),
    so that both orientations are cached and an epoch can train either."""
    if plan.flip_twins:
        return plan
    twins = [mirrored(p) for p in plan.placements]
    return replace(
        plan, samples=plan.samples * 2, placements=plan.placements + twins, flip_twins=True
    )


def flip_coin(seed: int, epoch: int, sample: Sample, repeat: int = 0) -> bool:
    """Whether `sample` trains mirrored in this epoch: a fair coin of its own per epoch (and
    per repeat, for a dataset with `repeats`)."""
    again = f"-{repeat}" if repeat else ""
    return (
        random.Random(f"{seed}-epoch-{epoch}-flip-{sample.image.as_posix()}{again}").random() < 0.5
    )


def _group(p: Placement) -> GroupKey:
    return (*p.bucket, p.num_frames)


def group_name(key: GroupKey) -> str:
    """`512x768`, or `512x768x17f` for clips."""
    w, h, f = key
    return f"{w}x{h}" + (f"x{f}f" if f > 1 else "")


def bucket_list(cfg: DataConfig, step: int) -> list[tuple[int, int]]:
    """The configured buckets (`buckets`, checked against the step), else generated ones."""
    if not cfg.buckets:
        return make_buckets(cfg.resolution, cfg.resolution_type, step, cfg.max_aspect_ratio)
    for w, h in cfg.buckets:
        if w % step or h % step:
            raise ConfigError(
                f"buckets: [{w}, {h}] is not a multiple of the bucket step {step} "
                "(bucket_step, or the model family's alignment)"
            )
    return sorted({(w, h) for w, h in cfg.buckets}, key=lambda wh: (wh[0] / wh[1], wh[0]))


def plan_buckets(
    samples: list[Sample], cfg: DataConfig, step: int, seed: int, group_size: int = 1
) -> BucketPlan:
    """Assign each sample a bucket and crop (and a clip its frames); drop what cannot train.

    Each sample is fitted by its own dataset's settings (resolution, buckets, crop, frames; see
    `kit.data.datasets`), so datasets of different resolutions share one plan and a batch never
    mixes sizes. `group_size` is one effective batch: buckets with fewer samples (counting each
    dataset's `repeats`) follow `small_bucket_policy`.
    """
    step = cfg.bucket_step or step
    seen = views(cfg)
    data = {v.index: v.data for v in seen}
    lists = {v.index: bucket_list(v.data, step) for v in seen}

    def fit(s: Sample, bucket: tuple[int, int]) -> Placement:
        d = data[s.dataset]
        return place(s, bucket, d.center_crop, seed, d.frame_stride, d.frame_start)

    every = sorted({b for bs in lists.values() for b in bs}, key=lambda wh: (wh[0] / wh[1], wh[0]))
    plan = BucketPlan(every, [], group_size=group_size)
    plan.dataset_repeats = [v.repeats for v in seen]
    chosen: dict[tuple[int, int, int], tuple[int, int]] = {}  # sizes repeat in a dataset
    for s in samples:
        size = (s.width, s.height, s.dataset)
        if size not in chosen:
            chosen[size] = assign_bucket(s.width, s.height, lists[s.dataset])
        bucket = chosen[size]
        need = upscale_needed(s, bucket)
        if need > data[s.dataset].max_upscale + 1e-9:
            plan.dropped.append((s.image, _too_small(need, data[s.dataset])))
            continue
        for w in clip_windows(s, data[s.dataset], seed):
            plan.samples.append(w)
            plan.placements.append(fit(w, bucket))
    if group_size > 1:
        _small_buckets(plan, cfg, fit, lambda s: data[s.dataset])
    return plan


def _too_small(need: float, cfg: DataConfig) -> str:
    return f"too small: needs {need:.2f}× upscale (max_upscale {cfg.max_upscale:g})"


def _small_buckets(plan: BucketPlan, cfg: DataConfig, fit: Any, data_of: Any) -> None:
    """Apply `small_bucket_policy` to groups with fewer samples than one effective batch."""
    n_eff = plan.group_size
    groups = plan.groups()
    small = {k: idx for k, idx in groups.items() if plan.occurrences(idx) < n_eff}
    if not small:
        return
    policy = cfg.small_bucket_policy
    if policy == "keep":
        return  # their images form a short batch, as in kohya's trainer
    if policy == "repeat":
        plan.repeats = {k: math.ceil(n_eff / plan.occurrences(idx)) for k, idx in small.items()}
        return
    big = [k for k in groups if k not in small]
    keep = [True] * len(plan.samples)
    for key, idx in small.items():
        why = f"bucket {group_name(key)} has {plan.occurrences(idx)} sample(s), fewer than one effective batch of {n_eff}"
        targets = [k for k in big if k[2] == key[2]]
        for i in idx:
            s = plan.samples[i]
            if policy == "drop" or not targets:
                reason = (
                    f"{why}; small_bucket_policy is drop"
                    if policy == "drop"
                    else f"{why}, and no bucket has enough to merge into"
                )
                plan.dropped.append((s.image, reason))
                keep[i] = False
                continue
            # The nearest big bucket by aspect ratio (log space), as for assign_bucket.
            ar = math.log(key[0] / key[1])
            target = min(targets, key=lambda k: (abs(math.log(k[0] / k[1]) - ar), -k[0] * k[1]))
            need = upscale_needed(s, target[:2])
            if need > data_of(s).max_upscale + 1e-9:
                plan.dropped.append((s.image, _too_small(need, data_of(s))))
                keep[i] = False
                continue
            plan.placements[i] = fit(s, target[:2])
    plan.samples = [s for s, k in zip(plan.samples, keep, strict=True) if k]
    plan.placements = [p for p, k in zip(plan.placements, keep, strict=True) if k]


def plan_dataset(
    cfg: Config,
    num_processes: int = 1,
    *,
    family: Any = None,
    scanned: ScanReport | None = None,
) -> tuple[list[Sample], BucketPlan]:
    """Scan the dataset and bucket it with the family's alignment: what training will see.

    The samples returned are the kept ones; `plan.dropped` says what was left out and why.
    A caller that has already built the family, or scanned the folder (`check_dataset`), passes
    them in: neither is then done again.
    """
    if family is None:
        family = family_info(cfg.model.model_family)
    samples = scanned.samples if scanned is not None else load_samples(cfg.data, family)
    t = cfg.train
    group = t.train_batch_size * t.gradient_accumulation_steps * num_processes
    plan = plan_buckets(samples, cfg.data, family.bucket_step, t.seed, group)
    if not plan.samples:
        first = plan.dropped[0] if plan.dropped else None
        why = f" (e.g. {first[0]}: {first[1]})" if first else ""
        where = cfg.data.image_dir or ", ".join(v.data.image_dir for v in views(cfg.data))
        raise DataError(f"every image in {where} was dropped{why}")
    bounds.check_plan(plan, views(cfg.data))  # before an epoch's order or a clip is held
    return plan.samples, plan


def epoch_batches(
    plan: BucketPlan, batch_size: int, seed: int, epoch: int, world: int = 1
) -> list[list[int]]:
    """The batches of one epoch, as the trainer runs them: one source of truth for counts.

    Shuffled within groups (a bucket and frame count, so a batch of clips stacks), small groups
    repeated as planned, batches shuffled; never mixing groups. With mirrored twins, each
    sample's coin for the epoch picks its orientation; the batches are the same either way, so
    counts do not depend on `random_flip`. Process r of `world` takes
    batches r, r + world, ...; a tail that cannot go to every process is left out (it waits for
    the next epoch's shuffle), so all processes step together.
    """
    rng = random.Random(f"{seed}-epoch-{epoch}")
    batches = []
    n = plan.size
    for key, idx in sorted(plan.groups().items()):
        # Each repeat of a sample is its own draw: its own coin for the orientation.
        drawn = [(i, r) for i in idx for r in range(plan.repeats_of(i))]
        if plan.flip_twins:
            idx = [i + n if flip_coin(seed, epoch, plan.samples[i], r) else i for i, r in drawn]
        else:
            idx = [i for i, _ in drawn]
        idx = idx * plan.repeats.get(key, 1)
        rng.shuffle(idx)
        batches += [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches[: len(batches) - len(batches) % world]
