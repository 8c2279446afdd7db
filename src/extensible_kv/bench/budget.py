"""The ``budget`` suite: what the memory budget every process shares costs,
on the host backend (real Linux virtual memory), each figure measured side
by side with its baseline in one run, samples interleaved.

* The claim in a commit: a commit and release of one 2 MiB granule through
  the raw backend, through a :class:`~extensible_kv.budget.adaptor.BudgetDriver`
  with no limit (the claim is a store into the shared ledger) and through
  one under a limit that never refuses (the claim takes the ledger's lock
  and sums every slot). Microseconds per cycle, and the budget's share of
  it against the goals: at most 5 % of a 2 MiB commit, at most 50 us a claim.
* The bare claim: ``Ledger.claim`` and ``give_back`` of 2 MiB, without and
  with a limit, microseconds per pair.
* Switching engines: two engine processes whose KV caches fit one at a time
  under the limit (1.5 caches). Handing the memory from one to the other
  (its ``release_physical``, then the other's ``recommit``, each timed in
  its process) against starting an engine from nothing (a new Python
  process that imports extensible-kv, makes its cache and commits it,
  timed by this process from the spawn to the child's word that it has).

Every state directory is a new temporary one, so the user's limits are
never touched.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from extensible_kv.bench.measure import MiB, Stats
from extensible_kv.bench.suites import BLOCK_BYTES
from extensible_kv.budget import STATE_DIR_ENV, Ledger
from extensible_kv.buffer import VirtualBuffer
from extensible_kv.devices import BudgetDriver
from extensible_kv.driver import Driver, backend

Row = dict[str, Any]

#: Bytes of each commit and claim: one granule of the host backend.
GRANULE = 2 * MiB
#: Goal: the budget adds at most this share to a 2 MiB commit (percent).
OVERHEAD_GOAL_PCT = 5.0
#: Goal: a claim costs at most this (microseconds).
CLAIM_GOAL_US = 50.0
#: A limit (bytes) no claim of the suite comes near.
NEVER_REFUSES = 1 << 60
#: Layers of each engine's KV cache, two segments (K and V) each.
ENGINE_LAYERS = 8
#: Switches each way (B to A, A to B) per engine B started.
ROUND_TRIPS = 2
#: Seconds an engine process may take to answer.
PATIENCE_S = 120.0


def budget(cycles: int, pairs: int, samples: int, cache_bytes: int, engines: int) -> Row:
    """The three measurements: ``samples`` samples of ``cycles`` commits and
    of ``pairs`` claims in a row each, and the switches between caches of
    ``cache_bytes`` with ``engines`` engine processes started (at least 2)."""
    scratch = _scratch_dir()
    states = {"no_limit": scratch / "no_limit", "limit": scratch / "limit"}
    _set_limit(states["limit"], NEVER_REFUSES)
    return {
        "commit": commit_overhead(states, cycles, samples),
        "claim": bare_claim(states, pairs, samples),
        "switch": switching(cache_bytes, max(engines, 2)),
    }


def _scratch_dir() -> Path:
    """A new directory for state directories, removed when this process
    exits: the budget's publishing thread, which lives as long as the
    process, may write into them until then."""
    path = Path(tempfile.mkdtemp(prefix="extensible-kv-bench-budget-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _set_limit(state: Path, limit: int) -> None:
    """Set the host's limit to ``limit`` bytes in the state directory ``state``."""
    ledger = Ledger(state, backend("cpu").device_uuid(0))
    try:
        ledger.set_limit(limit)
    finally:
        ledger.close()


def _us(samples: list[float]) -> dict[str, float]:
    """Min, median and max of ``samples`` (seconds), in microseconds."""
    return {key: value * 1e6 for key, value in vars(Stats.of(samples)).items()}


def _median(samples: list[float]) -> float:
    return Stats.of(samples).median


# 1. the claim in a commit ----------------------------------------------------------


def _commit_turns(buffers: dict[str, VirtualBuffer], cycles: int) -> dict[str, float]:
    """Seconds per commit and release of one granule in each of
    ``buffers``, averaged over ``cycles``; the buffers take turns cycle by
    cycle, in an order that rotates, so that drift and order weigh on each
    alike."""
    names = list(buffers)
    spent = dict.fromkeys(names, 0.0)
    for k in range(cycles):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            buffer = buffers[name]
            start = time.perf_counter()
            buffer.commit([(0, GRANULE)])
            buffer.release_physical()
            spent[name] += time.perf_counter() - start
    return {name: total / cycles for name, total in spent.items()}


