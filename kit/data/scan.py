"""Images (or clips) and captions → aspect buckets → batches; the cache itself is `kit.data.cache`.

Video families also read clips (see `kit.data.video`): a sample then has frames, its buckets group by
(width, height, frames), and its pixels are (3, F, H, W). Images behave as they always have.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from PIL import UnidentifiedImageError

from kit.config import DataConfig
from kit.data import video
from kit.data.blob import use_remote
from kit.data.datasets import views
from kit.data.images import DEFAULT_MAX_PIXELS, probe
from kit.data.pairs import pair_controls
from kit.data.paths import caption_path
from kit.data.samples import Sample, ScanReport, decode_caption
from kit.data.sources import describe, elsewhere, owns, scan_source
from kit.errors import DataError

IMAGE_EXTS = set(video.FRAME_EXTS)


def _prefix(folder: str | Path) -> str:
    """What a path relative to `folder` is appended to; normalised by Path first, so that
    `Path(prefix + relative)` prints exactly as `prefix + relative`."""
    top = str(Path(folder))
    return "" if top == "." else top if top.endswith(os.sep) else top + os.sep


def _order(rel: str) -> str:
    """Sort key giving the order Paths sort in (by their parts), at the cost of one string copy:
    the separator becomes the one character below every character a file name can hold."""
    return rel.replace(os.sep, "\0")


def _is_file(entry: os.DirEntry[str]) -> bool:
    """`Path.is_file` from a listing: no system call unless the entry is a link."""
    try:
        return entry.is_file()
    except OSError:
        return False


@dataclass
class _Tree:
    """Files and folders under a dataset folder, and the folder links that lead back into it.

    Each is a path relative to the folder (`sub/cat.png`), a plain string: on 10,000 images,
    building, hashing and comparing Paths cost more than reading the image headers, so a Path is
    built only for what a scan reports. Every list is in the order Paths sort in.
    """

    prefix: str
    """The folder as `_prefix` spells it: `prefix + relative` is the path as the user gave it."""
    files: list[str]
    """Non-hidden entries that are not folders (a broken link among them is reported when read)."""
    dirs: list[str]
    loops: list[str]
    images: list[str]
    """The files with a still-image extension."""
    videos: list[str]
    """The regular files (or links to them) with a video extension."""
    stills: dict[str, list[os.DirEntry[str]]]
    """For each folder entered, its entries with a still-image extension (for frame folders)."""
    special: list[str] = field(default_factory=list)  # no regular file: never opened

    def path(self, rel: str) -> Path:
        return Path(self.prefix + rel)


def _walk(root: Path) -> _Tree:
    """Every non-hidden file and folder under `root`, following folder links once each.

    A link to a folder is followed (datasets are often linked in), but a folder already seen
    through another path (a link to a parent, say) is not entered again, so a scan always ends.
    Folders are entered depth first, each one's subfolders in name order, so which of two paths
    to one folder counts as the link back is always the same. Besides the listings, the only
    system calls are for links (to resolve a folder link, or see where a file link leads).
    """
    prefix = _prefix(root)
    files: list[str] = []
    dirs: list[str] = []
    loops: list[str] = []
    images: list[str] = []
    videos: list[str] = []
    stills: dict[str, list[os.DirEntry[str]]] = {}
    special: list[str] = []
    seen = {os.path.realpath(root)}
    stack = [("", next(iter(seen)))]  # (folder relative to root, its resolved path)
    while stack:
        rel, real = stack.pop()
        head = rel + os.sep if rel else ""
        try:
            with os.scandir(prefix + rel or ".") as listing:
                entries = list(listing)
        except OSError:
            continue  # an unreadable folder is passed over, as `os.walk` does
        subdirs = []
        mine = []
        for entry in entries:
            name = entry.name
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if name[0] != ".":
                    subdirs.append(entry)
                continue
            if name[0] == ".":
                continue
            files.append(head + name)
            dot = name.rfind(".")  # the suffix as Path gives it, for a name that is not hidden
            ext = name[dot:].lower() if dot > 0 else ""
            if ext in IMAGE_EXTS and not _is_file(entry):  # a FIFO would block its reader
                special.append(head + name)
            elif ext in IMAGE_EXTS:
                images.append(head + name)
                mine.append(entry)
            elif ext in video.VIDEO_EXTS and _is_file(entry):
                videos.append(head + name)
        if rel:
            stills[rel] = mine
        kept = []
        for entry in sorted(subdirs, key=lambda e: e.name):
            target = _resolved(entry, real)
            if target in seen:
                loops.append(head + entry.name)
                continue
            seen.add(target)
            kept.append((head + entry.name, target))
        dirs += [d for d, _ in kept]
        stack += reversed(kept)
    for found in (files, dirs, loops, images, videos):
        found.sort(key=_order)
    return _Tree(prefix, files, dirs, loops, images, videos, stills, special)


def _resolved(entry: os.DirEntry[str], parent: str) -> str:
    """A subfolder's real path: below a resolved folder, one that is not a link is itself."""
    try:
        if not entry.is_symlink():
            return os.path.join(parent, entry.name)
    except OSError:
        pass
    return os.path.realpath(entry.path)


