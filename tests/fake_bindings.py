"""LABELLED FAKES of the GPU bindings, for machines without a GPU.

``FakeCuda`` stands in for ``cuda.bindings.driver`` and ``FakeHip`` for
``hip.hip`` at the one boundary no real thing reaches here: the GPU driver.
Types, enums and structs come from the real, installed bindings, so the
backends' struct building is checked against them; only the calls that
would enter the driver are simulated, with the driver's rules (granularity,
whole mappings, access on mapped memory). They record every call so tests
can check order, arguments and rollback.

Passing tests against these fakes is NOT GPU verification: see
docs/gpu-validation.md for what has run on hardware.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20


@dataclass
class FakeGpuState:
    """The simulated driver's memory: what a test inspects after the calls."""

    granularity: int = 2 * MiB
    next_va: int = 0x7F00_0000_0000
    next_handle: int = 1
    reservations: dict[int, int] = field(default_factory=dict)
    handles: dict[int, tuple[int, bool]] = field(default_factory=dict)
    mappings: dict[int, tuple[int, int]] = field(default_factory=dict)
    accessible: set[int] = field(default_factory=set)
    exported: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.reservations or self.handles or self.mappings)


class _FakeBindings:
    """Shared rules; subclasses speak one binding's dialect."""

    SUCCESS = 0
    INVALID_VALUE = 1
    OUT_OF_MEMORY = 2
    NOT_SUPPORTED = 801

    def __init__(self, real: Any, devices: int = 1, vmm: bool = True) -> None:
        self._real = real
        self.devices = devices
        self.vmm = vmm
        self.state = FakeGpuState()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.failures: dict[str, int] = {}
        self.refuse_shareable = False

    def __getattr__(self, name: str) -> Any:
        # Types, enums and structs: the real bindings' own.
        return getattr(self._real, name)

    def _enter(self, name: str, args: tuple[Any, ...]) -> int:
        self.calls.append((name, args))
        return self.failures.pop(name, self.SUCCESS)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # -- the driver's rules, in plain ints ----------------------------------

    def _reserve(self, size: int) -> tuple[int, int]:
        g = self.state.granularity
        if size <= 0 or size % g:
            return self.INVALID_VALUE, 0
        ptr = self.state.next_va
        self.state.next_va += size + 64 * g
        self.state.reservations[ptr] = size
        return self.SUCCESS, ptr

    def _free_reserved(self, ptr: int, size: int) -> int:
        if self.state.reservations.get(ptr) != size:
            return self.INVALID_VALUE
        if any(ptr <= m < ptr + size for m in self.state.mappings):
            return self.INVALID_VALUE
        del self.state.reservations[ptr]
        return self.SUCCESS

    def _create(self, size: int, shareable: bool) -> tuple[int, int]:
        if size <= 0 or size % self.state.granularity:
            return self.INVALID_VALUE, 0
        if shareable and self.refuse_shareable:
            return self.NOT_SUPPORTED, 0
        handle = self.state.next_handle
        self.state.next_handle += 1
        self.state.handles[handle] = (size, shareable)
        return self.SUCCESS, handle

    def _release(self, handle: int) -> int:
        if handle not in self.state.handles:
            return self.INVALID_VALUE
        del self.state.handles[handle]
        return self.SUCCESS

    def _map(self, ptr: int, size: int, offset: int, handle: int) -> int:
        held = self.state.handles.get(handle)
        inside = any(r <= ptr and ptr + size <= r + s for r, s in self.state.reservations.items())
        overlaps = any(m < ptr + size and ptr < m + s for m, (s, _) in self.state.mappings.items())
        if held is None or held[0] != size or offset or not inside or overlaps:
            return self.INVALID_VALUE
        self.state.mappings[ptr] = (size, handle)
        return self.SUCCESS

    def _covering(self, ptr: int, size: int) -> list[int] | None:
        starts, cursor = [], ptr
        while cursor < ptr + size:
            if cursor not in self.state.mappings:
                return None
            starts.append(cursor)
            cursor += self.state.mappings[cursor][0]
        return starts if cursor == ptr + size else None

    def _unmap(self, ptr: int, size: int) -> int:
        starts = self._covering(ptr, size)
        if starts is None:
            return self.INVALID_VALUE
        for start in starts:
            del self.state.mappings[start]
            self.state.accessible.discard(start)
        return self.SUCCESS

    def _set_access(self, ptr: int, size: int) -> int:
        starts = self._covering(ptr, size)
        if starts is None:
            return self.INVALID_VALUE
        self.state.accessible.update(starts)
        return self.SUCCESS

    def _export(self, handle: int) -> tuple[int, int]:
        held = self.state.handles.get(handle)
        if held is None or not held[1]:
            return self.INVALID_VALUE, -1
        fd = os.open(os.devnull, os.O_RDONLY)
        self.state.exported[fd] = held
        return self.SUCCESS, fd

    def _import(self, fd: int) -> tuple[int, int]:
        held = self.state.exported.get(fd)
        if held is None:
            return self.INVALID_VALUE, 0
        handle = self.state.next_handle
        self.state.next_handle += 1
        self.state.handles[handle] = held
        return self.SUCCESS, handle


