"""Images (or clips) and captions → aspect buckets → batches; the cache itself is `kit.cache`.

Video families also read clips (see `kit.video`): a sample then has frames, its buckets group by
(width, height, frames), and its pixels are (3, F, H, W). Images behave as they always have.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from kit import video
from kit.config import Config, DataConfig
from kit.errors import ConfigError, DataError
from kit.images import DEFAULT_MAX_PIXELS, BadImage, open_rgb, probe

IMAGE_EXTS = set(video.FRAME_EXTS)


@dataclass
class Sample:
    """One training image (or clip) and its caption."""

    image: Path
    """The image file, or the clip: a video file or a folder of numbered frames."""
    caption: str
    width: int
    height: int
    frames: int = 1
    """Frames this sample trains on (1 for an image)."""
    total_frames: int = 1
    """Frames the clip holds."""
    clip: bool = False
    """True for a clip (even one of a single frame), False for a still image."""


@dataclass
class ScanReport:
    """What a dataset folder holds, and every file that is skipped or looks wrong, with why."""

    samples: list[Sample] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    orphan_captions: list[Path] = field(default_factory=list)
    empty_captions: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    """Files that cannot be decoded (corrupt, cut short, empty), with why."""
    duplicate_stems: list[str] = field(default_factory=list)
    short_clips: list[tuple[Path, str]] = field(default_factory=list)
    """Clips too short for even the family's smallest clip, with why."""
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Readable files left out for another reason (too small, too large, ambiguous caption)."""
    warnings: list[tuple[Path, str]] = field(default_factory=list)
    """Files used, but not as they are on disk (a caption that is not UTF-8), with what was done."""

    def dropped(self) -> list[tuple[Path, str]]:
        """Every file that was found but is not trained on, with why."""
        missing = [(p, "no caption file") for p in self.missing_captions]
        return sorted(self.unreadable + self.short_clips + self.skipped + missing)

    def entries(self) -> list[dict[str, Any]]:
        """The data report: each dropped file and each warning, as {"file", "reason", "skipped"}."""
        notes = (
            self.warnings
            + [(p, "empty caption: trained with an empty caption") for p in self.empty_captions]
            + [(p, "caption file without an image") for p in self.orphan_captions]
        )
        return [{"file": str(p), "reason": why, "skipped": True} for p, why in self.dropped()] + [
            {"file": str(p), "reason": why, "skipped": False} for p, why in sorted(notes)
        ]

    def summary(self) -> str:
        """One line: how many files are used, skipped and warned about."""
        skipped = self.dropped()
        total = len(self.samples) + len(skipped)
        line = f"{len(self.samples)} of {total} file(s) usable"
        if skipped:
            first = skipped[0]
            line += f"; {len(skipped)} skipped (first: {first[0].name}: {first[1]})"
        if self.warnings:
            line += f"; {len(self.warnings)} warning(s)"
        return line

    def problems(self) -> list[str]:
        """One line per kind of problem found; the files concerned are skipped."""
        out = []
        if self.unreadable:
            path, why = self.unreadable[0]
            more = f" (and {len(self.unreadable) - 1} more)" if len(self.unreadable) > 1 else ""
            kind = "clip" if video.is_clip(path) else "image"
            out.append(f"unreadable {kind} {path}: {why}{more}")
        if self.short_clips:
            path, why = self.short_clips[0]
            more = f" (and {len(self.short_clips) - 1} more)" if len(self.short_clips) > 1 else ""
            out.append(f"clip too short: {path} {why}{more}")
        if self.missing_captions:
            names = ", ".join(str(p) for p in self.missing_captions[:3])
            more = (
                f" and {len(self.missing_captions) - 3} more"
                if len(self.missing_captions) > 3
                else ""
            )
            out.append(f"{len(self.missing_captions)} image(s) have no caption file: {names}{more}")
        if self.skipped:
            path, why = self.skipped[0]
            more = f" (and {len(self.skipped) - 1} more)" if len(self.skipped) > 1 else ""
            out.append(f"skipped {path}: {why}{more}")
        if self.duplicate_stems:
            out.append(
                "images share a name but differ in extension, so a caption is ambiguous: "
                + ", ".join(self.duplicate_stems[:3])
            )
        return out


def _caption_path(image: Path, cfg: DataConfig, is_dir: bool | None = None) -> Path:
    folder = Path(cfg.caption_dir) if cfg.caption_dir else image.parent
    if cfg.caption_dir:
        folder = folder / image.parent.relative_to(Path(cfg.image_dir))
    # A frame folder `clip.v2/` is captioned by `clip.v2.txt`: its whole name is the stem.
    stem = image.name if (image.is_dir() if is_dir is None else is_dir) else image.stem
    return folder / (stem + cfg.caption_extension)


@dataclass
class _Tree:
    """Files and folders under a dataset folder, and the folder links that lead back into it."""

    files: list[Path]
    dirs: list[Path]
    loops: list[Path]


def _walk(root: Path) -> _Tree:
    """Every non-hidden file and folder under `root`, following folder links once each.

    A link to a folder is followed (datasets are often linked in), but a folder already seen
    through another path (a link to a parent, say) is not entered again, so a scan always ends.
    """
    files: list[Path] = []
    dirs: list[Path] = []
    loops: list[Path] = []
    seen = {os.path.realpath(root)}
    for top, subdirs, names in os.walk(root, followlinks=True):
        keep = []
        for d in sorted(subdirs):
            path = Path(top, d)
            real = os.path.realpath(path)
            if d.startswith("."):
                continue
            if real in seen:
                loops.append(path)
                continue
            seen.add(real)
            keep.append(d)
        subdirs[:] = keep
        dirs += [Path(top, d) for d in keep]
        files += [Path(top, n) for n in names if not n.startswith(".")]
    return _Tree(sorted(files), sorted(dirs), sorted(loops))


def _images_of(tree: _Tree) -> list[Path]:
    # `os.walk` lists non-folders only: a broken link among them is reported when it is read.
    return [p for p in tree.files if p.suffix.lower() in IMAGE_EXTS]


def _clips_of(tree: _Tree) -> list[Path]:
    return sorted(
        [p for p in tree.files if video.is_video_file(p) and p.is_file()]
        + [d for d in tree.dirs if video.frame_files(d)]
    )


def is_prior_image(image: str | Path, patterns: list[str], image_dir: str | Path = "") -> bool:
    """Whether an image is one of `prior_images`: a pattern with `/` matches the path relative to
    image_dir, one without matches the file name."""
    from fnmatch import fnmatchcase

    if not patterns:
        return False
    path = Path(image)
    try:
        rel = path.resolve().relative_to(Path(image_dir).resolve()).as_posix() if image_dir else ""
    except ValueError:
        rel = ""
    return any(
        fnmatchcase(rel or path.as_posix(), p) if "/" in p else fnmatchcase(path.name, p)
        for p in patterns
    )


def list_images(image_dir: Path) -> list[Path]:
    """Image files under a folder (recursively, skipping hidden folders), sorted."""
    return _images_of(_walk(Path(image_dir)))


def image_size(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Width and height as displayed (after EXIF rotation), read without decoding pixels."""
    return probe(path, max_pixels)


