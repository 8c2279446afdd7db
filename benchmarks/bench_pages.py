"""The host backend's page policy, measured: a commit as the host backend
makes it (``HostDriver.create``: the system's transparent-huge-page policy,
populated at once in pieces on a thread per core) against one
``MADV_POPULATE_WRITE`` call over the whole range, the same with huge pages
forced (``MADV_HUGEPAGE``), and stock vLLM's ``torch.zeros``.

Each repeat runs every way in turn, each in a fresh process (so that none
inherits another's freed memory): a first commit of ``--mib`` MiB, its
release, a commit again at once (a wake right after a sleep), its release,
and a commit again ``--asleep`` seconds later (a wake after a sleep of that
long, by when a VM's host may have taken the freed memory back). Median
[min-max] over the repeats.

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
from collections.abc import Callable

import torch

from extensible_kv.driver import HostDriver

MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python's mmap module
STEPS = ("first commit", "again at once", "again after the sleep")


def host_backend(size: int) -> Callable[[], None]:
    """A commit's physical memory, as the host backend creates it; returns
    its release."""
    driver = HostDriver()
    handle = driver.create(size, 0, False)
    return lambda: driver.release(handle)


def one_call(size: int, huge: bool = False) -> Callable[[], None]:
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    memory.madvise(MADV_POPULATE_WRITE)
    return memory.close


def torch_zeros(size: int) -> Callable[[], None]:
    # The list holds the only reference: clearing it frees the storage
    # (resize_(0) would keep it).
    held = [torch.zeros(size, dtype=torch.int8)]
    return held.clear


WAYS: dict[str, Callable[[int], Callable[[], None]]] = {
    "host backend (pieces on threads)": host_backend,
    "one call": one_call,
    "one call, forced huge pages": lambda size: one_call(size, huge=True),
    "torch.zeros": torch_zeros,
}


def child(size: int, way: str, asleep_s: float) -> list[float]:
    """The three commits of one way, in this process: seconds each."""
    seconds = []
    for wait in (0.0, 0.0, asleep_s):
        time.sleep(wait)
        start = time.perf_counter()
        release = WAYS[way](size)
        seconds.append(time.perf_counter() - start)
        release()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per commit, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--asleep", type=float, default=3.0, help="seconds before the last")
    parser.add_argument("--child", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mib << 20
    if args.child:
        print(json.dumps(child(size, args.child, args.asleep)))
        return
    runs: dict[str, list[list[float]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            argv = [sys.executable, __file__, "--mib", str(args.mib), "--asleep", str(args.asleep)]
            out = subprocess.run([*argv, "--child", way], capture_output=True, text=True)
            out.check_returncode()
            runs[way].append(json.loads(out.stdout))
    print(f"| {args.mib} MiB, populated (s) | " + " | ".join(WAYS) + " |")
    print("| --- |" + " --- |" * len(WAYS))
    for i, step in enumerate(STEPS):
        label = f"{step} ({args.asleep:g} s)" if i == 2 else step
        cells = [_cell([run[i] for run in runs[way]]) for way in WAYS]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


if __name__ == "__main__":
    main()