def commit_overhead(states: dict[str, Path], cycles: int, samples: int) -> Row:
    """A 2 MiB commit and release through the raw host backend and through
    a budget in each of ``states`` (``no_limit``, ``limit``: state
    directories): microseconds per cycle (``*_us``), their ratios to the raw
    one, the percent and microseconds the budget adds, and whether the 5 %
    goal is met (by medians)."""
    raw = backend("cpu")
    budgets = {name: BudgetDriver(raw, state_dir=path) for name, path in states.items()}
    drivers: dict[str, Driver] = {"raw": raw, **budgets}
    buffers = {name: VirtualBuffer(GRANULE, driver) for name, driver in drivers.items()}
    try:
        _commit_turns(buffers, 1)  # warm-up: each ledger opened, each slot taken
        per_sample = [_commit_turns(buffers, cycles) for _ in range(samples)]
    finally:
        for buffer in buffers.values():
            buffer.free()
        for driver in budgets.values():
            driver.ledger(0).close()
    taken = {name: [sample[name] for sample in per_sample] for name in drivers}
    a, b, c = (_median(taken[name]) for name in ("raw", "no_limit", "limit"))
    percent = {"no_limit": 100 * (b / a - 1), "limit": 100 * (c / a - 1)}
    return {
        "bytes": GRANULE,
        "cycles_per_sample": cycles,
        "samples": samples,
        **{f"{name}_us": _us(values) for name, values in taken.items()},
        "no_limit_vs_raw": b / a,
        "limit_vs_raw": c / a,
        "no_limit_overhead_pct": percent["no_limit"],
        "limit_overhead_pct": percent["limit"],
        "no_limit_added_us": (b - a) * 1e6,
        "limit_added_us": (c - a) * 1e6,
        "overhead_goal_pct": OVERHEAD_GOAL_PCT,
        "overhead_goal_met": max(percent.values()) <= OVERHEAD_GOAL_PCT,
    }


# 2. the bare claim -------------------------------------------------------------------


def _claim_pairs(ledger: Ledger, pairs: int) -> float:
    """Seconds per ``claim`` and ``give_back`` of one granule, averaged
    over ``pairs`` in a row."""
    start = time.perf_counter()
    for _ in range(pairs):
        ledger.claim(GRANULE)
        ledger.give_back(GRANULE)
    return (time.perf_counter() - start) / pairs


def bare_claim(states: dict[str, Path], pairs: int, samples: int) -> Row:
    """``Ledger.claim`` and ``give_back`` of 2 MiB in each of ``states``
    (``no_limit``, ``limit``), samples taking turns after one untimed turn
    each: microseconds per pair (``*_us``), and whether the slower median
    meets the 50 us goal."""
    uuid = backend("cpu").device_uuid(0)
    ledgers = {name: Ledger(path, uuid) for name, path in states.items()}
    taken: dict[str, list[float]] = {name: [] for name in ledgers}
    try:
        for ledger in ledgers.values():
            _claim_pairs(ledger, pairs)
        for _ in range(samples):
            for name, ledger in ledgers.items():
                taken[name].append(_claim_pairs(ledger, pairs))
    finally:
        for ledger in ledgers.values():
            ledger.close()
    slowest = max(_median(values) for values in taken.values()) * 1e6
    return {
        "bytes": GRANULE,
        "pairs_per_sample": pairs,
        "samples": samples,
        **{f"{name}_us": _us(values) for name, values in taken.items()},
        "claim_goal_us": CLAIM_GOAL_US,
        "claim_goal_met": slowest <= CLAIM_GOAL_US,
    }


# 3. switching engines ----------------------------------------------------------------

#: An engine: ``python -c ENGINE LAYERS LAYER_BYTES BLOCK_BYTES`` makes a KV
#: cache of LAYERS buffers on the host, commits it and says ``committed
#: SECONDS``; then for each line ``release_physical`` or ``recommit`` makes
#: that call on the cache and says ``done SECONDS``; ``quit`` frees the cache
#: and ends. It imports nothing of the bench: its start is an engine's own.
ENGINE = """
import sys, time
from extensible_kv import ExtensibleTensor
from extensible_kv.kv import KVCacheBuffers

layers, layer_bytes, block = map(int, sys.argv[1:4])
start = time.perf_counter()
blocks = layer_bytes // (2 * block)
tensors = [(ExtensibleTensor(layer_bytes, "cpu", num_segments=2), block) for _ in range(layers)]
cache = KVCacheBuffers(tensors, blocks)
cache.commit(blocks)
print("committed", time.perf_counter() - start, flush=True)
for line in sys.stdin:
    verb = line.strip()
    if verb == "quit":
        break
    start = time.perf_counter()
    getattr(cache, verb)()
    print("done", time.perf_counter() - start, flush=True)
cache.free()
"""


