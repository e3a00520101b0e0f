"""Datasets where they live: a Hugging Face dataset (parquet, a saved dataset), WebDataset tar
shards, and an s3:// prefix on a real S3-compatible server (moto's, on a loopback port), each
trained with a resume in the middle equal to the straight run; broken samples named and skipped."""

from __future__ import annotations

import json
import socket
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.cli import main
from kit.config import load_config
from kit.data.blob import expand_braces, filesystem
from kit.data.scan import check_dataset, scan
from kit.data.sources.write import folder_records, write_parquet, write_shards
from kit.errors import ConfigError, DataError
from kit.run import checkpoint as ckpt
from tests.conftest import lazy_module, resumed_equals_straight, write_config

datasets = lazy_module("datasets")


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """`datasets` prepares parquet into its cache: the test's own folder, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # saved shard scans


@pytest.fixture()
def records(dataset):
    """Eight of the toy images with their captions, as (key, ext, bytes, caption)."""
    return folder_records(dataset)[:8]


def _train_with_resume(make_config, tmp_path: Path, entry: dict) -> dict:
    """Train 4 steps straight, and 2 + resume + 2: the two runs end on the same weights."""
    from kit.train.loop import train

    common = {"image_dir": "", "datasets": [entry], "max_train_steps": 4}
    a = make_config("a.json", output_dir=str(tmp_path / "a"), **common)
    b = make_config("b.json", output_dir=str(tmp_path / "b"), **common)
    assert train(load_config(a)).step == 4
    resumed_equals_straight(tmp_path, b)
    return json.loads((tmp_path / "a" / "dataset_manifest.json").read_text())


@pytest.mark.slow
def test_parquet_dataset_trains_and_resumes_exactly(tmp_path, make_config, records):
    path = write_parquet(records, tmp_path / "toy.parquet")
    manifest = _train_with_resume(make_config, tmp_path, {"hf_dataset": str(path)})
    assert len(manifest) == 8
    assert {r["caption"] for r in manifest} == {r[3] for r in records}


@pytest.mark.slow
def test_tar_shards_train_and_resume_exactly(tmp_path, make_config, records):
    pattern = write_shards(records, tmp_path / "shards", per_shard=3)
    assert len(expand_braces(pattern)) == 3
    manifest = _train_with_resume(make_config, tmp_path, {"shards": pattern})
    assert len(manifest) == 8


def test_saved_dataset_scans_like_its_parquet(tmp_path, records):
    """A folder written by `save_to_disk` gives the same samples, captions and digests."""
    from kit.config import from_dict

    path = write_parquet(records, tmp_path / "toy.parquet")
    datasets.load_dataset("parquet", data_files=str(path), split="train").save_to_disk(
        str(tmp_path / "saved")
    )
    got = [
        scan(from_dict({"datasets": [{"hf_dataset": str(p)}]}).data).samples
        for p in (path, tmp_path / "saved")
    ]
    assert [(s.caption, s.width, s.height, s.blob.digest) for s in got[0]] == [
        (s.caption, s.width, s.height, s.blob.digest) for s in got[1]
    ]
    assert got[0][3].blob.read() == records[3][2]
    # The scan was saved: read again, it gives the same samples, each readable.
    again = scan(from_dict({"datasets": [{"hf_dataset": str(path)}]}).data).samples
    assert [(s.image, s.blob) for s in again] == [(s.image, s.blob) for s in got[0]]
    assert again[3].blob.read() == records[3][2]
    assert list((tmp_path / "xdg" / "kit" / "scans").glob("*.json"))


def test_a_corrupt_image_in_a_shard_is_named_and_skipped_alone(tmp_path, records):
    from kit.config import from_dict

    broken = [*records[:4], ("bad", "png", b"\x89PNG\r\n\x1a\n not an image", "x"), *records[4:]]
    pattern = write_shards(broken, tmp_path / "shards", per_shard=4)
    rep = scan(from_dict({"datasets": [{"shards": pattern}]}).data)
    assert len(rep.samples) == 8
    ((name, why),) = rep.unreadable
    assert name.as_posix().endswith("train-000001.tar/bad.png")
    assert "key bad" in why and "train-000001.tar" in why
    assert "bad.png" in "; ".join(rep.problems())


def test_a_shard_cut_short_keeps_what_came_before(tmp_path, records):
    from kit.config import from_dict

    pattern = write_shards(records, tmp_path / "shards", per_shard=8)
    shard = Path(expand_braces(pattern)[0])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    rep = scan(from_dict({"datasets": [{"shards": pattern}]}).data)
    assert 0 < len(rep.samples) < 8
    assert any("cut short" in why for _, why in rep.skipped)


def test_bad_sources_give_one_clear_line(tmp_path, records, make_config):
    from kit.config import from_dict

    path = write_parquet(records, tmp_path / "toy.parquet")
    cfg = from_dict({"datasets": [{"hf_dataset": str(path), "caption_column": "caption"}]})
    with pytest.raises(DataError, match=r"no column 'caption' \(its columns: image, text\)"):
        check_dataset(cfg.data)
    # A folder of parquet files names its splits by their file names: `test` is not one.
    (tmp_path / "folder").mkdir()
    path.rename(tmp_path / "folder" / "train.parquet")
    cfg = from_dict({"datasets": [{"hf_dataset": str(tmp_path / "folder"), "split": "test"}]})
    with pytest.raises(DataError, match=r"(?i)split.*test"):
        check_dataset(cfg.data)
    pattern = write_shards(records, tmp_path / "shards", per_shard=8)
    missing = pattern.replace("000000}", "000001}")
    cfg = from_dict({"datasets": [{"shards": missing}]})
    with pytest.raises(DataError, match=r"shard .*train-000001.tar not found"):
        check_dataset(cfg.data)
    # A dataset whose every sample is broken names its first problem.
    broken = [(k, e, b"\x89PNG\r\n\x1a\n cut", c) for k, e, _, c in records[:2]]
    gone = write_shards(broken, tmp_path / "broken", per_shard=2)
    cfg = from_dict({"datasets": [{"shards": gone}]})
    with pytest.raises(DataError, match=r"no usable images in shards .*all 2 file\(s\) skipped"):
        check_dataset(cfg.data)
    (tmp_path / "junk.tar").write_bytes(b"not a tar file at all" * 40)
    cfg = from_dict({"datasets": [{"shards": str(tmp_path / "junk.tar")}]})
    with pytest.raises(DataError, match="junk.tar is not an uncompressed tar file"):
        check_dataset(cfg.data)
    from kit.data.masks import plan_masks

    masked = from_dict(
        {"datasets": [{"hf_dataset": str(tmp_path / "folder"), "masked_loss": True}]}
    )
    with pytest.raises(DataError, match="no alpha channel to take its mask from.*mask_column"):
        plan_masks(masked)
    with pytest.raises(ConfigError, match="drawn into a local image_dir"):
        from_dict(
            {
                "datasets": [
                    {"shards": pattern, "role": "prior", "generate": {"count": 2, "prompt": "x"}}
                ]
            }
        )
    # A parquet file named relative to the config is looked for beside it, even when missing.
    missing_file = write_config(tmp_path / "m.json", datasets=[{"hf_dataset": "no/such.parquet"}])
    with pytest.raises(DataError, match=f"Unable to find '{tmp_path}/no/such.parquet'"):
        check_dataset(load_config(missing_file).data)
    with pytest.raises(ConfigError, match="one source"):
        from_dict({"datasets": [{"shards": pattern, "hf_dataset": str(path)}]})
    # A scheme fsspec does not know, or whose package is missing: named with what to do.
    with pytest.raises(DataError, match="foo://x/pets: Protocol not known: foo; give a local"):
        check_dataset(from_dict({"datasets": [{"image_dir": "foo://x/pets"}]}).data)
    import fsspec

    def no_package(url):
        raise ImportError("Please install gcsfs to access Google Storage")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsspec.core, "url_to_fs", no_package)
        with pytest.raises(DataError, match=r"install gcsfs .*\(pip install it beside the kit"):
            check_dataset(from_dict({"datasets": [{"image_dir": "gs://b/pets"}]}).data)
    # Through the command line: one line, no traceback.
    bad = make_config("bad.json", image_dir="", datasets=[{"shards": missing}])
    assert main(["buckets", str(bad)]) != 0


def test_buckets_report_reads_shards(tmp_path, make_config, records, capsys):
    pattern = write_shards(records, tmp_path / "shards", per_shard=3)
    path = make_config("c.json", image_dir="", datasets=[{"shards": pattern, "repeats": 2}])
    assert main(["buckets", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 8 and report["samples_per_epoch"] == 16


# ------------------------------------------------------------------------- a real S3 server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def s3(monkeypatch):
    """An S3-compatible server (moto's server mode) on a free loopback port, with a bucket
    `kit-data`; credentials and endpoint in the environment only, as a user gives them."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import s3fs

    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    filesystem.cache_clear()
    fs = s3fs.S3FileSystem()
    fs.mkdir("kit-data")
    yield fs
    fs.rm("kit-data", recursive=True)  # moto's state outlives its server, within this process
    s3fs.S3FileSystem.clear_instance_cache()
    filesystem.cache_clear()
    server.stop()


@pytest.mark.slow
def test_s3_prefix_trains_and_resumes_exactly(tmp_path, make_config, records, s3):
    for key, ext, data, caption in records:
        s3.pipe(f"kit-data/toy/{key}.{ext}", data)
        s3.pipe(f"kit-data/toy/{key}.txt", caption.encode())
    manifest = _train_with_resume(make_config, tmp_path, {"image_dir": "s3://kit-data/toy"})
    assert len(manifest) == 8
    assert all(r["image"].startswith("s3://kit-data/toy/") for r in manifest)
    # The bucket report names each object by its URL, as written.
    from kit.config import load_config
    from kit.data.report import bucket_report

    cfg = load_config(make_config("b.json", image_dir="s3://kit-data/toy"))
    files = [f for b in bucket_report(cfg)["buckets"] for f in b["files"]]
    assert len(files) == 8 and all(f.startswith("s3://kit-data/toy/") for f in files), files


def test_s3_shards_and_a_changed_object_re_encodes_alone(tmp_path, records, s3):
    from kit.config import from_dict

    pattern = write_shards(records, tmp_path / "shards", per_shard=4)
    for shard in expand_braces(pattern):
        s3.put(shard, f"kit-data/shards/{Path(shard).name}")
    remote = from_dict(
        {"datasets": [{"shards": "s3://kit-data/shards/train-{000000..000001}.tar"}]}
    )
    local = from_dict({"datasets": [{"shards": pattern}]})
    a, b = scan(remote.data).samples, scan(local.data).samples
    assert [s.blob.digest for s in a] == [s.blob.digest for s in b]
    assert a[5].blob.read() == b[5].blob.read() == records[5][2]
    # A folder on S3 is keyed by the objects' ETags: a changed object changes its key alone.
    for key, ext, data, caption in records:
        s3.pipe(f"kit-data/toy/{key}.{ext}", data)
        s3.pipe(f"kit-data/toy/{key}.txt", caption.encode())
    folder = from_dict({"datasets": [{"image_dir": "s3://kit-data/toy"}]})
    before = [s.blob.digest for s in scan(folder.data).samples]
    key, ext, _, _ = records[2]
    s3.pipe(f"kit-data/toy/{key}.{ext}", records[3][2])
    s3.invalidate_cache()
    filesystem.cache_clear()
    after = [s.blob.digest for s in scan(folder.data).samples]
    assert [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y] == [2]


def test_tar_member_layout_matches_webdataset(tmp_path, records):
    """Shards written here are what WebDataset reads: per key an image and a .txt, in order."""
    pattern = write_shards(records[:2], tmp_path / "shards", per_shard=2)
    with tarfile.open(expand_braces(pattern)[0]) as tar:
        names = tar.getnames()
    assert names == [
        f"{records[0][0]}.png",
        f"{records[0][0]}.txt",
        f"{records[1][0]}.png",
        f"{records[1][0]}.txt",
    ]


def test_a_shard_scan_is_saved_and_shared(tmp_path, records, monkeypatch):
    """A shard is read once: the next scan (another run, another process) reads its saved scan;
    a process of a launch starts at its own shards; a changed shard is read again."""
    from kit.config import from_dict
    from kit.data.sources import index, tar

    pattern = write_shards(records, tmp_path / "shards", per_shard=2)
    cfg = from_dict({"datasets": [{"shards": pattern}]})
    first = scan(cfg.data).samples
    read = []
    monkeypatch.setattr(tar, "_open", lambda shard: read.append(shard) or open(shard, "rb"))
    again = scan(cfg.data).samples
    assert read == [] and [(s.image, s.blob) for s in again] == [(s.image, s.blob) for s in first]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert index.rotated(expand_braces(pattern)) == [
        *expand_braces(pattern)[2:],
        *expand_braces(pattern)[:2],
    ]
    shard = Path(expand_braces(pattern)[1])
    write_shards(records[2:4][::-1], tmp_path / "other", per_shard=2)
    (tmp_path / "other" / "train-000000.tar").replace(shard)
    third = scan(cfg.data).samples
    assert read == [str(shard)]
    assert [s.caption for s in third[2:4]] == [records[3][3], records[2][3]]


def test_auto_cache_format_shards_large_datasets_only(tmp_path):
    from kit.data.store import AUTO_SHARDS, auto_format

    entry = tmp_path / "entry.safetensors"
    assert auto_format("auto", 8, entry) == "files"
    assert auto_format("auto", AUTO_SHARDS, entry) == "shards"
    entry.write_bytes(b"x")  # a cache written as files before stays in use
    assert auto_format("auto", AUTO_SHARDS, entry) == "files"
    assert auto_format("files", 10**6, None) == "files"


def test_notebook_shows_images_of_shards(tmp_path, records):
    """Notebook 02 shows a bucket's images: a shard's sample is read from its shard."""
    import base64

    from kit.config import from_dict
    from kit.ui.widgets import show_images

    pattern = write_shards(records, tmp_path / "shards", per_shard=4)
    samples = scan(from_dict({"datasets": [{"shards": pattern}]}).data).samples
    html = show_images(samples[:2]).data
    assert base64.b64encode(records[1][2]).decode() in html and records[1][0] in html


def test_tar_reader_agrees_with_tarfile():
    """The shard reader gives each file's name, data offset and bytes as tarfile does, long
    names (pax, GNU) and non-ASCII ones included; folders are passed over."""
    import io

    from kit.data.sources.tar import members

    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT):
        buf = io.BytesIO()
        files = [("a/" + "x" * 90 + ".jpg", b"1" * 700), ("b.txt", b"hi"), ("ü/é.png", b"2" * 512)]
        if fmt != tarfile.USTAR_FORMAT:
            files.append(("c/" + "y" * 150 + ".png", b"3" * 5000))
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            folder = tarfile.TarInfo("dir")
            folder.type = tarfile.DIRTYPE
            t.addfile(folder)
        raw = buf.getvalue()
        with tarfile.open(fileobj=io.BytesIO(raw)) as t:
            ref = [
                (m.name, m.offset_data, raw[m.offset_data : m.offset_data + m.size])
                for m in t
                if m.isfile()
            ]
        assert list(members(io.BytesIO(raw))) == ref
        assert [r[0] for r in ref] == [name for name, _ in files]


