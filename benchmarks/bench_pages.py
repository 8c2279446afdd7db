"""The host backend's page policy, measured: committing memory as the
system's transparent-huge-page policy gives it (what the host backend does)
against forcing huge pages with ``MADV_HUGEPAGE``, each populated at once
with ``MADV_POPULATE_WRITE`` as a commit is.

Each repeat runs both policies in turn, each in a fresh process (so that
neither inherits the other's freed memory): a first commit of ``--mib``
MiB, its release, a commit again at once (a wake right after a sleep), its
release, and a commit again ``--asleep`` seconds later (a wake after a
sleep of that long, by when a VM's host may have taken the freed memory
back). Median [min-max] over the repeats.

    python benchmarks/bench_pages.py [--mib 512] [--repeats 5] [--asleep 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time

MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python's mmap module
POLICIES = {"system policy": False, "forced huge pages": True}
STEPS = ("first commit", "again at once", "again after the sleep")


def commit(size: int, huge: bool) -> tuple[mmap.mmap, float]:
    """``size`` bytes of anonymous memory, populated; and the seconds it took."""
    start = time.perf_counter()
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    memory.madvise(MADV_POPULATE_WRITE)
    return memory, time.perf_counter() - start


def child(size: int, huge: bool, asleep_s: float) -> list[float]:
    """The three commits of one policy, in this process: seconds each."""
    seconds = []
    for wait in (0.0, 0.0, asleep_s):
        time.sleep(wait)
        memory, elapsed = commit(size, huge)
        seconds.append(elapsed)
        memory.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per commit, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--asleep", type=float, default=3.0, help="seconds before the last")
    parser.add_argument("--child", choices=list(POLICIES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mib << 20
    if args.child:
        print(json.dumps(child(size, POLICIES[args.child], args.asleep)))
        return
    runs: dict[str, list[list[float]]] = {policy: [] for policy in POLICIES}
    for _ in range(args.repeats):
        for policy in POLICIES:
            argv = [sys.executable, __file__, "--mib", str(args.mib), "--asleep", str(args.asleep)]
            out = subprocess.run([*argv, "--child", policy], capture_output=True, text=True)
            out.check_returncode()
            runs[policy].append(json.loads(out.stdout))
    print(f"| {args.mib} MiB, populated (s) | " + " | ".join(POLICIES) + " |")
    print("| --- |" + " --- |" * len(POLICIES))
    for i, step in enumerate(STEPS):
        label = f"{step} ({args.asleep:g} s)" if i == 2 else step
        cells = [_cell([run[i] for run in runs[policy]]) for policy in POLICIES]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


if __name__ == "__main__":
    main()