class _Engine:
    """An engine process (:data:`ENGINE`) on the state directory ``env``
    names, told what to do line by line."""

    def __init__(self, env: dict[str, str], layer_bytes: int) -> None:
        command = [sys.executable, "-c", ENGINE, str(ENGINE_LAYERS), str(layer_bytes)]
        self.spawned = time.perf_counter()
        self.process = subprocess.Popen(
            [*command, str(BLOCK_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def answer(self, word: str) -> float:
        """The seconds in the engine's next line, which must be ``word SECONDS``."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], PATIENCE_S)
        line = self.process.stdout.readline().split() if ready else []
        if len(line) != 2 or line[0] != word:
            raise RuntimeError(
                f"engine process {self.process.pid} answered {line or 'nothing'} instead of "
                f"{word!r} (exit status {self.process.poll()}; its stderr is above)"
            )
        return float(line[1])

    def started(self) -> tuple[float, float]:
        """Seconds from the spawn until the engine said its cache is
        committed (timed here), and of making and committing the cache
        (timed there)."""
        inside = self.answer("committed")
        return time.perf_counter() - self.spawned, inside

    def call(self, method: str) -> float:
        """Seconds ``method`` of the engine's cache took, timed in the engine."""
        self._tell(method)
        return self.answer("done")

    def quit(self) -> None:
        """Have the engine free its cache, and wait for it to end."""
        self._tell("quit")
        self.process.wait(PATIENCE_S)
        self.close()

    def close(self) -> None:
        """Kill the engine if it still runs; close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def _tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()


def switching(cache_bytes: int, engines: int) -> Row:
    """Engine A and, one after another, ``engines - 1`` engines B, each
    with a KV cache of about ``cache_bytes`` under a limit of 1.5 caches.

    Each B starts from nothing while A sleeps (a start sample), then the
    memory goes from B to A and back :data:`ROUND_TRIPS` times (switch
    samples: the release and the recommit, each timed in its engine), then
    B frees its cache and ends. Seconds, min/median/max; ``start_vs_switch``
    is how many times a switch is faster than a start, by medians.
    """
    unit = 2 * GRANULE
    layer_bytes = max(1, cache_bytes // ENGINE_LAYERS // unit) * unit
    size = ENGINE_LAYERS * layer_bytes
    starts: list[tuple[float, float]] = []
    switches: list[tuple[float, float]] = []
    with (
        tempfile.TemporaryDirectory(prefix="extensible-kv-bench-budget-") as state,
        ExitStack() as live,
    ):
        _set_limit(Path(state), 3 * size // 2)
        env = os.environ | {STATE_DIR_ENV: state}

        def start() -> _Engine:
            engine = _Engine(env, layer_bytes)
            live.callback(engine.close)
            starts.append(engine.started())
            return engine

        a = start()
        a.call("release_physical")
        for _ in range(engines - 1):
            b = start()
            for _ in range(ROUND_TRIPS):
                switches.append(_switch(b, a))
                switches.append(_switch(a, b))
            b.quit()
    return _switch_row(size, starts, switches)


def _switch(source: _Engine, target: _Engine) -> tuple[float, float]:
    """Seconds of ``source``'s release and of ``target``'s recommit after it."""
    return source.call("release_physical"), target.call("recommit")


def _switch_row(
    size: int, starts: list[tuple[float, float]], switches: list[tuple[float, float]]
) -> Row:
    release, recommit = ([pair[i] for pair in switches] for i in (0, 1))
    whole = Stats.of([sum(pair) for pair in switches])
    start = Stats.of([spawn for spawn, _ in starts])
    return {
        "cache_bytes": size,
        "limit_bytes": 3 * size // 2,
        "layers": ENGINE_LAYERS,
        "engines_started": len(starts),
        "switches": len(switches),
        "release_s": vars(Stats.of(release)),
        "recommit_s": vars(Stats.of(recommit)),
        "switch_s": vars(whole),
        "start_s": vars(start),
        "start_commit_s": vars(Stats.of([inside for _, inside in starts])),
        "start_vs_switch": start.median / whole.median,
    }
