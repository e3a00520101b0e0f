"""Bad input gets one clear line naming the file or key, and the `kit` command no traceback."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kit.cli import main


@pytest.fixture(autouse=True)
def _restore_showwarning(monkeypatch):
    # `kit.cli.main` installs its own warning printer; keep it out of other tests.
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


def kit(capsys, *argv) -> tuple[int, str, str]:
    """Run `kit ARGV` in-process; return its exit code, stdout and stderr."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def refused(capsys, *argv) -> str:
    """Run `kit ARGV`, expecting a refusal; return its stderr."""
    rc, _, err = kit(capsys, *argv)
    assert rc == 2, err
    assert err.startswith("kit: error: ")
    errors = [line for line in err.splitlines() if line.startswith("kit: error:")]
    assert len(errors) == 1, err
    return err


# ---------------------------------------------------------------- config files


def test_unknown_config_key(capsys, make_config):
    cfg = make_config(lora_rnak=4)
    err = refused(capsys, "train", cfg)
    assert "'lora_rnak'" in err and "did you mean 'lora_rank'" in err
    assert str(cfg) in err


def test_missing_config_file(capsys, tmp_path):
    path = tmp_path / "no-such-config.json"
    err = refused(capsys, "train", path)
    assert str(path) in err and "not found" in err


def test_invalid_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "lora_rank": 4\n  "resolution": 64\n}\n')
    err = refused(capsys, "train", path)
    assert str(path) in err and "line 3" in err


def test_unknown_model_family(capsys, make_config, tmp_path):
    err = refused(capsys, "train", make_config(model_family="sd1.5"))
    assert "model_family" in err and "'sd1.5'" in err
    assert "did you mean 'sd15'" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_override(capsys, make_config):
    err = refused(capsys, "buckets", make_config(), "--set", "lora_rnak=8")
    assert "'lora_rnak'" in err and "did you mean 'lora_rank'" in err


# ---------------------------------------------------------------- dataset folders


def test_missing_image_folder(capsys, make_config, tmp_path):
    missing = tmp_path / "no-images-here"
    err = refused(capsys, "train", make_config(image_dir=str(missing)))
    assert str(missing) in err and "image_dir" in err


def test_images_without_captions(capsys, make_config, dataset):
    for txt in dataset.glob("*.txt"):
        txt.unlink()
    err = refused(capsys, "train", make_config())
    assert "no usable images" in err and "no caption file" in err
    assert str(dataset / "zorbic_000.png") in err


def test_broken_images_are_skipped_and_reported(capsys, make_config, few_images, tmp_path):
    """A corrupt, an empty and a truncated file are left out; the run trains on the rest."""
    (few_images / "broken.png").write_bytes(b"this is not a png at all" * 10)
    (few_images / "empty.png").write_bytes(b"")
    arr = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(few_images / "cut.png")
    data = (few_images / "cut.png").read_bytes()
    (few_images / "cut.png").write_bytes(data[: len(data) // 2])  # header fine, pixels cut off
    for name in ("broken", "empty", "cut"):
        (few_images / f"{name}.txt").write_text(f"a {name} image")
    rc, out, err = kit(capsys, "train", make_config(max_train_steps=1))
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("data:")]
    assert "3 skipped" in line and "data_report.json" in line
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    why = {Path(e["file"]).name: e["reason"] for e in report}
    assert set(why) == {"broken.png", "empty.png", "cut.png"}
    assert "not an image" in why["broken.png"] and "0 bytes" in why["empty.png"]
    assert "truncated" in why["cut.png"]
    manifest = json.loads((tmp_path / "run" / "dataset_manifest.json").read_text())
    assert sorted(Path(m["image"]).name for m in manifest) == sorted(
        p.name for p in few_images.glob("zorbic_*.png")
    )


def test_empty_image_folder(capsys, make_config, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = refused(capsys, "train", make_config(image_dir=str(empty)))
    assert "no images found" in err and str(empty) in err


# ---------------------------------------------------------------- run folders


@pytest.fixture()
def few_images(dataset):
    """The dataset cut to four images, so that a one-step run is quick."""
    for png in sorted(dataset.glob("*.png"))[4:]:
        png.unlink()
        png.with_suffix(".txt").unlink()
    return dataset


def test_second_train_into_the_same_folder_is_refused(capsys, make_config, few_images, tmp_path):
    cfg = make_config(max_train_steps=1)
    rc, _, err = kit(capsys, "train", cfg)
    assert rc == 0, err
    assert (tmp_path / "run" / "checkpoints").is_dir()
    err = refused(capsys, "train", cfg)
    assert "--resume" in err and str(tmp_path / "run") in err


def test_failed_overwrite_keeps_the_earlier_run(capsys, make_config, few_images, tmp_path):
    rc, _, err = kit(capsys, "train", make_config(max_train_steps=1))
    assert rc == 0, err
    bad = make_config("bad.json", max_train_steps=1, image_dir=str(tmp_path / "typo"))
    err = refused(capsys, "train", bad, "--overwrite")
    assert "image_dir" in err
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_export_of_a_folder_that_is_not_a_run(capsys, tmp_path):
    folder = tmp_path / "not-a-run"
    folder.mkdir()
    err = refused(capsys, "export", folder)
    assert "not a run folder" in err and str(folder) in err


def test_export_with_an_unknown_format(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path), "--format", "safetensorz"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "safetensorz" in err and "invalid choice" in err
    assert "Traceback" not in out + err


# ---------------------------------------------------------------- bucket settings


def test_negative_bucket_step(capsys, make_config):
    err = refused(capsys, "buckets", make_config(bucket_step=-32))
    assert "bucket_step" in err


def test_square_only_buckets_off_the_step_grid(capsys, make_config):
    """Resolution 100 with sd15's step of 64 and no aspect freedom still has its square bucket:
    the largest one within 100² pixels."""
    cfg = make_config(resolution=100, bucket_step=0, max_aspect_ratio=1.0)
    rc, out, err = kit(capsys, "buckets", cfg, "--json")
    assert rc == 0, err
    assert [b["bucket"] for b in json.loads(out)["buckets"]] == ["64x64"]


def test_buckets_of_a_good_config_work(capsys, make_config):
    rc, out, err = kit(capsys, "buckets", make_config(resolution=128, bucket_step=32), "--json")
    assert rc == 0, err
    shown = json.loads(out)
    assert shown["images"] == 24
    assert sum(row["images"] for row in shown["buckets"]) == 24
    assert len(shown["buckets"]) >= 3  # square, wide and tall images
