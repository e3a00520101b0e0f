"""Where cache entries live: one safetensors file each, or packed into shard files with an index.

An entry is a small dict of tensors (a latent, or a caption's embeddings) addressed by the path
the cache planned for it (`<folder>/<key>.safetensors`). Both stores answer `has(path)`,
`get(path)`, `put(path, tensors)` / `put_many(items)`, `flush()` and `refresh()`:

`FileStore` (`cache_format: files`) is the path itself: each entry one file, written atomically.

`ShardStore` (`cache_format: shards`) keeps the entries of a folder in a few large files, so a
dataset of a million images is a few thousand files rather than millions. In each folder:

- `shard-<writer>-<n>.safetensors`: a plain safetensors file (readable by any safetensors
  reader) holding up to `SHARD_ENTRIES` entries (or `SHARD_BYTES`), the tensor `name` of entry
  `key` stored as `<key>/<name>`. With `cache_compression: zlib` an entry is one uint8 tensor
  named `<key>`: the zlib-compressed safetensors serialization of its tensors (the shard's
  metadata says `compression: zlib`).
- `index-<writer>.json`: what one writer (one process of one run) wrote: per shard its size in
  bytes and, per entry, the CRC-32 of the entry's stored bytes (its tensors' raw bytes in name
  order, or the compressed blob). Rewritten atomically after each shard.
- `index.json`: the merged index. After a build the writers' indexes are folded into it (under a
  lock on the folder) and removed, so a finished cache is its shards and one index per folder.

Writers never share a file: every store gets a writer name of its own (time, process id and a
random part), so the processes of a launch, or two runs on one cache, write side by side. A
shard is written whole (to a temporary name, then renamed) before the index names it, so a
crash leaves complete shards and an index of them: the next build encodes only what no index
lists. Entries still buffered when the build fails with an exception are written out first
(see `fill_cache`); a killed process loses at most one shard's worth of encodes.

Checksums: the first time a process touches a shard it reads it through and checks every entry
against the index (and the file's size); a shard that fails is reported in a warning, removed
from the indexes and deleted, so its entries count as missing and are encoded again: a damaged
shard is never trained on. Every read checks its entry's CRC again; a mismatch there (the file
changed during the run) stops with an error rather than returning the tensors.

Garbage: an entry whose image or caption changed is simply no longer asked for; its old copy
stays in its shard (a few kilobytes to a megabyte each). Delete the cache folder to reclaim the
space; there is no compaction step.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load, load_file, save

from kit.errors import DataError
from kit.io import save_tensors, write_json

SHARD_ENTRIES = 500
"""Entries per shard: a dataset of N images writes about N/500 latent shards."""
SHARD_BYTES = 512 << 20
"""A shard is closed early at this many bytes, so that buffered entries stay bounded in memory
(large video latents reach it before `SHARD_ENTRIES`)."""
INDEX = "index.json"
FORMAT = "kit-cache-shards"


class EntryStore(Protocol):
    """What the cache asks of a store (see the module docstring)."""

    def has(self, path: Path) -> bool: ...
    def get(self, path: Path) -> dict[str, torch.Tensor]: ...
    def put(self, path: Path, tensors: dict[str, torch.Tensor]) -> None: ...
    def put_many(self, items: Iterable[tuple[Path, dict[str, torch.Tensor]]]) -> None: ...
    def flush(self) -> None: ...
    def refresh(self) -> None: ...


AUTO_SHARDS = 2000
"""`cache_format: auto` shards the cache of this many images or more: one file per entry is
4,000 files for 2,000 images (a latent and a caption each), slow to list, copy and check."""


def auto_format(cache_format: str, images: int, first_entry: Path | None) -> str:
    """The format `auto` stands for: shards from `AUTO_SHARDS` images on, unless the cache already
    holds this dataset's entries as files (`first_entry` is one), which stay in use."""
    if cache_format != "auto":
        return cache_format
    if images < AUTO_SHARDS or (first_entry is not None and first_entry.is_file()):
        return "files"
    return "shards"


