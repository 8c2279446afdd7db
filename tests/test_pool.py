"""PoolingDriver: released handles are reused by the next commit of their
kind, within a cap; a sleep drains the pool; reused memory is zeroed when
asked; memory a peer may map is never handed out again; nothing leaks or is
released twice, whatever the sequence or the interleaving of threads."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from extensible_kv import (
    BudgetDriver,
    BudgetExceededError,
    ExtensibleTensor,
    FaultInjectingDriver,
    PoolingDriver,
    StatisticsDriver,
    get_driver,
)
from extensible_kv.driver import Driver, DriverAdaptor, DriverError, backend
from extensible_kv.kv import KVCacheBuffers
from extensible_kv.share import receive_tensor, send_tensor


def test_a_released_handle_serves_the_next_create_of_its_kind(stats: StatisticsDriver) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=2 * g)
    with pool.context(0):
        first = pool.create(g, 0, False)
        pool.release(first)
        assert pool.idle_bytes == g
        assert stats.live.handles == 1, "kept, not released to the driver"
        assert pool.create(g, 0, False) == first
        assert (pool.hits, pool.misses) == (1, 1)
        other = pool.create(2 * g, 0, False)
        assert other != first
        assert pool.misses == 2, "another size is another kind"
        pool.release(first)
        pool.release(other)
        assert pool.idle_bytes == g, "the cap keeps 2 granules: the larger went to the driver"
        assert pool.drain() == g
        assert pool.idle_bytes == 0
    assert stats.live.handles == 0


def test_a_handle_released_while_mapped_goes_to_the_driver(stats: StatisticsDriver) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats)
    with pool.context(0):
        ptr = pool.reserve(g, g)
        handle = pool.create(g, 0, False)
        pool.map(ptr, g, handle)
        pool.release(handle)  # the memory goes once unmapped
        assert pool.idle_handles == 0
        pool.unmap(ptr, g)
        pool.free_reserved(ptr, g)
    assert stats.live.handles == 0


def test_reused_memory_is_zeroed_when_the_commit_asks(driver: Driver, device: str) -> None:
    g = driver.granularity(0, False)
    pool = PoolingDriver(driver)
    assert pool.zeroes_new_memory is False
    tensor = ExtensibleTensor(4 * g, device, driver=pool, chunk_bytes=g)
    tensor.resize_per_segment_(4 * g, zero_new=True)
    tensor.full_view().fill_(9)
    tensor.shrink_per_segment_(g)
    assert pool.idle_bytes == 3 * g, "trimmed granules wait in the pool"
    tensor.resize_per_segment_(4 * g, zero_new=True)
    assert pool.hits == 3
    assert pool.idle_bytes == 0
    full = tensor.full_view()
    assert bool((full[:g] == 9).all())
    assert int(full[g:].count_nonzero()) == 0
    del full
    tensor.free()
    assert pool.idle_bytes == 4 * g, "free returns the memory to the pool"
    pool.release_idle()


def test_a_sleep_gives_every_byte_back_and_free_feeds_the_pool(stats: StatisticsDriver) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=64 * g)
    tensors = [ExtensibleTensor(2 * g, "cpu", driver=pool, chunk_bytes=g) for _ in range(2)]
    cache = KVCacheBuffers([(t, g) for t in tensors], 2)
    cache.commit(2)
    cache.trim(1)
    assert pool.idle_bytes == 2 * g
    cache.release_physical()
    assert pool.idle_bytes == 0
    assert stats.live.handles == 0, "a sleep drains the pool"
    cache.recommit()
    assert stats.live.handles == 2, "one block of each tensor, as it slept"
    cache.free()
    assert pool.idle_bytes == 2 * g
    assert pool.drain() == 2 * g


def test_fill_creates_ahead_within_the_cap_and_in_the_background(
    stats: StatisticsDriver,
) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=3 * g)
    assert pool.fill(g, 5) == 3
    assert pool.idle_bytes == 3 * g
    pool.drain()
    assert pool.fill_in_background(g, 2).result(timeout=60) == 2
    tensor = ExtensibleTensor(2 * g, "cpu", driver=pool, chunk_bytes=g)
    tensor.resize_(2 * g)
    assert (pool.hits, pool.idle_bytes) == (2, 0), "the commit took the filled handles"
    tensor.free()
    pool.drain()


def test_a_failing_release_in_a_drain_keeps_the_rest_for_a_retry(
    stats: StatisticsDriver,
) -> None:
    g = stats.granularity(0, False)
    faulty = FaultInjectingDriver(stats)
    pool = PoolingDriver(faulty, cap_bytes=4 * g)
    pool.fill(g, 3)
    faulty.fail_at("release", nth=2)
    with pytest.raises(DriverError, match="injected"):
        pool.drain()
    assert pool.idle_bytes == 2 * g
    assert stats.live.handles == 2
    assert pool.drain() == 2 * g
    assert stats.live.handles == 0


class PoolMachine(RuleBasedStateMachine):
    """Random commits, trims, sleeps and drains of a tensor over a pool,
    against the driver's own count of live handles."""

    def __init__(self) -> None:
        super().__init__()
        from extensible_kv import get_driver

        self.stats = StatisticsDriver(get_driver("cpu"))
        self.g = self.stats.granularity(0, False)
        self.pool = PoolingDriver(self.stats, cap_bytes=3 * self.g)
        self.tensor = ExtensibleTensor(6 * self.g, "cpu", driver=self.pool, chunk_bytes=self.g)

    @rule(granules=st.integers(0, 6))
    def resize(self, granules: int) -> None:
        old = self.tensor.bytes_per_segment
        if granules * self.g >= old:
            self.tensor.resize_per_segment_(granules * self.g, zero_new=True)
            grown = self.tensor.tensor[old:]
            assert int(grown.count_nonzero()) == 0, "reused memory shows zeros"
        else:
            self.tensor.shrink_per_segment_(granules * self.g)

    @rule()
    def write(self) -> None:
        self.tensor.tensor.fill_(3)

    @rule()
    def sleep(self) -> None:
        self.tensor.release_physical()
        assert self.pool.idle_bytes == 0

    @rule()
    def drain(self) -> None:
        self.pool.drain()

    @rule(count=st.integers(1, 4))
    def fill(self, count: int) -> None:
        self.pool.fill(self.g, count)

    @rule(granules=st.integers(0, 6))
    def create_ahead(self, granules: int) -> None:
        missing = max(granules * self.g - self.tensor.bytes_per_segment, 0)
        room = self.pool.cap_bytes - self.pool.idle_bytes
        added = self.tensor.create_ahead(granules * self.g).result(timeout=60)
        assert added == min(missing, room // self.g * self.g)

    @invariant()
    def every_handle_is_mapped_or_idle(self) -> None:
        live = self.stats.live
        mapped = self.tensor.physical_bytes // self.g
        assert live.handles == mapped + self.pool.idle_handles
        assert self.pool.idle_bytes <= self.pool.cap_bytes
        assert live.mapped_bytes == self.tensor.physical_bytes

    def teardown(self) -> None:
        self.tensor.free()
        self.pool.drain()
        assert self.stats.live.handles == 0
        assert self.stats.live.mappings == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


def test_zero_filled_commits_hide_what_reused_memory_held(driver: Driver, device: str) -> None:
    g = driver.granularity(0, False)
    pool = PoolingDriver(driver)
    first = ExtensibleTensor(g, device, driver=pool)
    first.resize_(g).fill_(5)
    first.free()
    second = ExtensibleTensor(g, device, driver=pool)
    second.resize_per_segment_(g, zero_new=True)
    assert pool.hits == 1, "the second tensor got the first one's memory"
    assert int(second.tensor.count_nonzero()) == 0
    second.free()
    pool.drain()


def test_a_failing_create_in_a_fill_keeps_what_it_made(stats: StatisticsDriver) -> None:
    g = stats.granularity(0, False)
    faulty = FaultInjectingDriver(stats)
    pool = PoolingDriver(faulty, cap_bytes=4 * g)
    faulty.fail_at("create", nth=2)
    with pytest.raises(DriverError, match="injected"):
        pool.fill(g, 3)
    assert pool.idle_handles == 1
    assert stats.live.handles == 1
    pool.drain()


def test_a_wake_after_create_ahead_creates_nothing(stats: StatisticsDriver) -> None:
    """Reserved while asleep (on a thread of its own, which a GPU driver
    must give a context), the wake's handles all come from the pool."""
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=64 * g)
    tensors = [ExtensibleTensor(8 * g, "cpu", driver=pool, chunk_bytes=g) for _ in range(3)]
    cache = KVCacheBuffers([(t, g) for t in tensors], 8)
    cache.commit(6)
    cache.release_physical()
    assert cache.create_ahead(6).result(timeout=60) == 3 * 6 * g
    assert stats.live.handles == 18, "the reserved memory is held, idle in the pool"
    creates = stats.calls["create"].calls
    cache.recommit()
    assert stats.calls["create"].calls == creates, "the wake only mapped"
    assert (pool.idle_bytes, cache.physical_bytes) == (0, 18 * g)
    assert cache.create_ahead(8).result(timeout=60) == 3 * 2 * g, "only what growing adds"
    assert cache.create_ahead(3).result(timeout=60) == 0, "not a growth: nothing to reserve"
    creates = stats.calls["create"].calls
    cache.commit(8)
    assert stats.calls["create"].calls == creates
    cache.free()
    pool.drain()


