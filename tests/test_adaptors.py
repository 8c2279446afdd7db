"""StatisticsDriver and FaultInjectingDriver keep the protocol and say what
happened; the adaptor calls pass through any stack to the adaptor that reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from extensible_kv.devices import BudgetDriver, get_driver
from extensible_kv.driver import (
    DRIVER_CALLS,
    Driver,
    DriverError,
    FaultInjectingDriver,
    LiveUsage,
    OutOfMemoryError,
    PoolingDriver,
    StatisticsDriver,
    backend,
)


def test_adaptors_satisfy_the_protocol(driver: Driver) -> None:
    inner = driver
    for adaptor in (StatisticsDriver(inner), FaultInjectingDriver(inner)):
        assert isinstance(adaptor, Driver)
        assert adaptor.dlpack_device_type == inner.dlpack_device_type
        assert adaptor.zeroes_new_memory == inner.zeroes_new_memory
        assert repr(inner) in repr(adaptor)


def test_statistics_track_live_resources_and_calls(driver: Driver, granularity: int) -> None:
    stats = StatisticsDriver(driver)
    g = granularity
    with stats.context(0):
        ptr = stats.reserve(4 * g, g)
        handles = [stats.create(g, 0, False) for _ in range(3)]
        for i, handle in enumerate(handles):
            stats.map(ptr + i * g, g, handle)
        stats.set_access(ptr, 3 * g, 0)
        assert stats.live == LiveUsage(
            handles=3,
            handle_bytes=3 * g,
            reservations=1,
            reserved_bytes=4 * g,
            mappings=3,
            mapped_bytes=3 * g,
        )
        stats.unmap(ptr + g, 2 * g)
        assert stats.live.mappings == 1
        assert stats.live.mapped_bytes == g
        stats.unmap(ptr, g)
        for handle in handles:
            stats.release(handle)
        stats.free_reserved(ptr, 4 * g)
        assert stats.live == LiveUsage()
    calls = stats.calls
    assert set(calls) == set(DRIVER_CALLS)
    assert calls["create"].calls == 3
    assert calls["unmap"].calls == 2
    assert calls["set_access"].calls == 1
    assert calls["create"].seconds > 0
    stats.reset_calls()
    assert stats.calls["create"].calls == 0


def test_statistics_count_failures_without_changing_live_state(driver: Driver) -> None:
    stats = StatisticsDriver(driver)
    with driver.context(0), pytest.raises(DriverError):
        stats.unmap(0, 1)
    assert stats.calls["unmap"].failures == 1
    assert stats.calls["unmap"].calls == 1
    assert stats.live == LiveUsage()


def test_fail_at_fails_the_nth_call_once_without_reaching_the_driver(
    driver: Driver, granularity: int
) -> None:
    stats = StatisticsDriver(driver)
    faulty = FaultInjectingDriver(stats)
    with driver.context(0):
        faulty.fail_at("create", nth=2)
        first = faulty.create(granularity, 0, False)
        with pytest.raises(OutOfMemoryError, match="injected"):
            faulty.create(granularity, 0, False)
        assert stats.calls["create"].calls == 1
        assert stats.live.handles == 1
        second = faulty.create(granularity, 0, False)
        assert faulty.injected == 1
        faulty.release(first)
        faulty.release(second)


def test_non_memory_calls_fail_with_a_plain_driver_error(driver: Driver, granularity: int) -> None:
    faulty = FaultInjectingDriver(driver)
    with driver.context(0):
        handle = faulty.create(granularity, 0, False)
        faulty.fail_at("release")
        with pytest.raises(DriverError) as info:
            faulty.release(handle)
        assert not isinstance(info.value, OutOfMemoryError)
        faulty.release(handle)


def test_byte_limit_fails_creates_past_the_budget(driver: Driver, granularity: int) -> None:
    faulty = FaultInjectingDriver(driver, byte_limit=2 * granularity)
    with driver.context(0):
        a = faulty.create(granularity, 0, False)
        b = faulty.create(granularity, 0, False)
        with pytest.raises(OutOfMemoryError, match="byte limit"):
            faulty.create(granularity, 0, False)
        faulty.release(a)
        c = faulty.create(granularity, 0, False)
        faulty.clear()
        d = faulty.create(granularity, 0, False)
        for handle in (b, c, d):
            faulty.release(handle)


def test_fail_at_rejects_unknown_calls_and_counts() -> None:
    faulty = FaultInjectingDriver(get_driver("cpu"))
    with pytest.raises(ValueError, match="unknown driver call"):
        faulty.fail_at("cuMemCreate")
    with pytest.raises(ValueError, match="from 1"):
        faulty.fail_at("map", nth=0)


def test_the_adaptor_calls_reach_the_adaptor_that_reads_them_through_any_stack(
    tmp_path: Path,
) -> None:
    """What the layers above ask of adaptors (ADAPTOR_CALLS) passes through
    adaptors that do not read it, to the one that does; a backend answers
    as having nothing of the kind."""
    host = backend("cpu")
    g = host.granularity(0, False)
    assert (host.accounting(0), host.release_idle()) == (None, 0)
    with pytest.raises(ValueError, match="fills a PoolingDriver"):
        host.create_ahead(g, 0, 0, False)
    budget = BudgetDriver(host, state_dir=tmp_path)
    pool = PoolingDriver(budget, cap_bytes=4 * g)
    stack = StatisticsDriver(FaultInjectingDriver(pool))
    assert stack.accounting(0) is None, "no claim has opened the ledger yet"
    assert stack.create_ahead(g, 3, 0, False) == 3
    assert pool.idle_bytes == 3 * g
    assert stack.accounting(0) == (host.device_uuid(0), str(tmp_path))
    budget.ledger(0).set_limit(4 * g)
    with stack.holding(0, 3 * g):
        assert budget.ledger(0).held == 3 * g, "the idle handles serve it: nothing more held"
    with stack.holding(0, 4 * g):
        assert budget.ledger(0).held == 4 * g, "what they do not serve is claimed"
    assert budget.ledger(0).held == 3 * g
    assert stack.release_idle() == 3 * g
    assert (pool.idle_bytes, budget.ledger(0).held) == (0, 0)
