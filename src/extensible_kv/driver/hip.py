"""The HIP backend: the driver protocol on ``hip.hip`` (hip-python), for ROCm.

Install with ``pip install 'extensible-kv[rocm]'`` (pick the hip-python
release numbered after your ROCm). Differences from CUDA, all from the
bindings:

* HIP has no explicit contexts: ``hipMemCreate``, the granularity query and
  ``hipMemImportFromShareableHandle`` act on the thread's *current device*,
  so :meth:`HipDriver.context` sets it (``hipSetDevice``) for the block and
  puts the previous one back;
* struct fields take enum instances, not ints;
* ``hipMemSetAccess`` takes one descriptor, not a list;
* ``hipMemExportToShareableHandle`` writes the fd into memory we pass;
* ``hipMemImportFromShareableHandle`` takes the fd value from ROCm 7.1 on,
  a pointer to it before;
* hip-python up to 10 does not expose ``hipMemAllocationProp``'s handle
  type, an anonymous union in the C header, and the runtime exports only
  memory created with the handle type asked for: it is written through the
  struct's own address (see :func:`request_posix_fd`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from extensible_kv.driver._gpu import GpuDriver, format_uuid

#: HIP_VERSION of ROCm 7.1 (major * 10^7 + minor * 10^5 + patch): from it on,
#: hipMemImportFromShareableHandle takes the fd by value.
_IMPORT_BY_VALUE_FROM = 70_100_000
_ENUM_BYTES = ctypes.sizeof(ctypes.c_int)


def load_bindings() -> Any:
    """``hip.hip``; ImportError when hip-python is not installed.

    Read as an attribute: from hip-python 10 on, ``hip`` re-exports
    ``rocm.bindings.hip`` and ``hip.hip`` is no longer a submodule.
    """
    return importlib.import_module("hip").hip


def request_posix_fd(prop: Any, posix_fd: Any) -> None:
    """Set ``prop.requestedHandleType`` to ``posix_fd`` (an enum instance).

    Newer bindings may name the field; hip-python up to 10 does not. In the
    C header the field is a union of two enums between ``type`` (an enum at
    offset 0) and ``location``: the bindings' own addresses of the struct
    and of ``location`` say where it lies, and it is written there, after
    checking the layout has room for exactly that one enum.
    """
    for name in ("requestedHandleTypes", "requestedHandleType"):
        if hasattr(prop, name):
            setattr(prop, name, posix_fd)
            return
    base = prop.as_c_void_p().value
    location = prop.location.as_c_void_p().value
    if location - base != 2 * _ENUM_BYTES:
        raise TypeError(
            f"hipMemAllocationProp of these bindings puts location at offset "
            f"{location - base}, not {2 * _ENUM_BYTES}: the handle-type field cannot be found"
        )
    ctypes.c_int.from_address(base + _ENUM_BYTES).value = int(posix_fd)


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

    def device_uuid(self, device: int) -> str:
        uuid = self._check("hipDeviceGetUuid", self._b.hipDeviceGetUuid(device))
        return format_uuid(uuid.bytes)

    def supports_vmm(self, device: int) -> bool:
        attribute = self._b.hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported
        return bool(
            self._check("hipDeviceGetAttribute", self._b.hipDeviceGetAttribute(attribute, device))
        )

    def context(self, device: int) -> AbstractContextManager[None]:
        return self._current(device)

    @contextlib.contextmanager
    def _current(self, device: int) -> Iterator[None]:
        # HIP's memory calls use the thread's current device: make it the
        # one asked for, and put the caller's back after.
        previous = int(self._check("hipGetDevice", self._b.hipGetDevice()))
        if previous == device:
            yield
            return
        self._check("hipSetDevice", self._b.hipSetDevice(device))
        try:
            yield
        finally:
            self._check("hipSetDevice", self._b.hipSetDevice(previous))

    def synchronize(self, device: int) -> None:
        """Wait for all work on ``device``, then restore the current device."""
        with self.context(device):
            self._check("hipDeviceSynchronize", self._b.hipDeviceSynchronize())

    def _synchronize_stream(self, stream: int) -> None:
        self._check("hipStreamSynchronize", self._b.hipStreamSynchronize(stream))

    # -- structs ----------------------------------------------------------------

    def _location(self, target: Any, device: int) -> None:
        target.type = self._b.hipMemLocationType.hipMemLocationTypeDevice
        target.id = device

    def _allocation_prop(self, device: int, shareable: bool) -> Any:
        prop = self._b.hipMemAllocationProp()
        prop.type = self._b.hipMemAllocationType.hipMemAllocationTypePinned
        self._location(prop.location, device)
        if shareable and device not in self._plain_only:
            try:
                request_posix_fd(prop, self._posix_fd_type())
            except TypeError as exc:
                with self._lock:
                    self._plain_only.add(device)
                warnings.warn(
                    f"{exc}; HIP device {device} gets plain memory, which cannot be exported",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return prop

    def access_desc(self, device: int, *, read_only: bool = False) -> Any:
        desc = self._b.hipMemAccessDesc()
        self._location(desc.location, device)
        flags = self._b.hipMemAccessFlags
        desc.flags = (
            flags.hipMemAccessFlagsProtRead if read_only else flags.hipMemAccessFlagsProtReadWrite
        )
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

    def reserve(self, size: int, alignment: int) -> int:
        return int(
            self._check("hipMemAddressReserve", self._b.hipMemAddressReserve(size, alignment, 0, 0))
        )

    def _free_reserved(self, ptr: int, size: int) -> None:
        self._check("hipMemAddressFree", self._b.hipMemAddressFree(ptr, size))

    def _create(self, size: int, prop: Any) -> int:
        return int(self._check("hipMemCreate", self._b.hipMemCreate(size, prop, 0)))

    def release(self, handle: int) -> None:
        self._check("hipMemRelease", self._b.hipMemRelease(handle))

    def _map(self, ptr: int, size: int, handle: int) -> None:
        self._check("hipMemMap", self._b.hipMemMap(ptr, size, 0, handle, 0))

    def _unmap(self, ptr: int, size: int) -> None:
        self._check("hipMemUnmap", self._b.hipMemUnmap(ptr, size))

    def _set_access(self, ptr: int, size: int, device: int, *, read_only: bool) -> None:
        desc = self.access_desc(device, read_only=read_only)
        with self.context(device):
            self._check("hipMemSetAccess", self._b.hipMemSetAccess(ptr, size, desc, 1))

    def _retain(self, ptr: int) -> int:
        return int(
            self._check("hipMemRetainAllocationHandle", self._b.hipMemRetainAllocationHandle(ptr))
        )

    def _memset_zero(self, ptr: int, size: int) -> None:
        self._check("hipMemset", self._b.hipMemset(ptr, 0, size))

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