def test_create_ahead_stops_at_the_cap_and_the_growth_creates_the_rest(
    stats: StatisticsDriver,
) -> None:
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=2 * g)
    tensor = ExtensibleTensor(5 * g, "cpu", driver=pool, chunk_bytes=g)
    assert tensor.create_ahead(5 * g).result(timeout=60) == 2 * g
    tensor.resize_(5 * g)
    assert (pool.hits, pool.idle_bytes, tensor.physical_bytes) == (2, 0, 5 * g)
    tensor.free()
    pool.drain()


def test_create_ahead_refuses_bad_requests_and_needs_a_pool(stats: StatisticsDriver) -> None:
    g = stats.granularity(0, False)
    plain = ExtensibleTensor(2 * g, "cpu", driver=stats)
    with pytest.raises(ValueError, match="create_ahead\\(\\) fills a PoolingDriver"):
        plain.create_ahead(g)
    plain.free()
    pool = PoolingDriver(stats)
    tensor = ExtensibleTensor(2 * g, "cpu", driver=pool)
    for bad, message in ((3 * g, "exceeds the segment capacity"), (-1, "non-negative")):
        with pytest.raises(ValueError, match=message):
            tensor.create_ahead(bad)
    cache = KVCacheBuffers([(tensor, g)], 2)
    with pytest.raises(ValueError, match="cannot create ahead for 3 blocks; the capacity is 2"):
        cache.create_ahead(3)
    assert stats.live.handles == 0, "a refused request creates nothing"
    cache.free()


