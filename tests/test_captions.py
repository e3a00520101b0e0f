"""Caption report and safe bulk edits: the diff shown is what is written, after a backup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kit.data.captions as captions
from kit.cli import main
from kit.config import DataConfig, load_config
from kit.data.captions import (
    Edit,
    apply_edit,
    caption_report,
    diff_text,
    edit_text,
    list_backups,
    plan_edit,
    restore_backup,
)
from kit.errors import DataError, KitError


def _data(dataset: Path) -> DataConfig:
    return DataConfig(image_dir=str(dataset))


def _texts(dataset: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dataset.glob("*.txt"))}


def _new_from_diff(diff: str) -> dict[str, str]:
    """Rebuild each file's new text from a unified diff that holds the whole file as context."""
    out: dict[str, str] = {}
    name, last = "", " "
    for line in diff.splitlines(keepends=True):
        if line.startswith("+++ "):
            name = Path(line[4:].strip()).name
            out[name] = ""
        elif line.startswith(("---", "@@")):
            continue
        elif line.startswith("\\ No newline"):
            if last in "+ ":
                out[name] = out[name][:-1]
        else:
            last = line[0]
            if last in "+ ":
                out[name] += line[1:]
    return out


def test_edit_text_steps():
    assert (
        edit_text("zorb,, red  hat ,sitting, \n", Edit(normalize=True))
        == "zorb, red hat, sitting\n"
    )
    assert edit_text("  a cat \n\n", Edit(strip=True)) == "a cat\n"
    assert edit_text("a cat\n", Edit(prepend="zorb")) == "zorb, a cat\n"
    assert edit_text("Zorb, a cat\n", Edit(prepend="zorb")) == "Zorb, a cat\n"  # already there
    assert edit_text("zorbs, a cat", Edit(prepend="zorb")) == "zorb, zorbs, a cat"  # whole words
    assert edit_text("a cat\r\n", Edit(append="photo")) == "a cat, photo\r\n"  # ending kept
    assert edit_text("", Edit(prepend="zorb")) == "zorb"
    assert edit_text("a cat, a hat\n", Edit(replace=("a ", "one "))) == "one cat, one hat\n"
    regex = Edit(replace=(r"(\w+) cat", r"\1 dog"), regex=True)
    assert edit_text("a black cat\n", regex) == "a black dog\n"
    with pytest.raises(KitError, match="bad regular expression"):
        Edit(replace=("(", "x"), regex=True)
    with pytest.raises(KitError, match="bad replacement"):
        edit_text("a cat", Edit(replace=("cat", r"\3"), regex=True))


def test_plan_diff_equals_what_apply_writes(dataset):
    (dataset / "zorbic_001.txt").write_text("zorbic,, red  hat ,sitting,\n")
    (dataset / "zorbic_002.txt").write_text("a blue thing")  # no newline at the end
    (dataset / "zorbic_003.txt").write_bytes(b"a gray thing\r\n")
    cfg = _data(dataset)
    before = _texts(dataset)
    changes = plan_edit(cfg, Edit(normalize=True, prepend="zorbic", append="photo"))
    assert _texts(dataset) == before  # planning writes nothing
    assert len(changes) == 24  # every caption lacks "photo"

    diff = diff_text(changes)
    backup = apply_edit(cfg, changes)
    for c in changes:
        assert c.path.read_bytes() == c.new.encode()
    assert _new_from_diff(diff) == {c.path.name: c.new for c in changes}
    assert (dataset / "zorbic_001.txt").read_text() == "zorbic, red hat, sitting, photo\n"
    assert (dataset / "zorbic_002.txt").read_text() == "zorbic, a blue thing, photo"
    assert (dataset / "zorbic_003.txt").read_bytes() == b"zorbic, a gray thing, photo\r\n"
    # the backup holds every caption file as it was, and the scan does not see it
    assert backup.parent == dataset / ".caption-backups"
    assert {p.name: p.read_bytes() for p in backup.glob("*.txt")} == before
    assert list_backups(cfg) == [backup]
    assert plan_edit(cfg, Edit(normalize=True, prepend="zorbic", append="photo")) == []
    assert not _orphans(cfg)


def _orphans(cfg: DataConfig) -> list[Path]:
    from kit.data.scan import scan

    return scan(cfg).orphan_captions


