"""Files: atomic writes (a file or folder either appears complete or not at all), and strict
reading of the JSON and YAML files a user writes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kit.errors import ConfigError, DiskError, KitError, disk_problem


@contextmanager
def atomic_path(path: str | os.PathLike, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename.

    The file gets the mode of any file the user makes (the umask's), whatever wrote it. A full
    or read-only disk is one line naming the file, the folder, the space left and (`needed`,
    where the caller knows it) about how much the file needed; nothing partial is left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of our own rather than mkstemp: mkstemp's files stay private (0600) after the rename.
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp_path
        refuse_untracked(path)  # a run never writes over a file it did not write
        share(tmp_path)
        os.replace(tmp_path, path)
        note_written(path)
    except Exception as e:
        _name_the_file(e, path, needed)
        raise
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _name_the_file(e: Exception, path: Path, needed: int | None = None) -> None:
    """Raise a disk failure (full, read-only, not permitted) while writing `path` as one line
    naming it; any other failure is left to the caller."""
    why = None if isinstance(e, KitError) else disk_problem(e, path.parent, needed=needed)
    if why is not None:
        raise DiskError(f"could not write {path.name}: {why}") from None


def share(path: Path) -> None:
    """Give a file the kit wrote (or every file and folder under a folder) the mode the umask
    gives a new one: libraries that write through a private temporary file (safetensors)
    leave theirs 0600, which a user who shares the file does not expect."""
    mask = current_umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_symlink():
            continue
        full = p.is_dir() or p.stat().st_mode & 0o100  # a folder or a program: searchable
        os.chmod(p, (0o777 if full else 0o666) & ~mask)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write text atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically, pretty-printed."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_with(
    path: str | os.PathLike, writer: Callable[[Path], None], needed: int | None = None
) -> None:
    """Call `writer(tmp_path)` and move the result to `path` atomically (see `atomic_path`)."""
    with atomic_path(path, needed) as tmp:
        writer(tmp)


def save_tensors(
    path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """A safetensors file written atomically; a full or read-only disk is one line naming the
    file, its folder, the space left and about how much the file needed."""
    from safetensors.torch import save_file

    need = sum(t.numel() * t.element_size() for t in tensors.values())
    write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), needed=need)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it is renamed to `path`, its files
    with the umask's modes (see `share`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # not mkdtemp's private 0700: as any folder made
    try:
        try:
            yield tmp
        except Exception as e:
            _name_the_file(e, path)
            raise
        refuse_untracked(path)
        share(tmp)
        if path.exists():
            # Move the old one aside first so that a crash never leaves neither.
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        note_written(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


LEDGER = "written.jsonl"
"""A folder's record of the files the kit wrote in it (a run folder's): a first line naming the
entries it tracks (`{"tracks": [...]}`), then one JSON string a line, a file's path relative to
the folder. Whatever is not listed is the user's: the kit never removes or replaces it."""


def _ledger(path: Path) -> tuple[Path, list[str]] | None:
    """The folder holding the ledger that tracks `path`, and `path` relative to it, if any."""
    path = Path(os.path.abspath(path))
    for folder in path.parents:
        ledger = folder / LEDGER
        if not ledger.is_file():
            continue
        try:
            with open(ledger, encoding="utf-8") as f:
                tracks = json.loads(f.readline()).get("tracks", [])
        except (OSError, ValueError, AttributeError):
            return None  # a damaged ledger records nothing (and so claims nothing)
        parts = list(path.relative_to(folder).parts)
        return (folder, parts) if parts[0] in tracks else None
    return None


def note_written(path: str | os.PathLike) -> None:
    """Add `path` (a file, or each file in a folder) to the ledger of the folder it is written
    in, where that folder keeps one and tracks the entry it is under."""
    found = _ledger(Path(path))
    if found is None:
        return
    folder, _ = found
    path = Path(os.path.abspath(path))
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    lines = "".join(json.dumps(p.relative_to(folder).as_posix()) + "\n" for p in files)
    with open(folder / LEDGER, "a", encoding="utf-8") as f:
        f.write(lines)  # one write: lines of several processes do not interleave


def written_files(folder: str | os.PathLike) -> set[str] | None:
    """The files (relative paths) the ledger of `folder` lists, or None where it keeps none."""
    try:
        lines = (Path(folder) / LEDGER).read_text(encoding="utf-8").splitlines()[1:]
    except OSError:
        return None
    out = set()
    for line in lines:
        try:
            name = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(name, str):
            out.add(name)
    return out


def untracked(path: str | os.PathLike) -> list[Path]:
    """The files under `path` that a ledger tracking it does not list: the user's."""
    path = Path(path)
    found = _ledger(path) if path.exists() else None
    if found is None:
        return []
    folder, _ = found
    mine = written_files(folder) or set()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    base = Path(os.path.abspath(folder))
    return [p for p in files if Path(os.path.abspath(p)).relative_to(base).as_posix() not in mine]


def refuse_untracked(path: str | os.PathLike) -> None:
    """Refuse to replace a folder of a run that holds a file the kit did not write."""
    theirs = untracked(path)
    if theirs:
        raise KitError(
            f"{theirs[0]} was not written by the kit, and writing {path} would replace it; "
            "move it out of the run folder and try again"
        )


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log file (made with its folder when missing, and then recorded in
    the run's ledger)."""
    path = Path(path)
    new = not path.exists()
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
    if new:
        note_written(path)


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def absolute_path(value: str, base_dir: str | Path) -> Path:
    """`value` as a path (`~` expanded), taken from `base_dir` when it is relative."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (Path(base_dir) / p).resolve()


def read_json_or_yaml(path: Path) -> Any:
    """The data of a JSON or YAML (`.yaml`, `.yml`) file, where a key written twice is refused;
    every problem is a ConfigError that names the file."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at line {line}); save the "
            "file as UTF-8"
        ) from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs pyyaml (pip install pyyaml)") from None
        try:
            return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
        except RecursionError:
            raise ConfigError(_too_deep(path)) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(_too_deep(path)) from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _too_deep(path: Path) -> str:
    return (
        f"{path}: nested too deeply to read (thousands of levels of lists or mappings); a "
        "config is a mapping of sections, each a mapping of settings"
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: a key written twice is a mistake, not a silent override."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"config key '{k}' is given twice")
        out[k] = v
    return out


def _yaml_loader() -> type:
    """A SafeLoader that reads `1e-4` as a number, as YAML 1.2 and JSON do."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            # A key written twice is refused, as in JSON: YAML would keep the last silently.
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ConfigError(
                        f"config key '{key}' is given twice (lines {seen[key]} and "
                        f"{key_node.start_mark.line + 1})"
                    )
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)$"),
        list("-+0123456789."),
    )
    return Loader


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