def test_a_failing_create_while_reserving_surfaces_in_the_future(
    stats: StatisticsDriver,
) -> None:
    g = stats.granularity(0, False)
    faulty = FaultInjectingDriver(stats)
    pool = PoolingDriver(faulty, cap_bytes=4 * g)
    tensor = ExtensibleTensor(4 * g, "cpu", driver=pool, chunk_bytes=g)
    faulty.fail_at("create", nth=3)
    with pytest.raises(DriverError, match="injected"):
        tensor.create_ahead(4 * g).result(timeout=60)
    assert pool.idle_handles == 2, "the handles made before the failure stay idle"
    tensor.resize_(4 * g)
    assert pool.hits == 2
    tensor.free()
    pool.drain()
    assert stats.live.handles == 0


class GateDriver(DriverAdaptor):
    """Stops the first call named ``at`` on its way to the driver until
    :attr:`opened` is set (30 s at most): a test then acts while that call
    is known to be in flight. :attr:`entered` says the call got there."""

    def __init__(self, inner: Driver, at: str) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self.opened = threading.Event()
        self._at = at
        self._lock = threading.Lock()
        self._armed = True

    def _call(self, name: str, *args: Any) -> Any:
        if name == self._at:
            with self._lock:
                first, self._armed = self._armed, False
            if first:
                self.entered.set()
                self.opened.wait(30)
        return super()._call(name, *args)


def test_memory_a_peer_maps_never_serves_another_tensor(
    stats: StatisticsDriver, device: str
) -> None:
    """Freed after an export, shareable memory goes to the driver: the
    importer keeps its mapping, and the next tensor gets memory of its own."""
    g = stats.granularity(0, True)
    pool = PoolingDriver(stats, cap_bytes=8 * g)
    exporter = ExtensibleTensor(2 * g, device, shareable=True, driver=pool)
    exporter.resize_(2 * g)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_tensor(ours, exporter)
        importer = receive_tensor(theirs, device, driver=stats)
    exporter.free()
    assert pool.idle_handles == 0, "exported memory waits in the pool"
    successor = ExtensibleTensor(2 * g, device, shareable=True, driver=pool)
    successor.resize_per_segment_(2 * g, zero_new=True)
    importer.tensor.fill_(0x11)
    assert pool.hits == 0
    assert int(successor.tensor.count_nonzero()) == 0, "the importer writes into the successor"
    importer.free()
    successor.free()
    assert pool.idle_handles == 0
    assert stats.live.handles == 0


