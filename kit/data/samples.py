"""What a scan gives: one `Sample` per training image (or clip), and a `ScanReport` of them with
every file left out and why. Every source (folders, Hugging Face datasets, tar shards, object
storage; see `kit.data.sources`) gives these same records, so everything after the scan (captions,
repeats, roles, buckets, cache, resume) reads one kind of sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.data import video
from kit.data.blob import Blob


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
    controls: list[Path] = field(default_factory=list)
    """Edit models: the control images paired with this target, one per `control_dir` (from a
    source, one per `control_column`: then only their names; `control_blobs` reads them)."""
    blob: Blob | None = None
    """Where the image's bytes are when it is no local file (a dataset row, a tar shard's member,
    an object in a bucket); `image` then only names it. None: `image` is the file."""
    mask: Blob | None = None
    """The loss mask read with the sample from its source (`mask_column`), for `masked_loss`."""
    control_blobs: list[Blob] = field(default_factory=list)
    """Where the controls' bytes are when they come from a source (a dataset's control column, a
    shard's control member), one per `controls`; empty: `controls` are the files."""


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
            out.append(f"unreadable {kind} {path}: {why}{and_more(self.unreadable)}")
        if self.short_clips:
            path, why = self.short_clips[0]
            out.append(f"clip too short: {path} {why}{and_more(self.short_clips)}")
        if self.missing_captions:
            names = ", ".join(str(p) for p in self.missing_captions[:3])
            more = and_more(self.missing_captions, 3, brackets=False)
            out.append(f"{len(self.missing_captions)} image(s) have no caption file: {names}{more}")
        if self.skipped:
            path, why = self.skipped[0]
            out.append(f"skipped {path}: {why}{and_more(self.skipped)}")
        if self.duplicate_stems:
            out.append(
                "images share a name but differ in extension, so a caption is ambiguous: "
                + ", ".join(self.duplicate_stems[:3])
            )
        return out


def and_more(items: list[Any], shown: int = 1, brackets: bool = True) -> str:
    """` (and N more)` for the items a message leaves unnamed after the first `shown`."""
    if len(items) <= shown:
        return ""
    more = f"and {len(items) - shown} more"
    return f" ({more})" if brackets else f" {more}"


def decode_caption(raw: bytes, name: str | Path, report: ScanReport) -> str:
    """A caption file's text: UTF-8 (a BOM dropped); bytes that are not are replaced, and the
    report notes the file."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        why = f"caption is not UTF-8 (byte {e.start}); undecodable bytes replaced with U+FFFD"
        report.warnings.append((Path(name), why))
        return raw.decode("utf-8-sig", errors="replace")
