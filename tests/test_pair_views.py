"""The pair views of notebooks 01, 02 and 05, `kit buckets` and the model card: pairs side by
side, the unpaired files named, each pair's bucket with its controls' trained size, and an edit
run's control → base → result rows (the issue's check, on a tiny Kontext run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kit.config import from_dict


def _image(path, seed, size=(64, 64)):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


@pytest.fixture()
def folder(tmp_path):
    """Five targets, two of them (d, e) without controls, and a control z without a target."""
    data, controls = tmp_path / "data", tmp_path / "controls"
    data.mkdir()
    controls.mkdir()
    for i, stem in enumerate("abcde"):
        _image(data / f"{stem}.png", i)
        (data / f"{stem}.txt").write_text(f"make {stem} red")
    for i, stem in enumerate("abcz"):
        _image(controls / f"{stem}.jpg", 10 + i, (96, 64))
    return tmp_path


def _cfg(root, family, **extra):
    return from_dict(
        {
            "model_family": family,
            "image_dir": str(root / "data"),
            "control_dir": [str(root / "controls")],
            "output_dir": str(root / "run"),
            "resolution": 64,
            **extra,
        }
    )


def test_notebook_01_shows_pairs_and_names_the_unpaired(folder):
    from kit.ui.pairs import dataset_pairs, pair_sheet

    paired, left = dataset_pairs(_cfg(folder, "flux_kontext"))
    assert [Path(s.image).name for s in paired] == ["a.png", "b.png", "c.png"]
    assert {Path(r["file"]).name: r["reason"].split(" ")[0] for r in left} == {
        "d.png": "no",
        "e.png": "no",
        "z.jpg": "control",
    }
    sheet = pair_sheet(paired, n=2, height=32)
    # Two rows: a 48 × 32 control, the arrow, the 32 × 32 target, under a label.
    assert sheet.size == (48 + 24 + 32, 2 * (14 + 32 + 4))
    assert pair_sheet([], n=2) is None


@pytest.mark.parametrize(
    ("family", "size"), [("flux_kontext", "1248x832"), ("flux2", "96x64")], ids=str
)
def test_buckets_of_pairs_show_the_controls_trained_size(folder, family, size):
    """Notebook 02's table and `kit buckets`: each pair in its target's bucket, with the size the
    family's pipeline resizes its control to."""
    from kit.data.report import bucket_report, pair_rows, report_lines

    report = bucket_report(_cfg(folder, family))
    rows = pair_rows(report)
    assert [(r["bucket"], r["target"], r["controls"]) for r in rows] == [
        ("64x64", f"{s}.png", f"{s}.jpg") for s in "abc"
    ]
    assert {r["control size"] for r in rows} == {size}
    assert any(f"pairs: 3, controls resized to {size} (3)" in x for x in report_lines(report))
    # FLUX.2's references are optional: without control_dir, no pairs and no pair lines.
    plain = bucket_report(_cfg(folder, "flux2").replace(control_dir=[]))
    assert pair_rows(plain) == [] and not any("pairs:" in x for x in report_lines(plain))


def test_an_edit_run_shows_control_base_result_in_notebook_05_and_the_card(
    folder, tiny_base, monkeypatch
):
    """A short Kontext run with its default grid (its first pairs): the grids over training and
    the base-versus-fine-tuned grid show the controls; the edit rows hold control, base and
    result; the pushed folder's card shows them from its own copy of the figure."""
    from kit.config import load_config
    from kit.export.edits import edit_examples, edit_figure
    from kit.export.push import assemble
    from kit.families.flux_kontext.family import FluxKontext
    from kit.run.folder import open_run
    from kit.sample.validate import draw_checkpoint
    from kit.train.loop import train
    from tests.conftest import write_run_config

    monkeypatch.setattr(FluxKontext, "auto_resize", False)  # controls at their own size: small
    for stem in "de":  # pairs only
        (folder / "data" / f"{stem}.png").unlink()
    path = write_run_config(
        folder / "run.json",
        base=tiny_base("flux_kontext"),
        data=folder / "data",
        family="flux_kontext",
        control_dir=[str(folder / "controls")],
        validation_prompt=[],
        max_train_steps=2,
        checkpointing_steps=2,
        validation_num_inference_steps=1,
    )
    train(load_config(path))
    run = open_run(folder / "run")
    grid = Image.open(run.validation_step(2) / "grid.png")
    assert grid.width == 2 * 64  # control, then result
    compare = draw_checkpoint(run.root, scales=[0.0, 1.0])
    drawn = [json.loads(p.read_text()) for p in sorted(compare.parent.glob("*.json"))]
    assert drawn and all(d["control"] for d in drawn)
    assert {d["adapter_scale"] for d in drawn} == {0.0, 1.0}

    examples = edit_examples(run)
    assert [e.prompt for e in examples] == ["make a red", "make b red"]
    assert all(e.base is not None and list(e.results) == [2] for e in examples)
    assert [c.name for c in examples[0].controls] == ["a.jpg"]
    figure = edit_figure(examples, height=32)
    assert figure.size == (48 + 24 + 32 + 4 + 32, 2 * (14 + 32 + 4))

    out = folder / "push"
    out.mkdir()
    assemble(run, load_config(run.config), out, "me/edit-lora", None, verify=False)
    card = (out / "README.md").read_text()
    assert "## Edits" in card and "![control → base → result](images/edits.png)" in card
    assert "`make a red`; `make b red`" in card and str(folder) not in card
    assert Image.open(out / "images" / "edits.png").size == edit_figure(examples).size
    shutil.rmtree(out)


def test_an_edit_rows_label_draws_in_the_grids_font():
    from kit.families.samplers import ImageSpec
    from kit.sample.validate import row_labels

    spec = ImageSpec("relight it", "", 0, 4, 3.5, 64, 64, control=("a.png",))
    # The grids' bitmap font has no arrow glyph (it drew a box): the label says "->".
    assert row_labels([[spec]]) == ["[scale 1] control -> relight it"]
