"""What ``extensible-kv top`` shows of a KV cache (see
:mod:`extensible_kv.budget.publish`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from extensible_kv.tensor import published_figures

if TYPE_CHECKING:
    from extensible_kv.kv.cache.core import KVCacheBuffers


def published(cache: KVCacheBuffers) -> dict[str, Any] | None:
    """What ``extensible-kv top`` shows of a KV cache."""
    if cache._freed or not cache.tensors:
        return None
    return published_figures(
        cache.tensors[0][0],
        "KVCacheBuffers",
        reserved_bytes=cache.reserved_bytes,
        committed_bytes=cache.committed_bytes,
        physical_bytes=cache.physical_bytes,
        asleep=cache.asleep,
        blocks=cache.num_blocks_committed,
        capacity_blocks=cache.num_blocks_capacity,
        **_use_figures(cache),
    )


def _use_figures(cache: KVCacheBuffers) -> dict[str, int]:
    """Bytes of the blocks in use and cached, once a scheduler counted them."""
    if cache.block_use is None:
        return {}
    in_use, cached = cache.block_use
    return {
        "in_use_bytes": in_use * cache.bytes_per_block,
        "cached_bytes": cached * cache.bytes_per_block,
    }
