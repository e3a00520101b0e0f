"""Caption statistics and safe caption edits.

A bulk edit is planned first (`plan_edit`: every file's old and new text, nothing written), shown
as a unified diff (`diff_text`), then applied (`apply_edit`) after a backup of every caption file,
and refused if a file changed in between. `restore_backup` puts a backup back.
"""

from __future__ import annotations

import difflib
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kit.config import Config, DataConfig
from kit.data.augment import split_tags
from kit.data.datasets import view_of, views
from kit.data.scan import caption_path, is_prior_image, scan
from kit.errors import DataError, KitError
from kit.families import family_info, get_family
from kit.io import atomic_dir, write_text, write_with

BACKUPS = ".caption-backups"  # hidden, so scans and orphan checks never see the copies
CREATED = ".created"
"""In a backup: caption files the edit created (one relative path a line); restoring removes them."""

_WORD = re.compile(r"[\w'-]+")


def words(caption: str) -> list[str]:
    """Lower-case words of a caption."""
    return [w.lower() for w in _WORD.findall(caption)]


def has_word(caption: str, word: str) -> bool:
    """Whether `word` appears in the caption as a whole word (any case): `zorb` is not in `zorbs`."""
    return re.search(rf"(?<!\w){re.escape(word.strip())}(?!\w)", caption, re.IGNORECASE) is not None


def caption_report(cfg: Config, token_counts: bool = True) -> dict[str, Any]:
    """What the captions hold: problems, word and tag frequencies, trigger coverage, token counts."""
    rep = scan(cfg.data, family_info(cfg.model.model_family))
    seen = views(cfg.data)
    captions = [s.caption for s in rep.samples]
    files = [
        s.blob.name if s.blob is not None else _source(s.image, seen[s.dataset].data)
        for s in rep.samples
    ]
    dup = [c for c, n in Counter(captions).items() if n > 1 and c]
    counts = Counter(w for c in captions for w in words(c))
    tags = Counter(" ".join(t.lower().split()) for c in captions for t in split_tags(c))
    # Prior images show what must not change: they are meant to lack the trigger word.
    concept = [
        (f, c)
        for f, c, s in zip(files, captions, rep.samples, strict=True)
        if not seen[s.dataset].prior
        and not is_prior_image(s.image, cfg.data.prior_images, seen[s.dataset].data.image_dir)
    ]
    missing = {t: [f for f, c in concept if not has_word(c, t)] for t in cfg.data.trigger_words}
    out: dict[str, Any] = {
        "images": len(rep.samples) + len(rep.dropped()),
        "captioned": len(rep.samples),
        "missing_captions": [str(p) for p in rep.missing_captions],
        "orphan_captions": [str(p) for p in rep.orphan_captions],
        "empty_captions": [str(p) for p in rep.empty_captions],
        "unreadable": [f"{p}: {why}" for p, why in rep.unreadable],
        "skipped": [f"{p}: {why}" for p, why in rep.skipped],
        "warnings": [f"{p}: {why}" for p, why in rep.warnings],
        "duplicate_captions": dup,
        "duplicate_stems": list(rep.duplicate_stems),
        "top_words": counts.most_common(40),
        "top_tags": tags.most_common(40),
        "tagged_captions": sum("," in c for c in captions),
        "prior_images": len(captions) - len(concept),
        "trigger_coverage": {
            t: 1 - len(m) / len(concept) if concept else 0.0 for t, m in missing.items()
        },
        "trigger_missing": missing,
        "samples": [{"image": str(s.image), "caption": s.caption} for s in rep.samples],
    }
    if token_counts and rep.samples:
        out["tokens"] = _token_counts(cfg, captions, files)
        out["truncation_warnings"] = truncation_warnings(out["tokens"])
    return out


def _source(image: Path, cfg: DataConfig) -> str:
    """Where a sample's caption comes from: its caption file, or the image itself."""
    return str(caption_path(image, cfg) if cfg.caption_strategy == "textfile" else image)


