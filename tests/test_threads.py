"""Threads sharing one KV cache, as a runner's do: data a thread wrote is
never lost to another thread's commit.

Four threads share one ``KVCacheBuffers`` over a ``PoolingDriver``. Reads
and writes of committed blocks (each thread owns the blocks ``i`` with
``i % 4 == thread``), ``commit``, ``commit_async``, ``ensure_blocks`` and
``create_ahead`` run under a shared lock; ``release_physical`` (both
kinds), ``recommit``, ``trim`` and a preserving ``defragment`` under an
exclusive one, as a runner stops its kernels for them. The model: each
block a thread wrote holds its value until a discarding call (a
discarding sleep, a trim below it) drops it.

A sleep and its wake are separate steps, so commits wake the cache too,
and ``create_ahead`` is not waited for: its fills run on while the other
threads commit, sleep and wake, as an engine reserving during its weight
reload leaves them. Before the pool's fix, such a fill racing a sleep's
drain released a handle twice and left it idle: on the host the next
release failed ("no live handle"); on a driver that hands a released
handle's value out again (HIP's handles are pointers) the stale entry
named another tensor's memory, and the next growth mapped it a second
time and zeroed it, the data loss this test was written for.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import pytest

from extensible_kv import ExtensibleTensor, PoolingDriver, StatisticsDriver
from extensible_kv.kv import KVCacheBuffers

THREADS = 4
CAPACITY = 64
PER_BLOCK = 72 * 1024 + 16  # blocks straddle granules; a segment spans a few


class SharedExclusiveLock:
    """Many holders in shared mode, or one in exclusive mode."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Runner:
    def __init__(self, cache: KVCacheBuffers) -> None:
        self.cache = cache
        self.lock = SharedExclusiveLock()
        self.owned: list[dict[int, int]] = [{} for _ in range(THREADS)]
        self.errors: list[str] = []
        self.fills: list[Future[int]] = []

    def view(self, buffer: ExtensibleTensor, segment: int, index: int) -> object:
        start = segment * buffer.segment_capacity_bytes + index * PER_BLOCK
        return buffer.full_view()[start : start + PER_BLOCK]

    def mine(self, me: int) -> list[int]:
        return list(range(me, self.cache.num_blocks_committed, THREADS))

    def write(self, me: int, rng: random.Random) -> None:
        # Asleep (only an exclusive step puts it to sleep), nothing is touched.
        mine = [] if self.cache.asleep else self.mine(me)
        if not mine:
            return
        index, value = rng.choice(mine), rng.randrange(1, 256)
        for buffer, _ in self.cache.buffers:
            for segment in range(buffer.num_segments):
                self.view(buffer, segment, index).fill_(value)  # type: ignore[attr-defined]
        self.owned[me][index] = value

    def check(self, me: int) -> None:
        if self.cache.asleep:
            return
        for index, value in self.owned[me].items():
            for b, (buffer, _) in enumerate(self.cache.buffers):
                for segment in range(buffer.num_segments):
                    block = self.view(buffer, segment, index)
                    if not bool(block.eq(value).all()):  # type: ignore[attr-defined]
                        found = int(block[0])  # type: ignore[index]
                        self.errors.append(
                            f"thread {me}: block {index} of buffer {b} segment {segment} "
                            f"reads {found}, wrote {value}"
                        )

    def forget_from(self, first: int) -> None:
        """Under the exclusive lock: blocks from ``first`` on were discarded."""
        for owned in self.owned:
            for index in [i for i in owned if i >= first]:
                del owned[index]

    def shared_step(self, me: int, rng: random.Random) -> None:
        n = rng.randrange(1, CAPACITY + 1)
        steps: list[Callable[[], object]] = [
            lambda: self.write(me, rng),
            lambda: self.write(me, rng),
            lambda: self.check(me),
            lambda: self.cache.commit(n),
            lambda: self.cache.commit_async(n).result().wait(),
            lambda: self.cache.ensure_blocks(n),
            lambda: self.fills.append(self.cache.create_ahead(n)),
        ]
        with self.lock.shared():
            rng.choice(steps)()

    def exclusive_step(self, rng: random.Random) -> None:
        with self.lock.exclusive():
            choice = rng.randrange(5)
            if choice == 0:
                self.cache.release_physical(preserve=True)
            elif choice == 1:
                self.cache.release_physical()
                self.forget_from(0)
            elif choice == 2:
                self.cache.recommit(keep_host_memory=rng.random() < 0.5)
            elif self.cache.asleep:
                pass  # trim and defragment are for an awake cache
            elif choice == 3:
                n = rng.randrange(0, self.cache.num_blocks_committed + 1)
                self.cache.trim(n)
                self.forget_from(n)
            else:
                self.cache.defragment(preserve=True)
            for me in range(THREADS):
                self.check(me)

    def run(self, me: int, seed: int, steps: int) -> None:
        rng = random.Random(seed * 100 + me)
        try:
            for _ in range(steps):
                if rng.random() < 0.1:
                    self.exclusive_step(rng)
                else:
                    self.shared_step(me, rng)
            with self.lock.shared():
                self.check(me)
        except BaseException as exc:
            self.errors.append(f"thread {me}: {exc!r}")


@pytest.mark.parametrize("granules_per_chunk", [1, None])
@pytest.mark.parametrize("seed", range(6))
def test_no_thread_loses_what_it_wrote_to_another_threads_commit(
    stats: StatisticsDriver, device: str, seed: int, granules_per_chunk: int | None
) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=64 * g)
    chunk = None if granules_per_chunk is None else granules_per_chunk * g
    buffers = [
        (
            ExtensibleTensor(CAPACITY * PER_BLOCK * s, device, s, driver=pool, chunk_bytes=chunk),
            PER_BLOCK,
        )
        for s in (2, 1)
    ]
    runner = Runner(KVCacheBuffers(buffers, CAPACITY))
    runner.cache.commit(THREADS)
    threads = [threading.Thread(target=runner.run, args=(me, seed, 150)) for me in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    for fill in runner.fills:
        fill.result(60)
    runner.cache.recommit()  # what a preserving sleep kept comes back
    for me in range(THREADS):
        runner.check(me)
    runner.cache.free()
    pool.drain()  # free() gives memory to the pool, as an RMM deallocation does
    assert runner.errors == []
