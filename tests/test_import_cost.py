"""The data commands' fixed costs: what they import, and how often a run reads the dataset.

Scanning and bucketing need no torch, diffusers or transformers (importing them takes seconds,
more than scanning thousands of images); a training run reads the dataset's folder once. These
are behaviour tests (what gets imported, how many scans), never timing asserts.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit.families import registry
from tests.conftest import write_run_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "datasets_example" / "images"
HEAVY = ("torch", "diffusers", "transformers", "accelerate", "peft")
"""The libraries a data command must not import before it needs them."""


def _imported_after(code: str) -> list[str]:
    """Which of `HEAVY` a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_data_modules_import_no_torch():
    loaded = _imported_after(
        "import kit.data.report, kit.data.captions, kit.data.buckets, kit.data.scan, "
        "kit.data.augment, kit.data.images, kit.data.video, kit.families, kit.logs"
    )
    assert loaded == []


@pytest.mark.slow
def test_the_planner_imports_no_model_library():
    # The planner asks the configured method for its learning rate, and the methods import
    # torch; the model libraries wait until a model is built.
    loaded = _imported_after("import kit.preflight.plan")
    assert [m for m in loaded if m != "torch"] == []


def test_family_facts_and_names_without_torch():
    code = (
        "from kit.families import family_info, family_names\n"
        "facts = {n: (family_info(n).bucket_step, family_info(n).video) for n in family_names()}\n"
        "assert facts and all(step > 0 for step, _ in facts.values()), facts"
    )
    assert _imported_after(code) == []


@pytest.mark.slow
def test_quieting_the_libraries_waits_for_their_import():
    code = (
        "import sys, logging\n"
        "from kit.logs import quiet_libraries\n"
        "quiet_libraries()\n"
        "assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules\n"
        "from diffusers.utils import logging as d\n"
        "from transformers.utils import logging as t\n"
        "assert d.get_verbosity() == t.get_verbosity() == logging.ERROR\n"
        "assert not d.is_progress_bar_enabled() and not t.is_progress_bar_enabled()\n"
        "assert d.__loader__ is d.__spec__.loader and type(d.__loader__).__name__ != '_ThenRun'"
    )
    loaded = _imported_after(code)
    assert "diffusers" in loaded and "transformers" in loaded


def test_kit_buckets_leaves_torch_unimported(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for image in sorted(EXAMPLE.glob("zorbic_00[0-3].png")):
        shutil.copy(image, data / image.name)
        shutil.copy(image.with_suffix(".txt"), data / f"{image.stem}.txt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"image_dir": str(data), "resolution": 64, "bucket_step": 32}))
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kit", "buckets", str(config), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["images"] == 4
    # `-X importtime` writes one line per module imported: "import time: self | total | name".
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "kit.data.buckets" in imported
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


# ------------------------------------------------------------------ the light registry


@pytest.mark.parametrize("name", sorted(registry.FAMILIES))
def test_registry_facts_match_the_family_class(name):
    info = registry.FAMILIES[name]
    cls = registry.family_class(name)
    assert cls.__module__ == info.module
    for key in registry.CHECKED:
        assert getattr(cls, key) == getattr(info, key), key
    family = cls()
    assert [family.frame_count(n) for n in range(40)] == [info.frame_count(n) for n in range(40)]


def _registering_modules() -> set[str]:
    """The modules of kit/families whose source registers a family (`@register`)."""
    found = set()
    families = ROOT / "kit" / "families"
    for path in sorted(families.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list
            ):
                parts = path.relative_to(families).with_suffix("").parts
                found.add(".".join(("kit", "families", *parts)))
    return found


def test_every_family_module_is_in_the_registry():
    """Every registering module is its folder's `family.py`, found through that folder's FACTS."""
    listed = {info.module for info in registry.FAMILIES.values()}
    assert _registering_modules() == listed


def test_register_refuses_facts_that_disagree(monkeypatch):
    info = registry.FAMILIES["sd15"]
    cls = registry.family_class("sd15")
    monkeypatch.delitem(registry._CLASSES, "sd15")
    monkeypatch.setitem(registry.FAMILIES, "sd15", registry.FamilyInfo("sd15", info.module, 32))
    with pytest.raises(ValueError, match="bucket_step is 64 in kit.families.sd15.family but 32"):
        registry.register(cls)


def test_unknown_family_names_the_known_ones():
    from kit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown family 'sd16'.*did you mean 'sd15'"):
        registry.family_info("sd16")
    with pytest.raises(ConfigError, match=r"unknown family 'sd16'"):
        registry.get_family("sd16")


# ------------------------------------------------------------------ one scan per run


@pytest.mark.slow
def test_a_training_run_scans_its_dataset_once(tmp_path, tiny_sd15, monkeypatch):
    """The scan in prepare is the run's only one: buckets, the cache plan, the validation
    prompts (from the captions here), the data report and the doctor all reuse it, and no image
    header is read twice."""
    import kit.data.images
    import kit.data.scan
    from kit.config import load_config
    from kit.toy.world import EXAMPLE_SIZES, write_example_dataset
    from kit.train.loop import train

    data = tmp_path / "data"
    write_example_dataset(data, n=6, priors=0, sizes=EXAMPLE_SIZES)
    config = write_run_config(
        tmp_path / "config.json",
        base=tiny_sd15,
        data=data,
        max_train_steps=1,
        checkpointing_steps=1,
        validation_prompt=[],
    )
    scans, probes = [], []

    def counted(original, calls):
        def wrapper(*args, **kwargs):
            calls.append(args[0])
            return original(*args, **kwargs)

        return wrapper

    # Every module that took the function by name gets the counting one.
    for original, calls in ((kit.data.scan.scan, scans), (kit.data.images.probe, probes)):
        wrapper = counted(original, calls)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("kit") and (
                getattr(mod, original.__name__, None) is original
            ):
                monkeypatch.setattr(mod, original.__name__, wrapper)
    result = train(load_config(config))
    assert result.step == 1
    assert len(scans) == 1
    assert sorted(Path(p).name for p in probes) == sorted(p.name for p in data.glob("*.png"))


@pytest.mark.slow
def test_the_kit_program_exits_with_its_commands_code(tmp_path):
    """`python -m kit` (the `kit` program, `kit.cli.run`) returns what the command returned,
    errors included, though it skips the interpreter's last garbage collection."""
    import subprocess
    import sys

    ok = subprocess.run(
        [sys.executable, "-m", "kit", "families"], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0 and "sd15" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kit", "buckets", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "missing.json" in bad.stderr
