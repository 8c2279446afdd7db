"""Elastic memory (kv/growth/elastic.py): a cache holds exactly the units a
scheduler orders, any of them, and gives back every granule no held unit
touches, holes included."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extensible_kv import (
    BudgetExceededError,
    DriverError,
    FaultInjectingDriver,
    PoolingDriver,
    StatisticsDriver,
    get_driver,
)
from extensible_kv.driver import Driver
from extensible_kv.integrations.vllm.worker.state import kv_state
from extensible_kv.kv import KVCacheBuffers, SleepState
from extensible_kv.kv.cache.published import published
from extensible_kv.kv.growth.elastic import ElasticBlocks, ElasticOrders, ranges_of, units_of
from faults import Fault, attempt
from test_growth import fill, reads
from test_kv_buffers import CAPACITY, make_cache


def elastic_cache(device: str, driver: Driver) -> KVCacheBuffers:
    """test_kv_buffers' cache, one chunk per granule."""
    return make_cache(device, driver, chunk_bytes=driver.granularity(0, False))


def expected_physical(cache: KVCacheBuffers, blocks: set[int], granule: int) -> int:
    """Bytes of the granules covering ``blocks`` in every buffer and segment."""
    total = 0
    for tensor, per_block in cache.buffers:
        granules = set()
        for segment in range(tensor.num_segments):
            for b in blocks:
                start = segment * tensor.segment_capacity_bytes + b * per_block
                granules.update(range(start // granule, (start + per_block - 1) // granule + 1))
        total += len(granules) * granule
    return total


def blocks_of(units: set[int], per_unit: int) -> set[int]:
    return {b for u in units for b in range(u * per_unit, min((u + 1) * per_unit, CAPACITY))}


@pytest.fixture
def cache(stats: StatisticsDriver, device: str) -> Iterator[KVCacheBuffers]:
    made = elastic_cache(device, stats)
    yield made
    made.free()


def test_holds_exactly_the_units_ordered_holes_included(
    cache: KVCacheBuffers, stats: StatisticsDriver
) -> None:
    granule = stats.granularity(0, False)
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    assert elastic.held_units == ((0, 1),)
    report = elastic.apply(ElasticOrders(1, 4, held=((0, 1), (14, 16))))
    assert report.granted == 0
    held = blocks_of({0, 14, 15}, 4)
    assert cache.physical_bytes == expected_physical(cache, held, granule)
    fill(cache, 60, 7)
    # The middle of the cache comes back while block 60 stays: a hole.
    elastic.apply(ElasticOrders(2, 4, held=((0, 1), (15, 16)), wanted=((3, 5),)))
    assert reads(cache, 60) == {7}
    held = blocks_of({0, 3, 4, 15}, 4)
    assert cache.physical_bytes == expected_physical(cache, held, granule)
    assert reads(cache, 13) == {0}  # newly held blocks read zero
    assert elastic.holds([0, 13, 60])
    assert not elastic.holds([20])
    assert cache.num_blocks_committed == len(held)
    assert all(tensor.num_bytes == 0 for tensor, _ in cache.buffers)  # not a prefix


def test_a_refused_wanted_run_stops_the_grant_and_held_units_stay(
    stats: StatisticsDriver, device: str
) -> None:
    granule = stats.granularity(0, False)
    limited = FaultInjectingDriver(stats)
    cache = elastic_cache(device, limited)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 8, held=((0, 2),)))
        fill(cache, 9, 3)
        # Room for unit 2, not for unit 7 (its granules lie apart).
        limited.byte_limit = expected_physical(cache, blocks_of({0, 1, 2}, 8), granule)
        report = elastic.apply(ElasticOrders(2, 8, held=((0, 2),), wanted=((2, 3), (7, 8))))
        assert report.granted == 1
        assert elastic.held_units == ((0, 3),)
        assert reads(cache, 9) == {3}
    finally:
        cache.free()