def open_store(cache_format: str, compression: str = "none") -> EntryStore:
    """The store of `cache_format` (`files` or `shards`)."""
    if cache_format == "files":
        return FileStore()
    if cache_format == "shards":
        return ShardStore(compression=compression)
    raise DataError(f"cache_format: {cache_format!r} must be files or shards")


class FileStore:
    """One safetensors file per entry, at the entry's own path (the cache's original layout)."""

    def has(self, path: Path) -> bool:
        return Path(path).is_file()

    def get(self, path: Path) -> dict[str, torch.Tensor]:
        return load_file(path)

    def put(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        save_tensors(path, tensors)

    def put_many(self, items: Iterable[tuple[Path, dict[str, torch.Tensor]]]) -> None:
        for path, tensors in items:
            self.put(path, tensors)

    def flush(self) -> None:
        """Nothing is buffered: each entry is on disk once `put` returns."""

    def refresh(self) -> None:
        """Nothing is held: `has` asks the file system each time."""


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as safetensors stores them (row-major, native little-endian)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _owns_memory(t: torch.Tensor) -> bool:
    """Whether a tensor is contiguous and alone in its storage (no copy needed to store it)."""
    size = t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == size


class _Shard:
    """One shard file, memory-mapped and kept open; its header parsed once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(self.map)
        n = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8 : 8 + n]))
        meta = header.pop("__metadata__", None) or {}
        self.compressed = meta.get("compression") == "zlib"
        start = 8 + n
        self.entries: dict[str, dict[str, tuple[str, list[int], int, int]]] = {}
        for name, info in header.items():
            key, _, tensor = name.partition("/")
            b, e = info["data_offsets"]
            self.entries.setdefault(key, {})[tensor] = (
                info["dtype"],
                info["shape"],
                start + b,
                start + e,
            )
        for tensors in self.entries.values():
            for _, _, b, e in tensors.values():
                if not start <= b <= e <= len(self.map):
                    raise ValueError("a tensor lies outside the file")

    def crc(self, key: str) -> int:
        view, crc = memoryview(self.map), 0
        for name in sorted(self.entries[key]):
            _, _, b, e = self.entries[key][name]
            crc = zlib.crc32(view[b:e], crc)
        return crc

    def read(self, key: str, expected: int) -> dict[str, torch.Tensor] | None:
        """The entry's tensors, or None when its bytes fail the CRC."""
        view, crc, out = memoryview(self.map), 0, {}
        for name in sorted(self.entries[key]):
            dtype, shape, b, e = self.entries[key][name]
            data = bytearray(view[b:e])  # one copy, writable, so torch may own it
            crc = zlib.crc32(data, crc)
            kind = _DTYPES[dtype]
            t = torch.frombuffer(data, dtype=kind) if data else torch.empty(0, dtype=kind)
            out[name] = t.reshape(shape)
        if crc != expected:
            return None
        if self.compressed:
            return load(zlib.decompress(bytes(out[""].numpy())))
        return out

    def close(self) -> None:
        self.map.close()


class _Folder:
    """The shards of one cache folder as this process sees them, and what it has buffered."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.shards: dict[str, dict] = {}  # shard name -> {"size", "entries": {key: crc}}
        self.where: dict[str, str] = {}  # entry key -> shard name
        self.open: dict[str, _Shard] = {}  # verified shards, kept open
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.pending_bytes = 0
        self.written: dict[str, dict] = {}  # this writer's shards, for its own index
        self.unmerged = False  # a shard written since the last merge
        self.load()

    def load(self) -> None:
        """Read the indexes: the writers' first, then the merged one (a merge removes a writer's
        index only after the merged index holds it, so reading in this order misses nothing)."""
        shards: dict[str, dict] = {}
        for f in [*sorted(self.dir.glob("index-*.json")), self.dir / INDEX]:
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                warnings.warn(f"cache index {f} is unreadable ({e}); ignoring it", stacklevel=3)
                continue
            shards.update(data.get("shards", {}))
        self.shards = {**shards, **self.written}
        self._locate()

    def _locate(self) -> None:
        self.where = {k: name for name, info in self.shards.items() for k in info["entries"]}


class ShardStore:
    """Entries packed into safetensors shards with JSON indexes (see the module docstring)."""

    def __init__(
        self,
        compression: str = "none",
        shard_entries: int | None = None,
        shard_bytes: int | None = None,
    ) -> None:
        if compression not in ("none", "zlib"):
            raise DataError(f"cache_compression: {compression!r} must be none or zlib")
        self.compression = compression
        self.shard_entries = shard_entries or SHARD_ENTRIES
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self.writer = f"{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(2)}"
        self.folders: dict[Path, _Folder] = {}
        self.count = 0

    def _folder(self, path: Path) -> tuple[_Folder, str]:
        path = Path(path)
        folder = self.folders.get(path.parent)
        if folder is None:
            folder = self.folders[path.parent] = _Folder(path.parent)
        return folder, path.stem

    def has(self, path: Path) -> bool:
        folder, key = self._folder(path)
        if key in folder.pending:
            return True
        while key in folder.where:
            if self._verified(folder, folder.where[key]):
                return True
        return False

    def get(self, path: Path) -> dict[str, torch.Tensor]:
        folder, key = self._folder(path)
        if key in folder.pending:
            return dict(folder.pending[key])
        if not self.has(path):
            raise DataError(f"{path}: not in the cache (no shard in {folder.dir} holds it)")
        name = folder.where[key]
        out = folder.open[name].read(key, folder.shards[name]["entries"][key])
        if out is None:
            self._discard(folder, name, f"entry {key} failed its checksum while reading")
            raise DataError(
                f"cache shard {folder.dir / name}: entry {key} failed its checksum; the shard "
                "was removed and is rebuilt by the next run (nothing was trained on it)"
            )
        return out

    def put(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        folder, key = self._folder(path)
        # A view into a larger tensor (a caption's row of its batch) is copied: shards may not
        # hold tensors that share memory, and the batch should not stay alive for one row.
        own = {k: v.detach().cpu() for k, v in tensors.items()}
        own = {
            k: v if _owns_memory(v) else v.clone(memory_format=torch.contiguous_format)
            for k, v in own.items()
        }
        folder.pending[key] = own
        folder.pending_bytes += sum(v.numel() * v.element_size() for v in own.values())
        if len(folder.pending) >= self.shard_entries or folder.pending_bytes >= self.shard_bytes:
            self._write_shard(folder)

    def put_many(self, items: Iterable[tuple[Path, dict[str, torch.Tensor]]]) -> None:
        for path, tensors in items:
            self.put(path, tensors)

    def flush(self) -> None:
        """Write the buffered entries as shards, then fold the writers' indexes into `index.json`."""
        for folder in self.folders.values():
            if folder.pending:
                self._write_shard(folder)
            if folder.unmerged or any(folder.dir.glob("index-*.json")):
                self._merge(folder)

    def refresh(self) -> None:
        """Read the indexes again: entries other processes wrote since become visible."""
        for folder in self.folders.values():
            folder.load()

    def close(self) -> None:
        """Unmap the open shards."""
        for folder in self.folders.values():
            for shard in folder.open.values():
                shard.close()
            folder.open.clear()

    def files(self) -> Iterator[Path]:
        """The shard files the indexes name, in every folder touched so far."""
        for folder in self.folders.values():
            for name in folder.shards:
                yield folder.dir / name

    # -- writing ------------------------------------------------------------------------------

    def _write_shard(self, folder: _Folder) -> None:
        name = f"shard-{self.writer}-{self.count:05d}.safetensors"
        self.count += 1
        tensors: dict[str, torch.Tensor] = {}
        crcs: dict[str, int] = {}
        for key, entry in sorted(folder.pending.items()):
            if self.compression == "zlib":
                blob = zlib.compress(save(entry), 1)  # fast; floats gain little more
                t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                tensors[key] = t
                crcs[key] = zlib.crc32(blob)
            else:
                crc = 0
                for k in sorted(entry):
                    tensors[f"{key}/{k}"] = entry[k]
                    crc = zlib.crc32(_raw(entry[k]), crc)
                crcs[key] = crc
        meta = {"format": FORMAT, "compression": self.compression}
        path = folder.dir / name
        save_tensors(path, tensors, meta)
        info = {"size": path.stat().st_size, "entries": crcs}
        folder.written[name] = info
        folder.shards[name] = info
        for key in crcs:
            folder.where[key] = name
        folder.pending.clear()
        folder.pending_bytes = 0
        folder.unmerged = True
        index = {"format": FORMAT, "version": 1, "shards": folder.written}
        with _locked(folder.dir):
            write_json(folder.dir / f"index-{self.writer}.json", index)

    def _merge(self, folder: _Folder) -> None:
        """Fold every writer's index into `index.json`, then remove the writers' files."""
        with _locked(folder.dir):
            merged = _read_index(folder.dir / INDEX)
            writers = sorted(folder.dir.glob("index-*.json"))
            for f in writers:
                merged.update(_read_index(f))
            write_json(folder.dir / INDEX, {"format": FORMAT, "version": 1, "shards": merged})
            for f in writers:
                f.unlink(missing_ok=True)
        folder.unmerged = False

    # -- checking -----------------------------------------------------------------------------

    def _verified(self, folder: _Folder, name: str) -> bool:
        """Whether shard `name` is sound, reading it through the first time; a shard that fails
        is discarded (and its entries are found elsewhere or count as missing)."""
        if name in folder.open:
            return True
        info, path = folder.shards[name], folder.dir / name
        why = ""
        try:
            if path.stat().st_size != info["size"]:
                why = f"its size is {path.stat().st_size} bytes, the index says {info['size']}"
            else:
                shard = _Shard(path)
                bad = [
                    k
                    for k, crc in info["entries"].items()
                    if k not in shard.entries or shard.crc(k) != crc
                ]
                if bad:
                    shard.close()
                    why = f"{len(bad)} of its {len(info['entries'])} entries fail their checksum"
                else:
                    folder.open[name] = shard
                    return True
        except FileNotFoundError:
            why = "the file is missing"
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = f"it cannot be read ({e})"
        self._discard(folder, name, why)
        return False

    def _discard(self, folder: _Folder, name: str, why: str) -> None:
        """Forget a damaged shard everywhere (indexes and disk); its entries are encoded again."""
        warnings.warn(
            f"cache shard {folder.dir / name} is damaged ({why}): its entries are encoded again",
            stacklevel=4,
        )
        shard = folder.open.pop(name, None)
        if shard is not None:
            shard.close()
        folder.shards.pop(name, None)
        folder.written.pop(name, None)
        folder._locate()
        with _locked(folder.dir):
            for f in [folder.dir / INDEX, *folder.dir.glob("index-*.json")]:
                shards = _read_index(f)
                if name in shards:
                    del shards[name]
                    write_json(f, {"format": FORMAT, "version": 1, "shards": shards})
            (folder.dir / name).unlink(missing_ok=True)


def _read_index(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("shards", {})
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"cache index {path} is unreadable ({e}); ignoring it", stacklevel=3)
        return {}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the folder while an index changes, where the system has one: two
    processes folding indexes at once would otherwise lose one's additions."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no flock; concurrent writers there may orphan a shard
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks: proceed unlocked
        yield
    finally:
        os.close(fd)