def test_a_drain_racing_a_create_releases_only_idle_handles(stats: StatisticsDriver) -> None:
    """The create runs while the drain is inside the driver's release: it
    must get the other handle, alive, and the drain must leak nothing."""
    g = stats.granularity(0, False)
    gate = GateDriver(stats, "release")
    pool = PoolingDriver(gate, cap_bytes=2 * g)
    assert pool.fill(g, 2) == 2
    with ThreadPoolExecutor(1) as executor:
        draining = executor.submit(pool.drain)
        try:
            assert gate.entered.wait(30), "the drain never reached the driver"
            taken = pool.create(g, 0, False)
        finally:
            gate.opened.set()
        assert draining.result(timeout=30) == g
    assert (pool.idle_handles, stats.live.handles) == (0, 1)
    with pool.context(0):
        ptr = pool.reserve(g, g)
        pool.map(ptr, g, taken)  # fails if the drain released the handle taken
        pool.unmap(ptr, g)
        pool.free_reserved(ptr, g)
        pool.release(taken)
    assert pool.drain() == g
    assert stats.live.handles == 0


def test_concurrent_fills_stay_within_the_cap(stats: StatisticsDriver) -> None:
    """A second fill runs while the first one's create is in flight."""
    g = stats.granularity(0, False)
    gate = GateDriver(stats, "create")
    pool = PoolingDriver(gate, cap_bytes=g)
    with ThreadPoolExecutor(1) as executor:
        first = executor.submit(pool.fill, g, 1)
        try:
            assert gate.entered.wait(30), "the first fill never reached the driver"
            second = pool.fill(g, 1)
        finally:
            gate.opened.set()
        added = first.result(timeout=30) + second
    assert added == 1
    assert (pool.idle_bytes, stats.live.handles) == (g, 1)
    pool.drain()


def test_a_second_release_of_an_idle_handle_is_refused(stats: StatisticsDriver) -> None:
    """As the driver refuses a handle released already; mapping it is
    refused too, since the next create may hand it out."""
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=4 * g)
    with pool.context(0):
        handle = pool.create(g, 0, False)
        pool.release(handle)
        with pytest.raises(DriverError, match="already released: it is idle in the pool") as exc:
            pool.release(handle)
        assert exc.value.call == "release"
        ptr = pool.reserve(g, g)
        with pytest.raises(DriverError, match="already released"):
            pool.map(ptr, g, handle)
        pool.free_reserved(ptr, g)
        first, second = pool.create(g, 0, False), pool.create(g, 0, False)
        assert first != second, "two creates got one handle"
        pool.release(first)
        pool.release(second)
    assert pool.drain() == 2 * g, "a later sleep fails"
    assert stats.live.handles == 0


def test_a_sleep_drains_shareable_and_plain_handles_alike(
    stats: StatisticsDriver, device: str
) -> None:
    """Trimmed plain memory waits in the pool, trimmed shareable memory goes
    to the driver, handles filled ahead wait for both kinds; a sleep then
    leaves nothing idle and nothing alive."""
    plain_g, shared_g = stats.granularity(0, False), stats.granularity(0, True)
    pool = PoolingDriver(stats, cap_bytes=16 * shared_g)
    plain = ExtensibleTensor(4 * plain_g, device, driver=pool, chunk_bytes=plain_g)
    shared = ExtensibleTensor(
        4 * shared_g, device, shareable=True, driver=pool, chunk_bytes=shared_g
    )
    cache = KVCacheBuffers([(plain, plain_g), (shared, shared_g)], 4)
    cache.commit(4)
    cache.trim(1)
    assert pool.idle_bytes == 3 * plain_g, "only the plain handles wait in the pool"
    assert pool.fill(shared_g, 2, shareable=True) == 2
    assert pool.idle_handles == 5
    cache.release_physical()
    assert pool.idle_handles == 0
    assert stats.live.handles == 0
    cache.free()


