"""Errors the kit raises for bad input: shown to the user as one clear line, never a traceback."""

from __future__ import annotations

import difflib
import errno
import os
import shutil
from pathlib import Path


class KitError(Exception):
    """A problem with the user's input (config, files, arguments) that they can fix."""


class ConfigError(KitError):
    """A config file or value that cannot be accepted."""


class DataError(KitError):
    """A dataset folder, image or caption that cannot be used."""


class DiskError(KitError, OSError):
    """A file that could not be written (a full, read-only or forbidden disk), in one line that
    names it; still an OSError, so that a caller that can do without the file (a saved scan, a
    digest kept for next time) goes on as before."""


def at_least(section: object, minimum: int, *names: str) -> None:
    """Refuse a config field (step count, interval) below `minimum`, naming it: a negative
    interval is no schedule, and must not be read as "every step"."""
    for name in names:
        if getattr(section, name) < minimum:
            raise ConfigError(f"{name}: {getattr(section, name)} must be at least {minimum}")


def did_you_mean(word: str, choices: list[str]) -> str:
    """`; did you mean 'x'?` naming the closest of `choices`, or nothing when none is close."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


# What the libraries we call say when a disk is full or a folder cannot be written: an OSError's
# errno, or (torch, safetensors) only the words of the operating system in their message.
_DISK = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
_DISK_WORDS = {
    "no space left on device": errno.ENOSPC,
    "os error 28": errno.ENOSPC,
    "file write failed": errno.ENOSPC,
    # torch.save's own check that each record landed whole: on a full disk the write falls
    # short, and its zip writer says only "[enforce fail at inline_container.cc] unexpected pos".
    "unexpected pos": errno.ENOSPC,
    # ... or, when the write itself is refused, only its C++ stream's words.
    "basic_ios::clear: iostream error": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "read-only file system": errno.EROFS,
    "os error 30": errno.EROFS,
    "permission denied": errno.EACCES,
    "os error 13": errno.EACCES,
}


def disk_errno(e: BaseException) -> int | None:
    """The errno of a disk-full, quota, read-only or permission failure, else None (and None
    for the kit's own line about one, which is said already)."""
    if isinstance(e, KitError):
        return None
    if isinstance(e, OSError) and e.errno in _DISK:
        return e.errno
    text = str(e).lower()
    return next((code for words, code in _DISK_WORDS.items() if words in text), None)


def _gib(n: float) -> str:
    if n >= 2**27:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{max(n / 2**10, 1):.0f} KiB"


def disk_problem(
    e: BaseException, folder: str | os.PathLike | None = None, needed: int | None = None
) -> str | None:
    """One line for a write that failed for lack of space or permission, naming the folder, the
    space left there and, where the caller knows it, about how much the write needed; None for
    any other failure."""
    code = disk_errno(e)
    if code is None:
        return None
    where = getattr(e, "filename", None) or folder
    place = Path(where).parent if where and not Path(where).is_dir() else where
    free = ""
    if place:
        probe = Path(place)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = f" ({_gib(shutil.disk_usage(probe).free)} free there"
        except OSError:
            free = " ("
        if code in (errno.ENOSPC, errno.EDQUOT) and needed:
            free += f"{', ' if free != ' (' else ''}about {_gib(needed)} needed"
        free = f"{free})" if free != " (" else ""
    fix = {
        errno.ENOSPC: "free some space or choose a folder on another disk",
        errno.EDQUOT: "free some space or choose a folder on another disk",
        errno.EROFS: "choose a writable folder",
    }.get(code, "choose a folder you can write, or fix its permissions")
    return f"cannot write {place or 'a file'}: {_DISK[code]}{free}; {fix}"


def explain(e: BaseException) -> str | None:
    """One line for a failure of a library the kit calls that has a known cause and fix (a full
    or read-only disk, a file that is not UTF-8), else None."""
    disk = disk_problem(e)
    if disk:
        return disk
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
    return None