def test_a_refused_wanted_run_is_granted_unit_by_unit_as_far_as_the_memory_goes(
    stats: StatisticsDriver, device: str
) -> None:
    granule = stats.granularity(0, False)
    limited = FaultInjectingDriver(stats)
    cache = elastic_cache(device, limited)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 4, held=((0, 2),)))
        limited.byte_limit = expected_physical(cache, blocks_of({0, 1, 2, 3}, 4), granule)

        def fits(units: int) -> bool:  # the first ``units`` wanted ones with those held
            needed = expected_physical(cache, blocks_of(set(range(2 + units)), 4), granule)
            return needed <= limited.byte_limit

        granted = max(k for k in range(5) if fits(k))
        assert 2 <= granted < 4  # the run of 4 is refused, a part of it fits
        report = elastic.apply(ElasticOrders(2, 4, held=((0, 2),), wanted=((2, 6),)))
        assert report.granted == granted
        assert elastic.held_units == ((0, 2 + granted),)
    finally:
        cache.free()


def test_sleep_gives_everything_back_and_wake_commits_unit_0_then_what_orders_hold(
    cache: KVCacheBuffers,
) -> None:
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (10, 12))))
    held = cache.physical_bytes
    fill(cache, 41, 5)
    elastic.release()
    assert cache.physical_bytes == 0
    assert elastic.held_units == ()
    assert not elastic.holds([0])
    elastic.wake()
    assert elastic.held_units == ((0, 1),)
    assert not elastic.holds([41])
    elastic.apply(ElasticOrders(2, 4, held=((0, 1), (10, 12))))
    assert cache.physical_bytes == held
    assert reads(cache, 41) == {0}


def test_a_sleep_keeping_units_restores_exactly_those_at_the_same_blocks(
    cache: KVCacheBuffers, stats: StatisticsDriver
) -> None:
    granule = stats.granularity(0, False)
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (3, 5), (10, 12))))
    fill(cache, 13, 3)  # unit 3: kept
    fill(cache, 41, 5)  # unit 10: kept
    fill(cache, 18, 9)  # unit 4: held, not kept (free blocks)
    elastic.release(keep=((3, 4), (10, 11)))
    assert cache.physical_bytes == 0
    assert (
        elastic.kept_bytes == sum(per_block * t.num_segments for t, per_block in cache.buffers) * 8
    )
    elastic.wake()
    assert elastic.held_units == ((0, 1), (3, 4), (10, 11))
    assert cache.physical_bytes == expected_physical(cache, blocks_of({0, 3, 10}, 4), granule)
    assert reads(cache, 13) == {3}
    assert reads(cache, 41) == {5}
    assert elastic.kept_bytes == 0
    elastic.apply(ElasticOrders(2, 4, held=((0, 1), (3, 5), (10, 11))))
    assert reads(cache, 18) == {0}  # not kept: zeroed when ordered again


def test_a_discarding_release_while_asleep_drops_the_kept_copy(cache: KVCacheBuffers) -> None:
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (10, 11))))
    fill(cache, 41, 5)
    elastic.release(keep=((10, 11),))
    elastic.release(keep=((10, 11),))  # asleep: nothing changes
    assert elastic.kept_bytes > 0
    elastic.release()
    assert elastic.kept_bytes == 0
    elastic.wake()
    assert elastic.held_units == ((0, 1),)


def test_keeping_a_unit_not_held_is_refused_and_the_cache_stays_awake(
    cache: KVCacheBuffers,
) -> None:
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (3, 4))))
    fill(cache, 13, 3)
    held = cache.physical_bytes
    with pytest.raises(ValueError, match=re.escape("units ((5, 6),) to keep over the sleep")):
        elastic.release(keep=((3, 4), (5, 6)))
    assert cache.physical_bytes == held
    assert not cache.asleep
    assert reads(cache, 13) == {3}