@pytest.mark.parametrize("chunk_granules", [None, 3])
def test_create_ahead_creates_the_chunks_a_tensor_growth_maps(
    stats: StatisticsDriver, device: str, chunk_granules: int | None
) -> None:
    """Two segments grow from 1 to 7 granules each: one 6-granule chunk per
    segment, or two 3-granule chunks, all taken from the pool."""
    g = stats.granularity(0, False)
    chunk = None if chunk_granules is None else chunk_granules * g
    pool = PoolingDriver(stats, cap_bytes=64 * g)
    tensor = ExtensibleTensor(16 * g, device, num_segments=2, driver=pool, chunk_bytes=chunk)
    tensor.resize_per_segment_(g)
    assert tensor.create_ahead(7 * g).result(timeout=60) == 2 * 6 * g
    creates = stats.calls["create"].calls
    tensor.resize_per_segment_(7 * g)
    assert stats.calls["create"].calls == creates, "the growth missed the pool"
    assert pool.hits == (2 if chunk is None else 4)
    assert (pool.idle_bytes, tensor.physical_bytes) == (0, 2 * 7 * g)
    tensor.free()
    pool.drain()


@pytest.mark.parametrize("chunk_granules", [None, 2])
def test_create_ahead_creates_the_chunks_a_cache_wake_maps(
    stats: StatisticsDriver, device: str, chunk_granules: int | None
) -> None:
    """Two buffers of 6 one-granule blocks wake from a discarding sleep:
    one 6-granule chunk per buffer, or three 2-granule chunks."""
    g = stats.granularity(0, False)
    chunk = None if chunk_granules is None else chunk_granules * g
    pool = PoolingDriver(stats, cap_bytes=64 * g)
    tensors = [ExtensibleTensor(8 * g, device, driver=pool, chunk_bytes=chunk) for _ in range(2)]
    cache = KVCacheBuffers([(t, g) for t in tensors], 8)
    cache.commit(6)
    cache.release_physical()
    assert cache.create_ahead(6).result(timeout=60) == 2 * 6 * g
    creates = stats.calls["create"].calls
    cache.recommit()
    assert stats.calls["create"].calls == creates, "the wake missed the pool"
    assert pool.hits == (2 if chunk is None else 6)
    assert (pool.idle_bytes, cache.physical_bytes) == (0, 2 * 6 * g)
    cache.free()
    pool.drain()


def test_a_cache_growth_into_pooled_memory_reads_zero(stats: StatisticsDriver, device: str) -> None:
    """The trimmed blocks held nonzero bytes; grown back from the pool, the
    new blocks read zero and the kept block keeps its bytes."""
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=16 * g)
    tensor = ExtensibleTensor(8 * g, device, num_segments=2, driver=pool, chunk_bytes=g)
    cache = KVCacheBuffers([(tensor, g)], 4)
    cache.commit(4)
    tensor.full_view().fill_(0x5A)
    cache.trim(1)
    cache.commit(4)
    assert pool.hits == 2 * 3, "the growth took the trimmed handles"
    for index in range(2):
        segment = tensor.segment(index)
        assert bool(segment[:g].eq(0x5A).all())
        assert int(segment[g:].count_nonzero()) == 0, "reused memory shows its old bytes"
    del segment
    cache.free()
    pool.drain()


@pytest.mark.parametrize("cap", [1.5, float("nan"), True, -1, "1GiB", 1 << 64])
def test_a_bad_cap_is_refused(cap: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="cap_bytes"):
        PoolingDriver(get_driver("cpu"), cap_bytes=cap)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((True, 1), "size must be an int"),
        ((2 << 20, 1.0), "count must be an int"),
        ((2 << 20, 1, 0, "yes"), "shareable must be a bool"),
        ((0, 1), "positive size"),
        ((2 << 20, -1), "count"),
    ],
)
def test_bad_fills_are_refused_and_fill_nothing(args: tuple[Any, ...], message: str) -> None:
    pool = PoolingDriver(get_driver("cpu"))
    with pytest.raises((TypeError, ValueError), match=message):
        pool.fill(*args)
    assert pool.idle_handles == 0