def list_clips(image_dir: Path) -> list[Path]:
    """Video files and frame folders under a folder (recursively, skipping hidden ones), sorted."""
    return _clips_of(_walk(Path(image_dir)))


def _read_caption(path: Path, report: ScanReport) -> str:
    """A caption file's text; bytes that are not UTF-8 are replaced and the file noted."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8-sig", errors="replace")
        report.warnings.append(
            (path, f"caption is not UTF-8 (byte {e.start}); undecodable bytes replaced with U+FFFD")
        )
    return text.strip()


def scan(cfg: DataConfig, family: Any = None) -> ScanReport:
    """Read the dataset folder: images (and clips), their captions and every problem found.

    Nothing here stops a run: each file that cannot be used is recorded with its reason and left
    out. The family decides what is read: an image family reads images only; a video family also
    reads clips and holds them to its frame rule. Without a family (a caption report before a
    model is chosen) a clip is read where it has a caption, so stray videos are left alone.
    Images that share a name but not an extension (`cat.jpg`, `cat.png`) are both skipped when
    captions come from text files, as either could be the one `cat.txt` describes.
    """
    image_dir = Path(cfg.image_dir)
    if not cfg.image_dir:
        raise DataError("image_dir is not set in the config")
    if not image_dir.is_dir():
        raise DataError(f"image folder not found: {image_dir} (image_dir)")
    if cfg.caption_dir and not Path(cfg.caption_dir).is_dir():
        raise DataError(f"caption folder not found: {cfg.caption_dir} (caption_dir)")
    report = ScanReport()
    tree = _walk(image_dir)
    report.skipped += [(p, "folder link back into the dataset: not read twice") for p in tree.loops]
    reads_clips = family is None or family.video
    clips = [c for c in _clips_of(tree) if _counts_as_clip(c, cfg, family)] if reads_clips else []
    clip_set = set(clips)
    in_clips = {f for c in clips if c.is_dir() for f in video.frame_files(c)}
    images = [p for p in _images_of(tree) if p not in in_clips]
    stems = Counter(p if p.is_dir() else p.with_suffix("") for p in images + clips)
    report.duplicate_stems = sorted(str(s) for s, n in stems.items() if n > 1)
    ambiguous = set(report.duplicate_stems) if cfg.caption_strategy == "textfile" else set()
    rule = family.frame_count if family is not None and family.video else None
    used_captions = set()
    # The walk already listed every file: caption look-ups need no system call per image.
    listed = set(tree.files) if not cfg.caption_dir else None
    folders = set(tree.dirs)
    for path in sorted(images + clips):
        is_clip = path in clip_set
        is_dir = path in folders
        cap = _caption_path(path, cfg, is_dir)
        # A skipped image's caption is accounted for by the image, not reported as an orphan.
        used_captions.add(os.path.abspath(cap))
        if ambiguous and str(path if is_dir else path.with_suffix("")) in ambiguous:
            others = sorted(
                p.name for p in images + clips if p.with_suffix("") == path.with_suffix("")
            )
            report.skipped.append(
                (path, f"ambiguous caption: {', '.join(others)} share one caption name; rename one")
            )
            continue
        try:
            w, h, total = (
                video.clip_info(path) if is_clip else (*probe(path, cfg.max_image_pixels), 1)
            )
        except (DataError, UnidentifiedImageError, OSError, SyntaxError) as e:
            report.unreadable.append((path, str(e) or type(e).__name__))
            continue
        if min(w, h) < cfg.min_image_size:
            report.skipped.append(
                (path, f"too small: {w}x{h}, under min_image_size {cfg.min_image_size} px")
            )
            continue
        if cfg.caption_strategy == "filename":
            caption = (
                (path.name if is_clip and path.is_dir() else path.stem).replace("_", " ").strip()
            )
        elif cfg.caption_strategy == "instanceprompt":
            caption = cfg.instance_prompt
        else:
            if not (cap in listed if listed is not None else cap.is_file()):
                report.missing_captions.append(path)
                continue
            try:
                caption = _read_caption(cap, report)
            except OSError as e:
                report.unreadable.append((path, f"caption {cap}: {e.strerror or e}"))
                continue
            if not caption:
                report.empty_captions.append(cap)
        frames = 1
        if is_clip:
            frames, short = _clip_frames(total, cfg, rule)
            if short:
                report.short_clips.append((path, short))
                continue
        report.samples.append(Sample(path, caption, w, h, frames, total, is_clip))
    if cfg.caption_strategy == "textfile":
        cap_root = Path(cfg.caption_dir) if cfg.caption_dir else image_dir
        for cap in sorted(cap_root.rglob("*" + cfg.caption_extension)):
            if os.path.abspath(cap) not in used_captions and not any(
                part.startswith(".") for part in cap.relative_to(cap_root).parts
            ):
                report.orphan_captions.append(cap)
    return report


def _counts_as_clip(path: Path, cfg: DataConfig, family: Any) -> bool:
    """Whether a video file or frame folder is read as a clip.

    Numbered images with captions of their own are images; and without a family only a
    captioned clip counts, so stray videos in an image dataset are left alone as they always were.
    """
    if cfg.caption_strategy != "textfile":
        return True
    if path.is_dir() and _caption_path(video.frame_files(path)[0], cfg).is_file():
        return False
    return family is not None or _caption_path(path, cfg).is_file()


def _clip_frames(total: int, cfg: DataConfig, rule: Any) -> tuple[int, str]:
    """Frames a clip trains on, and why it is too short ("" when it is not).

    A clip shorter than `num_frames` gives the largest count the family allows; it is too short
    when that is below the family's smallest clip (Wan: 5 frames), as one frame is no motion.
    """
    frames = video.usable_frames(total, cfg.num_frames, cfg.frame_stride, rule)
    if rule is None:
        return frames, "" if frames else "has no frames"
    target = rule(cfg.num_frames)
    smallest = next((n for n in range(2, target + 1) if rule(n) == n), target)
    if frames >= smallest:
        return frames, ""
    need = (smallest - 1) * cfg.frame_stride + 1
    return frames, (
        f"has {total} frame(s); {smallest} frames at frame_stride {cfg.frame_stride} need {need}"
    )


def check_dataset(cfg: DataConfig, family: Any = None) -> ScanReport:
    """The scan of the dataset, or a DataError when not one usable sample is left in it."""
    report = scan(cfg, family)
    if report.samples:
        return report
    dropped = report.dropped()
    if not dropped:
        raise DataError(f"no images found in {cfg.image_dir} (extensions: {sorted(IMAGE_EXTS)})")
    why = "; ".join(report.problems())
    raise DataError(
        f"no usable images in {cfg.image_dir}: all {len(dropped)} file(s) skipped: {why}"
    )


def load_samples(cfg: DataConfig, family: Any = None) -> list[Sample]:
    """The usable samples; unusable files are left out (see `check_dataset` and `scan`)."""
    return check_dataset(cfg, family).samples


# ---------------------------------------------------------------- buckets


def make_buckets(
    resolution: int, resolution_type: str, step: int, max_aspect_ratio: float
) -> list[tuple[int, int]]:
    """(width, height) buckets, multiples of `step`, from square to `max_aspect_ratio`."""
    # The square bucket nearest the resolution is always there, so square images are never cropped.
    side = max(step, round(resolution / step) * step)
    out: set[tuple[int, int]] = {(side, side)}
    if resolution_type == "area":
        area = resolution * resolution
        for w in range(step, int(resolution * math.sqrt(max_aspect_ratio)) + step + 1, step):
            h = max(step, round(area / w / step) * step)
            if max(w / h, h / w) <= max_aspect_ratio + 1e-6:
                out.add((w, h))
                out.add((h, w))
    else:
        short = max(step, round(resolution / step) * step)
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
    """Mirrored left to right after the crop."""

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
    flip: bool = False,
) -> Placement:
    """Resize to cover the bucket, then crop at the centre or a seeded offset; pick a clip's frames.

    With `flip`, a seeded coin per sample decides whether it is mirrored.
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
    if sample.clip:
        key = f"{seed}-{sample.image.as_posix()}-frames"
        frames = video.select_frames(
            sample.total_frames, sample.frames, frame_stride, frame_start, key
        )
    mirrored = flip and random.Random(f"{seed}-{sample.image.as_posix()}-flip").random() < 0.5
    return Placement(bucket, (rw, rh), (top, left), (sample.width, sample.height), frames, mirrored)


