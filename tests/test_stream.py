"""A Hugging Face dataset read as a stream (`streaming: true`): scanned and cached with nothing
downloaded whole, a read stopped in the middle resumed from its saved position, a broken row
named and skipped alone, training with a resume equal to the straight run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.cli import main
from kit.config import from_dict, load_config
from kit.data.scan import scan
from kit.data.sources import stream
from kit.data.sources.write import folder_records, write_parquet
from kit.errors import ConfigError, DataError
from kit.run import checkpoint as ckpt
from tests.conftest import lazy_module, resumed_equals_straight

datasets = lazy_module("datasets")


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """`datasets`' cache and the saved scans in the test's own folder; no stream left open."""
    from kit.data import streamed

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    streamed.open_stream.cache_clear()
    yield
    streamed.close_all()


@pytest.fixture()
def records(dataset):
    """Eight of the toy images with their captions, as (key, ext, bytes, caption)."""
    return folder_records(dataset)[:8]


def arrow_files(tmp_path: Path) -> list[Path]:
    """What `datasets` wrote into its cache (its empty lock files aside): Arrow, or downloads."""
    return [p for p in (tmp_path / "hf-cache").rglob("*") if p.is_file() and p.stat().st_size]


def seen(report) -> list[tuple]:
    return [(str(s.image), s.caption, s.width, s.height, s.blob.digest) for s in report.samples]


def streamed(path: Path | str, **kw) -> dict:
    return {"datasets": [{"hf_dataset": str(path), "streaming": True, **kw}]}


def test_a_stream_scans_as_the_table_and_writes_nothing_whole(
    tmp_path, records, monkeypatch, make_config, capsys
):
    path = write_parquet(records, tmp_path / "toy.parquet")
    got = scan(from_dict(streamed(path)).data)
    assert not arrow_files(tmp_path)  # nothing prepared as Arrow: read as a stream
    table = scan(from_dict({"datasets": [{"hf_dataset": str(path)}]}).data)
    assert any(p.suffix == ".arrow" for p in arrow_files(tmp_path))  # the table's reader does
    assert seen(got) == seen(table) and len(got.samples) == 8
    # Each row's bytes are read from the stream again, in any order (a row behind restarts).
    for i in (5, 6, 6, 2, 7):
        assert got.samples[i].blob.read() == records[i][2]
    cfg = make_config("c.json", image_dir="", datasets=streamed(path)["datasets"])
    assert main(["buckets", str(cfg), "--json"]) == 0  # the bucket report reads a stream too
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 8
    # Saved: a second scan pulls no row.
    monkeypatch.setattr(stream, "_examples", lambda s: pytest.fail("read the stream again"))
    assert seen(scan(from_dict(streamed(path)).data)) == seen(got)
    # A stream whose rows changed after its scan is not cached from: the row says so.
    from kit.data import streamed as streaming

    write_parquet(records[::-1], path)
    streaming.close_all()
    streaming.open_stream.cache_clear()
    with pytest.raises(DataError, match=r"toy.parquet\[0\]: this row of the stream changed"):
        got.samples[0].blob.read()


def test_a_stopped_stream_read_resumes_where_it_was(
    tmp_path, records, monkeypatch, make_config, capsys
):
    """A read that fails at row 5 (positions saved every 2 rows) resumes at row 4, not at the
    start, and ends with the scan of a read that never stopped."""
    path = write_parquet(records, tmp_path / "toy.parquet")
    monkeypatch.setattr(stream, "CHECKPOINT", 2)
    real, pulled = stream._examples, []

    def failing_at(k):
        def rows(s):
            for n, example in enumerate(real(s)):
                if n == k:
                    raise OSError("connection reset by peer")
                pulled.append(example["text"])
                yield example

        return rows

    monkeypatch.setattr(stream, "_examples", failing_at(5))
    with pytest.raises(DataError, match=r"stream broke at row 5 .*connection reset.*from row 4"):
        scan(from_dict(streamed(path)).data)
    assert pulled == [r[3] for r in records[:5]]
    # Through the command line, broken again one row on: one line, the saved position kept.
    pulled.clear()
    monkeypatch.setattr(stream, "_examples", failing_at(1))
    where = {"datasets": streamed(path)["datasets"], "cache_dir": str(tmp_path / "xdg" / "kit")}
    assert main(["buckets", str(make_config("c.json", image_dir="", **where))]) != 0
    err = capsys.readouterr().err
    assert "at row 5" in err and "from row 4" in err and "Traceback" not in err
    assert pulled == [records[4][3]]
    pulled.clear()
    monkeypatch.setattr(stream, "_examples", failing_at(-1))
    resumed = scan(from_dict(streamed(path)).data)
    assert pulled == [r[3] for r in records[4:]]  # from the saved position on, each row once
    straight = scan(from_dict({**streamed(path), "cache_dir": str(tmp_path / "c2")}).data)
    assert seen(resumed) == seen(straight)
    scans = tmp_path / "xdg" / "kit" / "scans"
    assert not list(scans.glob("*.progress.json")) and len(list(scans.glob("*.json"))) == 1


def test_a_broken_row_is_named_and_skipped_alone(tmp_path, records):
    broken = [*records[:3], ("bad", "png", b"\x89PNG\r\n\x1a\n not an image", "x"), *records[3:]]
    path = write_parquet(broken, tmp_path / "toy.parquet")
    rep = scan(from_dict(streamed(path)).data)
    assert len(rep.samples) == 8
    ((name, why),) = rep.unreadable
    assert str(name) == "toy.parquet[3]" and "toy.parquet[3]" in "; ".join(rep.problems())


def test_streaming_refuses_what_it_cannot_read(tmp_path, records):
    path = write_parquet(records, tmp_path / "toy.parquet")
    with pytest.raises(ConfigError, match="streaming: only an hf_dataset is streamed"):
        from_dict({"datasets": [{"shards": "a-{0..1}.tar", "streaming": True}]})
    with pytest.raises(ConfigError, match="mask_column: masks are not read from a stream"):
        from_dict(streamed(path, mask_column="mask"))
    with pytest.raises(ConfigError, match="control_column: control images are not read from a"):
        from_dict(streamed(path, control_column="control"))
    with pytest.raises(ConfigError, match="masked_loss: masks are not read from a stream"):
        from_dict(streamed(path, masked_loss=True))
    with pytest.raises(DataError, match="masked_loss: masks are not read from a stream"):
        scan(from_dict({**streamed(path), "masked_loss": True}).data)
    with pytest.raises(DataError, match=r"no column 'caption' \(its columns: image, text\)"):
        scan(from_dict(streamed(path, caption_column="caption")).data)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.parquet").write_bytes(path.read_bytes())
    with pytest.raises(DataError, match=r"has no split 'test' \(it has \['train'\]\)"):
        scan(from_dict(streamed(tmp_path / "folder", split="test")).data)
    with pytest.raises(DataError, match="no/such.parquet cannot be opened: Unable to find"):
        scan(from_dict(streamed(tmp_path / "no" / "such.parquet")).data)
    datasets.load_dataset("parquet", data_files=str(path), split="train").save_to_disk(
        str(tmp_path / "saved")
    )
    with pytest.raises(DataError, match="written by save_to_disk.*set streaming to false"):
        scan(from_dict(streamed(tmp_path / "saved")).data)


@pytest.mark.slow
def test_a_streamed_dataset_trains_and_resumes_exactly(tmp_path, make_config, records, monkeypatch):
    """A stream cached with a read that broke at row 5 (the cache kept its entries, the read
    resumed at the first row not cached), trained 4 steps straight and 2 + resume + 2: the same
    weights, with no Arrow file written."""
    from kit.data import streamed as streaming
    from kit.train.loop import train

    path = write_parquet(records, tmp_path / "toy.parquet")
    entry = {"hf_dataset": str(path), "streaming": True}
    common = {"image_dir": "", "datasets": [entry], "max_train_steps": 4}
    a = make_config("a.json", output_dir=str(tmp_path / "a"), **common)
    b = make_config(
        "b.json", output_dir=str(tmp_path / "b"), cache_dir=str(tmp_path / "cb"), **common
    )
    real, pulled = streaming._pull, []

    def pull(rows, fail_at=None):
        if len(pulled) == fail_at:
            raise OSError("connection reset by peer")
        row = real(rows)
        pulled.append(row)
        return row

    monkeypatch.setattr(streaming, "_pull", lambda rows: pull(rows, fail_at=5))
    with pytest.raises(DataError, match=r"stream broke while caching \(connection reset"):
        train(load_config(a))
    monkeypatch.setattr(streaming, "_pull", pull)
    pulled.clear()
    assert train(load_config(a)).step == 4
    # Rows 0-4 were cached before the break and are not read again: the read starts at row 5.
    assert len(pulled) == 8 - 5

    resumed_equals_straight(tmp_path, b)
    # The cache built across the break equals the one built in one go, entry for entry.
    ca, cb = (
        {f.relative_to(root): load_file(str(f)) for f in (root / "latents").rglob("*.safetensors")}
        for root in (tmp_path / "cache", tmp_path / "cb")
    )
    assert ca.keys() == cb.keys() and len(ca) >= 8
    assert all(torch.equal(ca[k]["latents"], cb[k]["latents"]) for k in ca)
    manifest = json.loads((tmp_path / "a" / "dataset_manifest.json").read_text())
    assert len(manifest) == 8 and {r["caption"] for r in manifest} == {r[3] for r in records}
    assert not arrow_files(tmp_path)


def row_groups(records, tmp_path: Path) -> Path:
    """The records as one parquet file of four row groups: a stream of four blocks."""
    import pyarrow.parquet as pq

    table = pq.read_table(write_parquet(records, tmp_path / "toy.parquet"))
    pq.write_table(table, tmp_path / "groups.parquet", row_group_size=2)
    return tmp_path / "groups.parquet"


def test_processes_share_a_stream_by_block(tmp_path, records, make_config, monkeypatch):
    """A parquet file of four row groups streams as four blocks: rows named by block and row,
    the samples of the table. Process 1 of 2 scans from block 2 on; its share of the cache
    reads blocks 1 and 3 only, each front to back once."""
    from kit.data import streamed as streaming
    from kit.data.cache import fill_cache, plan_cache
    from kit.families.loading import load_base

    path = row_groups(records, tmp_path)
    got = scan(from_dict(streamed(path)).data)
    assert [str(s.image) for s in got.samples[:3]] == [
        "groups.parquet[0:0]",
        "groups.parquet[0:1]",
        "groups.parquet[1:0]",
    ]
    table = scan(from_dict({"datasets": [{"hf_dataset": str(path)}]}).data)
    assert [r[1:] for r in seen(got)] == [r[1:] for r in seen(table)]

    real, firsts = stream._examples, []

    def first_rows(s):
        for n, example in enumerate(real(s)):
            if n == 0:
                firsts.append(example["text"])
            yield example

    monkeypatch.setattr(stream, "_examples", first_rows)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    again = scan(from_dict({**streamed(path), "cache_dir": str(tmp_path / "c2")}).data)
    assert firsts == [records[i][3] for i in (4, 6, 0, 2)] and seen(again) == seen(got)

    cfg = load_config(make_config(image_dir="", datasets=[streamed(path)["datasets"][0]]))
    family, comps = load_base(cfg)
    data = plan_cache(cfg, comps.identity, torch.float32, family=family)
    pulled = []
    monkeypatch.setattr(streaming, "_pull", lambda rows: pulled.append(next(rows)) or pulled[-1])
    fill_cache(data, cfg, family, comps, progress=False, share=(1, 2))
    assert [r["image"]["bytes"] for r in pulled] == [records[i][2] for i in (2, 3, 6, 7)]
    assert data.stats["latents_encoded"] == 4


@pytest.mark.slow
def test_two_processes_on_a_stream_match_one(tmp_path, records, two_processes_and_one):
    """Two processes streaming the same dataset (each scanning from its own block, each caching
    the rows of its own blocks) train as one process with twice the accumulation."""
    path = row_groups(records, tmp_path)
    ddp, one = two_processes_and_one(
        image_dir="",
        datasets=[{"hf_dataset": str(path), "streaming": True}],
        max_train_steps=2,
        checkpointing_steps=0,
    )
    a = load_file(str(ckpt.checkpoint_dir(ddp, 2) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(one, 2) / ckpt.ADAPTER_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    # Four blocks, one saved scan each, whichever process wrote it; no position left behind.
    scans = tmp_path / "cache" / "scans"
    assert len(list(scans.glob("*.json"))) == 4 and not list(scans.glob("*.progress.json"))
    assert not arrow_files(tmp_path)


@pytest.mark.parametrize(
    "damage",
    [
        lambda saved: [saved[0], saved[1], {k: v for k, v in saved[2].items() if k != "epoch"}],
        lambda saved: [saved[0], saved[1], "not a stream's state"],
        lambda saved: [10**9, saved[1], saved[2]],
        lambda saved: [-5, saved[1], saved[2]],
        lambda saved: {"row": 4},
    ],
)
def test_a_damaged_saved_stream_position_is_read_again_by_itself(
    tmp_path, records, monkeypatch, damage
):
    """A saved position edited or damaged (was: `unexpected KeyError: 'epoch'` on every later
    run until the file was deleted by hand) is dropped with one warning, and the block read
    again from its start, ending as a read that never stopped."""
    path = write_parquet(records, tmp_path / "toy.parquet")
    monkeypatch.setattr(stream, "CHECKPOINT", 2)
    real = stream._examples

    def failing(s):
        for n, example in enumerate(real(s)):
            if n == 5:
                raise OSError("connection reset by peer")
            yield example

    monkeypatch.setattr(stream, "_examples", failing)
    with pytest.raises(DataError, match="stream broke"):
        scan(from_dict(streamed(path)).data)
    monkeypatch.setattr(stream, "_examples", real)
    (progress,) = (tmp_path / "xdg" / "kit" / "scans").glob("*.progress.json")
    progress.write_text(json.dumps(damage(json.loads(progress.read_text()))))
    with pytest.warns(UserWarning, match=r"saved position .* damaged.*from its start") as caught:
        resumed = scan(from_dict(streamed(path)).data)
    assert len(caught) == 1 and str(progress.name) in str(caught[0].message)
    straight = scan(from_dict({**streamed(path), "cache_dir": str(tmp_path / "c2")}).data)
    assert seen(resumed) == seen(straight) and len(resumed.samples) == 8
    assert not progress.exists()