@pytest.mark.parametrize(
    ("size", "credit", "message"),
    [
        (-(2 << 20), 0, "size must be between 0"),
        (True, 0, "size must be an int"),
        (0, float("nan"), "credit must be an int"),
        (0, -1, "credit must be between 0"),
    ],
)
def test_a_bad_hold_is_refused_before_the_pool_counts_it(
    size: Any, credit: Any, message: str
) -> None:
    """A pool checks a hold as the budget below it does: a negative size
    is not quietly read as nothing."""
    pool = PoolingDriver(get_driver("cpu"))
    with pytest.raises((TypeError, ValueError), match=message):
        pool.holding(0, size, credit=credit)


def test_a_sleep_gives_back_what_a_fill_in_flight_creates(
    stats: StatisticsDriver, device: str
) -> None:
    """A create_ahead still creating when the cache sleeps: the sleep
    stops it and waits for its create in flight, so no memory is left in
    the pool (or anywhere) once the sleep has returned."""
    g = stats.granularity(0, False)
    gate = GateDriver(stats, "create")
    pool = PoolingDriver(gate, cap_bytes=16 * g)
    tensor = ExtensibleTensor(16 * g, device, driver=pool, chunk_bytes=g)
    reserving = tensor.create_ahead(8 * g)  # its first create waits at the gate
    assert gate.entered.wait(10), "the fill never reached the driver"
    sleeping = threading.Thread(target=tensor.release_physical)
    sleeping.start()
    sleeping.join(0.5)  # on its own, the sleep does not get past the fill in flight
    gate.opened.set()
    sleeping.join(30)
    reserving.result(30)
    assert pool.idle_handles == 0
    assert stats.live.handles == 0
    tensor.free()


# -- a pool over a budget: the hold a piece of work asks for goes through it ---------


def test_a_commit_a_pool_over_a_full_budget_cannot_serve_is_refused_holding_nothing(
    tmp_path: Path,
) -> None:
    """The commit holds its memory up front (the protocol's ``holding``),
    through the pool: refused before any handle is made, none left idle."""
    budget = BudgetDriver(backend("cpu"), state_dir=tmp_path)
    stats = StatisticsDriver(budget)
    pool = PoolingDriver(stats)
    g = pool.granularity(0, False)
    budget.ledger(0).set_limit(2 * g)
    tensor = ExtensibleTensor(4 * g, "cpu", driver=pool, chunk_bytes=g)
    with pytest.raises(BudgetExceededError):
        tensor.resize_(3 * g)
    assert stats.calls["create"].calls == 0, "refused before it made anything"
    assert (tensor.physical_bytes, pool.idle_bytes, budget.ledger(0).held) == (0, 0, 0)
    tensor.free()


def test_what_a_pool_keeps_idle_serves_a_commit_under_a_full_budget(tmp_path: Path) -> None:
    """Idle handles hold their claim already: the hold asks the budget only
    for what they will not serve, so a growth back into them is not refused."""
    budget = BudgetDriver(backend("cpu"), state_dir=tmp_path)
    pool = PoolingDriver(budget)
    g = pool.granularity(0, False)
    budget.ledger(0).set_limit(3 * g)
    tensor = ExtensibleTensor(4 * g, "cpu", driver=pool, chunk_bytes=g)
    tensor.resize_(3 * g)
    tensor.shrink_per_segment_(g)
    assert (pool.idle_bytes, budget.ledger(0).held) == (2 * g, 3 * g)
    tensor.resize_(3 * g)
    assert (pool.hits, pool.idle_bytes, budget.ledger(0).held) == (2, 0, 3 * g)
    with pytest.raises(BudgetExceededError):
        tensor.resize_(4 * g)
    assert tensor.physical_bytes == 3 * g
    tensor.free()  # into the pool: only a sleep or a drain gives idle memory back
    assert pool.release_idle() == 3 * g
    assert budget.ledger(0).held == 0


def test_reserve_ahead_stays_the_old_name_of_create_ahead(stats: StatisticsDriver) -> None:
    """docs/api.md's old names: code written against 0.1 keeps working."""
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=8 * g)
    tensor = ExtensibleTensor(4 * g, "cpu", driver=pool, chunk_bytes=g)
    cache = KVCacheBuffers([(tensor, g)], 4)
    assert cache.reserve_ahead(2).result(timeout=60) == 2 * g
    assert tensor.reserve_ahead(3 * g).result(timeout=60) == 3 * g, "it counts no idle handle"
    cache.free()
    pool.release_idle()
