"""The helpers a model runner calls around the cache: warm-up metering,
the final commit, the sized description, the longest request, connectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from extensible_kv import StatisticsDriver
from extensible_kv.driver import LiveUsage
from extensible_kv.kv import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSplitBackend,
    MambaSpec,
    WarmupMeter,
    allocate_kv_cache,
    commit_final_size,
    fit_max_model_len,
    register_connector,
    sized_config,
)
from extensible_kv.tensor import in_one_chunk_per_segment

SPEC = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
CAPACITY = 1024


def config(layers: str = "ab", capacity: int = CAPACITY) -> KVCacheConfig:
    tensors = tuple(KVCacheTensor(capacity * SPEC.page_size_bytes, (name,)) for name in layers)
    return KVCacheConfig(capacity, tensors, (KVCacheGroup(tuple(layers), SPEC),))


def test_warm_up_commits_what_it_touches_and_sizes_from_it(
    stats: StatisticsDriver, device: str
) -> None:
    kv = allocate_kv_cache(config(), KVSplitBackend, device, driver=stats)
    meter = WarmupMeter.start(kv.cache, device)
    assert meter.ensure_blocks(300) == 300
    assert kv.cache.num_blocks_committed == 300
    assert meter.ensure_blocks(5 * CAPACITY) == CAPACITY, "capped at the capacity"
    budget = 200 * kv.cache.bytes_per_block
    sizing = meter.size(kv_budget_bytes=budget)
    assert sizing.num_blocks == 200
    assert sizing.kv_bytes_at_warmup == kv.cache.physical_bytes
    kv.free()


def test_the_final_commit_holds_exactly_the_size_for_a_connector(
    stats: StatisticsDriver, device: str
) -> None:
    kv = allocate_kv_cache(config(), KVSplitBackend, device, shareable=True, driver=stats)
    kv.cache.ensure_blocks(CAPACITY)
    assert commit_final_size(kv.cache, 500, connector=True) == 500
    assert all(in_one_chunk_per_segment(buffer) for buffer, _ in kv.cache.tensors)
    plain = allocate_kv_cache(config(), KVSplitBackend, device, driver=stats)
    plain.cache.ensure_blocks(CAPACITY)
    assert commit_final_size(plain.cache, 500) == CAPACITY, "without a connector, kept"
    kv.free()
    plain.free()
    assert stats.live == LiveUsage()


def test_the_sized_description_scales_blocks_and_bytes() -> None:
    sized = sized_config(config(), 100)
    assert sized.num_blocks == 100
    assert [t.size for t in sized.kv_cache_tensors] == [100 * SPEC.page_size_bytes] * 2
    assert sized.kv_cache_groups == config().kv_cache_groups
    assert config().num_blocks == CAPACITY, "the original is left alone"

    class Plain:  # an engine's own, not a dataclass
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    tensor = Plain(size=CAPACITY * 64, shared_by=["a"])
    engine = Plain(num_blocks=CAPACITY, kv_cache_tensors=[tensor], kv_cache_groups=[])
    sized_engine = sized_config(engine, 10)
    assert sized_engine.num_blocks == 10
    assert sized_engine.kv_cache_tensors[0].size == 640
    assert tensor.size == CAPACITY * 64
    for bad in (0, CAPACITY + 1):
        with pytest.raises(ValueError, match="num_blocks must be 1 to the capacity 1024"):
            sized_config(config(), bad)


def test_the_longest_request_is_checked_against_the_cache() -> None:
    cfg = config()
    assert fit_max_model_len(cfg, 100, 1600) == 1600
    with pytest.raises(ValueError, match="max_model_len 1601 needs 101 blocks of 16 tokens"):
        fit_max_model_len(cfg, 100, 1601)
    assert fit_max_model_len(cfg, 100, 4096, shrink=True) == 1600
    mamba = MambaSpec(shapes=((4, 8),), dtypes=(torch.float32,))
    only_mamba = KVCacheConfig(8, (), (KVCacheGroup(("m",), mamba),))
    assert fit_max_model_len(only_mamba, 1, 10**6) == 10**6


@dataclass
class Connector:
    """Stands in for a NIXL agent: records what it was asked to register."""

    fail: bool = False
    registered: dict[str, Any] | None = None

    def register_kv_caches(self, views: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("the NIC refused the registration")
        self.registered = views


def test_a_connector_registers_the_committed_views(stats: StatisticsDriver, device: str) -> None:
    kv = allocate_kv_cache(config(), KVSplitBackend, device, shareable=True, driver=stats)
    commit_final_size(kv.cache, 300, connector=True)
    failing = Connector(fail=True)
    with pytest.raises(RuntimeError, match="refused"):
        register_connector(kv, "nixl", failing.register_kv_caches)
    assert kv.cache.external_registrations == (), "a failed registration is forgotten"
    connector = Connector()
    views = register_connector(kv, "nixl", connector.register_kv_caches)
    assert connector.registered is views
    view = views["a"]
    assert isinstance(view, torch.Tensor)
    assert view.shape[1] == 300
    assert kv.cache.external_registrations == ("nixl",)
    kv.free()