def _token_counts(
    cfg: Config, captions: list[str], files: list[str] | None = None, worst: int = 10
) -> dict[str, Any] | None:
    """Per text encoder: tokens per caption, the limit, and which captions it cuts off.

    A silently truncated caption looks like a learning-rate problem, so this is reported early.
    """
    family = get_family(cfg.model.model_family, cfg)
    try:
        tokenizers = family.load_tokenizers(cfg.model.pretrained_model)
    except (OSError, ValueError, KitError):
        return None  # the base model (or its tokenizers) is not reachable yet; counts come later
    files = files if files is not None else [f"caption {i}" for i in range(len(captions))]
    out = {}
    for name, tok in tokenizers.items():
        limit = family.token_limit(name, tok)
        n = [len(tok(c).input_ids) for c in captions]
        over = sorted(((x, f) for x, f in zip(n, files, strict=True) if x > limit), reverse=True)
        out[name] = {
            "limit": limit,
            "max": max(n),
            "mean": round(sum(n) / len(n), 1),
            "truncated": len(over),
            "most_over_by": over[0][0] - limit if over else 0,
            "truncated_files": [(f, x) for x, f in over[:worst]],
        }
    return out


def truncation_warnings(tokens: dict[str, Any] | None) -> list[str]:
    """One line per text encoder that cuts captions off, naming the longest ones."""
    out = []
    for name, t in (tokens or {}).items():
        if t["truncated"]:
            worst = ", ".join(f"{Path(f).name} ({x})" for f, x in t["truncated_files"])
            more = (
                f" and {t['truncated'] - len(t['truncated_files'])} more"
                if t["truncated"] > len(t["truncated_files"])
                else ""
            )
            out.append(
                f"{name}: {t['truncated']} caption(s) longer than {t['limit']} tokens are cut off: "
                f"{worst}{more}"
            )
    return out


def save_caption(image: str | Path, text: str, cfg: DataConfig) -> Path:
    """Write one image's caption atomically; return the caption file."""
    path = caption_path(Path(image), view_of(image, cfg).data if cfg.datasets else cfg)
    write_text(path, text.strip() + "\n")
    return path


@dataclass
class Edit:
    """One bulk edit of every caption file; steps run in field order, empty ones are skipped."""

    replace: tuple[str, str] | None = None
    """Search and replace: (old, new); with `regex`, old is a pattern and new may use `\\1`."""
    regex: bool = False
    """Read `replace`'s old text as a regular expression."""
    strip: bool = False
    """Strip whitespace at both ends (the file then ends with one newline)."""
    normalize: bool = False
    """Tags joined by ", ": repeated commas and spaces collapsed, trailing separators removed."""
    prepend: str = ""
    """Put this word (e.g. the trigger) first, unless the caption already has it."""
    append: str = ""
    """Put this word last, unless the caption already has it."""

    def __post_init__(self) -> None:
        if self.replace is not None:
            if len(self.replace) != 2 or not self.replace[0]:
                raise KitError(f"replace: {self.replace!r} must be (old, new) with old not empty")
            if self.regex:
                try:
                    re.compile(self.replace[0])
                except re.error as e:
                    raise KitError(
                        f"replace: bad regular expression {self.replace[0]!r}: {e}"
                    ) from None
        elif self.regex:
            raise KitError("regex: needs a replace (old, new) to apply to")
        for name in ("prepend", "append"):
            if getattr(self, name) != getattr(self, name).strip():
                raise KitError(f"{name}: {getattr(self, name)!r} has spaces at its ends")

    def empty(self) -> bool:
        """Whether this edit changes nothing at all."""
        return not (self.replace or self.strip or self.normalize or self.prepend or self.append)


@dataclass
class Change:
    """One caption file's text before and after a planned edit."""

    path: Path
    old: str
    new: str
    created: bool = False
    """The file does not exist yet (`old` is empty): applying creates it, restoring removes it."""


