"""The cache build's reads from tar shards: each shard front to back, in one read.

A shard's scan recorded each member's byte range, and an image can be read by it alone: one
request per image, which costs little on a local disk and sets the pace over object storage
(tens of milliseconds a request). When enough of a shard's members are wanted, the shard is read
instead as one stream from its start (one GET for a URL, in chunks of `CHUNK` bytes, never held
whole) up to the end of the last member wanted, and each wanted member's bytes are handed over as
the stream passes them.

The rule (`worth_streaming`): a request is worth `REQUEST_BYTES` of streamed bytes (4 MiB over a
URL: an object store answers in tens of ms at ~100 MB/s; 64 KiB for a local file). A shard is
streamed when its wanted members' requests would cost more than the stream up to the last of
them: `k × REQUEST_BYTES + their bytes > the bytes up to the last one's end + REQUEST_BYTES`. A
cache built whole streams every shard; a resumed or partly changed one reads its few missing
members by range.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

from kit.data.blob import Blob, filesystem, is_url, local_path
from kit.data.samples import Sample

CHUNK = 8 << 20
"""Bytes read from a stream at a time: memory holds about one chunk and one member."""
REQUEST_BYTES = {"url": 4 << 20, "local": 64 << 10}
"""What a request costs, in bytes of a stream read in the same time (see the module's rule)."""


def _member(sample: Sample) -> Blob | None:
    """The sample's byte range in a file that holds others (a shard), or None."""
    b = sample.blob
    if b is None or b.table is not None or not b.location or b.size < 0:
        return None
    return b


def worth_streaming(location: str, blobs: Sequence[Blob]) -> bool:
    """Whether reading `location` from its start to its last wanted member costs less than one
    request per member (the module's rule)."""
    ranges = {(b.start, b.size) for b in blobs}
    if len(ranges) < 2:
        return False
    cost = REQUEST_BYTES["url" if is_url(location) else "local"]
    end = max(s + n for s, n in ranges)
    return len(ranges) * cost + sum(n for _, n in ranges) > end + cost


def in_read_order(
    samples: Sequence[Sample], todo: Iterable[int]
) -> Iterator[tuple[int, bytes | None]]:
    """(index, bytes) of each sample to encode: the members of streamed shards with their bytes,
    shard by shard; every other sample (a file, a table's cell, a shard's few missing members)
    first, in the order given, with None (its bytes are read by range when it is decoded)."""
    todo = list(todo)
    groups: dict[str, list[int]] = defaultdict(list)
    for i in todo:
        b = _member(samples[i])
        if b is not None:
            groups[b.location].append(i)
    streamed = {
        loc: ix
        for loc, ix in groups.items()
        if worth_streaming(loc, [samples[i].blob for i in ix])  # type: ignore[misc]
    }
    in_stream = {i for ix in streamed.values() for i in ix}
    for i in todo:
        if i not in in_stream:
            yield i, None
    for loc in sorted(streamed):
        yield from _stream_members(loc, samples, streamed[loc])


def _stream_members(
    location: str, samples: Sequence[Sample], indices: list[int]
) -> Iterator[tuple[int, bytes | None]]:
    """The wanted members of one shard as one read passes them. A sample and its mirrored twin
    share a member: read once, handed to both. If the read fails or ends early (the shard
    changed since its scan), the members not yet handed over come with None: each is then read
    by range, and fails or succeeds alone."""
    wanted: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in indices:
        b = samples[i].blob
        assert b is not None
        wanted[(b.start, b.size)].append(i)
    ranges = sorted(wanted)
    done = 0
    chunks = _chunks(location, max(s + n for s, n in ranges))
    try:
        for data in _passing(chunks, ranges):
            for i in wanted[ranges[done]]:
                yield i, data
            done += 1
    except Exception:  # noqa: BLE001 — any failure of the stream (a lost connection, a
        pass  # store's error): the members not yet handed over are read by range, each alone
    finally:
        chunks.close()
    for r in ranges[done:]:
        for i in wanted[r]:
            yield i, None


def _passing(chunks: Iterator[bytes], ranges: list[tuple[int, int]]) -> Iterator[bytes]:
    """The bytes of each (start, size) range, in order, as the chunks pass them; stops early
    when the chunks end first."""
    buf, at = b"", 0  # `buf` holds the file's bytes from offset `at`
    for start, size in ranges:
        while at + len(buf) < start + size:
            chunk = next(chunks, b"")
            if not chunk:
                return
            keep = min(max(start - at, 0), len(buf))  # bytes before this member: not wanted
            buf, at = buf[keep:] + chunk, at + keep
        yield buf[start - at : start - at + size]


def _chunks(location: str, end: int) -> Iterator[bytes]:
    """A file's bytes from its start up to `end`, in chunks, in one read: a local file read
    sequentially; a URL streamed in one request where its filesystem streams (fsspec's
    `open_async`: S3, HTTP, GCS), else read through its file object a block at a time."""
    left = end
    if not is_url(location):
        with open(local_path(location), "rb") as f:
            while left > 0 and (data := f.read(min(CHUNK, left))):
                left -= len(data)
                yield data
        return
    fs, path = filesystem(location)
    stream = None
    if getattr(fs, "async_impl", False):
        from fsspec.asyn import sync

        try:
            stream = sync(fs.loop, fs.open_async, path, "rb")
        except (NotImplementedError, ValueError):
            stream = None
    if stream is None:
        with fs.open(path, "rb", block_size=CHUNK) as f:
            while left > 0 and (data := f.read(min(CHUNK, left))):
                left -= len(data)
                yield data
        return
    try:
        while left > 0 and (data := sync(fs.loop, stream.read, min(CHUNK, left))):
            left -= len(data)
            yield data
    finally:
        body = getattr(stream, "r", None)  # s3fs's response body: release its connection now
        if body is not None and hasattr(body, "close"):
            body.close()


def process_share(samples: Sequence[Sample], share: tuple[int, int]) -> set[int]:
    """The entries process `share[0]` of `share[1]` encodes, of all of them (cached or not, so
    that the shares never depend on what is cached): the members of shards split into `count`
    runs in shard and byte order (each process reads its own shards, and at most the ends of two
    more); every other entry, every `count`-th from `index`."""
    index, count = share
    located = sorted(
        (b.location, b.start, i) for i, s in enumerate(samples) if (b := _member(s)) is not None
    )
    n = len(located)
    mine = {i for _, _, i in located[index * n // count : (index + 1) * n // count]}
    in_shards = {i for _, _, i in located}
    mine |= {i for i in range(len(samples)) if i not in in_shards and i % count == index}
    return mine
