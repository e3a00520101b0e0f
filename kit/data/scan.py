"""Images (or clips) and captions → aspect buckets → batches; the cache itself is `kit.data.cache`.

Video families also read clips (see `kit.data.video`): a sample then has frames, its buckets group by
(width, height, frames), and its pixels are (3, F, H, W). Images behave as they always have.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import UnidentifiedImageError

from kit.config import DataConfig
from kit.data import video
from kit.data.datasets import views
from kit.data.images import DEFAULT_MAX_PIXELS, probe
from kit.errors import DataError

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
    dataset: int = 0
    """Index of the dataset (in `datasets`) the sample comes from; 0 for a single folder."""
    window_start: int | None = None
    """A clip's window: the frame its frames start at (`frame_sampling` uniform, chunk, slide;
    see `kit.data.buckets.clip_windows`). None: the clip's one window, placed by `frame_start`.
    The scan gives one sample per clip; bucketing splits a clip into its windows, so caption
    tools still see each file once."""


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
        used = len({s.image for s in self.samples})  # a clip split into windows is one file
        total = used + len(skipped)
        line = f"{used} of {total} file(s) usable"
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
            kind = "clip" if video.is_clip(path) else "image"
            out.append(f"unreadable {kind} {path}: {why}{_and_more(self.unreadable)}")
        if self.short_clips:
            path, why = self.short_clips[0]
            out.append(f"clip too short: {path} {why}{_and_more(self.short_clips)}")
        if self.missing_captions:
            names = ", ".join(str(p) for p in self.missing_captions[:3])
            more = _and_more(self.missing_captions, 3, brackets=False)
            out.append(f"{len(self.missing_captions)} image(s) have no caption file: {names}{more}")
        if self.skipped:
            path, why = self.skipped[0]
            out.append(f"skipped {path}: {why}{_and_more(self.skipped)}")
        if self.duplicate_stems:
            out.append(
                "images share a name but differ in extension, so a caption is ambiguous: "
                + ", ".join(self.duplicate_stems[:3])
            )
        return out


def _and_more(items: list[Any], shown: int = 1, brackets: bool = True) -> str:
    """` (and N more)` for the items a message leaves unnamed after the first `shown`."""
    if len(items) <= shown:
        return ""
    more = f"and {len(items) - shown} more"
    return f" ({more})" if brackets else f" {more}"


def caption_path(image: Path, cfg: DataConfig, is_dir: bool | None = None) -> Path:
    """The caption file of an image or frame folder (it may not exist yet)."""
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
    # Sorted by parts, the order Paths compare in, with each key built once rather than per
    # comparison (a third of a scan of 10,000 files went to comparing Paths).
    return _Tree(sorted(files, key=_parts), sorted(dirs, key=_parts), sorted(loops, key=_parts))


def _parts(path: Path) -> tuple[str, ...]:
    return path.parts


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
    """Read the dataset: its folder, or each of `datasets` in turn (see `scan_folder`).

    Each sample records its dataset's index; a problem in one dataset skips only its files,
    and a missing folder is named with its dataset.
    """
    if not cfg.datasets:
        return scan_folder(cfg, family)
    report = ScanReport()
    for view in views(cfg):
        try:
            part = scan_folder(view.data, family)
        except DataError as e:
            raise DataError(f"{view.where}: {e}") from None
        for sample in part.samples:
            sample.dataset = view.index
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(part, f.name))
    return report


def scan_folder(cfg: DataConfig, family: Any = None) -> ScanReport:
    """Read one dataset folder: images (and clips), their captions and every problem found.

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
    folders = set(tree.dirs)
    stems = Counter(p if p in folders else p.with_suffix("") for p in images + clips)
    report.duplicate_stems = sorted(str(s) for s, n in stems.items() if n > 1)
    ambiguous = set(report.duplicate_stems) if cfg.caption_strategy == "textfile" else set()
    rule = family.frame_count if family is not None and family.video else None
    used_captions = set()
    # The walk already listed every file: caption look-ups need no system call per image.
    listed = set(tree.files) if not cfg.caption_dir else None
    for path in sorted(images + clips):
        is_clip = path in clip_set
        is_dir = path in folders
        cap = caption_path(path, cfg, is_dir)
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
        # Captions beside the images were listed by the walk: the folder is not read twice.
        found = (
            sorted(cap_root.rglob("*" + cfg.caption_extension))
            if cfg.caption_dir
            else [p for p in tree.files if p.name.endswith(cfg.caption_extension)]
        )
        for cap in found:
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
    if path.is_dir() and caption_path(video.frame_files(path)[0], cfg).is_file():
        return False
    return family is not None or caption_path(path, cfg).is_file()


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
    for view in views(cfg) if cfg.datasets else []:
        if not any(s.dataset == view.index for s in report.samples):
            mine = [d for d in report.dropped() if _within(d[0], view.data.image_dir)]
            why = f": all {len(mine)} file(s) skipped ({mine[0][0]}: {mine[0][1]})" if mine else ""
            raise DataError(
                f"{view.where}: no usable images in {view.data.image_dir}{why}"
                if mine
                else f"{view.where}: no images found in {view.data.image_dir} "
                f"(extensions: {sorted(IMAGE_EXTS)})"
            )
    if report.samples:
        return report
    dropped = report.dropped()
    if not dropped:
        raise DataError(f"no images found in {cfg.image_dir} (extensions: {sorted(IMAGE_EXTS)})")
    why = "; ".join(report.problems())
    raise DataError(
        f"no usable images in {cfg.image_dir}: all {len(dropped)} file(s) skipped: {why}"
    )


def _within(path: Path, folder: str) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def load_samples(cfg: DataConfig, family: Any = None) -> list[Sample]:
    """The usable samples; unusable files are left out (see `check_dataset` and `scan`)."""
    return check_dataset(cfg, family).samples


# ---------------------------------------------------------------- buckets
