"""How large the worker makes vLLM's KV cache: the capacity its reservation
spans (blocks of address space), and the seed's measurement after warm-up
(the bytes vLLM may give the cache: the budget minus what everything else
holds). Plain functions over vLLM's objects, handed in by the worker; they
own nothing."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.platforms import current_platform

from extensible_kv.integrations.vllm.seam import KVCacheBuffers, granule_size, segmentation

__all__ = [
    "capacity_blocks",
    "cpu_budget_and_used",
    "gpu_budget_and_used",
    "measured",
    "total_memory",
    "warm_up",
    "warm_up_config",
]

#: The worker's logger (``worker.py``'s): its messages keep one name.
logger = logging.getLogger("extensible_kv.integrations.vllm.worker")


def total_memory(device: torch.device) -> int:
    """Bytes of memory the device has: what bounds a capacity by default."""
    if device.type == "cpu":
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(torch.cuda.mem_get_info(device)[1])


def capacity_blocks(
    config: Any, bytes_per_block: int, asked: object, growth: str, device: torch.device
) -> int:
    """Blocks to reserve address space for: ``asked`` (the
    ``num_blocks_capacity`` option, None if unset), else as many blocks of
    ``bytes_per_block`` bytes as the device's memory holds; never below
    vLLM's count (``config.num_blocks``). With ``growth`` ``"elastic"`` the
    default is rounded up so that every layer's segment starts on a granule."""
    num_blocks = int(config.num_blocks)
    if asked is None:
        capacity = max(num_blocks, total_memory(device) // bytes_per_block)
        if growth == "elastic":
            # Every layer's segment starts on a granule, so that a unit
            # of blocks takes the same granules in each.
            row = segmentation(config).row_bytes
            step = granule_size(device) // math.gcd(granule_size(device), row)
            capacity = -(-capacity // step) * step
        return capacity
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < num_blocks:
        raise ValueError(
            f"additional_config['extensible_kv']['num_blocks_capacity'] is {asked!r}, "
            f"below the {num_blocks} blocks vLLM sized the KV cache to; give an int "
            f"of at least {num_blocks}"
        )
    return asked


def warm_up_config(vllm_config: Any, kv_cache_spec: Any) -> Any:
    """vLLM's KV cache config for warm-up: one block per sequence vLLM may
    batch, as vLLM's own profiling KV cache. ``vllm_config``'s block-count
    override is set for the call and restored after."""
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    groups = get_kv_cache_groups(vllm_config, kv_cache_spec)
    cache_config = vllm_config.cache_config
    saved = cache_config.num_gpu_blocks_override
    cache_config.num_gpu_blocks_override = max(1, vllm_config.scheduler_config.max_num_seqs)
    try:
        return get_kv_cache_config_from_groups(vllm_config, groups, available_memory=0)
    finally:
        cache_config.num_gpu_blocks_override = saved


def warm_up(model_runner: Any, compile_or_warm_up_model: Callable[[], object]) -> None:
    """vLLM's warm-up, over the committed prefix: a dummy forward of the
    largest batch; on a GPU also compilation and CUDA-graph capture (the
    worker's ``compile_or_warm_up_model``)."""
    if current_platform.is_cpu():
        model_runner.warming_up_model()
        return
    model_runner.profile_run()
    compile_or_warm_up_model()


def cpu_budget_and_used(requested_bytes: int) -> tuple[int, int]:
    """On CPU: the memory vLLM may use (``requested_bytes``, what vLLM's CPU
    worker takes of the host's NUMA node) and what this process holds now
    (its resident set), in bytes."""
    # What vLLM's CPU worker measures too (psutil is vLLM's dependency).
    import psutil

    return requested_bytes, int(psutil.Process().memory_info().rss)


def gpu_budget_and_used(
    device: torch.device, utilization: float, free_at_start: int
) -> tuple[int, int]:
    """On a GPU: the memory vLLM may use (``utilization``, vLLM's
    ``gpu_memory_utilization``, of the device's total) and what this worker
    uses now (``free_at_start``, the bytes free when vLLM's worker started,
    less the bytes free now), in bytes."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization), free_at_start - int(free)


def measured(budget: int, used: int, cache: KVCacheBuffers) -> dict[str, int]:
    """What warm-up measured, in bytes, over the KV cache ``cache`` it ran
    in, logged: ``budget_bytes``, ``non_kv_bytes`` (``used`` less the
    cache's physical memory), ``available_kv_bytes`` (the budget less that)
    and ``warm_up_blocks`` (blocks committed for warm-up)."""
    non_kv = used - cache.physical_bytes
    available = budget - non_kv
    warm_up_blocks = cache.num_blocks_committed
    logger.info(
        "extensible-kv: warm-up ran over %d KV blocks; everything else holds %d bytes, "
        "so %d of the %d-byte budget go to the KV cache",
        warm_up_blocks,
        non_kv,
        available,
        budget,
    )
    return {
        "budget_bytes": budget,
        "non_kv_bytes": non_kv,
        "available_kv_bytes": available,
        "warm_up_blocks": warm_up_blocks,
    }
