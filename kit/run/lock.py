"""One run per folder: a lock file in the run folder, held while a command works in it.

`kit train` (a resume too), `kit export`, `kit merge` and `kit resize` hold the lock of the run
folder they work in; a second process is refused, naming the first one's pid, command and start
time. The lock is the kernel's (`flock`): it is released when its holder exits in any way, a
`kill -9` or a crash too, so a lock file left behind by a dead process is stale by construction
and the next command takes it over (and says so). Where a file system offers no `flock`, the
pid and the boot it was recorded in decide: a pid that is not alive, or one of an earlier boot,
holds nothing.

Within one process the lock is re-entrant (a notebook that exports while its panel trains in a
thread, a training that exports at its end): only other processes are kept out.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kit.errors import KitError
from kit.io import append_line
from kit.run.folder import RunDir

# Lock files this process holds: resolved path -> [open file, depth]. Guarded by _GUARD.
_HELD: dict[Path, list[Any]] = {}
_GUARD = threading.Lock()


def boot_id() -> str:
    """This boot of the machine ("" where the system does not say): a pid from another boot is
    not the same process, whatever its number."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def lead_process() -> bool:
    """Whether this is the process that locks the run folder: the only one, or rank 0 of a
    multi-process launch (the others work under its lock)."""
    return os.environ.get("RANK", "0") == "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _read(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe_holder(info: dict[str, Any]) -> str:
    """`kit train (pid 123, started 2026-01-02 10:00:00 UTC)` from a lock file's record."""
    started = info.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(started)))
        if isinstance(started, (int, float))
        else "at an unknown time"
    )
    return f"`kit {info.get('command', '?')}` (pid {info.get('pid', '?')}, started {when})"


def _refusal(root: Path, command: str, info: dict[str, Any]) -> KitError:
    return KitError(
        f"run folder {root} is in use by {describe_holder(info)}; `kit {command}` waits for "
        "nothing: let that one finish (or stop it), or choose another output_dir"
    )


def _stale_pid(info: dict[str, Any]) -> bool:
    """Whether a lock file's holder is gone (used where `flock` is not available)."""
    pid = info.get("pid")
    if not isinstance(pid, int):
        return True
    if info.get("boot_id") and info.get("boot_id") != boot_id():
        return True
    return not _alive(pid)


def _flock(fd: int) -> bool | None:
    """Take the kernel lock of `fd` without waiting: True taken, False held elsewhere, None
    where the file system has no locks."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return True


def acquire(root: str | os.PathLike, command: str) -> Any:
    """Take the lock of run folder `root` for `command` (creating the folder); return a handle
    for `release`, or raise KitError naming the process that holds it."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise KitError(f"output_dir {root} is a file, not a folder; choose a folder for the run")
    created = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KitError(f"cannot create the run folder {root}: {e.strerror}") from None
    path = RunDir(root).lock.resolve()
    with _GUARD:
        if path in _HELD:
            _HELD[path][1] += 1
            return path
    for _ in range(5):  # the file may be replaced by a holder releasing it meanwhile
        try:
            f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (kept open while held)
        except OSError as e:
            raise KitError(
                f"cannot write the lock file of run folder {root}: {e.strerror}"
            ) from None
        taken = _flock(f.fileno())
        previous = _read(path)
        if taken is False:
            f.close()
            raise _refusal(root, command, previous)
        if taken is None and previous and not _stale_pid(previous):
            f.close()
            raise _refusal(root, command, previous)
        try:
            same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            f.close()
            continue
        break
    else:
        raise KitError(f"cannot take the lock of run folder {root}: it keeps changing")
    if previous.get("pid") not in (None, os.getpid()):
        warnings.warn(
            f"{root}: the lock of {describe_holder(previous)} was stale (that process ended "
            "without releasing it, e.g. a crash or kill -9); taken over",
            stacklevel=3,
        )
    record = {"pid": os.getpid(), "command": command, "started": time.time(), "boot_id": boot_id()}
    f.seek(0)
    f.truncate()
    f.write(json.dumps(record))
    f.flush()
    with _GUARD:
        _HELD[path] = [f, 1, created]
    return path


def release(handle: Any) -> None:
    """Give back a lock taken by `acquire` (the outermost release removes the file, and the run
    folder when the lock made it and it is still empty)."""
    with _GUARD:
        held = _HELD.get(handle)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[handle]
    f, _, created = held
    with contextlib.suppress(OSError):
        handle.unlink()  # before the kernel lock goes: a waiter re-checks the inode
    f.close()
    if created:
        with contextlib.suppress(OSError):
            handle.parent.rmdir()  # only succeeds when nothing was written


@contextlib.contextmanager
def hold_run(root: str | os.PathLike, command: str) -> Iterator[Path]:
    """Hold the lock of run folder `root` while the block runs; released on any exit."""
    handle = acquire(root, command)
    try:
        yield Path(root)
    except Exception:
        record_error(Path(root), command)
        raise
    finally:
        release(handle)


def record_error(root: Path, command: str) -> None:
    """Append the traceback being handled to the run's error log (a run folder only: one that
    holds a config), so the console can keep to one line."""
    import traceback

    run = RunDir(root)
    if not run.config.is_file():
        return
    with contextlib.suppress(OSError):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        append_line(run.error_log, f"--- kit {command}, {stamp}\n{traceback.format_exc()}\n")


def holder(root: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the process holding `root`'s lock, or None when it is free (or stale)."""
    path = RunDir(Path(root)).lock
    if not path.is_file():
        return None
    with open(path, "a+", encoding="utf-8") as f:
        taken = _flock(f.fileno())
        info = _read(path)
        if taken is True:
            return None
        if taken is None and _stale_pid(info):
            return None
        return info