class FakeCuda(_FakeBindings):
    """FAKE ``cuda.bindings.driver`` (see the module docstring)."""

    def __init__(
        self,
        real: Any,
        devices: int = 1,
        vmm: bool = True,
        posix_fd: bool = True,
        rdma: bool = True,
    ) -> None:
        super().__init__(real, devices, vmm)
        self.posix_fd = posix_fd
        self.rdma = rdma
        self.current = 0
        self.stack: list[int] = []
        self.synchronized: list[int] = []

    def _r(self, code: int, *values: Any) -> tuple[Any, ...]:
        result = self._real.CUresult(code)
        return (result, *values) if code == 0 else (result, *(None for _ in values))

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        code = self._enter("cuInit", (flags,))
        return self._r(code if self.devices else 100)

    def cuGetErrorName(self, error: Any) -> tuple[Any, ...]:
        return self._r(0, self._real.CUresult(int(error)).name.encode())

    def cuGetErrorString(self, error: Any) -> tuple[Any, ...]:
        return self._r(0, b"fake driver error")

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return self._r(self._enter("cuDeviceGetCount", ()), self.devices)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        code = self._enter("cuDeviceGet", (ordinal,)) or (0 if ordinal < self.devices else 101)
        return self._r(code, self._real.CUdevice(ordinal))

    def cuDeviceGetAttribute(self, attribute: Any, device: Any) -> tuple[Any, ...]:
        code = self._enter("cuDeviceGetAttribute", (attribute, device))
        values = {
            "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED": self.vmm,
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": self.posix_fd,
            "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED": self.rdma,
        }
        return self._r(code, int(values[attribute.name]))

    def cuDevicePrimaryCtxRetain(self, device: Any) -> tuple[Any, ...]:
        code = self._enter("cuDevicePrimaryCtxRetain", (device,))
        return self._r(code, self._real.CUcontext(0x1000 + int(device)))

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return self._r(self._enter("cuCtxGetCurrent", ()), self._real.CUcontext(self.current))

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        code = self._enter("cuCtxSetCurrent", (ctx,))
        if code == 0:
            self.current = int(ctx)
        return self._r(code)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any, ...]:
        code = self._enter("cuCtxPushCurrent", (ctx,))
        if code == 0:
            self.stack.append(self.current)
            self.current = int(ctx)
        return self._r(code)

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:
        code = self._enter("cuCtxPopCurrent", ())
        popped = self.current
        if code == 0:
            self.current = self.stack.pop()
        return self._r(code, self._real.CUcontext(popped))

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        code = self._enter("cuCtxSynchronize", ())
        if code == 0:
            self.synchronized.append(self.current)
        return self._r(code)

    def _shareable(self, prop: Any) -> bool:
        posix = self._real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return bool(prop.requestedHandleTypes == posix)

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        code = self._enter("cuMemGetAllocationGranularity", (prop, option))
        return self._r(code, self.state.granularity)

    def cuMemAddressReserve(
        self, size: int, alignment: int, addr: int, flags: int
    ) -> tuple[Any, ...]:
        code = self._enter("cuMemAddressReserve", (size, alignment, addr, flags))
        if code:
            return self._r(code, None)
        code, ptr = self._reserve(size)
        return self._r(code, self._real.CUdeviceptr(ptr))

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[Any, ...]:
        return self._r(
            self._enter("cuMemAddressFree", (ptr, size)) or self._free_reserved(ptr, size)
        )

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        code = self._enter("cuMemCreate", (size, prop, flags))
        if code:
            return self._r(code, None)
        pinned = self._real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        if prop.type != pinned or prop.location.id >= self.devices:
            return self._r(self.INVALID_VALUE, None)
        code, handle = self._create(size, self._shareable(prop))
        return self._r(code, self._real.CUmemGenericAllocationHandle(handle))

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        return self._r(self._enter("cuMemRelease", (handle,)) or self._release(int(handle)))

    def cuMemMap(
        self, ptr: int, size: int, offset: int, handle: int, flags: int
    ) -> tuple[Any, ...]:
        code = self._enter("cuMemMap", (ptr, size, offset, handle, flags))
        return self._r(code or self._map(int(ptr), size, offset, int(handle)))

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[Any, ...]:
        return self._r(self._enter("cuMemUnmap", (ptr, size)) or self._unmap(int(ptr), size))

    def cuMemSetAccess(self, ptr: int, size: int, descs: Any, count: int) -> tuple[Any, ...]:
        code = self._enter("cuMemSetAccess", (ptr, size, descs, count))
        readwrite = self._real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        if not code and (count != len(descs) or any(d.flags != readwrite for d in descs)):
            code = self.INVALID_VALUE
        return self._r(code or self._set_access(int(ptr), size))

    def cuMemExportToShareableHandle(self, handle: int, kind: Any, flags: int) -> tuple[Any, ...]:
        code = self._enter("cuMemExportToShareableHandle", (handle, kind, flags))
        if code:
            return self._r(code, None)
        code, fd = self._export(int(handle))
        return self._r(code, fd)

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple[Any, ...]:
        code = self._enter("cuMemImportFromShareableHandle", (fd, kind))
        if code:
            return self._r(code, None)
        code, handle = self._import(int(fd))
        return self._r(code, self._real.CUmemGenericAllocationHandle(handle))


