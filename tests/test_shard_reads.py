"""The cache build reads tar shards front to back, one read per shard (one GET on S3), and
builds the very cache that per-image range reads and a folder of the same images build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.data import blob, shard_reads
from kit.data.blob import expand_braces
from kit.data.cache import fill_cache, plan_cache
from kit.data.sources.write import write_shards
from kit.families.loading import load_base
from tests import test_sources

records, s3 = test_sources.records, test_sources.s3  # their fixtures: eight images, an S3 server


@pytest.fixture()
def build(make_config):
    """build(name, entry, share=(0, 1)) -> the cache planned and filled for one dataset entry,
    in its own cache folder (or `cache`); `before` is called between the plan (and its scan)
    and the encoding. The tiny model is loaded once per test."""
    loaded = {}

    def run(name: str, entry: dict, share=(0, 1), cache=None, before=None):
        path = make_config(f"{name}.json", image_dir="", datasets=[entry])
        cfg = load_config(path)
        cfg.data.cache_dir = str(cache or Path(path).parent / f"cache-{name}")
        if not loaded:
            loaded["family"], loaded["comps"] = load_base(cfg)
        family, comps = loaded["family"], loaded["comps"]
        data = plan_cache(cfg, comps.identity, torch.float32)  # scans the shards
        if before is not None:
            before()
        return fill_cache(data, cfg, family, comps, progress=False, share=share)

    return run


@pytest.fixture()
def reads(monkeypatch):
    """Every read the cache makes of a shard: ("stream", shard) or ("range", name)."""
    log: list[tuple[str, str]] = []
    stream, ranged = shard_reads._chunks, blob.read_range

    def chunks(location, end):
        log.append(("stream", Path(location).name))
        return stream(location, end)

    def read_range(location, start=0, size=-1):
        log.append(("range", Path(location).name))
        return ranged(location, start, size)

    monkeypatch.setattr(shard_reads, "_chunks", chunks)
    monkeypatch.setattr(blob, "read_range", read_range)
    return log


def _entries(data) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(str(f)) for f in data.latent_files}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][t], b[k][t]) for t in a[k]) for k in a
    )


def test_s3_shards_are_read_once_each_and_cache_as_per_image_reads_do(
    tmp_path, build, records, s3, monkeypatch
):
    import s3fs

    pattern = write_shards(records, tmp_path / "shards", per_shard=4)
    for shard in expand_braces(pattern):
        s3.put(shard, f"kit-data/shards/{Path(shard).name}")
    remote = {"shards": "s3://kit-data/shards/train-{000000..000001}.tar"}
    folder = tmp_path / "folder"
    folder.mkdir()
    for key, ext, data, caption in records:
        (folder / f"{key}.{ext}").write_bytes(data)
        (folder / f"{key}.txt").write_text(caption)
    gets: list[str] = []
    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        gets.extend([method] if method == "get_object" else [])
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    streamed = build("streamed", remote, before=gets.clear)
    assert gets == ["get_object"] * 2  # one per shard, not one per image
    assert streamed.stats["latents_encoded"] == 8
    with monkeypatch.context() as m:  # requests cost nothing: every image by its own range
        m.setitem(shard_reads.REQUEST_BYTES, "url", 0)
        ranged = build("ranged", remote, before=gets.clear)
    assert gets == ["get_object"] * 8
    from_folder = build("folder", {"image_dir": str(folder)})
    # Content-keyed: the same entries under the same names, tensor for tensor.
    assert _same(_entries(streamed), _entries(ranged))
    assert _same(_entries(streamed), _entries(from_folder))


def test_local_shards_stream_split_by_process_and_a_bad_member_is_skipped_alone(
    tmp_path, build, records, reads
):
    """Two shards, two processes: each streams only its own. A member whose header reads but
    whose pixels do not (in the middle of shard 1) is named with its shard and key and skipped
    alone; the members after it still come from the stream. A resumed cache missing one entry
    reads it by its range, not its whole shard."""
    key, ext, data, _ = records[5]
    records[5] = (key, ext, data[: len(data) * 2 // 3], "cut")  # its IDAT is cut short
    pattern = write_shards(records, tmp_path / "shards", per_shard=4)
    entry, cache = {"shards": pattern}, tmp_path / "cache"
    build("p0", entry, share=(0, 2), cache=cache)
    assert reads == [("stream", "train-000000.tar")]
    reads.clear()
    build("p1", entry, share=(1, 2), cache=cache)
    assert reads == [("stream", "train-000001.tar")]
    reads.clear()
    whole = build("after", entry, cache=cache)  # the whole pass after the shares
    assert reads == [("range", "train-000001.tar")]  # the bad member, tried again alone
    ((name, why),) = whole.skipped
    assert "train-000001.tar" in why and f"{key}.{ext}" in why, why
    assert len(whole.samples) == 7 and whole.missing()["latents"] == 0
    first = next(i for i, s in enumerate(whole.samples) if "000000.tar" in s.blob.location)
    whole.latent_files[first].unlink()  # one entry of shard 0
    reads.clear()
    again = build("resumed", entry, cache=cache)
    assert again.stats["latents_encoded"] == 1
    assert sorted(reads) == [("range", "train-000000.tar"), ("range", "train-000001.tar")]


def test_a_stream_in_small_chunks_or_lost_midway_gives_each_member_its_bytes(
    tmp_path, records, monkeypatch
):
    """Members are cut out of chunks smaller than themselves exactly; a stream lost after its
    first chunk hands the rest over as None (each then read by its range, alone)."""
    from kit.config import from_dict
    from kit.data.scan import scan

    pattern = write_shards(records, tmp_path / "shards", per_shard=8)
    samples = scan(from_dict({"datasets": [{"shards": pattern}]}).data).samples
    monkeypatch.setattr(shard_reads, "CHUNK", 97)
    got = dict(shard_reads.in_read_order(samples, range(8)))
    assert got == {i: s.blob.read() for i, s in enumerate(samples)}
    stream = shard_reads._chunks

    def lost(location, end):
        yield next(stream(location, end))
        raise OSError("connection reset")

    monkeypatch.setattr(shard_reads, "CHUNK", 4096)
    monkeypatch.setattr(shard_reads, "_chunks", lost)
    order = list(shard_reads.in_read_order(samples, range(8)))
    got = dict(order)
    assert sorted(i for i, _ in order) == list(range(8))
    handed = [i for i, data in got.items() if data is not None]
    assert 0 < len(handed) < 8 and all(got[i] == samples[i].blob.read() for i in handed)
