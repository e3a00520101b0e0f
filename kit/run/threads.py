"""How many CPU threads torch's operators use in a run.

torch starts one thread per CPU it may run on (its affinity), whatever else the machine is
doing. Two threads on two cores that another job keeps busy wait on each other at every
operator, and a step takes many times longer than it would on one thread. Inside a container
with a CPU quota torch also counts CPUs it will never get. The run's count (`cpu_threads: 0`)
is therefore the CPUs this process may use, its affinity capped by its cgroup's quota, less
those that other processes keep busy when the run starts, shared among the processes of a launch
on the same machine. `OMP_NUM_THREADS` in the environment,
or `cpu_threads` above 0, sets the count instead.

The count is chosen once, before the cache is filled, and a resume takes the count its
checkpoint was saved with: on the CPU the order of a parallel sum depends on the number of
threads, so changing it mid-run changes the last bits of the weights. A resume on another
count (set by the config or the environment, or fewer CPUs here) is warned about.

In a notebook the count stays set after the run, for the cells that follow; the next run
chooses again.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kit.run.checkpoint import PROGRESS_FILE

TORCH_DEFAULT = torch.get_num_threads()
"""torch's own count in this process, before any run set one: auto never goes above it (on some
systems torch counts physical cores, fewer than the CPUs the scheduler offers)."""
PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
SAMPLES, SAMPLE_GAP_S = 5, 0.01
"""Reads of the run queue: a job that keeps a CPU busy is runnable in every one of them."""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    """The number of intra-op threads set."""
    available: int
    """The CPUs this process may use (affinity and quota)."""
    busy: int
    """Of those, how many other processes kept busy at the start (0 when not measured)."""
    reason: str
    """`auto`, `config`, `environment` or `resumed`."""
    changed: bool = False
    """Whether torch's own count was replaced by this one."""

    def describe(self) -> str:
        """One console line, for a count other than torch's own default."""
        return f"CPU threads: {self.threads} ({self.reason_text()}; cpu_threads sets the count)"

    def reason_text(self) -> str:
        """Why this count, in words."""
        return {
            "auto": f"{self.available} CPU(s) this process may use"
            + (f", {self.busy} of them busy with other work" if self.busy else ""),
            "config": "cpu_threads in the config",
            "environment": "OMP_NUM_THREADS",
            "resumed": "the count the checkpoint was saved with, so the resumed steps are exact",
        }[self.reason]


