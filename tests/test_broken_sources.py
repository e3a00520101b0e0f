"""Broken data, source by source and pair by pair: each kind of dataset the kit reads (a folder, a
parquet file, a saved Hugging Face dataset, a stream, tar shards, an fsspec URL) and each kind of
pair (control_dir, control_column) fed inputs that cannot be used. Every one ends in one line of
`kit: error:` naming the culprit (its file, row, key or URL), never `unexpected`."""

from __future__ import annotations

import io
import socket
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kit.cli import main
from kit.data.blob import filesystem
from kit.data.sources.write import write_parquet, write_shards
from tests.conftest import write_config

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """`datasets`' cache and the saved scans in the test's own folder; no stream left open."""
    from kit.data import streamed
    from kit.data.blob import open_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.disable_progress_bars()
    streamed.open_stream.cache_clear()
    open_dataset.cache_clear()
    yield
    streamed.close_all()
    open_dataset.cache_clear()


def _png(size: tuple[int, int], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _records(n: int = 2) -> list[tuple[str, str, bytes, str]]:
    return [(f"s{i}", "png", _png((64, 64), i), f"a zorbic square {i}") for i in range(n)]


def _table(path: Path, columns: dict, features: dict | None = None) -> Path:
    """A parquet file of these columns, as `datasets` writes one."""
    spec = datasets.Features(features) if features else None
    datasets.Dataset.from_dict(columns, features=spec).to_parquet(str(path))
    return path


def _closed_port() -> int:
    """A loopback port nothing listens on: a connection there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refusing_s3(monkeypatch) -> None:
    """S3 credentials whose endpoint refuses every connection."""
    pytest.importorskip("s3fs")
    import s3fs

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
        "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries, each after a pause: not tested here
    }.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    filesystem.cache_clear()


# Each source case writes its broken dataset under `root` and returns (the dataset entry, what the
# one line must name).
Case = Callable[[Path, pytest.MonkeyPatch], tuple[dict, str]]


def folder_of_text(root: Path, mp) -> tuple[dict, str]:
    (root / "d").mkdir()
    (root / "d" / "cat.png").write_text("a red cat, not an image")
    (root / "d" / "cat.txt").write_text("a red cat")
    return {"image_dir": str(root / "d")}, "cat.png"


def folder_missing(root: Path, mp) -> tuple[dict, str]:
    return {"image_dir": str(root / "nowhere")}, "nowhere"


def parquet_image_column_of_text(root: Path, mp) -> tuple[dict, str]:
    path = _table(root / "t.parquet", {"image": ["a red cat", "a blue dog"], "text": ["x", "y"]})
    return {"hf_dataset": str(path)}, "t.parquet[0]"


def parquet_paths_missing(root: Path, mp) -> tuple[dict, str]:
    """An Image column's rows hold no bytes, only paths to files that are gone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"bytes": None, "path": str(root / "gone" / f"{i}.png")} for i in range(2)]
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array(rows, kind), "text": ["x", "y"]})
    pq.write_table(table, root / "p.parquet")
    return {"hf_dataset": str(root / "p.parquet")}, "gone/0.png"


def parquet_string_paths_missing(root: Path, mp) -> tuple[dict, str]:
    paths = [str(root / "gone" / "0.png"), str(root / "gone" / "1.png")]
    path = _table(root / "s.parquet", {"image": paths, "text": ["x", "y"]})
    return {"hf_dataset": str(path)}, "gone/0.png"


def parquet_empty(root: Path, mp) -> tuple[dict, str]:
    spec = {"image": datasets.Image(), "text": datasets.Value("string")}
    path = _table(root / "e.parquet", {"image": [], "text": []}, spec)
    return {"hf_dataset": str(path)}, "e.parquet"


def parquet_integers(root: Path, mp) -> tuple[dict, str]:
    path = _table(root / "i.parquet", {"image": [1, 2], "text": ["x", "y"]})
    return {"hf_dataset": str(path)}, "image"


def parquet_not_parquet(root: Path, mp) -> tuple[dict, str]:
    (root / "n.parquet").write_text("this is not a parquet file\n" * 20)
    return {"hf_dataset": str(root / "n.parquet")}, "n.parquet"


def saved_integers(root: Path, mp) -> tuple[dict, str]:
    datasets.Dataset.from_dict({"image": [1, 2], "text": ["x", "y"]}).save_to_disk(
        str(root / "saved")
    )
    return {"hf_dataset": str(root / "saved")}, "image"


def saved_text(root: Path, mp) -> tuple[dict, str]:
    datasets.Dataset.from_dict({"image": ["a cat", "a dog"], "text": ["x", "y"]}).save_to_disk(
        str(root / "saved")
    )
    return {"hf_dataset": str(root / "saved")}, "saved[0]"


def saved_arrow_lost(root: Path, mp) -> tuple[dict, str]:
    records = _records()
    path = write_parquet(records, root / "ok.parquet")
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    ds.save_to_disk(str(root / "saved"))
    for f in (root / "saved").glob("*.arrow"):
        f.unlink()
    return {"hf_dataset": str(root / "saved")}, "saved"