@pytest.mark.slow
def test_two_processes_on_shards_match_one(tmp_path, records, two_processes_and_one):
    """Two processes reading the same shards (each scanning from its own shard, each encoding
    its share of the cache) train as one process with twice the accumulation."""
    pattern = write_shards(records, tmp_path / "shards", per_shard=2)
    ddp, one = two_processes_and_one(
        image_dir="", datasets=[{"shards": pattern}], max_train_steps=2, checkpointing_steps=0
    )
    a = load_file(str(ckpt.checkpoint_dir(ddp, 2) / ckpt.ADAPTER_FILE))
    b = load_file(str(ckpt.checkpoint_dir(one, 2) / ckpt.ADAPTER_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    # Four shards, one saved scan each, whichever process wrote it (the key is the shard's).
    assert len(list((tmp_path / "cache" / "scans").glob("*.json"))) == 4


def test_mask_column_gives_each_row_its_mask(tmp_path, records):
    """`mask_column`: each row's mask is read from the dataset (lazily, keyed by its digest); a
    mask of another size than its image is refused with the key to fix."""
    import io

    import numpy as np
    from PIL import Image

    from kit.config import from_dict
    from kit.data.masks import plan_masks, read_mask

    def mask_png(size):
        im = Image.new("L", size, 0)
        im.paste(255, (0, 0, size[0] // 2, size[1]))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        return buf.getvalue()

    sizes = [Image.open(io.BytesIO(data)).size for _, _, data, _ in records]
    masks = [mask_png(size) for size in sizes]
    masks[5] = mask_png((sizes[5][0] + 8, sizes[5][1]))  # the wrong size
    features = datasets.Features(
        {"image": datasets.Image(), "text": datasets.Value("string"), "mask": datasets.Image()}
    )
    ds = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": r[2], "path": None} for r in records],
            "text": [r[3] for r in records],
            "mask": [{"bytes": m, "path": None} for m in masks],
        },
        features=features,
    )
    ds.to_parquet(str(tmp_path / "masked.parquet"))
    entry = {"hf_dataset": str(tmp_path / "masked.parquet"), "mask_column": "mask"}
    cfg = from_dict({"datasets": [entry], "masked_loss": True})
    plan = plan_masks(cfg)
    assert len(plan.scanned.samples) == 7
    ((image, why),) = plan.refused
    assert "mask masked.parquet[5].mask is" in why and "(mask_column)" in why
    source = plan.for_samples(plan.scanned.samples[:1])[0]
    got = read_mask(source)
    assert got.shape == sizes[0][::-1] and abs(float(np.mean(got)) - 0.5) < 0.05
    assert source.digest == plan.scanned.samples[0].mask.digest


def test_an_s3_folder_scan_is_saved(tmp_path, records, s3, monkeypatch):
    """A second scan of an unchanged S3 folder reads no object: its saved scan is keyed by the
    objects' ETags."""
    from kit.config import from_dict
    from kit.data.sources import remote

    for key, ext, data, caption in records:
        s3.pipe(f"kit-data/toy/{key}.{ext}", data)
        s3.pipe(f"kit-data/toy/{key}.txt", caption.encode())
    folder = from_dict({"datasets": [{"image_dir": "s3://kit-data/toy"}]})
    first = scan(folder.data).samples
    monkeypatch.setattr(remote, "_scan_batch", lambda *a: pytest.fail("read objects again"))
    again = scan(folder.data).samples
    assert [(s.image, s.caption, s.blob) for s in again] == [
        (s.image, s.caption, s.blob) for s in first
    ]


def test_the_planner_proposes_shards_for_a_large_files_cache(tmp_path, monkeypatch):
    """`kit plan` on a dataset of `AUTO_SHARDS` images or more with `cache_format: files`
    proposes shards (with `auto`, the default, nothing needs proposing)."""
    from kit.config import from_dict
    from kit.preflight import plan as planner

    records = [(f"{i:05d}", "png", None, "a zorbic square") for i in range(planner.AUTO_SHARDS)]
    image = folder_records(Path(__file__).resolve().parent.parent / "datasets_example" / "images")
    data = image[0][2]
    pattern = write_shards([(k, e, data, c) for k, e, _, c in records], tmp_path / "s", 1000)
    base = {"output_dir": str(tmp_path / "run"), "datasets": [{"shards": pattern}]}
    rows = {
        fmt: planner.plan("", "concept", base=from_dict({**base, "cache_format": fmt})).rows(
            from_dict({**base, "cache_format": fmt})
        )
        for fmt in ("files", "auto")
    }
    shards = [r for r in rows["files"] if r["setting"] == "cache_format"]
    assert shards and shards[0]["planned"] == "shards" and "files" in shards[0]["reason"]
    assert not [r for r in rows["auto"] if r["setting"] == "cache_format"]


def test_an_s3_header_read_that_gets_no_answer_is_asked_again_not_dropped(
    tmp_path, records, s3, monkeypatch
):
    """A batch's request that timed out is tried again alone: the image is kept, not taken
    for an unreadable file."""
    import s3fs

    from kit.config import from_dict

    for key, ext, data, caption in records[:3]:
        s3.pipe(f"kit-data/slow/{key}.{ext}", data)
        s3.pipe(f"kit-data/slow/{key}.txt", caption.encode())
    real = s3fs.S3FileSystem._cat_ranges
    calls = []

    async def first_times_out(self, paths, *args, **kwargs):
        got = await real(self, paths, *args, **kwargs)
        calls.append(len(paths))
        return [TimeoutError("no answer") if i == 0 else g for i, g in enumerate(got)]

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_ranges", first_times_out)
    rep = scan(from_dict({"datasets": [{"image_dir": "s3://kit-data/slow"}]}).data)
    assert calls and len(rep.samples) == 3 and not rep.unreadable, (calls, rep.unreadable)