def affinity_cpus() -> int:
    """The CPUs the scheduler lets this process run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def quota_cpus(proc: Path = PROC, cgroup: Path = CGROUP) -> float | None:
    """The CPU quota of this process's cgroup and its parents (the smallest), in CPUs; None
    without one. cgroup v2 `cpu.max` (`QUOTA PERIOD`, or `max`) and v1 `cpu.cfs_quota_us`."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], parts[2].lstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            folders = [cgroup / rel] + list((cgroup / rel).parents)
            quotas += [q for f in folders if f.is_relative_to(cgroup) for q in [_v2_quota(f)] if q]
        elif "cpu" in controllers.split(","):
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                base = cgroup / name
                for f in [base / rel] + list((base / rel).parents):
                    if f.is_relative_to(base) and (q := _v1_quota(f)):
                        quotas.append(q)
    return min(quotas) if quotas else None


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(proc: Path = PROC, cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's quota."""
    cpus = affinity_cpus()
    quota = quota_cpus(proc, cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def runnable_others(proc: Path = PROC) -> int | None:
    """Threads of other processes that are running or waiting for a CPU, the fewest over a few
    reads of the kernel's run queue (a short task shows in one read, a busy job in every one);
    None where /proc has no load average."""
    counts = []
    for i in range(SAMPLES):
        if i:
            time.sleep(SAMPLE_GAP_S)
        try:
            running = int((proc / "loadavg").read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(running - _own_running(proc))
    return max(0, min(counts))


def _own_running(proc: Path) -> int:
    """This process's threads that are running now (at least the one reading)."""
    own = 0
    for task in (proc / "self" / "task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :][:1] == "R":
            own += 1
    return max(own, 1)


def host_cpus() -> int:
    """The CPUs of the whole machine, whose run queue /proc/loadavg counts."""
    return os.cpu_count() or 1


def loadavg_is_the_containers(proc: Path = PROC) -> bool:
    """Whether /proc/loadavg counts this container's tasks only (LXCFS mounts its own view
    there), rather than the whole machine's."""
    try:
        mounts = (proc / "self" / "mounts").read_text()
    except OSError:
        return False
    return any("lxcfs" in line and " /proc/loadavg " in f" {line} " for line in mounts.splitlines())


def env_threads(env: dict[str, str] | os._Environ) -> int | None:
    """The count `OMP_NUM_THREADS` sets: its first entry (OpenMP allows a list, one count per
    nesting level); the one torch read when it has no number there."""
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else TORCH_DEFAULT


def choose(
    setting: int,
    resumed: int | None = None,
    environ: dict[str, str] | None = None,
    proc: Path = PROC,
    cgroup: Path = CGROUP,
) -> ThreadChoice:
    """The thread count for a run: `setting` above 0, else `OMP_NUM_THREADS`, else the count
    `resumed` was saved with (at most the CPUs this process may use), else those CPUs less the
    ones busy with other work (at least one)."""
    env = os.environ if environ is None else environ
    available = available_cpus(proc, cgroup)
    if setting > 0:
        return ThreadChoice(setting, available, 0, "config")
    from_env = env_threads(env)
    if from_env is not None:
        return ThreadChoice(from_env, available, 0, "environment")
    if resumed:
        return ThreadChoice(min(resumed, available), available, 0, "resumed")
    local = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE", "").isdigit() else 1
    if local > 1:
        # Processes launched side by side share the CPUs, each the same count; the machine's
        # load is not read, as each process would count its siblings as other work.
        count = min(TORCH_DEFAULT, available) // local
        return ThreadChoice(max(1, count), available, 0, "auto")
    others = runnable_others(proc) or 0
    # The host's other CPUs (outside the affinity or the quota) take the first of the others,
    # unless the load average counts this container alone.
    outside = 0 if loadavg_is_the_containers(proc) else max(0, host_cpus() - available)
    busy = min(available - 1, max(0, others - outside))
    return ThreadChoice(min(TORCH_DEFAULT, available - busy), available, busy, "auto")


def apply(choice: ThreadChoice) -> bool:
    """Set torch's intra-op thread count; whether it changed."""
    if torch.get_num_threads() == choice.threads:
        return False
    torch.set_num_threads(choice.threads)
    return True


def saved_threads(checkpoint: Path | None) -> int | None:
    """The thread count a checkpoint was saved with; torch's own for one saved before runs
    recorded it (what those runs trained on); None without a checkpoint."""
    if checkpoint is None:
        return None
    try:
        progress = json.loads((checkpoint / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    value = progress.get("cpu_threads", TORCH_DEFAULT)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def for_run(setting: int, resume_from: Path | None) -> ThreadChoice:
    """Choose and set a run's thread count (see the module docstring); returns the choice,
    whose `describe()` is worth printing when `changed` says torch's own count was replaced.
    A resume on another count than its checkpoint's (set by the config or the environment, or
    capped by this machine's CPUs) is warned about: its steps will not be bit-exact."""
    saved = saved_threads(resume_from)
    choice = choose(setting, resumed=saved)
    if saved and choice.threads != saved:
        warnings.warn(
            f"resuming on {choice.threads} CPU thread(s) ({choice.reason_text()}), where "
            f"checkpoint {resume_from.name} was saved on {saved}: the resumed steps will not "
            "match the uninterrupted run's bit for bit",
            stacklevel=2,
        )
    return replace(choice, changed=apply(choice))