class FakeHip(_FakeBindings):
    """FAKE ``hip.hip`` (see the module docstring)."""

    def __init__(
        self, real: Any, devices: int = 1, vmm: bool = True, version: int = 70_100_000
    ) -> None:
        super().__init__(real, devices, vmm)
        self.version = version
        self.device = 0
        self.synchronized: list[int] = []

    def _r(self, code: int, *values: Any) -> tuple[Any, ...]:
        return (self._real.hipError_t(code), *values)

    def hipInit(self, flags: int) -> tuple[Any, ...]:
        return self._r(self._enter("hipInit", (flags,)))

    def hipRuntimeGetVersion(self) -> tuple[Any, ...]:
        return self._r(0, self.version)

    def hipGetErrorName(self, error: Any) -> tuple[Any, ...]:
        return self._r(0, self._real.hipError_t(int(error)).name.encode())

    def hipGetErrorString(self, error: Any) -> tuple[Any, ...]:
        return self._r(0, b"fake runtime error")

    def hipGetDeviceCount(self) -> tuple[Any, ...]:
        return self._r(self._enter("hipGetDeviceCount", ()), self.devices)

    def hipDeviceGetAttribute(self, attribute: Any, device: int) -> tuple[Any, ...]:
        code = self._enter("hipDeviceGetAttribute", (attribute, device))
        return self._r(code, int(self.vmm))

    def hipGetDevice(self) -> tuple[Any, ...]:
        return self._r(self._enter("hipGetDevice", ()), self.device)

    def hipSetDevice(self, device: int) -> tuple[Any, ...]:
        code = self._enter("hipSetDevice", (device,))
        if code == 0:
            self.device = device
        return self._r(code)

    def hipDeviceSynchronize(self) -> tuple[Any, ...]:
        code = self._enter("hipDeviceSynchronize", ())
        self.synchronized.append(self.device)
        return self._r(code)

    def hipMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        code = self._enter("hipMemGetAllocationGranularity", (prop, option))
        return self._r(code, self.state.granularity)

    def hipMemAddressReserve(
        self, size: int, alignment: int, addr: int, flags: int
    ) -> tuple[Any, ...]:
        code = self._enter("hipMemAddressReserve", (size, alignment, addr, flags))
        if code:
            return self._r(code, None)
        return self._r(*self._reserve(size))

    def hipMemAddressFree(self, ptr: int, size: int) -> tuple[Any, ...]:
        return self._r(
            self._enter("hipMemAddressFree", (ptr, size)) or self._free_reserved(ptr, size)
        )

    def hipMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        code = self._enter("hipMemCreate", (size, prop, flags))
        if code:
            return self._r(code, None)
        return self._r(*self._create(size, shareable=True))

    def hipMemRelease(self, handle: int) -> tuple[Any, ...]:
        return self._r(self._enter("hipMemRelease", (handle,)) or self._release(handle))

    def hipMemMap(
        self, ptr: int, size: int, offset: int, handle: int, flags: int
    ) -> tuple[Any, ...]:
        code = self._enter("hipMemMap", (ptr, size, offset, handle, flags))
        return self._r(code or self._map(ptr, size, offset, handle))

    def hipMemUnmap(self, ptr: int, size: int) -> tuple[Any, ...]:
        return self._r(self._enter("hipMemUnmap", (ptr, size)) or self._unmap(ptr, size))

    def hipMemSetAccess(self, ptr: int, size: int, desc: Any, count: int) -> tuple[Any, ...]:
        code = self._enter("hipMemSetAccess", (ptr, size, desc, count))
        if not code and (isinstance(desc, list) or count != 1):
            code = self.INVALID_VALUE
        return self._r(code or self._set_access(ptr, size))

    def hipMemExportToShareableHandle(
        self, out: int, handle: int, kind: Any, flags: int
    ) -> tuple[Any, ...]:
        code = self._enter("hipMemExportToShareableHandle", (out, handle, kind, flags))
        if not code:
            code, fd = self._export(handle)
            if not code:
                ctypes.c_int.from_address(out).value = fd
        return self._r(code)

    def hipMemImportFromShareableHandle(self, os_handle: int, kind: Any) -> tuple[Any, ...]:
        code = self._enter("hipMemImportFromShareableHandle", (os_handle, kind))
        if code:
            return self._r(code, None)
        fd = os_handle if self.version >= 70_100_000 else ctypes.c_int.from_address(os_handle).value
        return self._r(*self._import(fd))