def upscale_needed(sample: Sample, bucket: tuple[int, int]) -> float:
    """How much the sample must be enlarged to cover the bucket (below 1: it is shrunk)."""
    return max(bucket[0] / sample.width, bucket[1] / sample.height)


def sample_pixels(sample: Sample, placement: Placement, cfg: DataConfig) -> torch.Tensor:
    """The pixels that are encoded for a sample: fitted to its bucket, mirrored if placed so."""
    pixels = load_pixels(sample.image, placement, cfg.alpha_background, cfg.max_image_pixels)
    return pixels.flip(-1) if placement.flip else pixels


def load_pixels(
    path: Path,
    placement: Placement,
    background: str = "white",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> torch.Tensor:
    """The image fitted to its bucket, (3, H, W) in [-1, 1]; a clip's frames, (3, F, H, W).

    An image that cannot be decoded raises `BadImage`; `background` fills transparent parts.
    """
    if placement.frames:
        frames = video.read_frames(path, placement.frames)
        return torch.stack([_fit(f, placement) for f in frames], dim=1)
    try:
        im = open_rgb(path, background, max_pixels)
    except BadImage as e:
        raise BadImage(f"unreadable image {path}: {e}") from None
    return _fit(im, placement)


def _fit(im: Image.Image, placement: Placement) -> torch.Tensor:
    """Resize and crop one picture to its bucket, as a (3, H, W) tensor in [-1, 1]."""
    im = im.resize(placement.resized, Image.Resampling.LANCZOS)
    top, left = placement.crop
    bw, bh = placement.bucket
    im = im.crop((left, top, left + bw, top + bh))
    arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


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

    def counts(self) -> dict[tuple[int, int], int]:
        """Images (and clips) per bucket."""
        return dict(Counter(p.bucket for p in self.placements))

    def frame_counts(self) -> dict[GroupKey, int]:
        """Samples per (width, height, frames): the groups batches are drawn from."""
        return dict(Counter(_group(p) for p in self.placements))

    def groups(self) -> dict[GroupKey, list[int]]:
        """Sample indices per group, in sample order."""
        out: dict[GroupKey, list[int]] = defaultdict(list)
        for i, p in enumerate(self.placements):
            out[_group(p)].append(i)
        return dict(out)


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

    `group_size` is one effective batch: buckets with fewer samples follow `small_bucket_policy`.
    """
    step = cfg.bucket_step or step
    buckets = bucket_list(cfg, step)

    def fit(s: Sample, bucket: tuple[int, int]) -> Placement:
        return place(
            s, bucket, cfg.center_crop, seed, cfg.frame_stride, cfg.frame_start, cfg.random_flip
        )

    plan = BucketPlan(buckets, [], group_size=group_size)
    for s in samples:
        bucket = assign_bucket(s.width, s.height, buckets)
        need = upscale_needed(s, bucket)
        if need > cfg.max_upscale + 1e-9:
            plan.dropped.append((s.image, _too_small(need, cfg)))
            continue
        plan.samples.append(s)
        plan.placements.append(fit(s, bucket))
    if group_size > 1:
        _small_buckets(plan, cfg, fit)
    return plan


def _too_small(need: float, cfg: DataConfig) -> str:
    return f"too small: needs {need:.2f}× upscale (max_upscale {cfg.max_upscale:g})"


def _small_buckets(plan: BucketPlan, cfg: DataConfig, fit: Any) -> None:
    """Apply `small_bucket_policy` to groups with fewer samples than one effective batch."""
    n_eff = plan.group_size
    groups = plan.groups()
    small = {k: idx for k, idx in groups.items() if len(idx) < n_eff}
    if not small:
        return
    policy = cfg.small_bucket_policy
    if policy == "repeat":
        plan.repeats = {k: math.ceil(n_eff / len(idx)) for k, idx in small.items()}
        return
    big = [k for k in groups if k not in small]
    keep = [True] * len(plan.samples)
    for key, idx in small.items():
        why = f"bucket {group_name(key)} has {len(idx)} sample(s), fewer than one effective batch of {n_eff}"
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
            if need > cfg.max_upscale + 1e-9:
                plan.dropped.append((s.image, _too_small(need, cfg)))
                keep[i] = False
                continue
            plan.placements[i] = fit(s, target[:2])
    plan.samples = [s for s, k in zip(plan.samples, keep, strict=True) if k]
    plan.placements = [p for p, k in zip(plan.placements, keep, strict=True) if k]


def plan_dataset(cfg: Config, num_processes: int = 1) -> tuple[list[Sample], BucketPlan]:
    """Scan the dataset and bucket it with the family's alignment: what training will see.

    The samples returned are the kept ones; `plan.dropped` says what was left out and why.
    """
    from kit.families import get_family

    family = get_family(cfg.model.model_family, cfg)
    samples = load_samples(cfg.data, family)
    t = cfg.train
    group = t.train_batch_size * t.gradient_accumulation_steps * num_processes
    plan = plan_buckets(samples, cfg.data, family.bucket_step, t.seed, group)
    if not plan.samples:
        first = plan.dropped[0] if plan.dropped else None
        why = f" (e.g. {first[0]}: {first[1]})" if first else ""
        raise DataError(f"every image in {cfg.data.image_dir} was dropped{why}")
    return plan.samples, plan


def epoch_batches(
    plan: BucketPlan, batch_size: int, seed: int, epoch: int, world: int = 1
) -> list[list[int]]:
    """The batches of one epoch, as the trainer runs them: one source of truth for counts.

    Shuffled within groups (a bucket and frame count, so a batch of clips stacks), small groups
    repeated as planned, batches shuffled; never mixing groups. Process r of `world` takes
    batches r, r + world, ...; a tail that cannot go to every process is left out (it waits for
    the next epoch's shuffle), so all processes step together.
    """
    rng = random.Random(f"{seed}-epoch-{epoch}")
    batches = []
    for key, idx in sorted(plan.groups().items()):
        idx = idx * plan.repeats.get(key, 1)
        rng.shuffle(idx)
        batches += [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches[: len(batches) - len(batches) % world]
