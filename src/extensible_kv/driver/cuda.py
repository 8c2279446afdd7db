"""The CUDA backend: the driver protocol on ``cuda.bindings.driver`` (cuda-python).

Install with ``pip install 'extensible-kv[cuda]'``. Every struct is built
from the bindings' own types; nothing here knows a struct layout.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from extensible_kv.driver._gpu import GpuDriver, format_uuid


def load_bindings() -> Any:
    """``cuda.bindings.driver``; ImportError when cuda-python is not installed."""
    return importlib.import_module("cuda.bindings.driver")


class CudaDriver(GpuDriver):
    """CUDA virtual memory management through the driver API.

    Args:
        bindings: the ``cuda.bindings.driver`` module (tests pass a stand-in).

    Raises:
        RuntimeError: the bindings cannot load the driver library (libcuda).
        DriverError: ``cuInit`` fails (no device, driver too old, ...).
    """

    backend = "CUDA"
    dlpack_device_type = 2
    out_of_memory_code = 2  # CUDA_ERROR_OUT_OF_MEMORY

    def __init__(self, bindings: Any = None) -> None:
        super().__init__(load_bindings() if bindings is None else bindings)
        self._check("cuInit", self._b.cuInit(0))
        self._contexts: dict[int, Any] = {}
        self._capabilities: dict[int, tuple[bool, bool]] = {}

    def _error_text(self, code: Any) -> tuple[str, str]:
        name = self._b.cuGetErrorName(code)
        text = self._b.cuGetErrorString(code)
        return (
            name[1].decode() if int(name[0]) == 0 else f"CUresult {int(code)}",
            text[1].decode() if int(text[0]) == 0 else "unknown error",
        )

    # -- devices and contexts ---------------------------------------------------

    def device_count(self) -> int:
        return int(self._check("cuDeviceGetCount", self._b.cuDeviceGetCount()))

    def device_uuid(self, device: int) -> str:
        dev = self._check("cuDeviceGet", self._b.cuDeviceGet(device))
        uuid = self._check("cuDeviceGetUuid", self._b.cuDeviceGetUuid(dev))
        return format_uuid(uuid.bytes)

    def _attribute(self, name: str, device: int) -> int:
        attribute = getattr(self._b.CUdevice_attribute, name)
        dev = self._check("cuDeviceGet", self._b.cuDeviceGet(device))
        return int(
            self._check("cuDeviceGetAttribute", self._b.cuDeviceGetAttribute(attribute, dev))
        )

    def supports_vmm(self, device: int) -> bool:
        return bool(
            self._attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED", device)
        )

    def capabilities(self, device: int) -> tuple[bool, bool]:
        """(POSIX fd handles supported, GPU-direct RDMA on VMM memory supported)."""
        if device not in self._capabilities:
            self._capabilities[device] = (
                bool(
                    self._attribute(
                        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", device
                    )
                ),
                bool(
                    self._attribute(
                        "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", device
                    )
                ),
            )
        return self._capabilities[device]

    def _primary_context(self, device: int) -> Any:
        # Retained once per device and kept: torch uses the same primary
        # context, so both agree on which memory belongs to which device.
        with self._lock:
            if device not in self._contexts:
                dev = self._check("cuDeviceGet", self._b.cuDeviceGet(device))
                self._contexts[device] = self._check(
                    "cuDevicePrimaryCtxRetain", self._b.cuDevicePrimaryCtxRetain(dev)
                )
            return self._contexts[device]

    def context(self, device: int) -> AbstractContextManager[None]:
        return self._pushed(device)

    @contextlib.contextmanager
    def _pushed(self, device: int) -> Iterator[None]:
        # Contexts are per thread. Pushing the device's primary context, and
        # popping it after, leaves the thread as it was: a thread that had no
        # context does not end up with cuda:N current behind torch's back, and
        # a thread working on another device keeps it.
        target = self._primary_context(device)
        current = self._check("cuCtxGetCurrent", self._b.cuCtxGetCurrent())
        if current is not None and int(current) == int(target):
            yield
            return
        self._check("cuCtxPushCurrent", self._b.cuCtxPushCurrent(target))
        try:
            yield
        finally:
            self._check("cuCtxPopCurrent", self._b.cuCtxPopCurrent())

    def synchronize(self, device: int) -> None:
        """Wait for all work in ``device``'s primary context, whatever is current."""
        with self.context(device):
            self._check("cuCtxSynchronize", self._b.cuCtxSynchronize())

    def _synchronize_stream(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._b.cuStreamSynchronize(self._b.CUstream(stream)))

    # -- structs ----------------------------------------------------------------

    def _location(self, target: Any, device: int) -> None:
        target.type = self._b.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        target.id = device

    def _allocation_prop(self, device: int, shareable: bool) -> Any:
        """Pinned device memory; shareable adds the POSIX fd handle type and
        the RDMA flag where the device supports each (they change granularity)."""
        prop = self._b.CUmemAllocationProp()
        prop.type = self._b.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._location(prop.location, device)
        if shareable:
            posix_fd, rdma = self.capabilities(device)
            if posix_fd:
                prop.requestedHandleTypes = (
                    self._b.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                )
            if rdma:
                prop.allocFlags.gpuDirectRDMACapable = 1
        return prop

    def access_desc(self, device: int, *, read_only: bool = False) -> Any:
        desc = self._b.CUmemAccessDesc()
        self._location(desc.location, device)
        flags = self._b.CUmemAccess_flags
        desc.flags = (
            flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only
            else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        return desc

    # -- protocol ---------------------------------------------------------------

    def _query_granularity(self, prop: Any) -> int:
        minimum = self._b.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(
            self._check(
                "cuMemGetAllocationGranularity",
                self._b.cuMemGetAllocationGranularity(prop, minimum),
            )
        )

    def reserve(self, size: int, alignment: int) -> int:
        return int(
            self._check("cuMemAddressReserve", self._b.cuMemAddressReserve(size, alignment, 0, 0))
        )

    def _free_reserved(self, ptr: int, size: int) -> None:
        self._check("cuMemAddressFree", self._b.cuMemAddressFree(ptr, size))

    def _create(self, size: int, prop: Any) -> int:
        return int(self._check("cuMemCreate", self._b.cuMemCreate(size, prop, 0)))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._b.cuMemRelease(handle))

    def _map(self, ptr: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self._b.cuMemMap(ptr, size, 0, handle, 0))

    def _unmap(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self._b.cuMemUnmap(ptr, size))

    def _set_access(self, ptr: int, size: int, device: int, *, read_only: bool) -> None:
        desc = self.access_desc(device, read_only=read_only)
        with self.context(device):
            self._check("cuMemSetAccess", self._b.cuMemSetAccess(ptr, size, [desc], 1))

    def _retain(self, ptr: int) -> int:
        return int(
            self._check("cuMemRetainAllocationHandle", self._b.cuMemRetainAllocationHandle(ptr))
        )

    def _memset_zero(self, ptr: int, size: int) -> None:
        self._check("cuMemsetD8", self._b.cuMemsetD8(ptr, 0, size))

    def export_handle(self, handle: int) -> int:
        posix_fd = self._b.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(
            self._check(
                "cuMemExportToShareableHandle",
                self._b.cuMemExportToShareableHandle(handle, posix_fd, 0),
            )
        )

    def import_handle(self, fd: int) -> int:
        posix_fd = self._b.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(
            self._check(
                "cuMemImportFromShareableHandle",
                self._b.cuMemImportFromShareableHandle(fd, posix_fd),
            )
        )
