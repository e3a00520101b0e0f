"""Images (or clips) and captions → aspect buckets → cached latents and text embeddings → batches.

Video families also read clips (see `kit.video`): a sample then has frames, its buckets group by
(width, height, frames), and its pixels are (3, F, H, W). Images behave as they always have.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from safetensors.torch import load_file, save_file

from kit import video
from kit.config import Config, DataConfig
from kit.errors import DataError
from kit.io import write_with

IMAGE_EXTS = set(video.FRAME_EXTS)
_ORIENTATION_TAG = 274  # EXIF orientations 5-8 swap width and height


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
    """What a dataset folder holds, and what is wrong with it."""

    samples: list[Sample] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    orphan_captions: list[Path] = field(default_factory=list)
    empty_captions: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    duplicate_stems: list[str] = field(default_factory=list)
    short_clips: list[tuple[Path, str]] = field(default_factory=list)
    """Clips too short for even the family's smallest clip, with why."""

    def problems(self) -> list[str]:
        """One line per problem that stops training."""
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
        if self.duplicate_stems:
            out.append(
                "images share a name but differ in extension, so a caption is ambiguous: "
                + ", ".join(self.duplicate_stems[:3])
            )
        return out


def _caption_path(image: Path, cfg: DataConfig) -> Path:
    folder = Path(cfg.caption_dir) if cfg.caption_dir else image.parent
    if cfg.caption_dir:
        folder = folder / image.parent.relative_to(Path(cfg.image_dir))
    # A frame folder `clip.v2/` is captioned by `clip.v2.txt`: its whole name is the stem.
    stem = image.name if image.is_dir() else image.stem
    return folder / (stem + cfg.caption_extension)


def list_images(image_dir: Path) -> list[Path]:
    """Image files under a folder (recursively, skipping hidden folders), sorted."""
    return sorted(
        p
        for p in image_dir.rglob("*")
        if p.suffix.lower() in IMAGE_EXTS
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(image_dir).parts)
    )


def image_size(path: Path) -> tuple[int, int]:
    """Width and height as displayed (after EXIF rotation), read without decoding pixels."""
    with Image.open(path) as im:
        w, h = im.size
        if im.getexif().get(_ORIENTATION_TAG, 1) in (5, 6, 7, 8):
            w, h = h, w
    return w, h


def list_clips(image_dir: Path) -> list[Path]:
    """Video files and frame folders under a folder (recursively, skipping hidden ones), sorted."""
    return sorted(
        p
        for p in image_dir.rglob("*")
        if not any(part.startswith(".") for part in p.relative_to(image_dir).parts)
        and (p.is_file() and video.is_video_file(p) or p.is_dir() and video.frame_files(p))
    )