def stream_text(root: Path, mp) -> tuple[dict, str]:
    path = _table(root / "t.parquet", {"image": ["a red cat", "a blue dog"], "text": ["x", "y"]})
    return {"hf_dataset": str(path), "streaming": True}, "t.parquet[0]"


def stream_integers(root: Path, mp) -> tuple[dict, str]:
    path = _table(root / "i.parquet", {"image": [1, 2], "text": ["x", "y"]})
    return {"hf_dataset": str(path), "streaming": True}, "image"


def stream_empty(root: Path, mp) -> tuple[dict, str]:
    spec = {"image": datasets.Image(), "text": datasets.Value("string")}
    path = _table(root / "e.parquet", {"image": [], "text": []}, spec)
    return {"hf_dataset": str(path), "streaming": True}, "e.parquet"


def stream_paths_missing(root: Path, mp) -> tuple[dict, str]:
    paths = [str(root / "gone" / "0.png"), str(root / "gone" / "1.png")]
    path = _table(root / "s.parquet", {"image": paths, "text": ["x", "y"]})
    return {"hf_dataset": str(path), "streaming": True}, "gone/0.png"


def shards_of_text(root: Path, mp) -> tuple[dict, str]:
    records = [(k, e, b"a red cat, not an image", c) for k, e, _, c in _records()]
    return {"shards": write_shards(records, root / "shards", 8)}, "s0.png"


def shard_empty_file(root: Path, mp) -> tuple[dict, str]:
    (root / "empty.tar").write_bytes(b"")
    return {"shards": str(root / "empty.tar")}, "empty.tar"


def shard_a_folder(root: Path, mp) -> tuple[dict, str]:
    (root / "dir.tar").mkdir()
    return {"shards": str(root / "dir.tar")}, "dir.tar"


def shard_of_folders_only(root: Path, mp) -> tuple[dict, str]:
    with tarfile.open(root / "dirs.tar", "w") as tar:
        info = tarfile.TarInfo("folder")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    return {"shards": str(root / "dirs.tar")}, "dirs.tar"


def url_refused(root: Path, mp) -> tuple[dict, str]:
    _refusing_s3(mp)
    return {"image_dir": "s3://kit-data/toy"}, "s3://kit-data/toy"


def url_shards_refused(root: Path, mp) -> tuple[dict, str]:
    _refusing_s3(mp)
    return {"shards": "s3://kit-data/train-{000000..000001}.tar"}, "s3://kit-data/train-000000"


def http_dataset_refused(root: Path, mp) -> tuple[dict, str]:
    url = f"http://127.0.0.1:{_closed_port()}/data/train.parquet"
    mp.delenv("HF_HUB_OFFLINE")
    return {"hf_dataset": url}, url


def http_stream_refused(root: Path, mp) -> tuple[dict, str]:
    url = f"http://127.0.0.1:{_closed_port()}/data/train.parquet"
    mp.delenv("HF_HUB_OFFLINE")
    return {"hf_dataset": url, "streaming": True}, url


SOURCES = [
    folder_of_text,
    folder_missing,
    parquet_image_column_of_text,
    parquet_paths_missing,
    parquet_string_paths_missing,
    parquet_empty,
    parquet_integers,
    parquet_not_parquet,
    saved_integers,
    saved_text,
    saved_arrow_lost,
    stream_text,
    stream_integers,
    stream_empty,
    stream_paths_missing,
    shards_of_text,
    shard_empty_file,
    shard_a_folder,
    shard_of_folders_only,
    url_refused,
    url_shards_refused,
    http_dataset_refused,
    http_stream_refused,
]


