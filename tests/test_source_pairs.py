"""Edit pairs, clips and captioning from dataset sources (a parquet dataset, tar shards): the same
pairs as a folder's give the same cache entries and train a tiny Kontext; a missing or broken
control is named and skipped; what the kit cannot do with a source is refused in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict
from kit.data.sources.write import folder_records, write_parquet, write_shards
from kit.errors import ConfigError, DataError, KitError
from tests.conftest import lazy_module
from tests.test_sources import s3  # noqa: F401 (the S3 server fixture)

datasets = lazy_module("datasets")


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """`datasets` prepares parquet into its cache: the test's own folder, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # saved shard scans


def _png(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture()
def pairs(tmp_path):
    """Three targets (64 × 64) with a 48 × 32 control each, as a folder pair and as records."""
    data, controls = tmp_path / "data", tmp_path / "controls"
    data.mkdir()
    controls.mkdir()
    for i, stem in enumerate("abc"):
        (data / f"{stem}.png").write_bytes(_png(i, (64, 64)))
        (data / f"{stem}.txt").write_text(f"make {stem} red")
        (controls / f"{stem}.png").write_bytes(_png(10 + i, (48, 32)))
    records = folder_records(data)
    paired = {key: [("png", (controls / f"{key}.png").read_bytes())] for key, *_ in records}
    return tmp_path, records, paired


def _entry(source: str, where: str, **extra) -> dict:
    return {"datasets": [{source: where, "control_column": "control", **extra}]}


def _cfg(body: dict, family: str = "flux_kontext", **extra):
    return from_dict({"model_family": family, "resolution": 64, **body, **extra})


def test_pairs_from_parquet_and_shards_key_the_cache_as_the_folders(pairs):
    """The same pairs as a folder, a parquet dataset and tar shards: equal target and control
    cache keys (entries keyed by content), and a source's control reads the same pixels."""
    from kit.data.cache import plan_cache
    from kit.data.pairs import control_image, controls_of
    from kit.families import get_family

    root, records, paired = pairs
    folder = {"image_dir": str(root / "data"), "control_dir": str(root / "controls")}
    parquet = _entry("hf_dataset", str(write_parquet(records, root / "p.parquet", paired)))
    shards = _entry("shards", write_shards(records, root / "shards", 2, paired))
    planned = []
    for body in (folder, parquet, shards):
        cfg = _cfg(body, cache_dir=str(root / "cache"))
        family = get_family("flux_kontext", cfg)
        data = plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32, family=family)
        planned.append(data)
        assert len(data.samples) == 3
    keys = [({*d.latent_files}, {f for fs in d.control_files for f in fs}) for d in planned]
    assert keys[0] == keys[1] == keys[2] and len(keys[0][1]) == 3
    place = planned[0].plan.placements[0]
    images = [np.asarray(control_image(controls_of(d.samples[0])[0], place)) for d in planned]
    assert all(np.array_equal(images[0], x) for x in images[1:])
    # The sources' controls are named by their column or member, read lazily from their bytes.
    assert [str(c) for c in planned[1].samples[0].controls] == ["p.parquet[0].control"]
    assert planned[2].samples[0].controls[0].as_posix().endswith("train-000000.tar/a.control.png")


def test_a_missing_or_broken_control_is_named_and_skipped(pairs):
    from kit.data.pairs import unpaired
    from kit.data.scan import scan
    from kit.families import family_info

    root, records, paired = pairs
    paired["b"] = [("png", b"\x89PNG\r\n\x1a\n broken")]
    del paired["c"]
    kontext = family_info("flux_kontext")
    parquet = _cfg(_entry("hf_dataset", str(write_parquet(records, root / "p.parquet", paired))))
    shards = _cfg(_entry("shards", write_shards(records, root / "shards", 8, paired)))
    for cfg in (parquet, shards):
        for _ in range(2):  # the second scan reads the saved one: the same pairs and reasons
            rep = scan(cfg.data, kontext)
            assert [s.caption for s in rep.samples] == ["make a red"]
            assert rep.samples[0].control_blobs[0].read() == paired["a"][0][1]
            left = sorted((Path(f).name, why) for f, why in unpaired(rep))
            assert [n for n, _ in left] in (["p.parquet[1]", "p.parquet[2]"], ["b.png", "c.png"])
            assert left[0][1].startswith("unreadable control image") and "control" in left[0][1]
            assert left[1][1].startswith("no control image")
    shard_left = dict(unpaired(scan(shards.data, kontext)))
    assert any("key c" in why and "c.control.*" in why for why in shard_left.values())
    assert "train-000000.tar/b.control.png" in next(iter(shard_left.values()))
    parquet_left = [why for _, why in unpaired(scan(parquet.data, kontext))]
    assert "no control image in column 'control' of row 2" in parquet_left


