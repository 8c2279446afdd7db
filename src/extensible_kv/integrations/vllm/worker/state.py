"""What ``llm.collective_rpc("extensible_kv_state")`` reports per worker:
its KV cache's figures (bytes, blocks, addresses), read from the parts the
worker owns and hands in."""

from __future__ import annotations

from typing import Any

from extensible_kv.integrations.vllm.seam import ElasticBlocks, KVCacheBuffers, OnDemandGrowth

__all__ = ["STATE_KEYS", "fallback_state", "kv_state"]

#: What ``extensible_kv_state`` returns per worker (keys users rely on).
STATE_KEYS = (
    "reserved_bytes",
    "committed_bytes",
    "physical_bytes",
    "num_blocks_committed",
    "num_blocks_capacity",
    "base_ptrs",
    "asleep",
    "host_backup_bytes",
    "growth",
    "high_water_blocks",
    "sizing",
)


def fallback_state() -> dict[str, Any]:
    """The report of a worker that fell back to vLLM's allocation: every
    figure 0, ``enabled`` False."""
    fallback: dict[str, Any] = {key: 0 for key in STATE_KEYS}
    return {
        **fallback,
        "base_ptrs": [],
        "asleep": False,
        "growth": "static",
        "sizing": None,
        "enabled": False,
    }


def kv_state(
    cache: KVCacheBuffers,
    growth: OnDemandGrowth | ElasticBlocks | None,
    mode: str,
    sizing: dict[str, int] | None,
) -> dict[str, Any]:
    """The report on the KV cache ``cache``, from ``growth`` (what commits
    the cache beyond a prefix; None: static), ``mode`` (the ``growth``
    option) and ``sizing`` (what warm-up measured).

    Keys: ``reserved_bytes`` (address space), ``committed_bytes`` (the
    committed blocks' bytes), ``physical_bytes`` (memory held, whole
    granules), ``num_blocks_committed``, ``num_blocks_capacity``,
    ``base_ptrs`` (one address per backing buffer), ``asleep`` and
    ``host_backup_bytes`` (host memory holding a preserving sleep's
    copy; with ``"elastic"``, of the units kept), ``growth``
    (``"static"``, ``"on_demand"`` or ``"elastic"``;
    with ``"elastic"`` ``num_blocks_committed`` counts the blocks of the
    units held) and
    ``high_water_blocks`` (the most blocks committed at once),
    ``sizing`` (None with an explicit KV size; else what warm-up
    measured: ``budget_bytes``, ``non_kv_bytes``, ``available_kv_bytes``,
    ``warm_up_blocks``); and ``enabled`` (True here; False in
    :func:`fallback_state`).
    """
    return {
        "reserved_bytes": cache.reserved_bytes,
        "committed_bytes": cache.committed_bytes,
        "physical_bytes": cache.physical_bytes,
        "num_blocks_committed": cache.num_blocks_committed,
        "num_blocks_capacity": cache.num_blocks_capacity,
        "base_ptrs": cache.base_ptrs,
        "asleep": cache.asleep,
        "host_backup_bytes": cache.host_backup_bytes
        + (growth.kept_bytes if isinstance(growth, ElasticBlocks) else 0),
        "growth": mode,
        # The most blocks committed at once so far.
        "high_water_blocks": cache.num_blocks_committed if growth is None else growth.high_water,
        "sizing": sizing,
        "enabled": True,
    }
