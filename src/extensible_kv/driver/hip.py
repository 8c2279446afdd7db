"""The HIP backend: the driver protocol on ``hip.hip`` (hip-python), for ROCm.

Install with ``pip install 'extensible-kv[rocm]'`` (pick the hip-python
release numbered after your ROCm). Differences from CUDA, all from the
bindings:

* struct fields take enum instances, not ints;
* ``hipMemSetAccess`` takes one descriptor, not a list;
* ``hipMemExportToShareableHandle`` writes the fd into memory we pass;
* ``hipMemImportFromShareableHandle`` takes the fd value from ROCm 7.1 on,
  a pointer to it before;
* the bindings do not expose ``hipMemAllocationProp``'s handle-type field
  (an anonymous union in the C header), so no allocation can *ask* for a
  POSIX fd handle: shareable memory is allocated as plain memory, with one
  warning, and exporting it works only where the ROCm runtime allows it.

HIP has no explicit contexts: each device's primary context is implicit.
"""

from __future__ import annotations

import ctypes
import importlib
import warnings
from typing import Any

from extensible_kv.driver._gpu import GpuDriver

#: HIP_VERSION of ROCm 7.1 (major * 10^7 + minor * 10^5 + patch): from it on,
#: hipMemImportFromShareableHandle takes the fd by value.
_IMPORT_BY_VALUE_FROM = 70_100_000


def load_bindings() -> Any:
    """``hip.hip``; ImportError when hip-python is not installed.

    Read as an attribute: from hip-python 10 on, ``hip`` re-exports
    ``rocm.bindings.hip`` and ``hip.hip`` is no longer a submodule.
    """
    return importlib.import_module("hip").hip


class HipDriver(GpuDriver):
    """ROCm virtual memory management through the HIP runtime API.

    Args:
        bindings: the ``hip.hip`` module (tests pass a stand-in).
    """

    backend = "HIP"
    dlpack_device_type = 10
    out_of_memory_code = 2  # hipErrorOutOfMemory

    def __init__(self, bindings: Any = None) -> None:
        super().__init__(load_bindings() if bindings is None else bindings)
        self._check("hipInit", self._b.hipInit(0))
        self._version = int(self._check("hipRuntimeGetVersion", self._b.hipRuntimeGetVersion()))
        self._warned_shareable = False

    def _error_text(self, code: Any) -> tuple[str, str]:
        name = self._b.hipGetErrorName(code)[1]
        text = self._b.hipGetErrorString(code)[1]
        return (
            name.decode() if name else f"hipError_t {int(code)}",
            text.decode() if text else "unknown error",
        )

    # -- devices ----------------------------------------------------------------

    def device_count(self) -> int:
        return int(self._check("hipGetDeviceCount", self._b.hipGetDeviceCount()))

    def supports_vmm(self, device: int) -> bool:
        attribute = self._b.hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported
        return bool(
            self._check("hipDeviceGetAttribute", self._b.hipDeviceGetAttribute(attribute, device))
        )

    def ensure_context(self, device: int) -> None:
        """HIP's contexts are implicit: nothing to make current."""

    def synchronize(self, device: int) -> None:
        """Wait for all work on ``device``, then restore the current device."""
        previous = self._check("hipGetDevice", self._b.hipGetDevice())
        self._check("hipSetDevice", self._b.hipSetDevice(device))
        try:
            self._check("hipDeviceSynchronize", self._b.hipDeviceSynchronize())
        finally:
            self._check("hipSetDevice", self._b.hipSetDevice(previous))

    # -- structs ----------------------------------------------------------------

    def _location(self, target: Any, device: int) -> None:
        target.type = self._b.hipMemLocationType.hipMemLocationTypeDevice
        target.id = device

    def _allocation_prop(self, device: int, shareable: bool) -> Any:
        prop = self._b.hipMemAllocationProp()
        prop.type = self._b.hipMemAllocationType.hipMemAllocationTypePinned
        self._location(prop.location, device)
        return prop

    def access_desc(self, device: int) -> Any:
        desc = self._b.hipMemAccessDesc()
        self._location(desc.location, device)
        desc.flags = self._b.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        return desc

    # -- protocol ---------------------------------------------------------------

    def _query_granularity(self, prop: Any) -> int:
        minimum = self._b.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
        return int(
            self._check(
                "hipMemGetAllocationGranularity",
                self._b.hipMemGetAllocationGranularity(prop, minimum),
            )
        )

    def reserve(self, size: int) -> int:
        return int(self._check("hipMemAddressReserve", self._b.hipMemAddressReserve(size, 0, 0, 0)))

    def free_reserved(self, ptr: int, size: int) -> None:
        self._check("hipMemAddressFree", self._b.hipMemAddressFree(ptr, size))

    def _create(self, size: int, prop: Any) -> int:
        return int(self._check("hipMemCreate", self._b.hipMemCreate(size, prop, 0)))

    def create(self, size: int, device: int, shareable: bool) -> int:
        if shareable and not self._warned_shareable:
            self._warned_shareable = True
            warnings.warn(
                "hip-python does not expose hipMemAllocationProp's handle type: "
                "shareable memory is allocated as plain memory, and exporting it "
                "works only where this ROCm runtime allows it",
                RuntimeWarning,
                stacklevel=2,
            )
        return super().create(size, device, False)

    def release(self, handle: int) -> None:
        self._check("hipMemRelease", self._b.hipMemRelease(handle))

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._check("hipMemMap", self._b.hipMemMap(ptr, size, 0, handle, 0))

    def unmap(self, ptr: int, size: int) -> None:
        self._check("hipMemUnmap", self._b.hipMemUnmap(ptr, size))

    def set_access(self, ptr: int, size: int, device: int) -> None:
        self._check(
            "hipMemSetAccess", self._b.hipMemSetAccess(ptr, size, self.access_desc(device), 1)
        )

    def _posix_fd_type(self) -> Any:
        return self._b.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor

    def export_handle(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self._check(
            "hipMemExportToShareableHandle",
            self._b.hipMemExportToShareableHandle(
                ctypes.addressof(fd), handle, self._posix_fd_type(), 0
            ),
        )
        return fd.value

    def import_handle(self, fd: int) -> int:
        # Before ROCm 7.1 the runtime read the fd through the pointer it got.
        by_value = self._version >= _IMPORT_BY_VALUE_FROM
        holder = ctypes.c_int(fd)
        os_handle = fd if by_value else ctypes.addressof(holder)
        return int(
            self._check(
                "hipMemImportFromShareableHandle",
                self._b.hipMemImportFromShareableHandle(os_handle, self._posix_fd_type()),
            )
        )
