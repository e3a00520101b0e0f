"""benchmarks/gpu_check.py without a GPU: the plan and its filters, every case's config, the dry
run's estimates, the random-init folders it builds, the child-process bookkeeping, and one whole
case end to end on the tiny SD1.5 on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


gc = _load()

ISSUE_CASES = {
    *(
        f"{a}-lora-{px}-{p}"
        for a in ("sd15", "sdxl")
        for px in (512, 1024)
        for p in ("bf16", "fp16")
    ),
    "sd15-ti-512-bf16",
    "sdxl-ti-1024-bf16",
    "flux-lora-512-bf16-nf4",
    "flux-lora-512-bf16-fp8",
    "flux-lora-512-bf16-swap18",
}


def test_plan_holds_every_case_of_the_issue_and_filters_by_glob():
    cases = gc.all_cases()
    assert {c.name for c in cases} == ISSUE_CASES
    assert len(cases) == len(ISSUE_CASES)  # no case twice
    quick = gc.select(cases, [], quick=True)
    # The quick set runs first, so a budget that runs out still leaves one of each kind.
    assert [c.name for c in cases[: len(quick)]] == [c.name for c in quick]
    assert {c.arch for c in quick} == {"sd15", "sdxl", "flux"}
    assert {c.method for c in quick} == {"lora", "textual_inversion"}
    assert {c.name for c in gc.select(cases, ["flux-*"], False)} == {
        n for n in ISSUE_CASES if n.startswith("flux")
    }
    picked = gc.select(cases, ["sd15-lora-512-*", "sdxl-ti-*"], False)
    assert [c.name for c in picked] == [
        "sd15-lora-512-bf16",
        "sd15-lora-512-fp16",
        "sdxl-ti-1024-bf16",
    ]
    with pytest.raises(SystemExit, match="matches no case.*sd15-lora-512-bf16"):
        gc.select(cases, ["sd3-*"], False)


def test_every_case_builds_a_checked_config(tmp_path):
    from kit.families.shipped import shipped_dir

    for case in gc.all_cases():
        base = shipped_dir(gc.ARCHS[case.arch].shipped)
        cfg = gc.case_config(case, base, tmp_path, steps=10, tiny=False)
        assert cfg.model.pretrained_model == str(base)
        assert cfg.data.resolution == case.px
        assert cfg.train.mixed_precision == case.precision
        assert cfg.train.max_train_steps == 10
        assert cfg.network.network_type == case.method
        # Each case trains from a cache and into a run folder of its own.
        assert cfg.data.cache_dir == str(tmp_path / "runs" / case.name / "cache")
        assert cfg.model.base_quantization == case.quantization
        assert cfg.train.blocks_to_swap == case.swap
        assert cfg.train.gradient_checkpointing == (case.arch == "flux")
        if case.method == "textual_inversion":
            assert cfg.network.placeholder_tokens == [gc.TOKEN]
    tiny = gc.case_config(gc.select(gc.all_cases(), ["*swap*"], False)[0], "x", tmp_path, 4, True)
    assert (tiny.train.blocks_to_swap, tiny.data.resolution) == (1, 64)


@pytest.mark.slow
def test_dry_run_builds_and_estimates_every_case_on_the_tiny_models(tmp_path, capsys):
    gc.main(["--dry-run", "--tiny", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ISSUE_CASES:
        (line,) = [
            ln for ln in out.splitlines() if ln.strip().startswith(name + " ") and "GiB" in ln
        ]
        assert "estimate" in line, line
    assert f"dry run: {len(ISSUE_CASES)} of {len(ISSUE_CASES)} cases estimated" in out
    assert not (tmp_path / "models").exists()  # a dry run writes no weights


def test_full_vocabulary_clip_tokenizer_grows_like_the_real_one(tmp_path):
    tok = gc.write_full_clip_tokenizer(tmp_path / "tokenizer", 49408)
    assert len(tok) == 49408
    assert (tok.bos_token_id, tok.eos_token_id) == (49406, 49407)  # as CLIP's own
    ids = tok(gc.PROMPT).input_ids
    assert ids[0] == 49406 and ids[-1] == 49407 and max(ids[1:-1]) < 1000
    assert len(tok(gc.INIT_TOKEN, add_special_tokens=False).input_ids) == 1
    tok.add_tokens([gc.TOKEN])  # what textual inversion does: one row past the real table
    assert tok.convert_tokens_to_ids(gc.TOKEN) == 49408


@pytest.mark.parametrize("family", ["sd15", "sdxl", "flux"])
def test_build_model_remakes_every_part_from_the_source_configs(tmp_path, tiny_base, family):
    import torch
    from safetensors import safe_open

    from kit.config import Config
    from kit.families import get_family

    source = tiny_base(family)
    out = gc.build_model(family, source, tmp_path / "model", "float16", "cpu")
    assert not (tmp_path / "model.partial").exists()
    assert json.loads((out / "model_index.json").read_text()) == json.loads(
        (source / "model_index.json").read_text()
    )
    denoiser = "transformer" if family == "flux" else "unet"
    (weights,) = (out / denoiser).glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        first = f.get_tensor(next(iter(f.keys())))
    assert first.dtype == torch.float16
    cfg = Config()
    cfg.model.model_family, cfg.model.pretrained_model = family, str(out)
    comps = get_family(family, cfg).load(str(out))
    for tok, enc in zip(comps.tokenizers, comps.text_encoders, strict=True):
        if "CLIP" in type(tok).__name__:  # sized to its encoder's table
            assert len(tok) == enc.config.vocab_size


def test_a_child_that_hangs_is_killed_and_one_that_fails_says_why(tmp_path):
    env = gc.child_env("cpu")
    stall = tmp_path / "stall"
    stall.mkdir()
    # Python runs sitecustomize at start-up: this child hangs before it reads its spec.
    (stall / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    hung_env = {**env, "PYTHONPATH": os.pathsep.join([str(stall), env["PYTHONPATH"]])}
    start = time.monotonic()
    hung = gc.run_child("case", {"config": {}}, tmp_path / "logs" / "hung", 1.0, hung_env)
    assert hung["status"] == "timeout after 1 s", hung
    assert time.monotonic() - start < 10
    assert not gc._LIVE  # reaped, and no longer counted as running
    bad = gc.run_child("case", {"config": {"lora_rnk": 4}}, tmp_path / "logs" / "bad", 60, env)
    assert bad["status"].startswith("failed:") and "lora_rnk" in bad["status"], bad


def test_table_and_readme_section(tmp_path):
    rows = [
        {
            "name": "sd15-lora-512-bf16",
            "status": "ok",
            "times": [0.0, 1.0, 1.5, 2.0],
            "losses": [0.5, 0.4, 0.3, 0.2],
            "peak_bytes": 4 * gc.GIB,
            "start_bytes": 2 * gc.GIB,
            "image": "ok",
            "seconds": 12,
            "estimate": {"allocated_bytes": 3.8 * gc.GIB, "weights_bytes": 2.1 * gc.GIB},
        },
        {"name": "flux-lora-512-bf16-nf4", "status": "failed: KitError: " + "x" * 40},
        {"name": "sdxl-lora-1024-fp16", "status": "skipped: time budget spent"},
    ]
    meta = {"date": "today", "machine": "m", "mode": "full", "commit": "c", "tiny": False}
    meta.update(versions={"torch": "2.13"}, steps=4, seconds=30)
    table = gc.render(rows, meta, warmup=1)
    assert "| sd15-lora-512-bf16 | ok | 1.50 | 3.80 | 4.00 | -5.0% | 2.10 / 2.00 |" in table
    assert "- flux-lora-512-bf16-nf4: failed: KitError: xxx" in table  # the reason in full
    assert gc.steady_rate([0.0, 1.0, 1.5, 2.0], 0) == pytest.approx(1.5)
    readme = tmp_path / "README.md"
    shutil.copy(gc.README, readme)
    assert gc.BEGIN in readme.read_text() and "Not yet measured on a GPU" in readme.read_text()
    gc.fill_readme(table, readme)
    text = readme.read_text()
    assert "Not yet measured" not in text and "| sd15-lora-512-bf16 | ok |" in text
    assert text.count(gc.BEGIN) == text.count(gc.END) == 1


@pytest.mark.slow
def test_one_case_end_to_end_on_the_tiny_model_on_the_cpu(tmp_path, tiny_base):
    work = tmp_path / "work"
    # The configs and the random-init folder as the run would make them (the build itself is
    # tested above), so that this run spends its time on the case.
    shutil.copytree(tiny_base("sd15"), work / "tiny-configs" / "sd15")
    gc.build_model(
        "sd15", work / "tiny-configs" / "sd15", gc.model_dir(work, "sd15", True), "float16", "cpu"
    )
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--device",
        "cpu",
        "--cases",
        "sd15-lora-512-bf16",
    ]
    cmd += ["--steps", "3", "--warmup", "1", "--work-dir", str(work), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    (row,) = [ln for ln in table.splitlines() if ln.startswith("| sd15-lora-512-bf16 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "ok", (row, table)
    assert float(cells[2]) > 0  # steps/s
    assert cells[3] != "–"  # the estimate came back from its own process
    assert "→" in cells[7] and "not finite" not in cells[7]
    assert cells[8] == "ok"  # a validation image that is not black
    raw = json.loads(out.with_suffix(".json").read_text())
    (case,) = raw["cases"]
    assert len(case["losses"]) == 3 and case["estimate"]["allocated_bytes"] > 0
    assert "Not yet measured" in gc.README.read_text()  # a smoke run leaves the README alone


def test_compare_sdxl_is_planned_checked_and_skipped_when_the_budget_is_short(tmp_path, capsys):
    gc.main(["--dry-run", "--tiny", "--compare-sdxl", "--no-cases", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "compare-sdxl" in out and "8 steps (3 warm-up)" in out and "budgeted" in out
    assert "kit config checked; model FLOPs per step" in out
    assert "0 of 0 cases estimated" in out  # --no-cases: the comparison alone
    assert not (tmp_path / "models").exists()
    # A budget below the comparison's cost: skipped with a line saying so, nothing built.
    table = tmp_path / "out.md"
    args = ["--tiny", "--device", "cpu", "--compare-sdxl", "--no-cases", "--budget", "5"]
    gc.main([*args, "--work-dir", str(tmp_path), "--out", str(table)])
    text = table.read_text()
    assert "Kit vs script (SDXL LoRA, `--compare-sdxl`): skipped: budgeted 150 s, " in text
    assert "| case |" not in text  # no cases, no case table
    assert json.loads(table.with_suffix(".json").read_text())["compare"]["status"].startswith(
        "skipped"
    )
    assert not (tmp_path / "models").exists()
    with pytest.raises(SystemExit, match="--no-cases"):
        gc.main(["--dry-run", "--no-cases", "--work-dir", str(tmp_path)])


def test_compare_section_renders_the_kit_vs_script_table():
    bench = gc.bench_step()
    run = {
        "times": [0.0, 0.5, 1.0],
        "losses": [0.2],
        "seconds": 60.0,
        "peak_rss_mib": 9000.0,
        "device_name": "NVIDIA H200",
        "setup_peak": 20 * gc.GIB,
        "train_peak": 14 * gc.GIB,
        "peak": 20 * gc.GIB,
    }
    result = bench.sdxl_summary(
        bench.sdxl_spec(steps=3, warmup=1), 1, int(14e12), {"kit": [run], "script": [run]}
    )
    text = gc.render_compare({**result, "status": "ok"})
    assert text.startswith("Kit vs script (SDXL LoRA, `--compare-sdxl`):")
    assert "| steps/s (steady) | 2.000 | 2.000 | 1.00 |" in text
    assert "| MFU | 2.8% | 2.8% | – |" in text  # 14 TFLOP × 2 /s of 989.5 TFLOP/s
    assert "989.5 TFLOP/s dense bf16" in text


def test_every_shipped_architecture_is_one_flag_from_its_cases(tmp_path, capsys):
    """A shipped folder (a new family's, once merged) needs no code here: `--arch FOLDER` plans
    its LoRA cases, sized from its shipped.json, and the dry run estimates them."""
    from kit.families.shipped import ARCHITECTURES

    assert {a.shipped for a in gc.ARCHS.values()} == set(ARCHITECTURES)
    for a in gc.ARCHS.values():
        assert a.family == ARCHITECTURES[a.shipped].family
    sd3 = gc.ARCHS["sd35m"]
    assert (sd3.dtype, sd3.billions) == ("bfloat16", max(ARCHITECTURES["sd35m"].denoiser_billions))
    assert gc.ARCHS["sd15"].case_timeout_s == 150  # measured values stay as measured
    cases = gc.all_cases(["sd35m"])
    assert [c.name for c in cases[-2:]] == ["sd35m-lora-512-bf16", "sd35m-lora-1024-bf16"]
    assert not any(c.checkpointing for c in cases[-2:])  # 2.5B: below the threshold
    with pytest.raises(SystemExit, match="--arch 'nope' is no shipped architecture"):
        gc.all_cases(["nope"])
    gc.main(
        ["--dry-run", "--tiny", "--work-dir", str(tmp_path), "--arch", "sd35m"]
        + ["--cases", "sd35m-lora-512-*"]
    )
    out = capsys.readouterr().out
    assert "dry run: 1 of 1 cases estimated" in out