def _frame_folders(tree: _Tree) -> dict[str, list[str]]:
    """Each folder of numbered frames, with its frames in order (`video.frame_files`, from the
    walk's listing): a folder holding any other still image is a folder of images."""
    out = {}
    for folder in tree.dirs:
        numbered = []
        for entry in tree.stills.get(folder, ()):  # none for a folder that could not be read
            name = entry.name
            if not name[: name.rfind(".")].isdigit():
                if _is_file(entry):
                    break
            elif _is_file(entry):
                numbered.append(name)
        else:
            if numbered:
                numbered.sort(key=lambda n: (int(n[: n.rfind(".")]), n))
                out[folder] = [folder + os.sep + n for n in numbered]
    return out


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
    tree = _walk(Path(image_dir))
    return [tree.path(r) for r in tree.images]


def image_size(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Width and height as displayed (after EXIF rotation), read without decoding pixels."""
    return probe(path, max_pixels)


def list_clips(image_dir: Path) -> list[Path]:
    """Video files and frame folders under a folder (recursively, skipping hidden ones), sorted."""
    tree = _walk(Path(image_dir))
    return [tree.path(r) for r in sorted([*tree.videos, *_frame_folders(tree)], key=_order)]


_READ = 1 << 16


def _read_caption(path: str, report: ScanReport) -> str:
    """A caption file's text; bytes that are not UTF-8 are replaced and the file noted."""
    # Plain descriptor reads: a third cheaper than a file object for a few bytes, 10,000 times.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        chunks = [os.read(fd, _READ)]
        while len(chunks[-1]) == _READ:  # a shorter read is the end of a regular file
            chunks.append(os.read(fd, _READ))
    finally:
        os.close(fd)
    raw = b"".join(chunks) if len(chunks) > 1 else chunks[0]
    return decode_caption(raw, path, report).strip()


class _Captions:
    """Which caption files exist, from listings rather than a system call per image.

    Captions beside the images were listed by the walk. A separate caption folder is listed once
    per subfolder asked about: an entry counts when it is a file or a link to one, as
    `Path.is_file` says.
    """

    def __init__(self, tree: _Tree, caption_dir: str) -> None:
        self.listed = None if caption_dir else set(tree.files)
        self.folders: dict[str, set[str] | None] = {}

    def exists(self, rel: str, path: str) -> bool:
        """Whether the caption at `path` (relative to its caption folder: `rel`) is a file."""
        if self.listed is not None:
            return rel in self.listed
        folder, name = os.path.split(path)
        if folder not in self.folders:
            self.folders[folder] = self._list(folder or ".")
        names = self.folders[folder]
        return os.path.isfile(path) if names is None else name in names

    @staticmethod
    def _list(folder: str) -> set[str] | None:
        try:
            with os.scandir(folder) as listing:
                return {e.name for e in listing if _is_file(e)}
        except FileNotFoundError:
            return set()
        except OSError:
            return None  # listing refused (a folder one may enter but not read): ask per file


def scan(cfg: DataConfig, family: Any = None) -> ScanReport:
    """Read the dataset: its folder, or each of `datasets` in turn (see `scan_folder`).

    Each sample records its dataset's index; a problem in one dataset skips only its files,
    and a missing folder is named with its dataset.
    """
    use_remote(cfg.remote_timeout, cfg.remote_retries)
    if not cfg.datasets:
        (view,) = views(cfg)
        found = scan_source(view, family) if elsewhere(view) else scan_folder(cfg, family)
        return pair_controls(found, cfg, family)
    report = ScanReport()
    for view in views(cfg):
        try:
            part = scan_source(view, family) if elsewhere(view) else scan_folder(view.data, family)
        except DataError as e:
            raise DataError(f"{view.where}: {e}") from None
        for sample in part.samples:
            sample.dataset = view.index
        for f in dataclasses.fields(ScanReport):
            getattr(report, f.name).extend(getattr(part, f.name))
    return pair_controls(report, cfg, family)


def scan_folder(cfg: DataConfig, family: Any = None) -> ScanReport:
    """Read one dataset folder: images (and clips), their captions and every problem found.

    Nothing here stops a run: each file that cannot be used is recorded with its reason and left
    out. The family decides what is read: an image family reads images only; a video family also
    reads clips and holds them to its frame rule. Without a family (a caption report before a
    model is chosen) a clip is read where it has a caption, so stray videos are left alone.
    Images that share a name but not an extension (`cat.jpg`, `cat.png`) are both skipped when
    captions come from text files, as either could be the one `cat.txt` describes.

    Paths are plain strings relative to the folder until a sample or a problem is recorded (see
    `_Tree`); the only system calls per image are the header read and the caption read.
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
    at = tree.prefix
    report.skipped += [
        (tree.path(p), "folder link back into the dataset: not read twice") for p in tree.loops
    ]
    odd = "not a regular file (a FIFO, socket, device or broken link): never opened"
    report.skipped += [(tree.path(p), odd) for p in tree.special]
    video_kind = family is None or family.video
    report.skipped += [(tree.path(p), w) for p in tree.files if (w := video.unread(p, video_kind))]
    clips: list[str] = []
    folders: dict[str, list[str]] = {}  # the frame folders read as clips, with their frames
    if family is None or family.video:
        for rel, frames in _frame_folders(tree).items():
            if _counts_as_clip(tree, rel, frames[0], cfg, family):
                clips.append(rel)
                folders[rel] = frames
        clips += [rel for rel in tree.videos if _counts_as_clip(tree, rel, "", cfg, family)]
    in_clips = {f for frames in folders.values() for f in frames}
    images = [r for r in tree.images if r not in in_clips] if in_clips else tree.images
    # The name a caption file is found by: a frame folder's whole name, a file's without suffix.
    stem_of = {r: r if r in folders else r[: r.rfind(".")] for r in (*images, *clips)}
    stems = Counter(stem_of.values())
    twins = {s for s, n in stems.items() if n > 1}
    report.duplicate_stems = [at + s for s in sorted(twins)]
    ambiguous = twins if cfg.caption_strategy == "textfile" else set()
    rule = family.frame_count if family is not None and family.video else None
    clip_set = set(clips)
    items = sorted([*images, *clips], key=_order) if clips else images
    ext, strategy, smallest = cfg.caption_extension, cfg.caption_strategy, cfg.min_image_size
    cap_at = _prefix(cfg.caption_dir) if cfg.caption_dir else at
    captions = _Captions(tree, cfg.caption_dir)
    for rel in items:
        stem = stem_of[rel]
        if stem in ambiguous:
            report.skipped.append((tree.path(rel), _ambiguous(rel, stem_of, folders)))
            continue
        is_clip = rel in clip_set
        where = at + rel
        try:
            w, h, total = (
                video.clip_info(Path(where))
                if is_clip
                else (*probe(where, cfg.max_image_pixels), 1)
            )
        except (DataError, UnidentifiedImageError, OSError, SyntaxError) as e:
            report.unreadable.append((Path(where), str(e) or type(e).__name__))
            continue
        if w < smallest or h < smallest:
            report.skipped.append(
                (Path(where), f"too small: {w}x{h}, under min_image_size {smallest} px")
            )
            continue
        if strategy == "filename":
            caption = stem[rel.rfind(os.sep) + 1 :].replace("_", " ").strip()
        elif strategy == "instanceprompt":
            caption = cfg.instance_prompt
        else:
            cap = cap_at + stem + ext
            if not captions.exists(stem + ext, cap):
                report.missing_captions.append(Path(where))
                continue
            try:
                caption = _read_caption(cap, report)
            except OSError as e:
                report.unreadable.append((Path(where), f"caption {cap}: {e.strerror or e}"))
                continue
            if not caption:
                report.empty_captions.append(Path(cap))
        frames = 1
        if is_clip:
            frames, short = video.clip_frames(total, cfg.num_frames, cfg.frame_stride, rule)
            if short:
                report.short_clips.append((Path(where), short))
                continue
        report.samples.append(Sample(Path(where), caption, w, h, frames, total, is_clip))
    if cfg.caption_strategy == "textfile":
        # Every image's caption is claimed, a skipped image's too: it is no orphan.
        report.orphan_captions = _orphans(tree, cfg, {s + ext for s in stem_of.values()})
    return report


def _ambiguous(rel: str, stem_of: dict[str, str], folders: dict[str, list[str]]) -> str:
    """Why an image (or clip) whose caption name another one shares is skipped."""

    def bare(r: str) -> str:  # the path without its suffix, as `Path.with_suffix("")` gives it
        return str(PurePath(r).with_suffix("")) if r in folders else stem_of[r]

    mine = bare(rel)
    others = sorted(r[r.rfind(os.sep) + 1 :] for r in stem_of if bare(r) == mine)
    return f"ambiguous caption: {', '.join(others)} share one caption name; rename one"


def _orphans(tree: _Tree, cfg: DataConfig, used: set[str]) -> list[Path]:
    """Caption files that no image or clip of the folder claims (`used`: relative to the caption
    folder), in the order Paths sort in."""
    ext = cfg.caption_extension
    if not cfg.caption_dir:
        # Captions beside the images were listed by the walk: the folder is not read twice.
        return [
            tree.path(r)
            for r in tree.files
            if r[r.rfind(os.sep) + 1 :].endswith(ext) and r not in used
        ]
    cap_root = Path(cfg.caption_dir)
    at = _prefix(cap_root)
    claimed = {os.path.abspath(at + r) for r in used}
    return [
        cap
        for cap in sorted(cap_root.rglob("*" + ext))
        if os.path.abspath(cap) not in claimed
        and not any(part.startswith(".") for part in cap.relative_to(cap_root).parts)
    ]


def _counts_as_clip(tree: _Tree, rel: str, first_frame: str, cfg: DataConfig, family: Any) -> bool:
    """Whether a video file or frame folder (`first_frame`: its first frame; "" for a video
    file) is read as a clip.

    Numbered images with captions of their own are images; and without a family only a
    captioned clip counts, so stray videos in an image dataset are left alone as they always were.
    """
    if cfg.caption_strategy != "textfile":
        return True
    if first_frame and caption_path(tree.path(first_frame), cfg, False).is_file():
        return False
    return family is not None or caption_path(tree.path(rel), cfg, bool(first_frame)).is_file()


def check_dataset(cfg: DataConfig, family: Any = None) -> ScanReport:
    """The scan of the dataset, or a DataError when not one usable sample is left in it."""
    report = scan(cfg, family)
    for view in views(cfg) if cfg.datasets else []:
        if not any(s.dataset == view.index for s in report.samples):
            at = describe(view)
            mine = [
                d
                for d in report.dropped()
                if (owns(view, d[0]) if elsewhere(view) else _within(d[0], at))
            ]
            why = f": all {len(mine)} file(s) skipped ({mine[0][0]}: {mine[0][1]})" if mine else ""
            kinds = "" if elsewhere(view) else f" (extensions: {sorted(IMAGE_EXTS)})"
            raise DataError(
                f"{view.where}: no usable images in {at}{why}"
                if mine
                else f"{view.where}: no images found in {at}{kinds}"
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
