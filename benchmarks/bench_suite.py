"""How long the three commands take from a fresh clone: `make check`, `make test`, `make demo`.

Clones the repository's committed HEAD into a temporary folder, installs once (`make install`,
timed apart), then times each command there, and prints one Markdown row per command with its
wall time and, for the test tiers, pytest's own count and its slowest tests. The quiet-machine
figures in benchmarks/README.md come from this script; `--busy N` starts N CPU-bound neighbours
for the time of the run, to see how a command shares the machine.

    python benchmarks/bench_suite.py                    # all three
    python benchmarks/bench_suite.py --only demo --busy 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("check", "test", "demo")


def spin(stop: multiprocessing.Event) -> None:
    """A CPU-bound neighbour: pure Python arithmetic until told to stop."""
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x = (x * 31 + i) % 1_000_003


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    """Run `cmd` in `cwd`, its output into `log`: (seconds, exit code)."""
    start = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    return time.monotonic() - start, code


def summary(log: Path) -> str:
    """pytest's closing counts and the slowest test, where the log has them."""
    text = log.read_text(errors="replace")
    counts = re.findall(r"^=*\s*(\d+ passed.*?) in [\d.]+s", text, re.M)
    slowest = re.search(r"^([\d.]+)s call\s+(\S+)", text, re.M)
    parts = [counts[-1]] if counts else []
    if slowest:
        parts.append(f"slowest {slowest.group(2)} {float(slowest.group(1)):.0f} s")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound neighbours to start")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its logs")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kit-bench-suite-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    seconds, code = timed(["make", "install"], clone, work / "install.log")
    print(f"installation: {seconds:.0f} s (exit {code}; not counted below)")
    if code:
        print((work / "install.log").read_text()[-3000:])
        return code

    stop = multiprocessing.Event()
    neighbours = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(args.busy)]
    for n in neighbours:
        n.start()
    print(f"| command | wall time | exit | notes ({args.busy} busy neighbours) |")
    print("|---|---|---|---|")
    worst = 0
    try:
        for name in args.only:
            log = work / f"{name}.log"
            seconds, code = timed(["make", name], clone, log)
            worst = worst or code
            print(
                f"| `make {name}` | {seconds / 60:.1f} min | {code} | {summary(log)} |", flush=True
            )
    finally:
        stop.set()
        for n in neighbours:
            n.join()
    print(f"logs in {work}" if args.keep else "")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return worst


if __name__ == "__main__":
    sys.exit(main())
