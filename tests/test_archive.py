"""The run archive written after each run, and `kit compare` between two runs."""

from __future__ import annotations

import hashlib
import json

import pytest

from kit.cli import main
from kit.config import load_config
from kit.report import archive
from kit.train.loop import train


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_runs_archived_and_compared(tmp_path, make_config, capsys):
    """Two runs that differ only in learning rate: full archives, and compare names that key."""
    runs = {}
    for name, lr in (("a", 1e-3), ("b", 5e-3)):
        path = make_config(
            f"{name}.json", output_dir=str(tmp_path / f"run-{name}"), learning_rate=lr
        )
        runs[name] = train(load_config(path)).run_dir

    arc = json.loads((runs["a"] / archive.ARCHIVE_FILE).read_text())
    assert arc["status"] == "finished" and arc["error"] is None
    assert arc["config"] == json.loads((runs["a"] / "config.json").read_text())
    manifest = json.loads((runs["a"] / "dataset_manifest.json").read_text())
    assert len(arc["dataset"]["files"]) == len(manifest) == 24
    assert [f["sha256"] for f in arc["dataset"]["files"]] == [m["sha256"] for m in manifest]
    assert arc["dataset"]["manifest_sha256"] == _sha(runs["a"] / "dataset_manifest.json")
    # The final step always draws validation images; each is listed with its hash.
    assert arc["validation"], "no validation images archived"
    for v in arc["validation"]:
        assert v["sha256"] == _sha(runs["a"] / v["path"])
    metrics = [
        json.loads(line) for line in (runs["a"] / "logs/metrics.jsonl").read_text().splitlines()
    ]
    assert arc["loss"]["history"] == [[r["step"], r["loss"]] for r in metrics]
    assert arc["loss"]["final"] == metrics[-1]["loss"]
    assert arc["loss"]["min"] == min(r["loss"] for r in metrics)
    assert arc["environment"]["versions"]["torch"] != "missing"
    assert "gpu" in arc["environment"]
    assert arc["time"]["duration_s"] > 0 and arc["time"]["start"] < arc["time"]["end"]
    assert set(arc["kit"]) == {"version", "git_commit"}

    png = tmp_path / "compare.png"
    capsys.readouterr()  # what training printed (its timings) is not the comparison's
    assert main(["compare", str(runs["a"]), str(runs["b"]), "--json", "--plot", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"] == {"learning_rate": [1e-3, 5e-3]}
    assert result["dataset"] == {"added": [], "removed": [], "changed": []}
    final_b = json.loads((runs["b"] / archive.ARCHIVE_FILE).read_text())["loss"]["final"]
    assert result["loss"]["a"]["final"] == arc["loss"]["final"]
    assert result["loss"]["b"]["final"] == final_b != arc["loss"]["final"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["compare", str(runs["a"]), str(runs["b"])]) == 0
    text = capsys.readouterr().out
    assert "learning_rate  0.001 → 0.005" in text and "same files" in text

    # A run from before archives existed is read from its folder instead.
    (runs["b"] / archive.ARCHIVE_FILE).unlink()
    again = archive.compare(runs["a"], runs["b"])
    assert again["config"] == {"learning_rate": [1e-3, 5e-3]}
    assert again["loss"]["b"]["final"] == final_b


def test_dataset_diff_names_added_removed_and_changed():
    """Files are matched by name: new bytes or a new caption count as changed."""
    files = [{"file": f"{i}.png", "sha256": str(i), "caption": "c"} for i in range(4)]
    other = [dict(f) for f in files[1:]] + [{"file": "9.png", "sha256": "9", "caption": "c"}]
    other[0]["sha256"] = "new"  # 1.png
    other[1]["caption"] = "recaptioned"  # 2.png
    diff = archive.dataset_diff({"files": files}, {"files": other})
    assert diff == {"added": ["9.png"], "removed": ["0.png"], "changed": ["1.png", "2.png"]}


def test_failed_run_is_archived_and_archive_errors_never_hide_it(
    tmp_path, make_config, monkeypatch
):
    """A run that fails is archived as failed; a broken archive leaves the run's own error."""

    def fail_at_two(event):
        if event["kind"] == "step" and event["step"] == 2:
            raise RuntimeError("boom at step 2")

    cfg = load_config(make_config(checkpointing_steps=0))
    with pytest.raises(RuntimeError, match="boom at step 2"):
        train(cfg, callbacks=[fail_at_two])
    arc = json.loads((tmp_path / "run" / archive.ARCHIVE_FILE).read_text())
    assert arc["status"] == "failed" and arc["error"] == "boom at step 2"
    assert [s for s, _ in arc["loss"]["history"]] == [1, 2]

    def broken(*args, **kwargs):
        raise OSError("disk full while archiving")

    monkeypatch.setattr(archive, "build_archive", broken)
    (tmp_path / "run" / archive.ARCHIVE_FILE).unlink()
    with pytest.raises(RuntimeError, match="boom at step 2"):
        train(cfg, callbacks=[fail_at_two], overwrite=True)
    assert not (tmp_path / "run" / archive.ARCHIVE_FILE).exists()
    # A successful run survives a broken archive too.
    result = train(cfg, overwrite=True)
    assert result.step == 4 and result.checkpoint is not None


def test_compare_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    """A wrong path is one clear error line naming it."""
    assert main(["compare", str(tmp_path / "nope"), str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
