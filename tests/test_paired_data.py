"""Paired datasets (control_dir): pairing, what the scan reports, refusals, cache keys, placement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict
from kit.data.buckets import Placement
from kit.data.cache import fill_cache, plan_cache
from kit.data.pairs import control_image, unpaired
from kit.data.pixels import fit_to_bucket
from kit.data.scan import scan
from kit.errors import ConfigError
from kit.families import get_family


def _image(path, seed, size=(64, 64)):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


@pytest.fixture()
def pairs(tmp_path):
    """Targets a, b, sub/c, d, e; controls for a, b, sub/c, and a control z with no target."""
    data, controls = tmp_path / "data", tmp_path / "controls"
    (data / "sub").mkdir(parents=True)
    (controls / "sub").mkdir(parents=True)
    for i, stem in enumerate(["a", "b", "sub/c", "d", "e"]):
        _image(data / f"{stem}.png", i)
        (data / f"{stem}.txt").write_text(f"edit {stem}")
    for i, stem in enumerate(["a", "b", "sub/c", "z"]):
        _image(controls / f"{stem}.jpg", 10 + i)
    return tmp_path


def _cfg(root, family="flux_kontext", **extra):
    fields = {
        "model_family": family,
        "pretrained_model": str(root / "base"),
        "image_dir": str(root / "data"),
        "control_dir": str(root / "controls"),
        "cache_dir": str(root / "cache"),
        "output_dir": str(root / "run"),
        "resolution": 64,
        **extra,
    }
    return from_dict({k: v for k, v in fields.items() if v is not None})


def test_scan_pairs_by_relative_stem_and_names_every_unpaired_file(pairs):
    cfg = _cfg(pairs)
    report = scan(cfg.data, get_family("flux_kontext", cfg))
    got = {s.image.relative_to(pairs / "data").as_posix(): s.controls for s in report.samples}
    assert got == {
        "a.png": [pairs / "controls" / "a.jpg"],
        "b.png": [pairs / "controls" / "b.jpg"],
        "sub/c.png": [pairs / "controls" / "sub" / "c.jpg"],
    }
    left = {p.name: why for p, why in unpaired(report)}
    assert set(left) == {"d.png", "e.png", "z.jpg"}  # nothing trains on them
    assert "no control image" in left["d.png"] and "controls/d.*" in left["d.png"]
    assert left["z.jpg"].startswith("control image without a target") and "data/z" in left["z.jpg"]
    assert "3 of 6 file(s) usable" in report.summary()


def test_a_family_without_controls_refuses_control_dir_naming_dataset_and_family(pairs):
    cfg = from_dict(
        {
            "model_family": "flux",
            "datasets": [
                {
                    "name": "edits",
                    "image_dir": str(pairs / "data"),
                    "control_dir": [str(pairs / "controls")],
                }
            ],
        }
    )
    with pytest.raises(ConfigError, match=r"datasets\[0\] \(edits\): control_dir .* flux takes no"):
        scan(cfg.data, get_family("flux", cfg))


def test_an_edit_family_refuses_a_dataset_without_controls(pairs):
    cfg = _cfg(pairs, control_dir=None)
    with pytest.raises(ConfigError, match="flux_kontext is an edit model"):
        scan(cfg.data, get_family("flux_kontext", cfg))
    two = _cfg(pairs, control_dir=[str(pairs / "controls"), str(pairs / "controls")])
    with pytest.raises(ConfigError, match="takes at most 1 control"):
        scan(two.data, get_family("flux_kontext", two))


def test_the_family_info_alone_is_enough_to_check(pairs):
    from kit.data.buckets import plan_dataset

    samples, _ = plan_dataset(_cfg(pairs))  # no family built: its registry facts are used
    assert all(s.controls for s in samples)
    with pytest.raises(ConfigError, match="flux_kontext is an edit model"):
        plan_dataset(_cfg(pairs, control_dir=None))


def test_control_is_flipped_and_cropped_as_its_target(tmp_path):
    _image(tmp_path / "t.png", 0, (96, 64))
    big = Image.open(tmp_path / "t.png").resize((192, 128), Image.Resampling.NEAREST)
    big.save(tmp_path / "c.png")  # the same picture at twice the size
    placement = Placement(bucket=(64, 64), resized=(96, 64), crop=(0, 16), original=(96, 64))
    for flip in (False, True):
        p = Placement(**{**placement.__dict__, "flip": flip})
        target = fit_to_bucket(Image.open(tmp_path / "t.png").convert("RGB"), p)
        control = control_image(tmp_path / "c.png", p)
        assert control.size == (128, 128)  # the target's crop, in the control's own pixels
        back = np.asarray(control.resize((64, 64), Image.Resampling.BOX))
        assert np.array_equal(back, np.asarray(target))  # the same part, mirrored alike
        assert not np.array_equal(back, np.asarray(target)[:, ::-1])


def test_control_latents_are_cached_batched_and_keyed_by_the_control(pairs, tiny_base):
    base = tiny_base("flux_kontext")
    cfg = _cfg(pairs, pretrained_model=str(base))
    family = get_family("flux_kontext", cfg)
    family.auto_resize = False  # the control at its own size: a small test
    comps = family.load(str(base))
    data = plan_cache(cfg, comps.identity, torch.float32, family=family)
    assert len(data.control_files) == 3 and data.missing()["latents"] == 6
    fill_cache(data, cfg, family, comps, progress=False)
    batch = data.load_batch([0, 1])
    assert batch["control_latents_0"].shape == (2, 16, 8, 8)
    # An edited control misses its own entry only; its target's entry stays.
    _image(pairs / "controls" / "b.jpg", 99)
    again = plan_cache(cfg, comps.identity, torch.float32, family=family)
    assert again.missing()["latents"] == 1
    assert again.latent_files == data.latent_files
    fill_cache(again, cfg, family, comps, progress=False)
    assert again.stats["latents_encoded"] == 1


def test_controls_that_cannot_share_a_batch_are_refused_before_caching(pairs):
    from kit.errors import DataError

    _image(pairs / "controls" / "b.jpg", 1, (128, 64))  # b's control is twice as wide
    cfg = _cfg(pairs, train_batch_size=2)
    family = get_family("flux_kontext", cfg)
    with pytest.raises(DataError, match=r"a\.jpg and .*b\.jpg are controls of one bucket"):
        plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32, family=family)
    assert not (pairs / "cache").exists()
    one = _cfg(pairs, train_batch_size=1)  # one pair a batch: any sizes go
    assert plan_cache(one, {"vae": "v", "text": "t"}, torch.float32, family=family).control_files


def test_held_out_images_of_an_edit_model_are_refused_before_training(pairs, tiny_base):
    from kit.train.prepare import prepare

    cfg = _cfg(
        pairs,
        pretrained_model=str(tiny_base("flux_kontext")),
        validation_image_dir=str(pairs / "data"),
    )
    with pytest.raises(ConfigError, match="validation_image_dir: flux_kontext scores pairs"):
        prepare(cfg)
    assert not (pairs / "cache").exists()


def test_bucket_report_shows_pairs_and_drops_the_unpaired(pairs):
    from kit.data.report import bucket_report, report_lines

    rep = bucket_report(_cfg(pairs))
    (row,) = rep["buckets"]
    pairs_shown = {
        Path(f).name: [Path(c).name for c in cs]
        for f, cs in zip(row["files"], row["controls"], strict=True)
    }
    assert pairs_shown == {"a.png": ["a.jpg"], "b.png": ["b.jpg"], "c.png": ["c.jpg"]}
    dropped = {Path(d["file"]).name for d in rep["dropped"]}
    assert dropped == {"d.png", "e.png", "z.jpg"}
    assert any("z.jpg: control image without a target" in line for line in report_lines(rep))


def test_registry_facts_match_each_family_class():
    """The scan checks pairs from the registry's facts (no torch): they must be the class's."""
    from kit.families import family_class, family_info
    from kit.families.registry import FAMILIES

    for name in FAMILIES:
        info, cls = family_info(name), family_class(name)
        assert (info.control_images, info.needs_control) == (
            cls.control_images,
            cls.needs_control,
        ), name