def test_a_copy_the_limit_refuses_changes_nothing_and_the_sleep_claims_only_the_copy() -> None:
    """On the host backend's shared budget, where the copy is claimed like
    the cache: a limit with no room for the copy refuses the sleep, which
    leaves the cache awake with its units and their contents; without the
    limit, the sleep's claim is the copy's whole granules, nothing more."""
    driver = get_driver("cpu")
    cache = elastic_cache("cpu", driver)
    ledger = driver.ledger(0)  # type: ignore[attr-defined]
    granule = driver.granularity(0, False)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 4, held=((0, 1), (3, 4), (10, 12))))
        fill(cache, 13, 3)
        held, claimed = cache.physical_bytes, ledger.held
        ledger.set_limit(sum(ledger.read().claims.values()))
        try:
            with pytest.raises(BudgetExceededError):
                elastic.release(keep=((3, 4),))
        finally:
            ledger.set_limit(None)
        assert not cache.asleep
        assert (cache.physical_bytes, ledger.held, elastic.kept_bytes) == (held, claimed, 0)
        assert elastic.held_units == ((0, 1), (3, 4), (10, 12))
        assert reads(cache, 13) == {3}
        elastic.release(keep=((3, 4),))
        copy = -(-elastic.kept_bytes // granule) * granule
        assert 0 < copy < held
        assert ledger.held == claimed - held + copy
        elastic.wake()
        assert reads(cache, 13) == {3}
        assert ledger.held == claimed - held + cache.physical_bytes
    finally:
        cache.free()


def test_a_wake_that_fails_stays_asleep_with_its_copy_for_the_next_try(
    stats: StatisticsDriver, device: str
) -> None:
    limited = FaultInjectingDriver(stats)
    cache = elastic_cache(device, limited)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 4, held=((0, 1), (10, 11))))
        fill(cache, 41, 5)
        elastic.release(keep=((10, 11),))
        limited.byte_limit = 0
        with pytest.raises(DriverError):
            elastic.wake()
        assert cache.asleep
        assert cache.physical_bytes == 0
        assert elastic.kept_bytes > 0
        limited.byte_limit = None
        elastic.wake()
        assert reads(cache, 41) == {5}
    finally:
        cache.free()


def test_bad_orders_are_refused_and_change_nothing(cache: KVCacheBuffers) -> None:
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    before = cache.physical_bytes
    with pytest.raises(ValueError, match="outside the engine's 16 units"):
        elastic.apply(ElasticOrders(1, 4, held=((15, 17),)))
    with pytest.raises(ValueError, match="blocks_per_unit must be positive"):
        elastic.apply(ElasticOrders(1, 0, held=()))
    assert cache.physical_bytes == before
    assert elastic.held_units == ((0, 1),)


def test_a_prefix_committed_cache_or_one_chunk_per_run_is_refused(
    stats: StatisticsDriver, device: str
) -> None:
    cache = elastic_cache(device, stats)
    cache.commit(2)
    with pytest.raises(ValueError, match="starts from an empty cache"):
        ElasticBlocks(cache, CAPACITY)
    cache.free()
    plain = make_cache(device, stats)  # one chunk per run
    with pytest.raises(ValueError, match="chunk_bytes="):
        ElasticBlocks(plain, CAPACITY)
    plain.free()


