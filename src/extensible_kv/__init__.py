"""extensible-kv: growable, sleepable KV caches on GPU (and host) virtual memory.

Reserve the address range once, commit physical memory underneath it as the
cache grows, release it while the engine sleeps and commit it again on wake;
views never move, so captured CUDA graphs stay valid throughout.
"""

from extensible_kv.buffer import Chunk, VirtualBuffer
from extensible_kv.dlpack import ByteView, uint8_tensor_from_ptr
from extensible_kv.driver import (
    BackendUnavailableError,
    Driver,
    DriverError,
    FaultInjectingDriver,
    HostDriver,
    OutOfMemoryError,
    StatisticsDriver,
    get_driver,
    unavailable_reason,
)
from extensible_kv.kv import ExtensibleKVCacheBuffers, KVCacheBuffers, allocate_kv_cache
from extensible_kv.tensor import ExtensibleTensor


def vmm_unavailable_reason(device: object = "cuda") -> str | None:
    """Why GPU virtual memory cannot be used (vLLM's name), or None."""
    return unavailable_reason(device)


__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "ByteView",
    "Chunk",
    "Driver",
    "DriverError",
    "ExtensibleKVCacheBuffers",
    "ExtensibleTensor",
    "FaultInjectingDriver",
    "HostDriver",
    "KVCacheBuffers",
    "OutOfMemoryError",
    "StatisticsDriver",
    "VirtualBuffer",
    "allocate_kv_cache",
    "get_driver",
    "uint8_tensor_from_ptr",
    "unavailable_reason",
    "vmm_unavailable_reason",
]