def _one_line(capsys, config: Path, culprit: str) -> str:
    """`kit buckets` on the config fails with one `kit: error:` line that names the culprit."""
    capsys.readouterr()  # what writing the broken data printed
    assert main(["buckets", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kit: error: ") and "\n" not in err, err
    assert "unexpected" not in err and "Traceback" not in err, err
    assert culprit in err, err
    return err


@pytest.mark.parametrize("case", SOURCES, ids=lambda c: c.__name__)
def test_a_broken_source_is_one_line_naming_it(case, tmp_path, monkeypatch, capsys):
    entry, culprit = case(tmp_path, monkeypatch)
    config = write_config(
        tmp_path / "c.json",
        model_family="sd15",
        resolution=64,
        image_dir="",
        cache_dir=str(tmp_path / "cache"),
        datasets=[entry],
    )
    err = _one_line(capsys, config, culprit)
    if "image_dir" not in entry:  # image file extensions mean nothing to a table or shards
        assert "extensions" not in err, err


# ------------------------------------------------------------------------------ pairs


def _pairs(root: Path, controls: list[bytes]) -> tuple[list, dict, Path]:
    """Targets (64 × 64) and these controls, as records, per-key controls and a control folder."""
    records = _records(len(controls))
    folder = root / "data"
    folder.mkdir()
    (root / "controls").mkdir()
    for (key, ext, data, caption), control in zip(records, controls, strict=True):
        (folder / f"{key}.{ext}").write_bytes(data)
        (folder / f"{key}.txt").write_text(caption)
        (root / "controls" / f"{key}.png").write_bytes(control)
    paired = {key: [("png", c)] for (key, *_), c in zip(records, controls, strict=True)}
    return records, paired, folder


def _control_dir(root: Path, controls: list[bytes]) -> tuple[dict, str]:
    _, _, folder = _pairs(root, controls)
    return {"image_dir": str(folder), "control_dir": str(root / "controls")}, "controls/s0.png"


def _control_parquet(root: Path, controls: list[bytes]) -> tuple[dict, str]:
    records, paired, _ = _pairs(root, controls)
    path = write_parquet(records, root / "p.parquet", paired)
    entry = {"hf_dataset": str(path), "control_column": "control"}
    return {"image_dir": "", "datasets": [entry]}, "p.parquet[0]"


def _control_shards(root: Path, controls: list[bytes]) -> tuple[dict, str]:
    records, paired, _ = _pairs(root, controls)
    entry = {
        "shards": write_shards(records, root / "shards", 8, paired),
        "control_column": "control",
    }
    return {"image_dir": "", "datasets": [entry]}, "s0.control.png"


PAIR_KINDS = [_control_dir, _control_parquet, _control_shards]
BROKEN_CONTROLS = {
    "a_few_pixels_tall": lambda: [_png((64, 3), 7), _png((64, 3), 8)],
    "text": lambda: [b"make it red", b"make it blue"],
}


@pytest.mark.parametrize("kind", PAIR_KINDS, ids=lambda k: k.__name__.strip("_"))
@pytest.mark.parametrize("broken", sorted(BROKEN_CONTROLS))
@pytest.mark.parametrize("family", ["flux_kontext", "flux2"])
def test_a_broken_control_is_one_line_naming_it(kind, broken, family, tmp_path, capsys):
    body, culprit = kind(tmp_path, BROKEN_CONTROLS[broken]())
    config = write_config(
        tmp_path / "c.json",
        model_family=family,
        resolution=64,
        cache_dir=str(tmp_path / "cache"),
        **body,
    )
    _one_line(capsys, config, culprit)


def test_a_control_column_of_captions_is_one_line_naming_it(tmp_path, capsys):
    records = _records()
    columns = {
        "image": [{"bytes": r[2], "path": None} for r in records],
        "text": [r[3] for r in records],
        "control": ["make it red", "make it blue"],
    }
    path = _table(tmp_path / "c.parquet", columns)
    config = write_config(
        tmp_path / "c.json",
        model_family="flux_kontext",
        resolution=64,
        image_dir="",
        cache_dir=str(tmp_path / "cache"),
        datasets=[{"hf_dataset": str(path), "control_column": "control"}],
    )
    err = _one_line(capsys, config, "control")
    assert "c.parquet" in err


def test_a_control_too_small_is_refused_at_batch_size_one_too(tmp_path):
    """Training one pair at a time checks no bucket's sizes, but still each control's: the
    pipeline's resize of a control a few pixels tall leaves nothing (a division by zero)."""
    import torch

    from kit.config import from_dict
    from kit.data.cache import plan_cache
    from kit.errors import DataError
    from kit.families import get_family

    body, culprit = _control_dir(tmp_path, BROKEN_CONTROLS["a_few_pixels_tall"]())
    cfg = from_dict(
        {"model_family": "flux_kontext", "resolution": 64, "train_batch_size": 1, **body}
        | {"cache_dir": str(tmp_path / "cache")}
    )
    family = get_family("flux_kontext", cfg)
    with pytest.raises(DataError, match=f"control image .*{culprit} is 64x3 px: too small"):
        plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32, family=family)


def test_a_remote_read_refused_while_caching_names_the_url(monkeypatch):
    """An object listed by the scan but refused when the cache reads it: an OSError naming its
    URL, which the cache reports as an unreadable image and skips, as a lost read."""
    from types import SimpleNamespace

    from kit.config import from_dict
    from kit.data.blob import Blob
    from kit.data.images import BadImage
    from kit.data.pixels import sample_pixels
    from kit.data.samples import Sample

    _refusing_s3(monkeypatch)
    url = "s3://kit-data/toy/a.png"
    blob = Blob(url, "etag", url, 0, 100)
    with pytest.raises(OSError, match="s3://kit-data/toy/a.png"):
        blob.read()
    sample = Sample(Path(url), "a cat", 64, 64, blob=blob)
    with pytest.raises(BadImage, match=f"unreadable image {url}"):
        sample_pixels(sample, SimpleNamespace(frames=0), from_dict({}).data)


def test_a_control_its_pipeline_refuses_is_named_when_cached(tmp_path):
    """FLUX.2's pipelines refuse a reference under 64 px a side: the cache's refusal names it."""
    from kit.data.pairs import control_pixels
    from kit.errors import DataError
    from kit.families import get_family

    control = tmp_path / "controls" / "s0.png"
    with pytest.raises(DataError, match=f"control image {control}: reference image refused"):
        control_pixels(get_family("flux2"), Image.new("RGB", (48, 48)), control)