def test_backup_is_made_before_the_first_write(dataset, monkeypatch):
    cfg = _data(dataset)
    before = _texts(dataset)
    changes = plan_edit(cfg, Edit(append="photo"))
    seen = []
    real = captions.write_with

    def spy(path, writer):
        (backup,) = list_backups(cfg)
        seen.append({p.name: p.read_bytes() for p in backup.glob("*.txt")} == before)
        return real(path, writer)

    monkeypatch.setattr(captions, "write_with", spy)
    apply_edit(cfg, changes)
    assert seen and all(seen)


def test_a_file_changed_after_planning_is_refused_and_nothing_is_written(dataset):
    cfg = _data(dataset)
    changes = plan_edit(cfg, Edit(prepend="glorp"))
    (dataset / "zorbic_005.txt").write_text("edited by hand meanwhile\n")
    before = _texts(dataset)
    with pytest.raises(DataError, match="zorbic_005.txt changed on disk"):
        apply_edit(cfg, changes)
    assert _texts(dataset) == before
    assert list_backups(cfg) == []


def test_non_utf8_captions_are_read_with_replacement(dataset, tmp_path):
    raw = b"caf\xe9 \xff, zorbic\n"
    (dataset / "zorbic_004.txt").write_bytes(raw)
    cfg = _data(dataset)
    (change,) = plan_edit(cfg, Edit(replace=("caf", "cafe ")))
    assert change.old == "caf\ufffd \ufffd, zorbic\n"
    backup = apply_edit(cfg, [change])
    assert (dataset / "zorbic_004.txt").read_text(encoding="utf-8") == change.new
    assert (backup / "zorbic_004.txt").read_bytes() == raw  # the backup is byte for byte
    restore_backup(cfg, backup)
    assert (dataset / "zorbic_004.txt").read_bytes() == raw


def test_restore_backup_puts_old_captions_back_and_backs_up_the_current(dataset):
    cfg = _data(dataset)
    before = _texts(dataset)
    backup = apply_edit(cfg, plan_edit(cfg, Edit(prepend="glorp")))
    edited = _texts(dataset)
    assert edited != before
    second = restore_backup(cfg, backup)
    assert _texts(dataset) == before
    assert {p.name: p.read_bytes() for p in second.glob("*.txt")} == edited
    with pytest.raises(DataError, match="caption backup not found"):
        restore_backup(cfg, dataset / ".caption-backups" / "nope")


def test_caption_dir_backups_keep_subfolders(dataset, tmp_path):
    caps = tmp_path / "caps"
    (caps / "sub").mkdir(parents=True)
    (dataset / "sub").mkdir()
    shutil.move(dataset / "zorbic_000.png", dataset / "sub" / "zorbic_000.png")
    for p in dataset.glob("*.txt"):
        shutil.move(p, caps / p.name)
    shutil.move(caps / "zorbic_000.txt", caps / "sub" / "zorbic_000.txt")
    cfg = DataConfig(image_dir=str(dataset), caption_dir=str(caps))
    backup = apply_edit(cfg, plan_edit(cfg, Edit(append="photo")))
    assert backup.parent == caps / ".caption-backups"
    assert (backup / "sub" / "zorbic_000.txt").is_file()
    assert (caps / "sub" / "zorbic_000.txt").read_text().endswith(", photo\n")


def test_report_tags_triggers_stems_and_truncation(make_config, dataset):
    (dataset / "zorbic_000.txt").write_text("zorbic, red hat, sitting\n")
    (dataset / "zorbic_001.txt").write_text("glorp, Red  Hat, standing\n")
    (dataset / "zorbic_002.txt").write_text("zorbic " + "very " * 100 + "long\n")
    shutil.copy(dataset / "zorbic_003.png", dataset / "zorbic_003.jpg")
    cfg = load_config(make_config(trigger_words=["zorbic", "glorp"]))
    rep = caption_report(cfg)

    assert rep["duplicate_stems"] == [str(dataset / "zorbic_003")]
    assert ("red hat", 2) in rep["top_tags"]
    assert rep["tagged_captions"] >= 2
    assert rep["trigger_missing"]["zorbic"] == [str(dataset / "zorbic_001.txt")]
    assert rep["trigger_coverage"]["zorbic"] == pytest.approx(1 - 1 / rep["captioned"])
    assert len(rep["trigger_missing"]["glorp"]) == rep["captioned"] - 1
    (enc,) = rep["tokens"].values()
    assert enc["truncated"] == 1
    assert enc["truncated_files"][0][0] == str(dataset / "zorbic_002.txt")
    assert enc["truncated_files"][0][1] > enc["limit"]
    (warning,) = rep["truncation_warnings"]
    assert "zorbic_002.txt" in warning and f"{enc['limit']} tokens" in warning