def test_several_controls_per_target_keep_their_order(pairs):
    """FLUX.2's references from shards and a parquet dataset: `control`, then `control_1`."""
    from kit.data.scan import scan
    from kit.families import family_info

    root, records, paired = pairs
    two = {k: [*v, ("png", _png(20 + i, (32, 48)))] for i, (k, v) in enumerate(paired.items())}
    names = ["control", "control_1"]
    for source, where in (
        ("shards", write_shards(records, root / "shards", 8, two)),
        ("hf_dataset", str(write_parquet(records, root / "p.parquet", two))),
    ):
        cfg = _cfg({"datasets": [{source: where, "control_column": names}]}, "flux2")
        (first, *_) = scan(cfg.data, family_info("flux2")).samples
        assert [b.read() for b in first.control_blobs] == [b for _, b in two["a"]]
        assert [c.name for c in first.controls] in (
            ["a.control.png", "a.control_1.png"],
            ["p.parquet[0].control", "p.parquet[0].control_1"],
        )


def test_pair_views_show_source_pairs(pairs):
    """Notebook 01's pair sheet and notebook 02's / `kit buckets`' pair rows read a source's
    pairs from their bytes."""
    from kit.data.report import bucket_report, pair_rows
    from kit.ui.pairs import dataset_pairs, pair_sheet

    root, records, paired = pairs
    cfg = _cfg(_entry("shards", write_shards(records, root / "shards", 8, paired)))
    samples, left = dataset_pairs(cfg)
    assert len(samples) == 3 and left == []
    sheet = pair_sheet(samples, n=2, height=32)
    assert sheet.size == (48 + 24 + 32, 2 * (14 + 32 + 4))
    rows = pair_rows(bucket_report(cfg))
    assert [(r["target"], r["controls"]) for r in rows] == [
        (f"{k}.png", f"{k}.control.png") for k in "abc"
    ]


def test_a_kontext_run_trains_from_parquet_pairs(pairs, tiny_base, monkeypatch):
    """A short Kontext run on parquet pairs: its grid shows control → result from the pair's
    control (written into the run folder), and a folder of the same pairs then finds every
    latent of its cache already there."""
    from kit.config import load_config
    from kit.data.cache import plan_cache
    from kit.families import get_family
    from kit.families.flux_kontext.family import FluxKontext
    from kit.run.folder import open_run
    from kit.train.loop import train
    from tests.conftest import write_run_config

    monkeypatch.setattr(FluxKontext, "auto_resize", False)  # controls at their own size: small
    root, records, paired = pairs
    path = write_run_config(
        root / "run.json",
        base=tiny_base("flux_kontext"),
        data=root / "data",
        family="flux_kontext",
        image_dir="",
        control_dir=[],
        datasets=[{"hf_dataset": str(write_parquet(records, root / "p.parquet", paired))}],
        cache_dir=str(root / "cache"),
        validation_prompt=[],
        max_train_steps=2,
        checkpointing_steps=2,
        validation_num_inference_steps=1,
    )
    raw = json.loads(path.read_text())
    raw["datasets"][0]["control_column"] = "control"
    path.write_text(json.dumps(raw))
    cfg = load_config(path)
    assert train(cfg).step == 2
    run = open_run(cfg.train.output_dir)
    assert Image.open(run.validation_step(2) / "grid.png").width == 2 * 64  # control, result
    drawn = [json.loads(p.read_text()) for p in sorted(run.validation_step(2).glob("*.json"))]
    assert {d["prompt"] for d in drawn} == {"make a red", "make b red"}  # its first two pairs
    for d in drawn:
        (control,) = d["control"]
        assert Path(control).parent == run.validation_controls
        assert Path(control).read_bytes() == paired[d["prompt"].split()[1]][0][1]
    folder = cfg.replace(
        datasets=[], image_dir=str(root / "data"), control_dir=[str(root / "controls")]
    )
    family = get_family("flux_kontext", folder)
    identity = family.identity(cfg.model.pretrained_model, cfg.model.revision)
    data = plan_cache(folder, identity, torch.float32, family=family)
    wanted = [*data.latent_files, *(f for fs in data.control_files for f in fs)]
    assert len(wanted) == 6 and all(data.store.has(f) for f in wanted)


