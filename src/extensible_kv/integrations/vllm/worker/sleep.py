"""The rules of the worker's sleep, wake and trim of vLLM's KV cache: who
sleeps the weights, how a release goes around a KV connector's registration,
what a wake commits again for each ``growth`` mode, when a prefix-keeping
sleep or a trim is refused, and which blocks running requests still use.
The worker owns the cache and calls these with its parts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.platforms import current_platform

from extensible_kv.integrations.vllm.seam import (
    ElasticBlocks,
    KVCacheBuffers,
    OnDemandGrowth,
    check_int,
    waiting_for_budget,
)
from extensible_kv.integrations.vllm.worker.connectors import (
    connector_name,
    connector_of,
    release_refusal,
)
from extensible_kv.integrations.vllm.worker.steps import ended

__all__ = [
    "blocks_in_use",
    "check_kv_sleep",
    "parent_sleeps",
    "release_kv",
    "trim_to",
    "trimmable",
    "wake_kv",
]


def parent_sleeps(vllm_config: Any) -> bool:
    """Whether vLLM's own sleep handles the weights: on a GPU with vLLM's
    sleep mode on (on CPU, vLLM's sleep does nothing)."""
    return not current_platform.is_cpu() and bool(vllm_config.model_config.enable_sleep_mode)


def release_kv(cache: KVCacheBuffers, vllm_config: Any, what: str) -> bool:
    """Release every byte of the KV cache ``cache`` (its contents
    discarded); with a connector, between its ``unregister_kv_caches()``
    and, on a failure, its ``restore_kv_caches()``. Returns whether the
    connector's registration was taken: the caller restores it once the
    memory is back. ``what`` (the call releasing) names a refusal
    (:func:`~extensible_kv.integrations.vllm.worker.connectors.release_refusal`), a
    RuntimeError."""
    connector = connector_of(vllm_config)
    if connector is None:
        cache.release_physical()
        return False
    kv_transfer_config = vllm_config.kv_transfer_config
    reason = release_refusal(type(connector), kv_transfer_config)
    if reason is not None:
        raise RuntimeError(
            f"{what} would discard the KV cache, which {connector_name(kv_transfer_config)} "
            f"has registered for transfers; {reason}. Sleep at level 0, or run without "
            f"the connector"
        )
    connector.unregister_kv_caches()
    try:
        cache.release_physical()
    except BaseException:
        connector.restore_kv_caches()  # the memory stayed: so does its registration
        raise
    return True


def wake_kv(
    cache: KVCacheBuffers, growth: OnDemandGrowth | ElasticBlocks | None, wait_s: float
) -> None:
    """Commit the KV cache ``cache`` again: what it held, or with
    on-demand ``growth`` the first step after a discarding sleep (vLLM reset
    its prefix cache), or with elastic ``growth`` unit 0 (the scheduler's
    next orders commit the rest). ``growth`` is what commits the cache
    beyond a prefix (None: static, a prefix of vLLM's count).

    Under a device budget (``extensible-kv limit``) that another engine
    fills, the commit waits up to ``wait_s`` seconds for room, then raises
    :class:`~extensible_kv.BudgetExceededError` with the cache still
    asleep, so a later wake can try again."""
    with waiting_for_budget(wait_s):
        if growth is not None:
            growth.wake()
        else:
            cache.recommit()


def check_kv_sleep(connector: str | None) -> None:
    """Refuse ``sleep_kv_cache`` where it cannot be undone: under a KV
    ``connector`` (its name; None without one)."""
    if connector is not None:
        raise RuntimeError(
            f"sleep_kv_cache would release the KV cache, which {connector} "
            f"has registered for transfers; a connector's peers learn of a cache "
            f"registered again only through vLLM's own wake_up (vLLM 0.33 and later). "
            f"Use llm.sleep(level=1) there, or run without the connector"
        )


def trimmable(growth: OnDemandGrowth | None, *, elastic: bool) -> OnDemandGrowth:
    """The on-demand ``growth`` a trim gives memory back through, or a
    RuntimeError saying why there is none (``elastic`` memory, or static)."""
    if elastic:
        raise RuntimeError(
            "trim_kv_cache is for growth 'on_demand': with growth 'elastic' the scheduler "
            "gives memory back by itself, within a step of the load falling"
        )
    if growth is None:
        raise RuntimeError(
            "trim_kv_cache needs additional_config={'extensible_kv': {'growth': "
            "'on_demand'}}: with static growth vLLM may use every block it was given"
        )
    return growth


def trim_to(growth: OnDemandGrowth, num_blocks: int | None, in_use: int) -> int:
    """Give back the memory past ``num_blocks`` blocks (default: ``in_use``,
    the blocks of the requests still running); returns the blocks still
    committed. A count below ``in_use`` is a ValueError."""
    if num_blocks is None:
        num_blocks = in_use
    check_int("num_blocks", num_blocks)
    if num_blocks < in_use:
        raise ValueError(
            f"trim_kv_cache({num_blocks}) would drop blocks that running requests "
            f"use (up to block {in_use - 1}); keep at least {in_use}"
        )
    return growth.trim(num_blocks)


def blocks_in_use(requests: Mapping[Any, Any], max_model_len: int) -> int:
    """One past the highest block id of the requests still running, among
    ``requests`` (vLLM's runner's, by request id).

    vLLM's runner lists a finished request until the next step tells it
    so (``finished_req_ids``), and an engine stepped in-process takes no
    step after ``generate`` returns: a request whose last token ended
    it (its ``max_tokens``, the model's length, a stop token) is not
    counted. (One ended by a stop string, which the front end finds,
    still counts until the next step: the trim is then refused, never
    wrong.)"""
    return 1 + max(
        (
            i
            for state in requests.values()
            if not ended(state, max_model_len)
            for group in state.block_ids
            for i in group
        ),
        default=-1,
    )