def scan(cfg: DataConfig, family: Any = None) -> ScanReport:
    """Read the dataset folder: images (and clips), their captions and every problem found.

    The family decides what is read: an image family reads images only; a video family also
    reads clips and holds them to its frame rule. Without a family (a caption report before a
    model is chosen) a clip is read where it has a caption, so stray videos are left alone.
    """
    image_dir = Path(cfg.image_dir)
    if not cfg.image_dir:
        raise DataError("image_dir is not set in the config")
    if not image_dir.is_dir():
        raise DataError(f"image folder not found: {image_dir} (image_dir)")
    if cfg.caption_dir and not Path(cfg.caption_dir).is_dir():
        raise DataError(f"caption folder not found: {cfg.caption_dir} (caption_dir)")
    report = ScanReport()
    reads_clips = family is None or family.video
    clips = (
        [c for c in list_clips(image_dir) if _counts_as_clip(c, cfg, family)] if reads_clips else []
    )
    clip_set = set(clips)
    in_clips = {f for c in clips if c.is_dir() for f in video.frame_files(c)}
    images = [p for p in list_images(image_dir) if p not in in_clips]
    stems = Counter(p if p.is_dir() else p.with_suffix("") for p in images + clips)
    report.duplicate_stems = sorted(str(s) for s, n in stems.items() if n > 1)
    rule = family.frame_count if family is not None and family.video else None
    used_captions = set()
    for path in sorted(images + clips):
        is_clip = path in clip_set
        try:
            w, h, total = video.clip_info(path) if is_clip else (*image_size(path), 1)
        except (DataError, UnidentifiedImageError, OSError, SyntaxError) as e:
            report.unreadable.append((path, str(e) or type(e).__name__))
            continue
        if cfg.caption_strategy == "filename":
            caption = (
                (path.name if is_clip and path.is_dir() else path.stem).replace("_", " ").strip()
            )
        elif cfg.caption_strategy == "instanceprompt":
            caption = cfg.instance_prompt
        else:
            cap = _caption_path(path, cfg)
            if not cap.is_file():
                report.missing_captions.append(path)
                continue
            used_captions.add(cap.resolve())
            caption = cap.read_text(encoding="utf-8", errors="replace").strip()
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
            if cap.resolve() not in used_captions and not any(
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


def load_samples(cfg: DataConfig, family: Any = None) -> list[Sample]:
    """The usable samples, or a DataError naming the first problem (see `scan` for `family`)."""
    report = scan(cfg, family)
    problems = report.problems()
    if problems:
        raise DataError(problems[0])
    if not report.samples:
        raise DataError(f"no images found in {cfg.image_dir} (extensions: {sorted(IMAGE_EXTS)})")
    return report.samples


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

    @property
    def num_frames(self) -> int:
        """Frames of the sample: 1 for an image."""
        return len(self.frames) or 1

    def record(self) -> dict[str, Any]:
        """As plain data; an image's record has no `frames`, so its cache key is what it always was."""
        d = asdict(self)
        if not self.frames:
            del d["frames"]
        return d


def place(
    sample: Sample,
    bucket: tuple[int, int],
    center: bool,
    seed: int,
    frame_stride: int = 1,
    frame_start: str = "first",
) -> Placement:
    """Resize to cover the bucket, then crop at the centre or a seeded offset; pick a clip's frames."""
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
    return Placement(bucket, (rw, rh), (top, left), (sample.width, sample.height), frames)


def load_pixels(path: Path, placement: Placement) -> torch.Tensor:
    """The image fitted to its bucket, (3, H, W) in [-1, 1]; a clip's frames, (3, F, H, W)."""
    if placement.frames:
        frames = video.read_frames(path, placement.frames)
        return torch.stack([_fit(f, placement) for f in frames], dim=1)
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"unreadable image {path}: {e}") from None
    return _fit(im, placement)


def _fit(im: Image.Image, placement: Placement) -> torch.Tensor:
    """Resize and crop one picture to its bucket, as a (3, H, W) tensor in [-1, 1]."""
    im = im.resize(placement.resized, Image.Resampling.LANCZOS)
    top, left = placement.crop
    bw, bh = placement.bucket
    im = im.crop((left, top, left + bw, top + bh))
    arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


@dataclass
class BucketPlan:
    """Every sample's bucket and crop."""

    buckets: list[tuple[int, int]]
    placements: list[Placement]

    def counts(self) -> dict[tuple[int, int], int]:
        """Images (and clips) per bucket."""
        return dict(Counter(p.bucket for p in self.placements))

    def frame_counts(self) -> dict[tuple[int, int, int], int]:
        """Samples per (width, height, frames): the groups batches are drawn from."""
        return dict(Counter((*p.bucket, p.num_frames) for p in self.placements))


def plan_buckets(samples: list[Sample], cfg: DataConfig, step: int, seed: int) -> BucketPlan:
    """Assign each sample a bucket and crop (and a clip its frames)."""
    step = cfg.bucket_step or step
    buckets = make_buckets(cfg.resolution, cfg.resolution_type, step, cfg.max_aspect_ratio)
    placements = [
        place(
            s,
            assign_bucket(s.width, s.height, buckets),
            cfg.center_crop,
            seed,
            cfg.frame_stride,
            cfg.frame_start,
        )
        for s in samples
    ]
    return BucketPlan(buckets, placements)


def plan_dataset(cfg: Config) -> tuple[list[Sample], BucketPlan]:
    """Scan the dataset and bucket it with the family's alignment: what training will see."""
    from kit.families import get_family

    family = get_family(cfg.model.model_family, cfg)
    samples = load_samples(cfg.data, family)
    return samples, plan_buckets(samples, cfg.data, family.bucket_step, cfg.train.seed)


