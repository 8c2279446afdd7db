"""What a model runner does around an extensible cache, as small helpers.

The flow (vLLM's runner follows it; docs/integration.md runs it end to end):

1. allocate the cache at its capacity (one block committed);
2. :meth:`WarmupMeter.start`, then warm up and capture CUDA graphs, calling
   :meth:`WarmupMeter.ensure_blocks` before a batch touches block ids;
3. :meth:`WarmupMeter.size` from what warm-up really used;
4. :func:`commit_final_size` (agreed across ranks, defragmented for a KV
   connector), then :func:`sized_config` and :func:`fit_max_model_len` for
   the scheduler;
5. :func:`register_connector` with views narrowed to the committed blocks.

An extensible cache captures its graphs during warm-up, where their memory
is measured, so the runner skips CUDA-graph memory *profiling* (vLLM's
estimate made before the KV cache exists) and sizes with no estimate.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from extensible_kv._checks import check_int
from extensible_kv.kv.allocate import KVCache, LayerView
from extensible_kv.kv.cache.core import KVCacheBuffers
from extensible_kv.kv.layouts.spec import is_mamba
from extensible_kv.kv.ranks import agree_num_blocks
from extensible_kv.kv.sizing import (
    DEFAULT_MARGIN_BYTES,
    DEFAULT_MEMORY_UTILIZATION,
    KVSizing,
    MemorySnapshot,
    size_kv_cache,
)

_Config = TypeVar("_Config")


@dataclass(frozen=True)
class WarmupMeter:
    """What sizing needs from before warm-up: a snapshot of the device and
    the KV bytes held then. Start it after the cache is allocated and the
    weights are loaded, before the first warm-up step."""

    cache: KVCacheBuffers
    device: torch.device
    before: MemorySnapshot
    kv_bytes_before: int

    @classmethod
    def start(cls, cache: KVCacheBuffers, device: torch.device | str) -> WarmupMeter:
        device = torch.device(device)
        return cls(cache, device, MemorySnapshot.take(device), cache.physical_bytes)

    def ensure_blocks(self, num_blocks: int) -> int:
        """Commit the blocks a warm-up batch is about to touch: at least
        ``min(num_blocks, capacity)``. Returns that count, the block ids
        (``0`` to it, exclusive) the batch may use."""
        check_int("num_blocks", num_blocks)
        usable = min(num_blocks, self.cache.num_blocks_capacity)
        self.cache.ensure_blocks(usable)
        return usable

    def size(
        self,
        *,
        memory_utilization: float | None = DEFAULT_MEMORY_UTILIZATION,
        margin_bytes: int = DEFAULT_MARGIN_BYTES,
        kv_budget_bytes: int | None = None,
        cudagraph_memory_bytes: int = 0,
    ) -> KVSizing:
        """The final block count from what warm-up used; see
        :func:`~extensible_kv.kv.size_kv_cache` for the arguments and the
        :class:`~extensible_kv.kv.KVCacheTooSmallError` it raises."""
        return size_kv_cache(
            self.before,
            MemorySnapshot.take(self.device),
            kv_bytes_before=self.kv_bytes_before,
            kv_bytes_after=self.cache.physical_bytes,
            bytes_per_block=self.cache.bytes_per_block,
            num_blocks_capacity=self.cache.num_blocks_capacity,
            margin_bytes=margin_bytes,
            kv_budget_bytes=kv_budget_bytes,
            memory_utilization=memory_utilization,
            cudagraph_memory_bytes=cudagraph_memory_bytes,
        )


def commit_final_size(
    cache: KVCacheBuffers,
    num_blocks: int,
    *,
    connector: bool = False,
    group: Any = None,
) -> int:
    """Commit the size sizing decided; returns the block count committed.

    The count is first agreed with the other ranks of ``group`` (the
    minimum; a no-op without ``torch.distributed``). With ``connector`` the
    commit defragments: the cache then holds exactly that many blocks, one
    physical chunk per segment, contents zeroed (warm-up's were garbage),
    as a KV connector needs before it registers memory. Without, a count
    below what warm-up committed changes nothing: the memory stays until a
    :meth:`~KVCacheBuffers.trim`.
    """
    agreed = agree_num_blocks(num_blocks, group)
    cache.commit(agreed, defragment=connector)
    return cache.num_blocks_committed


def sized_config(config: _Config, num_blocks: int) -> _Config:
    """A copy of a KV cache description for ``num_blocks`` blocks: what the
    scheduler's block manager is given after the final commit.

    ``num_blocks`` and every tensor's ``size`` (bytes) are scaled from the
    capacity; everything else is kept. Works on our frozen dataclasses,
    vLLM's dataclasses and plain objects with the same attributes.
    """
    described: Any = config
    capacity = check_int("num_blocks of the config", described.num_blocks)
    check_int("num_blocks", num_blocks)
    if not 0 < num_blocks <= capacity:
        raise ValueError(f"num_blocks must be 1 to the capacity {capacity}, got {num_blocks}")
    original = described.kv_cache_tensors
    tensors = [_with(t, size=t.size // capacity * num_blocks) for t in original]
    return _with(config, num_blocks=num_blocks, kv_cache_tensors=type(original)(tensors))


def _with(obj: _Config, **changes: Any) -> _Config:
    """A copy of ``obj`` with ``changes``: replaced if a dataclass, else set."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        replaced: _Config = dataclasses.replace(obj, **changes)
        return replaced
    new = copy.copy(obj)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def fit_max_model_len(
    config: Any, num_blocks: int, max_model_len: int, *, shrink: bool = False
) -> int:
    """The longest request the cache can hold, checked against ``max_model_len``.

    One request of ``L`` tokens needs ``ceil(L / block_size)`` blocks in each
    attention group (Mamba groups need one block whatever the length). If
    ``num_blocks`` blocks hold fewer than ``max_model_len`` tokens this raises
    a ValueError naming both, as vLLM refuses to start, unless ``shrink``:
    then it returns the length that fits (vLLM's ``max_model_len=auto``).
    """
    check_int("max_model_len", max_model_len)
    sizes = [
        group.kv_cache_spec.block_size
        for group in config.kv_cache_groups
        if not is_mamba(group.kv_cache_spec)
    ]
    fits = num_blocks * min(sizes) if sizes else max_model_len
    if fits >= max_model_len:
        return max_model_len
    if shrink and fits > 0:
        return fits
    raise ValueError(
        f"max_model_len {max_model_len} needs {-(-max_model_len // min(sizes))} blocks of "
        f"{min(sizes)} tokens for one request, but the KV cache has {num_blocks} blocks "
        f"({fits} tokens); raise memory_utilization or lower max_model_len"
    )


def register_connector(
    kv: KVCache, name: str, register: Callable[[dict[str, LayerView]], object]
) -> dict[str, LayerView]:
    """Hand a KV connector the views of the committed blocks, and record it.

    ``register`` is the connector's own call (e.g. a NIXL agent's
    ``register_kv_caches``); it gets :meth:`KVCache.narrowed_views`. Call
    this after :func:`commit_final_size` with ``connector=True``: the cache
    refuses a registration over memory made shareable=False or spanning
    several physical chunks per segment. If ``register`` raises, the
    registration is forgotten. Returns the views handed over.
    """
    views = kv.narrowed_views()
    kv.cache.register_external(name)
    try:
        register(views)
    except BaseException:
        kv.cache.unregister_external(name)
        raise
    return views