unit_sets = st.sets(st.integers(0, 15), max_size=16)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(st.tuples(unit_sets, unit_sets, st.sampled_from([4, 8])), max_size=6))
def test_memory_follows_any_sequence_of_orders(
    stats: StatisticsDriver, device: str, steps: list[tuple[set[int], set[int], int]]
) -> None:
    """The model: after each order the cache holds its held and wanted
    units (and unit 0), exactly their granules are backed, a block held
    throughout keeps what was written to it, and a newly held one reads zero
    or, where its granule stayed mapped for a neighbour, its old bytes."""
    granule = stats.granularity(0, False)
    cache = elastic_cache(device, stats)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        last: dict[int, int] = {}
        for seq, (held, wanted, per_unit) in enumerate(steps, 1):
            limit = -(-CAPACITY // per_unit)
            held = {u % limit for u in held}
            wanted = {u % limit for u in wanted} - held
            before = blocks_of(set(units_of(elastic.held_units)), elastic.blocks_per_unit)
            elastic.apply(ElasticOrders(seq, per_unit, ranges_of(held), ranges_of(wanted)))
            now = blocks_of(held | wanted | {0}, per_unit)
            assert elastic.held_units == ranges_of(held | wanted | {0})
            assert cache.physical_bytes == expected_physical(cache, now, granule)
            for b in sorted(now):
                if b in before:
                    assert reads(cache, b) == {last.get(b, 0)}
                else:
                    assert reads(cache, b) <= {0, last.get(b, 0)}
                last[b] = seq % 250 + 1
                fill(cache, b, last[b])
    finally:
        cache.free()


def unmapped_held_blocks(elastic: ElasticBlocks) -> list[int]:
    """Blocks the books say are held that have a byte with no memory behind it."""
    cache, out = elastic.cache, []
    for b in sorted(blocks_of(set(units_of(elastic.held_units)), elastic.blocks_per_unit)):
        for tensor, per_block in cache.buffers:
            for segment in range(tensor.num_segments):
                start = segment * tensor.segment_capacity_bytes + b * per_block
                if sum(size for _, size in tensor.buffer.mapped_in(start, per_block)) < per_block:
                    out.append(b)
    return sorted(set(out))


def test_a_failed_release_past_the_unmap_leaves_the_units_given_back_in_the_books(
    device: str, driver: Driver
) -> None:
    """Issue 47, bug 1: the units were unmapped but still counted as held."""
    faulty = FaultInjectingDriver(driver)
    cache = elastic_cache(device, faulty)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 8, held=((0, 1), (5, 6))))
        faulty.fail_at("release", 1)
        with pytest.raises(DriverError, match="injected"):
            elastic.apply(ElasticOrders(2, 8, held=((0, 1),)))
        faulty.clear()
        assert elastic.held_units == ((0, 1),)
        elastic.apply(ElasticOrders(3, 8, held=((0, 1), (5, 6))))
        assert elastic.holds([40])
        assert unmapped_held_blocks(elastic) == []
        assert reads(cache, 40) == {0}
    finally:
        cache.free()


ELASTIC_CALLS = ("create", "map", "set_access", "unmap", "release")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.sets(st.integers(0, 15), max_size=4),
            st.sampled_from([4, 8]),
            st.none() | st.tuples(st.sampled_from(ELASTIC_CALLS), st.integers(1, 3)),
        ),
        max_size=6,
    )
)
def test_books_and_memory_agree_after_a_failure_at_any_driver_call(
    device: str, driver: Driver, steps: list[tuple[set[int], int, Fault]]
) -> None:
    """Each order runs with one driver call failing: whatever it leaves, every
    unit the books hold is mapped and nothing else is, and the same orders
    sent again end where a clean run ends."""
    granule = driver.granularity(0, False)
    faulty = FaultInjectingDriver(driver)
    cache = elastic_cache(device, faulty)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        for seq, (held, per_unit, fault) in enumerate(steps, 1):
            held = {u % -(-CAPACITY // per_unit) for u in held}
            orders = ElasticOrders(seq, per_unit, ranges_of(held))
            attempt(faulty, fault, lambda orders=orders: elastic.apply(orders))
            books = blocks_of(set(units_of(elastic.held_units)), elastic.blocks_per_unit)
            assert unmapped_held_blocks(elastic) == []
            assert cache.physical_bytes == expected_physical(cache, books, granule)
            elastic.apply(orders)
            assert elastic.held_units == ranges_of(held | {0})
            now = blocks_of(held | {0}, per_unit)
            assert cache.physical_bytes == expected_physical(cache, now, granule)
    finally:
        cache.free()


def test_clear_forgets_the_units_and_the_same_orders_map_them_again(
    cache: KVCacheBuffers,
) -> None:
    """``clear()`` leaves no block and no memory: the units go from the books
    with their memory, and the orders that held them map them again."""
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    orders = ElasticOrders(1, 4, held=((0, 1), (10, 12)))
    elastic.apply(orders)
    fill(cache, 41, 5)
    cache.clear()
    assert (cache.physical_bytes, elastic.held_units, elastic.num_blocks_held) == (0, (), 0)
    assert not elastic.holds([41])
    elastic.apply(orders)
    assert elastic.holds([41])
    assert unmapped_held_blocks(elastic) == []
    assert reads(cache, 41) == {0}


def test_every_report_counts_the_held_blocks_as_committed() -> None:
    """The cache's own figures, what ``top`` publishes and what the vLLM
    worker's ``extensible_kv_state`` reports say one thing: the blocks of the
    units held are the committed ones. (The host backend's budget, which
    publishes; a simulator publishes nothing.)"""
    cache = elastic_cache("cpu", get_driver("cpu"))
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (10, 12))))
    held = len(blocks_of({0, 10, 11}, 4))
    assert elastic.num_blocks_held == held
    assert cache.num_blocks_committed == held
    assert cache.committed_bytes == held * cache.bytes_per_block
    figures = published(cache)
    assert figures is not None
    assert (figures["blocks"], figures["committed_bytes"]) == (held, held * cache.bytes_per_block)
    state = kv_state(cache, elastic, "elastic", None)
    assert (state["num_blocks_committed"], state["committed_bytes"]) == (
        held,
        held * cache.bytes_per_block,
    )
    elastic.release()
    assert (cache.num_blocks_committed, cache.committed_bytes) == (0, 0)
    cache.free()


