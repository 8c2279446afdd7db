"""vLLM's allocation hook and names: ExtensibleKVCacheBuilder, extend,
granule_size."""

from __future__ import annotations

import pytest

from extensible_kv import (
    ExtensibleKVCacheBuffers,
    ExtensibleKVCacheBuilder,
    FaultInjectingDriver,
    StatisticsDriver,
    granule_size,
)
from extensible_kv.driver import LiveUsage

CAPACITY = 256
PAGE = 64 * 1024  # 16 MiB per tensor: several granules, so a missed commit faults


def test_reserve_then_finish_commits_one_block(stats: StatisticsDriver, device: str) -> None:
    builder = ExtensibleKVCacheBuilder(CAPACITY, device, driver=stats)
    split = builder.reserve(CAPACITY * PAGE, num_segments=2)
    major = builder.reserve(CAPACITY * PAGE)
    assert split.numel() == major.numel() == CAPACITY * PAGE
    buffers = builder.finish()
    assert isinstance(buffers, ExtensibleKVCacheBuffers)
    assert buffers.num_blocks_committed == 1
    assert [per_block for _, per_block in buffers.buffers] == [PAGE // 2, PAGE]
    kv = split.view(2, CAPACITY, PAGE // 2)
    kv[:, 0].fill_(1)  # block 0 of K and of V
    buffers.extend(CAPACITY)
    kv[:, CAPACITY - 1].fill_(2)
    assert kv[:, 0].eq(1).all()
    assert kv[:, 1 : CAPACITY - 1].count_nonzero() == 0
    buffers.free()
    del split, major, kv  # the address ranges outlive their views
    assert stats.live == LiveUsage()


def test_bad_reservations_are_named(stats: StatisticsDriver, device: str) -> None:
    builder = ExtensibleKVCacheBuilder(CAPACITY, device, driver=stats)
    with pytest.raises(ValueError, match="not a positive whole number of 256 blocks"):
        builder.reserve(CAPACITY * PAGE + 1)
    with pytest.raises(ValueError, match="do not split into 3 segments"):
        builder.reserve(CAPACITY * PAGE, num_segments=3)
    builder.reserve(CAPACITY * PAGE)
    buffers = builder.finish()
    with pytest.raises(ValueError, match="finish\\(\\) has run"):
        builder.reserve(CAPACITY * PAGE)
    with pytest.raises(ValueError, match="already run"):
        builder.finish()
    buffers.free()
    assert stats.live == LiveUsage()


def test_a_failed_finish_frees_every_reservation(stats: StatisticsDriver, device: str) -> None:
    faulty = FaultInjectingDriver(stats)
    builder = ExtensibleKVCacheBuilder(CAPACITY, device, driver=faulty)
    builder.reserve(CAPACITY * PAGE)
    faulty.fail_at("create")
    with pytest.raises(Exception, match="injected"):
        builder.finish()
    assert stats.live == LiveUsage()


def test_granule_size_is_the_drivers_granularity() -> None:
    size = granule_size("cpu")
    assert size > 0
    assert size & (size - 1) == 0
    builder = ExtensibleKVCacheBuilder(4, "cpu")
    builder.reserve(4 * 4096)
    buffers = builder.finish()
    assert buffers.physical_bytes == size, "one block commits one granule"
    buffers.free()
    with pytest.raises(ValueError, match="device type 'tpu' is not supported"):
        granule_size("tpu")
