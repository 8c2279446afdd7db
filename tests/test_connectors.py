"""What a vLLM runner relies on around sleep: KV connector registrations
(refused discarding sleep, dropped with a warning by a preserving one), and
commits made while the cache is released."""

from __future__ import annotations

import warnings

import pytest
import torch

from extensible_kv import ExtensibleTensor, FaultInjectingDriver, StatisticsDriver
from extensible_kv.driver import Driver, LiveUsage
from extensible_kv.kv import (
    AttentionSpec,
    ConnectorRegistrationWarning,
    KVCacheBuffers,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSplitBackend,
    allocate_kv_cache,
)

CAPACITY = 64
PER_BLOCK = 48 * 1024


def make(device: str, driver: Driver, shareable: bool = True) -> KVCacheBuffers:
    buffers = [
        (ExtensibleTensor(CAPACITY * PER_BLOCK * 2, device, 2, shareable, driver=driver), PER_BLOCK)
    ]
    return KVCacheBuffers(buffers, CAPACITY)


def first_block(cache: KVCacheBuffers) -> torch.Tensor:
    return cache.buffers[0][0].full_view()[:PER_BLOCK]


def test_registration_needs_shareable_defragmented_memory(
    stats: StatisticsDriver, device: str
) -> None:
    plain = make(device, stats, shareable=False)
    plain.commit(8, defragment=True)
    with pytest.raises(ValueError, match="shareable=True"):
        plain.register_external("nixl")
    plain.free()

    cache = make(device, stats)
    cache.commit(4)
    cache.commit(40)  # two chunks per segment
    with pytest.raises(ValueError, match=r"commit\(num_blocks, defragment=True\) before"):
        cache.register_external("nixl")
    cache.commit(40, defragment=True)
    cache.register_external("nixl")
    assert cache.external_registrations == ("nixl",)
    with pytest.raises(ValueError, match="already registered"):
        cache.register_external("nixl")
    with pytest.raises(ValueError, match="'ucx' is not registered"):
        cache.unregister_external("ucx")
    cache.free()
    assert stats.live == LiveUsage()


def test_a_registered_cache_refuses_what_would_pull_memory_from_the_connector(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make(device, stats)
    cache.commit(20, defragment=True)
    cache.register_external("nixl")
    first_block(cache).fill_(9)
    refused = {
        "discarding release": lambda: cache.release_physical(),
        "trim": lambda: cache.trim(10),
        "defragment": lambda: cache.defragment(),
        "grow": lambda: cache.commit(30),
        "remap": lambda: cache.commit(10, defragment=True),
    }
    for what, call in refused.items():
        with pytest.raises(ValueError, match="KV connector registrations \\(nixl\\)"):
            call()
        assert cache.num_blocks_committed == 20, what
        assert not cache.asleep, what
    # What leaves the memory in place stays allowed: the warm-up of a
    # restarted runner, and its final commit again, which remaps nothing
    # (the registration stays valid) but discards, as a defragment does.
    cache.ensure_blocks(5)
    assert first_block(cache).eq(9).all()
    cache.commit(20, defragment=True)
    assert cache.external_registrations == ("nixl",)
    assert int(first_block(cache).count_nonzero()) == 0
    cache.unregister_external("nixl")
    cache.trim(10)
    cache.free()


def test_a_preserving_sleep_drops_registrations_and_says_so(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make(device, stats)
    cache.commit(20, defragment=True)
    cache.register_external("nixl")
    first_block(cache).fill_(9)
    with pytest.warns(ConnectorRegistrationWarning, match="register kv.narrowed_views\\(\\) again"):
        cache.release_physical(preserve=True)
    assert cache.external_registrations == ()
    cache.recommit()
    assert first_block(cache).eq(9).all()
    cache.register_external("nixl")  # again, on the memory of the wake
    cache.unregister_external("nixl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.release_physical(preserve=True)  # nothing registered: no warning
    cache.free()


def test_a_commit_while_released_wakes_only_what_it_asks(
    stats: StatisticsDriver, device: str
) -> None:
    """As vLLM's runner: warm-up after a discarding sleep commits its few
    blocks; recommit() later brings the cache back to its size."""
    cache = make(device, stats)
    cache.commit(40)
    first_block(cache).fill_(5)
    cache.release_physical()
    cache.ensure_blocks(3)
    assert not cache.asleep
    assert cache.num_blocks_committed == 3
    assert first_block(cache).eq(0).all(), "a discarding sleep's blocks come back zeroed"
    first_block(cache).fill_(6)
    cache.recommit()
    assert cache.num_blocks_committed == 40
    assert first_block(cache).eq(6).all(), "the blocks committed while waking are kept"
    cache.recommit()
    assert cache.num_blocks_committed == 40
    cache.free()


def test_a_commit_while_released_after_a_preserving_sleep_restores_everything(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make(device, stats)
    cache.commit(40)
    first_block(cache).fill_(5)
    cache.release_physical(preserve=True)
    cache.commit(2)
    assert cache.num_blocks_committed == 40
    assert first_block(cache).eq(5).all()
    assert cache.host_backup_bytes == 0
    cache.free()


def test_a_failed_commit_while_released_leaves_the_cache_asleep(
    stats: StatisticsDriver, device: str
) -> None:
    faulty = FaultInjectingDriver(stats)
    cache = make(device, faulty)
    cache.commit(40)
    cache.release_physical()
    faulty.fail_at("create")
    with pytest.raises(Exception, match="injected"):
        cache.commit(10)
    assert cache.asleep
    assert cache.physical_bytes == 0
    cache.recommit()
    assert cache.num_blocks_committed == 40
    cache.free()
    assert stats.live == LiveUsage()


def test_allocate_kv_cache_views_are_what_a_connector_registers(
    stats: StatisticsDriver, device: str
) -> None:
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    tensors = tuple(KVCacheTensor(1024 * spec.page_size_bytes, (name,)) for name in "ab")
    config = KVCacheConfig(1024, tensors, (KVCacheGroup(("a", "b"), spec),))
    kv = allocate_kv_cache(config, KVSplitBackend, device, shareable=True, driver=stats)
    kv.cache.commit(100, defragment=True)
    views = kv.narrowed_views()
    kv.cache.register_external("nixl")
    for view in views.values():
        assert isinstance(view, torch.Tensor)
        assert view.shape[1] == 100
    with pytest.raises(ValueError, match="KV connector"):
        kv.cache.release_physical()
    kv.free()
    assert kv.cache.external_registrations == ()