def test_cli_dry_run_then_apply(make_config, dataset, capsys):
    config = make_config()
    before = _texts(dataset)
    assert main(["captions", str(config), "--prepend", "glorp"]) == 0
    out = capsys.readouterr().out
    assert "+glorp, " in out and "24 caption file(s) would change (dry run)" in out
    assert _texts(dataset) == before

    assert main(["captions", str(config), "--prepend", "glorp", "--apply"]) == 0
    out = capsys.readouterr().out
    (backup,) = list_backups(_data(dataset))
    assert str(backup) in out
    assert all(t.startswith(b"glorp, ") for t in _texts(dataset).values())

    assert main(["captions", str(config), "--restore", str(backup)]) == 0
    capsys.readouterr()
    assert _texts(dataset) == before


def test_prior_images_are_meant_to_lack_the_trigger(make_config, tmp_path):
    from kit.toy.world import write_example_dataset

    data = tmp_path / "example"
    write_example_dataset(data, n=24, priors=8)
    priors = sorted(str(p.with_suffix(".txt")) for p in data.glob("prior_*.png"))
    assert len(priors) == 8
    cfg = load_config(make_config(image_dir=str(data), trigger_words=["zorbic"]))
    rep = caption_report(cfg, token_counts=False)
    assert rep["trigger_missing"]["zorbic"] == priors and rep["prior_images"] == 0
    assert rep["trigger_coverage"]["zorbic"] == pytest.approx(24 / 32)
    cfg = load_config(
        make_config(image_dir=str(data), trigger_words=["zorbic"], prior_images=["prior_*"])
    )
    rep = caption_report(cfg, token_counts=False)
    assert rep["trigger_missing"]["zorbic"] == [] and rep["prior_images"] == 8
    assert rep["trigger_coverage"]["zorbic"] == 1.0


def test_cli_report_json_and_errors(make_config, dataset, capsys):
    config = make_config(trigger_words=["zorbic"], prior_images=["prior_*"])
    assert main(["captions", str(config), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["trigger_coverage"] == {"zorbic": 1.0} and "top_tags" in rep
    assert main(["captions", str(config), "--replace", "(", "x", "--regex"]) == 2
    assert "bad regular expression" in capsys.readouterr().err
    assert main(["captions", str(config), "--apply"]) == 2
    assert "--apply needs an edit" in capsys.readouterr().err
    assert main(["captions", str(config), "--json", "--replace", "zorbic", "glorp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["changes"]) == 24 and out["applied"] is False


def test_caption_editor_filters_steps_and_saves_without_a_browser(make_config, dataset):
    from kit.data.scan import scan
    from kit.ui.widgets import CaptionEditor, caption_editor, load

    (dataset / "zorbic_003.txt").write_text("zorbic, red hat\n")
    (dataset / "zorbic_007.txt").write_text("zorbic, Red Hat, grass\n")
    cfg = load(make_config())
    samples = scan(cfg.data).samples
    assert caption_editor(cfg, samples).children  # builds headlessly
    ed = CaptionEditor(cfg, samples)
    assert bytes(ed.image.value).startswith(b"\x89PNG") and ed.text.value == samples[0].caption

    ed.filter.value = "red hat"  # as if typed: only the two tagged samples remain
    assert [Path(samples[i].image).name for i in ed.shown] == [
        "zorbic_003.png",
        "zorbic_007.png",
    ]
    prev_b, next_b, save_b = ed.buttons
    next_b.click()
    assert ed.text.value == "zorbic, Red Hat, grass" and ed.status.value.startswith("2/2")
    next_b.click()
    assert Path(ed.current().image).name == "zorbic_003.png"  # wraps round

    ed.text.value = "  zorbic, red hat, standing \n"
    save_b.click()
    assert (dataset / "zorbic_003.txt").read_text() == "zorbic, red hat, standing\n"
    assert ed.status.value == "saved zorbic_003.txt"

    # a change made on disk after the caption was shown is not overwritten
    (dataset / "zorbic_003.txt").write_text("zorbic, edited elsewhere\n")
    ed.text.value = "zorbic, mine"
    save_b.click()
    assert (dataset / "zorbic_003.txt").read_text() == "zorbic, edited elsewhere\n"
    assert ed.status.value.startswith("not saved")
    prev_b.click()
    next_b.click()
    assert ed.text.value == "zorbic, edited elsewhere"  # reloaded from the file

    ed.filter.value = "no such tag"
    assert ed.current() is None and "no caption matches" in ed.status.value
    assert ed.save() is None
