"""A failing driver call at any point of an operation.

For every call an operation makes, in order, fail that call alone:

* every operation (commit, release, shrink, a shrink that maps a
  straddling chunk again smaller, preserving defragment, free) rolls back
  up to its point of no return: state, chunks, data and live driver
  resources are exactly as before;
* releasing a handle or a reservation cannot be undone (the memory is
  gone), so a failure there leaves the operation done, keeps what was not
  returned, and the next call returns it;

and in every case a retry succeeds and ends where a clean run ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from extensible_kv import DriverError, ExtensibleTensor, FaultInjectingDriver, StatisticsDriver
from extensible_kv.driver import Driver

IRREVERSIBLE = {"release", "free_reserved"}


def snapshot(et: ExtensibleTensor, stats: StatisticsDriver) -> tuple[Any, ...]:
    committed = b""
    if not et.buffer.freed and et.num_bytes:
        full = et.full_view()
        cap, n = et.segment_capacity_bytes, et.bytes_per_segment
        committed = b"".join(
            bytes(full[i * cap : i * cap + n].cpu().tolist()) for i in range(et.num_segments)
        )
    chunks = [(c.offset, c.size) for c in et.buffer.chunks]
    return (et.num_bytes, et.physical_bytes, chunks, et.buffer.mapped_runs, stats.live, committed)


def setup(
    device: str, driver: Driver, granularity: int, operation: str
) -> tuple[ExtensibleTensor, StatisticsDriver, FaultInjectingDriver]:
    stats = StatisticsDriver(driver)
    faulty = FaultInjectingDriver(stats)
    cap = 3 * granularity + granularity // 2
    # One chunk per segment prefix makes a trim map a straddling chunk again.
    chunk_bytes = None if operation == "shrink-remap" else granularity
    et = ExtensibleTensor(2 * cap, device, num_segments=2, driver=faulty, chunk_bytes=chunk_bytes)
    et.resize_per_segment_(granularity + 10)
    full = et.full_view()
    pattern = torch.arange(granularity + 10, dtype=torch.int64).remainder(251).to(torch.uint8)
    full[: granularity + 10] = pattern
    full[cap : cap + granularity + 10] = pattern.flip(0)
    return et, stats, faulty


OPERATIONS: dict[str, Callable[[ExtensibleTensor], object]] = {
    "grow": lambda et: et.resize_per_segment_(et.segment_capacity_bytes, zero_new=True),
    "release": lambda et: et.release_physical(),
    "shrink": lambda et: et.shrink_per_segment_(5),
    "shrink-remap": lambda et: et.shrink_per_segment_(5),
    "defragment-preserve": lambda et: et.defragment_(preserve=True),
    "free": lambda et: et.free(),
}


def calls_made(device: str, driver: Driver, granularity: int, operation: str) -> Counter[str]:
    et, stats, _ = setup(device, driver, granularity, operation)
    before = {name: s.calls for name, s in stats.calls.items()}
    OPERATIONS[operation](et)
    made = Counter({name: s.calls - before[name] for name, s in stats.calls.items()})
    et.free()
    return +made


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_failure_at_every_driver_call(
    device: str, driver: Driver, granularity: int, operation: str
) -> None:
    clean, clean_stats, _ = setup(device, driver, granularity, operation)
    OPERATIONS[operation](clean)
    expected = snapshot(clean, clean_stats)
    clean.free()

    made = calls_made(device, driver, granularity, operation)
    assert made, f"{operation} makes no driver call"
    for call, count in sorted(made.items()):
        for nth in range(1, count + 1):
            case = f"{operation}: failing {call} #{nth} of {count}"
            et, stats, faulty = setup(device, driver, granularity, operation)
            before = snapshot(et, stats)
            faulty.fail_at(call, nth)
            with pytest.raises(DriverError, match="injected"):
                OPERATIONS[operation](et)
            assert faulty.injected == 1, case
            after = snapshot(et, stats)
            if call not in IRREVERSIBLE:
                assert after == before, case
            OPERATIONS[operation](et)
            assert snapshot(et, stats) == expected, case
            et.free()
            assert stats.live.handles == stats.live.reservations == 0, case


def test_construction_failure_leaves_nothing(device: str, driver: Driver) -> None:
    stats = StatisticsDriver(driver)
    faulty = FaultInjectingDriver(stats)
    faulty.fail_at("reserve")
    with pytest.raises(DriverError):
        ExtensibleTensor(100, device, driver=faulty)
    assert stats.live.reservations == 0
    ExtensibleTensor(100, device, driver=faulty).free()


def test_byte_limit_makes_a_grow_fail_whole(device: str, driver: Driver, granularity: int) -> None:
    """Out of memory partway through a two-segment grow: nothing committed."""
    stats = StatisticsDriver(driver)
    faulty = FaultInjectingDriver(stats, byte_limit=5 * granularity)
    et = ExtensibleTensor(8 * granularity, device, num_segments=2, driver=faulty)
    et.resize_per_segment_(granularity)
    before = snapshot(et, stats)
    with pytest.raises(torch.OutOfMemoryError):
        et.resize_per_segment_(4 * granularity)
    assert snapshot(et, stats) == before
    et.resize_per_segment_(2 * granularity)
    assert et.physical_bytes == 4 * granularity
    et.free()
