"""What the worker commits in its reservation of vLLM's KV cache: vLLM's
block count, as the ``growth`` option says, and the final count after the
measuring warm-up, checked to fit the addresses warm-up ran in. The worker
owns the reservation; these functions commit in it and hand back what
commits it from then on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from extensible_kv.integrations.vllm.seam import (
    ElasticBlocks,
    KVCacheBuffers,
    OnDemandGrowth,
    at_capacity,
)

__all__ = ["commit_count", "final_layout", "for_runner"]


def for_runner(layout: Any, num_blocks: int) -> Any:
    """The config vLLM's runner gets: ``layout`` (spaced for the capacity)
    at vLLM's ``num_blocks``."""
    # vLLM's views and block tables keep its count; the strides are the capacity's.
    return dataclasses.replace(layout, num_blocks=num_blocks)


def commit_count(
    cache: KVCacheBuffers,
    num_blocks: int,
    growth: str,
    *,
    defragment: bool,
    adopt: Callable[[ElasticBlocks], object] | None = None,
) -> OnDemandGrowth | ElasticBlocks | None:
    """Commit vLLM's ``num_blocks`` blocks in ``cache`` as ``growth`` says:
    ``"static"`` all of them (``defragment``: in one piece, for a connector;
    returns None), ``"on_demand"`` the first step, ``"elastic"`` unit 0 only
    (after clearing it, and ``adopt``, if given, taking in what a stopped
    engine kept, before anything is committed). Returns what commits the
    rest from then on; it commits in ``cache``, which the caller still owns."""
    if growth == "on_demand":
        # Memory follows the ids the scheduler hands out (execute_model).
        on_demand = OnDemandGrowth(cache, num_blocks)
        on_demand.start()
        return on_demand
    if growth == "elastic":
        # Memory follows the scheduler's orders (execute_model), in
        # units of granules, not as the prefix the allocation committed.
        cache.clear()
        elastic = ElasticBlocks(cache, num_blocks)
        if adopt is not None:
            adopt(elastic)
        elastic.start()
        return elastic
    cache.commit(num_blocks, defragment=defragment)
    return None


def final_layout(kv_cache_config: Any, capacity: int, warm_up_layout: Any) -> Any:
    """vLLM's final KV cache config laid out at ``capacity`` blocks (the
    reservation's), or an error where it does not fit the reservation
    warm-up ran in: a count past the capacity, or another placement than
    ``warm_up_layout``'s."""
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks > capacity:
        raise ValueError(
            f"vLLM sized the KV cache to {num_blocks} blocks, past the {capacity} reserved; "
            f"raise additional_config['extensible_kv']['num_blocks_capacity']"
        )
    layout = at_capacity(kv_cache_config, capacity)
    # What places memory; the engine's settings (layout name, hash
    # block size) reach the final config only.
    differ = [
        name
        for name in ("kv_cache_tensors", "kv_cache_groups")
        if getattr(layout, name) != getattr(warm_up_layout, name)
    ]
    if differ:
        raise RuntimeError(
            f"vLLM's final KV cache layout differs from the one its warm-up ran over "
            f"({', '.join(differ)}); extensible-kv cannot commit it in the same reservation"
        )
    return layout