def test_what_a_source_cannot_do_is_refused_in_one_line(pairs, tmp_path, capsys):
    from kit.cli import main
    from kit.data.captioners import find_targets
    from kit.data.datasets import views
    from kit.data.scan import check_dataset
    from kit.families import family_info

    root, records, paired = pairs
    parquet = str(write_parquet(records, root / "p.parquet", paired))
    with pytest.raises(ConfigError, match="control_column: names an hf_dataset's column"):
        _cfg({"datasets": [{"image_dir": str(root / "data"), "control_column": "control"}]})
    with pytest.raises(ConfigError, match="control_dir: pairs the images of a local image_dir"):
        _cfg({"datasets": [{"hf_dataset": parquet, "control_dir": str(root / "controls")}]})
    with pytest.raises(ConfigError, match=r"set control_column .* KEY\.control\.png"):
        check_dataset(
            _cfg({"datasets": [{"hf_dataset": parquet}]}).data, family_info("flux_kontext")
        )
    with pytest.raises(ConfigError, match="control_column is set, but flux takes no control"):
        check_dataset(_cfg(_entry("hf_dataset", parquet)).data, family_info("flux"))
    with pytest.raises(DataError, match="has no column 'edit'"):
        check_dataset(
            _cfg(_entry("hf_dataset", parquet, control_column="edit")).data,
            family_info("flux_kontext"),
        )
    with pytest.raises(ConfigError, match="control_dir: pairs the images of a local image_dir"):
        views(_cfg({"image_dir": "s3://bucket/data", "control_dir": str(root / "controls")}).data)
    # Captioners write files beside images: a dataset's rows have none.
    with pytest.raises(
        KitError, match=r"datasets\[0\] \(p.parquet\): hf_dataset .* caption column \(text\)"
    ):
        find_targets(_cfg(_entry("hf_dataset", parquet)))
    shards = write_shards(records, root / "shards", 8)
    with pytest.raises(KitError, match=r"shards .* \.txt member"):
        find_targets(from_dict({"datasets": [{"shards": shards}]}))
    # `kit caption` says so in one line, and writes nothing.
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"datasets": [{"shards": shards}]}))
    capsys.readouterr()
    assert main(["caption", str(config), "--captioner", "wd14"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "captioners write a caption file" in err
    assert sorted(p.name for p in (root / "shards").iterdir()) == ["train-000000.tar"]


@pytest.mark.slow
def test_clips_in_shards_train_a_video_family_as_a_folders_do(tmp_path, tiny_base):
    """mp4 members of shards: the same clips, windows and cache keys as the same files in a
    folder, the same pixels, a clip too short named with its key; a short Wan run trains on
    them; an image family names and skips them."""
    from kit.config import load_config
    from kit.data.cache import plan_cache
    from kit.data.masks import plan_masks
    from kit.data.pixels import sample_pixels
    from kit.data.scan import check_dataset, scan
    from kit.families import family_info, get_family
    from kit.train.loop import train
    from tests.conftest import write_run_config
    from tests.test_frame_sampling import write_mp4

    folder = tmp_path / "clips"
    paths = [write_mp4(folder / f"c{i}.mp4", n) for i, n in enumerate((9, 7, 3))]
    records = [(p.stem, "mp4", p.read_bytes(), p.with_suffix(".txt").read_text()) for p in paths]
    records.append(("bad", "mp4", b"\0\0\0\x18ftypmp42 cut", "a broken clip"))
    shards = write_shards(records, tmp_path / "shards", 2)
    body = {"model_family": "wan", "resolution": 64, "bucket_step": 32, "num_frames": 5}
    folder_cfg = from_dict({**body, "image_dir": str(folder)})
    shard_cfg = from_dict({**body, "datasets": [{"shards": shards}]})
    wan = get_family("wan", shard_cfg)
    planned = [
        plan_cache(c, {"vae": "v", "text": "t"}, torch.float32, family=wan)
        for c in (folder_cfg, shard_cfg)
    ]
    assert [(s.frames, s.total_frames, s.clip) for s in planned[1].samples] == [
        (5, 9, True),
        (5, 7, True),
    ]
    assert set(planned[0].latent_files) == set(planned[1].latent_files)
    place = planned[0].plan.placements[0]
    pixels = [
        sample_pixels(d.samples[0], place, d_cfg.data)
        for d, d_cfg in zip(planned, (folder_cfg, shard_cfg), strict=True)
    ]
    assert pixels[0].shape == (3, 5, 64, 64) and torch.equal(pixels[0], pixels[1])
    for _ in range(2):  # and again from the saved scan
        rep = scan(shard_cfg.data, wan)
        ((name, why),) = rep.short_clips
        assert name.as_posix().endswith("train-000001.tar/c2.mp4") and "key c2" in why
        ((name, why),) = rep.unreadable  # named by its member, not by its temporary copy
        assert name.name == "bad.mp4" and "key bad" in why and "\n" not in why
        assert why.startswith(f"unreadable clip {name}: ")

    masked = from_dict({**body, "masked_loss": True, "datasets": [{"shards": shards}]})
    with pytest.raises(DataError, match="c0.mp4: a clip from shards has no mask to train with"):
        plan_masks(masked, wan)

    path = write_run_config(
        tmp_path / "run.json",
        base=tiny_base("wan"),
        data=folder,
        family="wan",
        image_dir="",
        datasets=[{"shards": shards}],
        num_frames=5,
        max_train_steps=2,
        validation_prompt=[],
    )
    assert train(load_config(path)).step == 2

    flux = from_dict({"model_family": "flux", "datasets": [{"shards": shards}]})
    with pytest.raises(DataError, match=r"c0\.mp4: a video member .* video family only"):
        check_dataset(flux.data, family_info("flux"))


def test_a_video_column_is_refused_by_name(tmp_path, pairs):
    from kit.data.scan import check_dataset
    from kit.families import family_info

    records = pairs[1]
    # A Video column: refused by name (its rows would otherwise each fail as an image).
    features = datasets.Features({"image": datasets.Video(), "text": datasets.Value("string")})
    clips = {"image": [{"bytes": records[0][2], "path": "clip.mp4"}], "text": ["a clip"]}
    datasets.Dataset.from_dict(clips, features=features).to_parquet(str(tmp_path / "v.parquet"))
    cfg = from_dict(
        {"model_family": "wan", "datasets": [{"hf_dataset": str(tmp_path / "v.parquet")}]}
    )
    with pytest.raises(DataError, match=r"image_column 'image' holds videos; clips train from a"):
        check_dataset(cfg.data, family_info("wan"))


def test_families_count_a_sources_controls_as_control_folders():
    """What a family checks of its controls (how many; none for image-to-video) counts a
    source's control columns as it counts control folders."""
    from kit.families import get_family

    def entry(shards, n):
        return {"shards": shards, "control_column": ["control", "control_1"][:n]}

    one_two = {"datasets": [entry("a-{0..1}.tar", 1), entry("b-{0..1}.tar", 2)]}
    with pytest.raises(ConfigError, match="takes one control image per target, 2 are given"):
        get_family("qwen_image_edit", _cfg(one_two, "qwen_image_edit"))  # the Edit base
    with pytest.raises(ConfigError, match=r"give 1 or 2 reference image\(s\) per target"):
        get_family("flux2", _cfg(one_two, "flux2", train_batch_size=2, bucket_step=64))
    from kit.families.wan.i2v import ImageToVideo, check_run

    i2v = ImageToVideo(first_frame=False, image_encoder=False, frame=0)
    with pytest.raises(ConfigError, match="remove control_dir \\(or a dataset's control_column\\)"):
        check_run(i2v, _cfg({"datasets": [entry("a-{0..1}.tar", 1)]}, "wan"), 5)


def test_a_clip_in_a_bucket_is_named_not_ignored(s3):  # noqa: F811 (the fixture, imported)
    from kit.data.scan import scan
    from kit.families import family_info

    for name, data in (("a.png", _png(0, (64, 64))), ("c.mp4", b"clip"), ("c.txt", b"x")):
        s3.pipe(f"kit-data/v/{name}", data)
    s3.pipe("kit-data/v/a.txt", b"a still")
    cfg = from_dict({"model_family": "wan", "image_dir": "s3://kit-data/v"})
    rep = scan(cfg.data, family_info("wan"))
    assert [s.caption for s in rep.samples] == ["a still"]
    ((name, why),) = rep.skipped
    assert name.as_posix().endswith("kit-data/v/c.mp4") and why.startswith("a clip in a bucket")