def edit_text(text: str, edit: Edit) -> str:
    """A caption file's text after `edit` (pure: nothing is read or written)."""
    body = text.rstrip("\r\n")
    ending = text[len(body) :]
    if edit.replace is not None:
        old, new = edit.replace
        try:
            body = re.sub(old, new, body) if edit.regex else body.replace(old, new)
        except re.error as e:
            raise KitError(f"replace: bad replacement {new!r} for {old!r}: {e}") from None
    if edit.strip:
        body, ending = body.strip(), "\n"
    if edit.normalize:
        body = "\n".join(_normalize_line(line) for line in body.split("\n"))
    if edit.prepend and not has_word(body, edit.prepend):
        body = f"{edit.prepend}, {body}" if body.strip() else edit.prepend
    if edit.append and not has_word(body, edit.append):
        body = f"{body}, {edit.append}" if body.strip() else edit.append
    return body + ending


def _normalize_line(line: str) -> str:
    """Tags joined by ", " with runs of spaces collapsed; empty tags (`a,,b`, `a,`) go."""
    tags = (re.sub(r"\s+", " ", t).strip() for t in line.split(","))
    return ", ".join(t for t in tags if t)


def caption_files(cfg: Config | DataConfig) -> list[Path]:
    """Every caption file under the caption folder (hidden folders such as backups left out)."""
    data = _data(cfg)
    root = _caption_root(data)
    return sorted(
        p
        for p in root.rglob("*" + data.caption_extension)
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def plan_edit(cfg: Config | DataConfig, edit: Edit) -> list[Change]:
    """Every caption file the edit would change, with its old and new text; nothing is written."""
    data = _data(cfg)
    seen = views(data)
    for v in seen:
        if v.data.caption_strategy != "textfile":
            raise KitError(
                f"{v.where + ': ' if v.where else ''}caption_strategy: bulk edits change caption "
                f"files, but it is '{v.data.caption_strategy}'; set it to 'textfile'"
            )
    family = None
    if isinstance(cfg, Config):
        family = family_info(cfg.model.model_family)
    changes = []
    for sample in scan(data, family).samples:
        if sample.blob is not None:
            raise KitError(
                f"{sample.blob.name}: its caption lives in its dataset, shard or bucket; "
                "edit it there (bulk edits change caption files of local folders)"
            )
        path = caption_path(sample.image, seen[sample.dataset].data)
        old = _read(path)
        new = edit_text(old, edit)
        if new != old:
            changes.append(Change(path, old, new))
    return changes


def diff_text(changes: list[Change]) -> str:
    """A unified diff of the planned changes: exactly what `apply_edit` will write."""
    out = []
    for c in changes:
        lines = difflib.unified_diff(
            _diff_lines(c.old),
            _diff_lines(c.new),
            fromfile="/dev/null" if c.created else str(c.path),
            tofile=str(c.path),
        )
        out.extend(lines)
    return "".join(out)


def _diff_lines(text: str) -> list[str]:
    """Lines for difflib, marking a last line without a newline the way `diff` does."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


def apply_edit(cfg: Config | DataConfig, changes: list[Change]) -> Path:
    """Back up every caption file, then write the planned changes; return the backup folder.

    Refuses before writing anything if a file no longer holds the text the plan was made from,
    so an edit made meanwhile (in the editor, by hand) is never overwritten.
    """
    if not changes:
        raise KitError("no caption changes to apply (the edit changes nothing)")
    for c in changes:
        now = _read(c.path) if c.path.is_file() else None
        if now != (None if c.created else c.old) or (c.created and c.path.exists()):
            raise DataError(
                f"{c.path} changed on disk after the edit was planned; nothing was written. "
                "Plan the edit again."
            )
    backup = _backup_touched(_data(cfg), changes)
    _note_created(backup.name, changes)
    for c in changes:
        # Bytes, not text mode, so line endings land exactly as the diff showed them.
        write_with(c.path, lambda tmp, c=c: tmp.write_bytes(c.new.encode("utf-8")))
    return backup


def _backup_touched(data: DataConfig, changes: list[Change]) -> Path:
    """Back up the caption folder of every dataset an edit touches, all under one time stamp;
    the first dataset's backup is returned (the others have the same name in their folders)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    touched = [
        v.data
        for v in views(data)
        if any(c.path.absolute().is_relative_to(_caption_root(v.data).absolute()) for c in changes)
    ]
    backups = [backup_captions(d, stamp) for d in touched or [views(data)[0].data]]
    return backups[0]


