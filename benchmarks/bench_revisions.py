"""Per-operation overhead of two revisions of the library, side by side.

A change that moves code around (a restructure) must not make the library
slower; this measures that. Each revision is checked out into a temporary
worktree, and rounds alternate between them, each round a fresh process
per revision timing every operation ``--repeats`` times (after a warm-up),
so that the machine's noise falls on both alike. Reported per operation:
min / median / max over the rounds of each revision's median, in
microseconds, and the ratio of the medians (after / before; below 1 is
faster).

The operations:

* ``commit+release 1 granule x 4 tensors``: four 2-segment tensors grow
  by one granule per segment together and release it again;
* ``elastic step: 8 units``: an elastic cache's orders commit 8 one-unit
  runs, the next orders give them back;
* ``preserving sleep+wake 64 MiB``: a cache's preserving sleep and its
  wake (host backend only: the null driver backs no memory to copy).

Each on the null driver (the library's own bookkeeping) and the host
backend (real ``mmap``/``memfd``), as the revision's code finds them.

Usage (from the repository root)::

    python benchmarks/bench_revisions.py --before 54b58ca --after HEAD
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _ops(driver_kind: str) -> dict[str, Callable[[], None]]:
    """The operations, built over the imported revision's library."""
    from extensible_kv.bench.suites import NullDriver
    from extensible_kv.driver import HostDriver
    from extensible_kv.kv import KVCacheBuffers
    from extensible_kv.tensor import ExtensibleTensor, release_physical_all, resize_per_segment_all

    try:
        from extensible_kv.kv import ElasticBlocks, ElasticOrders
    except ImportError:  # before kv/ was laid out by idea
        from extensible_kv.kv.elastic import ElasticBlocks, ElasticOrders  # type: ignore[no-redef]

    g = 2 * MiB
    driver: Any = NullDriver(g) if driver_kind == "null" else HostDriver(granularity=g)
    tensors = [ExtensibleTensor(8 * g, "cpu", num_segments=2, driver=driver) for _ in range(4)]

    def commit_release() -> None:
        resize_per_segment_all([(t, g) for t in tensors])
        release_physical_all(tensors)

    units = [
        ExtensibleTensor(64 * g, "cpu", num_segments=2, chunk_bytes=g, driver=driver)
        for _ in range(2)
    ]
    elastic = ElasticBlocks(KVCacheBuffers([(t, g) for t in units], 32), 32)
    elastic.start()
    seq = iter(range(1, 1 << 30))

    def elastic_step() -> None:
        held = tuple((u, u + 1) for u in range(1, 17, 2))
        elastic.apply(ElasticOrders(next(seq), 1, ((0, 1), *held)))
        elastic.apply(ElasticOrders(next(seq), 1, ((0, 1),)))

    ops = {
        "commit+release 1 granule x 4 tensors": commit_release,
        "elastic step: 8 units": elastic_step,
    }
    if driver_kind == "host":
        sleeper = KVCacheBuffers([(ExtensibleTensor(64 * MiB, "cpu", driver=driver), 2 * MiB)], 32)
        sleeper.commit(32)

        def sleep_wake() -> None:
            sleeper.release_physical(preserve=True)
            sleeper.recommit()

        ops["preserving sleep+wake 64 MiB"] = sleep_wake
    return ops


def measure(repeats: int) -> dict[str, float]:
    """Every operation's median time in this process, in seconds."""
    out = {}
    for kind in ("null", "host"):
        for name, op in _ops(kind).items():
            for _ in range(3):
                op()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            out[f"{name} ({kind})"] = statistics.median(times)
    return out


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(where), rev], check=True)
    return where


def _run(src: Path, repeats: int) -> dict[str, float]:
    """One round of one revision: a fresh process importing its sources."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--repeats", str(repeats)],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return result


def compare(before: str, after: str, rounds: int, repeats: int) -> list[list[str]]:
    """The table: per operation, each revision's medians over the rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {
            rev: _worktree(rev, Path(tmp) / name) for name, rev in (("a", before), ("b", after))
        }
        try:
            runs: dict[str, list[dict[str, float]]] = {before: [], after: []}
            for index in range(rounds):
                order = (before, after) if index % 2 == 0 else (after, before)
                for rev in order:
                    runs[rev].append(_run(trees[rev] / "src", repeats))
                print(f"round {index + 1}/{rounds} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)
    rows = [
        [
            "operation (driver)",
            f"{before}: us min/median/max",
            f"{after}: us min/median/max",
            "after / before",
        ]
    ]
    for name in runs[before][0]:
        old = [r[name] * 1e6 for r in runs[before]]
        new = [r[name] * 1e6 for r in runs[after]]
        rows.append(
            [
                name,
                _spread(old),
                _spread(new),
                f"{statistics.median(new) / statistics.median(old):.2f}x",
            ]
        )
    return rows


def _spread(values: list[float]) -> str:
    return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD~1")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    rows = compare(args.before, args.after, args.rounds, args.repeats)
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
