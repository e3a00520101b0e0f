"""The run's CPU thread count (kit.run.threads): quotas, the machine's load, the settings that
override it, and a resume that keeps the count it was saved with."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.config import from_dict, load_config
from kit.errors import ConfigError
from kit.run import checkpoint as ckpt
from kit.run import threads
from kit.train import train

# The CPUs this process may use; torch's own count may be fewer (a pytest-xdist worker takes
# its share of them), so a test that chooses among them sets `TORCH_DEFAULT` to these.
CPUS = threads.available_cpus()


@pytest.fixture
def keep_threads():
    """Put torch's thread count back after a test that lets a run change it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_proc(root: Path, running: int, own_states: str = "R", cgroup: str = "0::/") -> Path:
    """A /proc with a load average of `running` runnable threads, this process's threads in
    `own_states` (one letter each) and its cgroup line."""
    (root / "self" / "task").mkdir(parents=True)
    (root / "loadavg").write_text(f"1.00 0.50 0.25 {running}/300 4242\n")
    for i, state in enumerate(own_states):
        task = root / "self" / "task" / str(100 + i)
        task.mkdir()
        task.joinpath("stat").write_text(f"{100 + i} (python (kit)) {state} 1 2 3 4\n")
    (root / "self" / "cgroup").write_text(cgroup + "\n")
    return root


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path):
    proc = fake_proc(tmp_path / "proc", 1, cgroup="0::/user/job")
    cg = tmp_path / "cg"
    (cg / "user" / "job").mkdir(parents=True)
    (cg / "cpu.max").write_text("max 100000\n")
    (cg / "user" / "cpu.max").write_text("150000 100000\n")
    (cg / "user" / "job" / "cpu.max").write_text("max 100000\n")
    assert threads.quota_cpus(proc, cg) == 1.5
    assert threads.available_cpus(proc, cg) == min(CPUS, 2)  # 1.5 CPUs of time: 2 threads


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = fake_proc(tmp_path / "proc", 1, cgroup="4:cpu,cpuacct:/docker/abc\n3:memory:/x")
    cg = tmp_path / "cg"
    job = cg / "cpu,cpuacct" / "docker" / "abc"
    job.mkdir(parents=True)
    job.joinpath("cpu.cfs_quota_us").write_text("100000\n")
    job.joinpath("cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota_cpus(proc, cg) == 1.0
    assert threads.available_cpus(proc, cg) == 1
    job.joinpath("cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert threads.quota_cpus(proc, cg) is None
    assert threads.available_cpus(proc, cg) == CPUS


def test_runnable_others_leaves_out_this_process(tmp_path):
    # 3 runnable on the machine; of this process's threads, 2 run and one sleeps.
    proc = fake_proc(tmp_path, 3, own_states="RRS")
    assert threads.runnable_others(proc) == 1
    # The reading thread always counts as this process's own, whatever its stat said.
    assert threads.runnable_others(fake_proc(tmp_path / "b", 1, own_states="S")) == 0
    (tmp_path / "c").mkdir()
    assert threads.runnable_others(tmp_path / "c") is None  # no /proc/loadavg


@pytest.mark.parametrize(
    "busy, host, local, expected",
    [
        (0, 4, "", 4),  # an idle machine: every CPU
        (1, 4, "", 3),  # one busy job: the others
        (9, 4, "", 1),  # never fewer than one
        (2, 6, "", 4),  # busy threads the host's other CPUs can take leave ours alone
        (4, 6, "", 2),
        (0, 4, "2", 2),  # two processes launched side by side share the CPUs
        (3, 4, "2", 2),  # and read no load: each would count its sibling as other work
    ],
)
def test_auto_count(tmp_path, monkeypatch, busy, host, local, expected):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 4)
    monkeypatch.setattr(threads, "TORCH_DEFAULT", 4)
    monkeypatch.setattr(threads, "host_cpus", lambda: host)
    proc = fake_proc(tmp_path / "proc", busy + 1)  # + the reading thread
    env = {"LOCAL_WORLD_SIZE": local} if local else {}
    choice = threads.choose(0, environ=env, proc=proc, cgroup=tmp_path / "none")
    assert (choice.threads, choice.reason) == (expected, "auto")
    assert choice.available == 4


def test_auto_never_goes_above_torchs_own_count(tmp_path, monkeypatch):
    """Where torch counts fewer threads than the scheduler offers CPUs (physical cores on some
    systems), an idle machine keeps torch's count."""
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    monkeypatch.setattr(threads, "TORCH_DEFAULT", 4)
    monkeypatch.setattr(threads, "host_cpus", lambda: 8)
    proc = fake_proc(tmp_path / "proc", 1)
    assert threads.choose(0, environ={}, proc=proc, cgroup=tmp_path / "none").threads == 4
    proc = fake_proc(tmp_path / "busy", 6)  # 5 busy of 8: 3 free
    assert threads.choose(0, environ={}, proc=proc, cgroup=tmp_path / "none").threads == 3


def test_settings_override_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 4)
    monkeypatch.setattr(threads, "TORCH_DEFAULT", 4)
    monkeypatch.setattr(threads, "host_cpus", lambda: 4)
    proc = fake_proc(tmp_path / "proc", 4)  # 3 busy
    cg = tmp_path / "none"
    assert threads.choose(3, environ={}, proc=proc, cgroup=cg).reason == "config"
    c = threads.choose(0, environ={"OMP_NUM_THREADS": "2"}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (2, "environment")
    c = threads.choose(0, environ={"OMP_NUM_THREADS": "3,1"}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (3, "environment")  # OpenMP's list: the first level's
    c = threads.choose(0, environ={"OMP_NUM_THREADS": "lots"}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (4, "environment")  # set but no number: torch's own
    c = threads.choose(0, resumed=4, environ={}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (4, "resumed")
    c = threads.choose(0, resumed=64, environ={}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (4, "resumed")  # never more than this machine offers
    c = threads.choose(0, environ={}, proc=proc, cgroup=cg)
    assert (c.threads, c.reason) == (1, "auto")
    assert "4 CPU(s) this process may use, 3 of them busy" in c.describe()


def test_a_containers_own_load_average_is_not_corrected_for_the_host(tmp_path, monkeypatch):
    """Under LXCFS /proc/loadavg counts the container's tasks only: all of them compete for
    its CPUs, however many the host has."""
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 4)
    monkeypatch.setattr(threads, "TORCH_DEFAULT", 4)
    monkeypatch.setattr(threads, "host_cpus", lambda: 64)
    proc = fake_proc(tmp_path / "proc", 3)  # 2 busy
    cg = tmp_path / "none"
    assert threads.choose(0, environ={}, proc=proc, cgroup=cg).threads == 4  # the host's load
    (proc / "self" / "mounts").write_text(
        "proc /proc proc rw 0 0\nlxcfs /proc/loadavg fuse.lxcfs rw 0 0\n"
    )
    assert threads.choose(0, environ={}, proc=proc, cgroup=cg).threads == 2


def test_resuming_on_another_count_is_warned_about(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "TORCH_DEFAULT", 2)
    saved = tmp_path / "step-000002"
    saved.mkdir()
    (saved / "progress.json").write_text(json.dumps({"step": 2}))  # saved before the key
    assert threads.saved_threads(saved) == 2  # what such a run trained on: torch's own
    (saved / "progress.json").write_text(json.dumps({"step": 2, "cpu_threads": True}))
    assert threads.saved_threads(saved) is None
    (saved / "progress.json").write_text(json.dumps({"step": 2, "cpu_threads": 1}))
    monkeypatch.setattr(threads, "apply", lambda choice: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.warns(
        UserWarning,
        match=r"resuming on 2 CPU thread\(s\) \(OMP_NUM_THREADS\), "
        r"where checkpoint step-000002 was saved on 1",
    ):
        assert threads.for_run(0, saved).reason == "environment"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert threads.for_run(0, saved).threads == 1  # the same count: nothing to say


def test_a_busy_job_on_this_machine_is_seen(keep_threads):
    """Real busy processes (a thread spinning each) show in the real /proc."""
    if not Path("/proc/loadavg").exists():
        pytest.skip("no /proc/loadavg on this system")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        # Both are runnable in every read, whatever else the machine runs.
        assert threads.runnable_others() >= 2
    finally:
        for spin in spinners:
            spin.kill()
            spin.wait()


def test_negative_setting_is_refused():
    with pytest.raises(ConfigError, match="cpu_threads: -1"):
        from_dict({"cpu_threads": -1})


def test_a_resume_keeps_the_count_it_was_saved_with(
    tmp_path, make_config, monkeypatch, keep_threads, capsys
):
    """A run started while another job kept all CPUs but one busy trains on one thread and
    records it; resumed on an idle machine it keeps that thread, and ends bit for bit where the
    uninterrupted run did."""
    if CPUS < 2:
        pytest.skip("needs two CPUs to choose between")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "TORCH_DEFAULT", CPUS)
    busy = {"n": CPUS - 1}
    monkeypatch.setattr(threads, "runnable_others", lambda proc=None: busy["n"])
    monkeypatch.setattr(threads, "host_cpus", lambda: CPUS)

    torch.set_num_threads(CPUS)  # torch's own count on an idle machine
    assert train(load_config(make_config("a.json", output_dir=str(tmp_path / "a")))).step == 4
    assert "CPU threads: 1 (" in capsys.readouterr().out
    assert torch.get_num_threads() == 1
    progress = json.loads((ckpt.checkpoint_dir(tmp_path / "a", 4) / "progress.json").read_text())
    assert progress["cpu_threads"] == 1

    torch.set_num_threads(CPUS)
    split = load_config(make_config("b.json", output_dir=str(tmp_path / "b")))
    train(split.replace(max_train_steps=2))
    busy["n"] = 0  # the other job has finished
    torch.set_num_threads(CPUS)
    train(split, resume="latest")
    assert "the count the checkpoint was saved with" in capsys.readouterr().out
    assert torch.get_num_threads() == 1
    wa = load_file(str(ckpt.checkpoint_dir(tmp_path / "a", 4) / ckpt.ADAPTER_FILE))
    wb = load_file(str(ckpt.checkpoint_dir(tmp_path / "b", 4) / ckpt.ADAPTER_FILE))
    assert wa.keys() == wb.keys() and wa
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # A new run on the idle machine takes every CPU again.
    assert threads.for_run(0, None).threads == CPUS
