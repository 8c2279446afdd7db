"""extensible-kv: growable, sleepable KV caches on GPU (and host) virtual memory.

Reserve the address range once, commit physical memory underneath it as the
cache grows, release it while the engine sleeps and commit it again on wake;
views never move, so captured CUDA graphs stay valid throughout.
"""

import torch

from extensible_kv.buffer import Chunk, VirtualBuffer
from extensible_kv.devices import BudgetDriver, get_driver, waiting_for_budget
from extensible_kv.dlpack import ByteView, uint8_tensor_from_ptr
from extensible_kv.driver import (
    BackendUnavailableError,
    BudgetExceededError,
    Driver,
    DriverError,
    FaultInjectingDriver,
    HostDriver,
    OutOfMemoryError,
    PoolingDriver,
    StatisticsDriver,
    unavailable_reason,
)
from extensible_kv.driver.select import parse_device
from extensible_kv.kv import (
    ExtensibleKVCacheBuffers,
    ExtensibleKVCacheBuilder,
    KVCacheBuffers,
    allocate_kv_cache,
)
from extensible_kv.tensor import ExtensibleTensor


def vmm_unavailable_reason(device: object = "cuda") -> str | None:
    """Why GPU virtual memory cannot be used (vLLM's name), or None."""
    return unavailable_reason(device)


def granule_size(device: object = 0, shareable: bool = False) -> int:
    """Bytes physical memory is committed in on ``device`` (vLLM's name;
    an int is a CUDA ordinal, ``"cuda"`` the current device): the driver's
    allocation granularity. Every committed range is rounded out to it."""
    spec = parse_device(device)
    index = spec.index
    if index is None:
        index = torch.cuda.current_device() if spec.type == "cuda" else 0
    return get_driver(spec).granularity(index, shareable)


__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BudgetDriver",
    "BudgetExceededError",
    "ByteView",
    "Chunk",
    "Driver",
    "DriverError",
    "ExtensibleKVCacheBuffers",
    "ExtensibleKVCacheBuilder",
    "ExtensibleTensor",
    "FaultInjectingDriver",
    "HostDriver",
    "KVCacheBuffers",
    "OutOfMemoryError",
    "PoolingDriver",
    "StatisticsDriver",
    "VirtualBuffer",
    "allocate_kv_cache",
    "get_driver",
    "granule_size",
    "uint8_tensor_from_ptr",
    "unavailable_reason",
    "vmm_unavailable_reason",
    "waiting_for_budget",
]
