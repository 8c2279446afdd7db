"""Memory that follows the load (OnDemandGrowth), and the wake to a count
it rests on (KVCacheBuffers.recommit(num_blocks=...))."""

from __future__ import annotations

import pytest
import torch

from extensible_kv import StatisticsDriver
from extensible_kv.kv import KVCacheBuffers, OnDemandGrowth
from test_kv_buffers import CAPACITY, block, make_cache


def fill(cache: KVCacheBuffers, index: int, value: int) -> None:
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            block(buffer, per_block, segment, index).fill_(value)


def reads(cache: KVCacheBuffers, index: int) -> set[int]:
    """The byte values block ``index`` holds, over every buffer and segment."""
    values: set[int] = set()
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            values |= _values(block(buffer, per_block, segment, index))
    return values


def _values(data: torch.Tensor) -> set[int]:
    """The values in ``data``: its min and max when they are one (the common
    case, and 20x cheaper than ``unique``), else every one."""
    low, high = (int(v) for v in torch.aminmax(data))
    if low == high:
        return {low}
    return {int(v) for v in data.unique()}


def test_commits_in_steps_up_to_the_highest_id_handed_out(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    growth = OnDemandGrowth(cache, num_blocks=48, step_blocks=8)
    growth.start()
    assert cache.num_blocks_committed == growth.first_blocks == 8
    assert growth.ensure([3, 0, 7]) == 8  # within the first step: no commit
    assert growth.ensure([9]) == 16
    assert growth.ensure([2, 40]) == 48  # the last step stops at the engine's count
    assert growth.high_water == 48
    fill(cache, 40, 9)
    with pytest.raises(ValueError, match="outside the engine's 48 blocks"):
        growth.ensure([5, 48])
    assert cache.num_blocks_committed == 48
    assert reads(cache, 40) == {9}
    cache.free()


def test_the_default_step_is_a_granule_of_the_largest_blocks(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    g = stats.granularity(0, False)
    assert cache.blocks_per_granule == max(1, g // (96 * 1024))
    growth = OnDemandGrowth(cache, num_blocks=CAPACITY)
    assert growth.step_blocks == cache.blocks_per_granule
    cache.free()


def test_a_discarding_sleep_wakes_to_the_first_step_a_preserving_one_whole(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    growth = OnDemandGrowth(cache, num_blocks=48, step_blocks=8)
    growth.start()
    first = cache.physical_bytes
    growth.ensure([20])
    fill(cache, 20, 5)
    cache.release_physical()
    growth.wake()
    assert cache.num_blocks_committed == 8
    assert cache.physical_bytes == first
    assert growth.ensure([20]) == 24
    assert reads(cache, 20) == {0}  # discarded, and zeroed when it came back

    fill(cache, 20, 6)
    cache.release_physical(preserve=True)
    growth.wake()
    assert cache.num_blocks_committed == 24
    assert reads(cache, 20) == {6}
    cache.free()


def test_a_step_on_a_sleeping_cache_wakes_it_to_what_the_step_needs(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    growth = OnDemandGrowth(cache, num_blocks=48, step_blocks=8)
    growth.ensure([30])
    cache.release_physical()
    assert growth.ensure([10]) == 16
    assert not cache.asleep
    cache.recommit()  # what a later wake of the whole cache does: nothing left to do
    assert cache.num_blocks_committed == 16
    cache.free()


def test_trim_keeps_whole_steps_and_at_least_the_first(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    growth = OnDemandGrowth(cache, num_blocks=48, step_blocks=8)
    growth.ensure([47])
    fill(cache, 3, 4)
    before = cache.physical_bytes
    assert growth.trim(9) == 16
    assert cache.physical_bytes < before
    assert growth.trim(0) == 8
    assert reads(cache, 3) == {4}
    assert growth.high_water == 48
    with pytest.raises(ValueError, match="keep_blocks must be 0 to 48"):
        growth.trim(49)
    assert cache.num_blocks_committed == 8
    cache.free()


@pytest.mark.parametrize("keep", [0, 9, 48])
def test_trim_on_a_freed_cache_is_refused(stats: StatisticsDriver, device: str, keep: int) -> None:
    cache = make_cache(device, stats)
    growth = OnDemandGrowth(cache, num_blocks=48, step_blocks=8)
    growth.ensure([20])
    cache.free()
    with pytest.raises(ValueError, match="has been freed; trim"):
        growth.trim(keep)
    with pytest.raises(ValueError, match="has been freed"):
        growth.ensure([5])  # as every other call on it
    assert cache.num_blocks_committed == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be 1 to the capacity"),
        ({"num_blocks": CAPACITY + 1}, "num_blocks must be 1 to the capacity"),
        ({"num_blocks": 8, "step_blocks": 0}, "step_blocks must be positive"),
        ({"num_blocks": True}, "num_blocks"),
    ],
)
def test_bad_arguments_are_refused(
    stats: StatisticsDriver, device: str, kwargs: dict[str, int], message: str
) -> None:
    cache = make_cache(device, stats)
    with pytest.raises((ValueError, TypeError), match=message):
        OnDemandGrowth(cache, **kwargs)
    assert cache.num_blocks_committed == 0
    cache.free()


def test_recommit_to_a_count(stats: StatisticsDriver, device: str) -> None:
    """recommit(num_blocks=n): after a discarding sleep exactly n, zeroed;
    after a preserving one the copy whole, then at least n; 0 commits nothing."""
    cache = make_cache(device, stats)
    cache.commit(20)
    cache.release_physical()
    cache.recommit(num_blocks=0)
    assert not cache.asleep
    assert cache.physical_bytes == 0
    cache.commit(20)
    fill(cache, 19, 3)
    cache.release_physical(preserve=True)
    cache.recommit(num_blocks=4)
    assert cache.num_blocks_committed == 20
    assert reads(cache, 19) == {3}
    cache.release_physical(preserve=True)
    cache.recommit(num_blocks=30)
    assert cache.num_blocks_committed == 30
    assert reads(cache, 19) == {3}
    assert reads(cache, 29) == {0}
    # A commit while asleep woke it partly; a count given wins over the one slept at.
    cache.release_physical()
    cache.commit(2)
    cache.recommit(num_blocks=5)
    assert cache.num_blocks_committed == 5
    cache.recommit()
    assert cache.num_blocks_committed == 5
    with pytest.raises(ValueError, match="cannot recommit 65 blocks"):
        cache.recommit(num_blocks=CAPACITY + 1)
    cache.free()