def epoch_batches(plan: BucketPlan, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: shuffled within buckets, then in order; never mixing buckets.

    A bucket here is (width, height) and frame count, so a batch of clips stacks.
    """
    rng = random.Random(f"{seed}-epoch-{epoch}")
    by_bucket: dict[tuple[tuple[int, int], int], list[int]] = defaultdict(list)
    for i, p in enumerate(plan.placements):
        by_bucket[(p.bucket, p.num_frames)].append(i)
    batches = []
    for bucket in sorted(by_bucket):
        idx = by_bucket[bucket]
        rng.shuffle(idx)
        batches += [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches


# ---------------------------------------------------------------- caches


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/kit`, else `~/.cache/kit`."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kit"


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (of a frame folder: its frames' names and bytes)."""
    h = hashlib.sha256()
    files = video.frame_files(path) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _key(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@dataclass
class CachedDataset:
    """Samples with their cache files; batches are read from disk on demand."""

    samples: list[Sample]
    plan: BucketPlan
    latent_files: list[Path]
    text_files: list[Path]
    digests: list[str]
    stats: dict[str, int] = field(default_factory=dict)

    def load_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Stack the cached tensors of these samples, with each one's size and crop (h, w order)."""
        out: dict[str, list[torch.Tensor]] = defaultdict(list)
        for i in indices:
            out["latents"].append(load_file(self.latent_files[i])["latents"])
            for k, v in load_file(self.text_files[i]).items():
                out[k].append(v)
            p = self.plan.placements[i]
            out["original_size"].append(torch.tensor([p.original[1], p.original[0]]))
            out["crop_top_left"].append(torch.tensor(list(p.crop)))
            out["target_size"].append(torch.tensor([p.bucket[1], p.bucket[0]]))
        return {k: torch.stack(v) for k, v in out.items()}

    def manifest(self) -> list[dict[str, Any]]:
        """Per-sample record of what was trained on (file, hash, caption, bucket, crop)."""
        return [
            {
                "image": str(s.image),
                "sha256": d,
                "caption": s.caption,
                **{k: list(v) for k, v in p.record().items()},
            }
            for s, p, d in zip(self.samples, self.plan.placements, self.digests, strict=True)
        ]


def build_cache(
    cfg: Config, family: Any, comps: Any, device: torch.device | str = "cpu"
) -> CachedDataset:
    """Scan, bucket and encode the dataset, reusing cache entries made by earlier runs."""
    samples, plan = plan_dataset(cfg)
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    latent_dir = root / "latents" / comps.identity["vae"]
    text_dir = root / "text" / comps.identity["text"]
    digests = [file_digest(s.image) for s in samples]
    latent_files = [
        latent_dir / f"{_key(d, p.record())}.safetensors"
        for d, p in zip(digests, plan.placements, strict=True)
    ]
    text_files = [text_dir / f"{_key(s.caption)}.safetensors" for s in samples]
    stats = {"latents_encoded": 0, "latents_reused": 0, "text_encoded": 0, "text_reused": 0}

    for s, p, f in zip(samples, plan.placements, latent_files, strict=True):
        if f.is_file():
            stats["latents_reused"] += 1
            continue
        pixels = load_pixels(s.image, p)
        if family.video and pixels.ndim == 3:
            pixels = pixels.unsqueeze(1)  # a still image is a one-frame clip to a video model
        pixels = pixels.unsqueeze(0).to(device)
        lat = family.encode_images(comps, pixels)[0].float().cpu().contiguous()
        write_with(f, lambda tmp, lat=lat: save_file({"latents": lat}, str(tmp)))
        stats["latents_encoded"] += 1
    todo = sorted({s.caption for s, f in zip(samples, text_files, strict=True) if not f.is_file()})
    stats["text_reused"] = len({s.caption for s in samples}) - len(todo)
    for start in range(0, len(todo), 16):
        chunk = todo[start : start + 16]
        enc = family.encode_text(comps, chunk)
        for j, caption in enumerate(chunk):
            tensors = {k: v[j].float().cpu().contiguous() for k, v in enc.items()}
            path = text_dir / f"{_key(caption)}.safetensors"
            write_with(path, lambda tmp, t=tensors: save_file(t, str(tmp)))
            stats["text_encoded"] += 1
    return CachedDataset(samples, plan, latent_files, text_files, digests, stats)