def backup_captions(cfg: Config | DataConfig, stamp: str = "") -> Path:
    """Copy every caption file, byte for byte, to `<caption folder>/.caption-backups/<time>/`
    (for several datasets: use each dataset's own data section, see `kit.data.datasets`)."""
    data = _data(cfg)
    root = _caption_root(data)
    dest = root / BACKUPS / (stamp or datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
    # Written whole or not at all: a half backup would be worse than none.
    with atomic_dir(dest) as tmp:
        for f in caption_files(data):
            target = tmp / f.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    return dest


def list_backups(cfg: Config | DataConfig) -> list[Path]:
    """The caption backups, oldest first (of every dataset's caption folder)."""
    out = []
    for v in views(_data(cfg)):
        folder = _caption_root(v.data) / BACKUPS
        if folder.is_dir():
            out += [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(out, key=lambda p: (p.name, str(p)))


def restore_backup(cfg: Config | DataConfig, backup: str | Path) -> Path:
    """Put a backup's caption files back (the current ones are backed up first); return that backup."""
    data = _data(cfg)
    backup = Path(backup).resolve()
    if not backup.is_dir():
        raise DataError(f"caption backup not found: {backup}")
    files = sorted(p for p in backup.rglob("*") if p.is_file() and p != backup / CREATED)
    created = _created_in(backup)
    if not files and not created:
        raise DataError(f"caption backup {backup} holds no caption files")
    # A backup lies in its caption folder's `.caption-backups`: that folder is where it goes back.
    root = backup.parent.parent if backup.parent.name == BACKUPS else None
    owner = next(
        (v.data for v in views(data) if root is None or _caption_root(v.data).resolve() == root),
        None,
    )
    if owner is None:
        raise DataError(f"caption backup {backup} belongs to none of the config's caption folders")
    before = backup_captions(owner)
    root = _caption_root(owner)
    for f in files:
        write_with(root / f.relative_to(backup), lambda tmp, f=f: shutil.copyfile(f, tmp))
    for name in created:
        # It did not exist when the backup was taken (the backup made just now keeps it).
        (root / name).unlink(missing_ok=True)
    return before


def _note_created(stamp: str, changes: list[Change]) -> None:
    """List in each backup the caption files the edit is about to create (see `CREATED`)."""
    notes: dict[Path, list[str]] = {}
    for c in changes:
        if c.created:
            root = next((p for p in c.path.parents if (p / BACKUPS / stamp).is_dir()), None)
            if root is not None:
                notes.setdefault(root, []).append(c.path.relative_to(root).as_posix())
    for root, names in notes.items():
        write_text(root / BACKUPS / stamp / CREATED, "".join(n + "\n" for n in names))


def _created_in(backup: Path) -> list[str]:
    """The caption files (relative to the caption folder) created after `backup` was taken."""
    note = backup / CREATED
    return note.read_text(encoding="utf-8").splitlines() if note.is_file() else []


def _data(cfg: Config | DataConfig) -> DataConfig:
    return cfg.data if isinstance(cfg, Config) else cfg


def _caption_root(data: DataConfig) -> Path:
    if not (data.caption_dir or data.image_dir):
        raise DataError("image_dir is not set in the config")
    return Path(data.caption_dir or data.image_dir)


def _read(path: Path) -> str:
    """A caption file's text; bytes that are not UTF-8 become U+FFFD instead of an error."""
    # newline="" keeps \r\n as it is, so an edit changes only what it says it changes.
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()