PREFIX_CALLS: dict[str, Callable[[KVCacheBuffers], None]] = {
    "a preserving release_physical()": lambda cache: cache.release_physical(preserve=True),
    "commit()": lambda cache: cache.commit(4),
    "trim()": lambda cache: cache.trim(0),
    "defragment()": lambda cache: cache.defragment(preserve=True),
}


@pytest.mark.parametrize("call", sorted(PREFIX_CALLS))
def test_what_would_lose_held_units_is_refused_and_changes_nothing(
    cache: KVCacheBuffers, call: str
) -> None:
    """A preserving sleep copies the committed prefix, and a commit, trim or
    defragment remaps it: each would lose units held elsewhere (the sleep
    while saying it kept them), so each is refused while units are held."""
    elastic = ElasticBlocks(cache, CAPACITY)
    elastic.start()
    elastic.apply(ElasticOrders(1, 4, held=((0, 1), (10, 12))))
    fill(cache, 41, 5)
    before = cache.physical_bytes
    with pytest.raises(ValueError, match=f"elastic units .* which {re.escape(call)} would lose"):
        PREFIX_CALLS[call](cache)
    assert (cache.state, cache.physical_bytes, cache.host_backup_bytes) == (
        SleepState.AWAKE,
        before,
        0,
    )
    assert elastic.held_units == ((0, 1), (10, 12))
    assert reads(cache, 41) == {5}


def test_units_given_back_while_kept_idle_serve_the_next_commit_without_a_create(
    stats: StatisticsDriver, device: str
) -> None:
    """Over a PoolingDriver, orders that keep memory idle leave the handles
    of units given back in the pool, and the next commit creates none;
    orders that do not give every idle byte back to the driver."""
    granule = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=64 * granule)
    cache = elastic_cache(device, pool)
    try:
        elastic = ElasticBlocks(cache, CAPACITY)
        elastic.start()
        elastic.apply(ElasticOrders(1, 4, held=((0, 1),), wanted=((8, 16),), keep_idle=True))
        held = cache.physical_bytes
        elastic.apply(ElasticOrders(2, 4, held=((0, 1),), keep_idle=True))
        assert cache.physical_bytes < held
        assert stats.live.handles * granule == held  # the handles wait, idle
        creates = stats.calls["create"].calls
        elastic.apply(ElasticOrders(3, 4, held=((0, 1), (8, 16)), keep_idle=True))
        assert stats.calls["create"].calls == creates  # served from the pool
        assert reads(cache, 40) == {0}  # reused memory reads zero all the same
        elastic.apply(ElasticOrders(4, 4, held=((0, 1),)))  # keep_idle False
        assert stats.live.handles * granule == cache.physical_bytes
    finally:
        cache.free()
        pool.drain()
