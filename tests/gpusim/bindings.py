"""SIMULATOR: ``cuda.bindings.driver`` and ``hip.hip``, the subsets the
backends call, over a :class:`~gpusim.machine.SimMachine`.

Types, enums and structs are the real, installed bindings' own (anything
not defined here is looked up on the real module), so the backends build
their structs as they would against a GPU, and the simulator reads them
back field by field (HIP's through the C header's layout, as the runtime
does). Each call returns the bindings' tuple: the error code, then values.
Every call is recorded (``calls``), and a test can make the next call of a
name fail with a code (``failures``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from gpusim.machine import Code, SimError, SimMachine


class _Bindings:
    """What both dialects share: the call log, injected failures, the sticky error."""

    def __init__(self, real: Any, machine: SimMachine) -> None:
        self._real = real
        self.machine = machine
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.failures: dict[str, int] = {}
        self._tls = threading.local()
        self._keep: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def _code(self, code: int) -> Any:
        raise NotImplementedError

    def _call(self, name: str, args: tuple[Any, ...], body: Callable[[], Any], values: int) -> Any:
        """Run ``body`` as the call ``name``; ``values`` is how many values
        the real call returns after its code."""
        self.calls.append((name, args))
        try:
            injected = self.failures.pop(name, None)
            if injected is not None:
                raise SimError(Code(injected), "injected by the test")
            self.machine.check_alive()
            value = body()
        except SimError as exc:
            return (self._code(exc.code), *([None] * values))
        if values == 0:
            return (self._code(0),)
        return (self._code(0), value)


class SimCuda(_Bindings):
    """SIMULATED ``cuda.bindings.driver``: contexts are per thread, and every
    memory call needs one current (``CUDA_ERROR_INVALID_CONTEXT`` otherwise)."""

    def __init__(self, real: Any, machine: SimMachine) -> None:
        super().__init__(real, machine)
        self.initialized = False

    def _code(self, code: int) -> Any:
        return self._real.CUresult(int(code))

    # -- init, errors, devices ------------------------------------------------

    def _initialized(self) -> None:
        if not self.initialized:
            raise SimError(Code.NOT_INITIALIZED, "cuInit was not called")

    def cuInit(self, flags: int) -> Any:
        def body() -> None:
            if flags:
                raise SimError(Code.INVALID_VALUE, "flags must be 0")
            if not self.machine.devices:
                raise SimError(Code.NO_DEVICE, "no device")
            self.initialized = True

        return self._call("cuInit", (flags,), body, 0)

    def cuGetErrorName(self, error: Any) -> Any:
        return (self._code(0), self._real.CUresult(int(error)).name.encode())

    def cuGetErrorString(self, error: Any) -> Any:
        return (self._code(0), f"simulated: {Code(int(error)).name}".encode())

    def cuDeviceGetCount(self) -> Any:
        return self._call("cuDeviceGetCount", (), lambda: len(self.machine.devices), 1)

    def cuDeviceGet(self, ordinal: int) -> Any:
        def body() -> Any:
            self._initialized()
            self.machine.check_device(ordinal)
            return self._real.CUdevice(ordinal)

        return self._call("cuDeviceGet", (ordinal,), body, 1)

    def cuDeviceGetAttribute(self, attribute: Any, dev: Any) -> Any:
        def body() -> int:
            device = self.machine.check_device(int(dev))
            values = {
                "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED": device.vmm,
                "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": device.posix_fd,
                "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED": device.rdma,
            }
            return int(values[attribute.name])

        return self._call("cuDeviceGetAttribute", (attribute, dev), body, 1)

    def cuDeviceGetUuid(self, dev: Any) -> Any:
        def body() -> Any:
            raw = (ctypes.c_char * 16).from_buffer_copy(self.machine.check_device(int(dev)).uuid)
            self._keep.append(raw)
            return self._real.CUuuid(_ptr=ctypes.addressof(raw))

        return self._call("cuDeviceGetUuid", (dev,), body, 1)

    # -- contexts -------------------------------------------------------------

    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        stack: list[int] = self._tls.stack
        return stack

    def current_device(self) -> int:
        """The device of this thread's current context; refuses when none is."""
        stack = self._stack()
        if not stack:
            raise SimError(Code.INVALID_CONTEXT, "no context is current on this thread")
        return stack[-1] - 0x1000

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> Any:
        def body() -> Any:
            self._initialized()
            self.machine.check_device(int(dev))
            return self._real.CUcontext(0x1000 + int(dev))

        return self._call("cuDevicePrimaryCtxRetain", (dev,), body, 1)

    def cuCtxGetCurrent(self) -> Any:
        stack = self._stack()
        return self._call(
            "cuCtxGetCurrent", (), lambda: self._real.CUcontext(stack[-1] if stack else 0), 1
        )

    def cuCtxSetCurrent(self, ctx: Any) -> Any:
        def body() -> None:
            stack = self._stack()
            if stack:
                stack.pop()
            if int(ctx):
                stack.append(int(ctx))

        return self._call("cuCtxSetCurrent", (ctx,), body, 0)

    def cuCtxPushCurrent(self, ctx: Any) -> Any:
        return self._call("cuCtxPushCurrent", (ctx,), lambda: self._stack().append(int(ctx)), 0)

    def cuCtxPopCurrent(self) -> Any:
        def body() -> Any:
            stack = self._stack()
            if not stack:
                raise SimError(Code.INVALID_CONTEXT, "no context to pop")
            return self._real.CUcontext(stack.pop())

        return self._call("cuCtxPopCurrent", (), body, 1)

    def cuCtxSynchronize(self) -> Any:
        return self._call(
            "cuCtxSynchronize", (), lambda: self.machine.synchronize(self.current_device()), 0
        )

    def cuStreamSynchronize(self, stream: Any) -> Any:
        def body() -> None:
            self.machine.synchronize(self.current_device(), int(stream))

        return self._call("cuStreamSynchronize", (stream,), body, 0)

    # -- memory -----------------------------------------------------------------

    def _read_prop(self, prop: Any) -> tuple[int, bool, bool]:
        """(device, POSIX fd asked for, RDMA asked for) of an allocation prop."""
        real = self._real
        if prop.type != real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
            raise SimError(Code.INVALID_VALUE, "allocation type is not pinned")
        if prop.location.type != real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
            raise SimError(Code.INVALID_VALUE, "location is not a device")
        kinds = real.CUmemAllocationHandleType
        if prop.requestedHandleTypes not in (
            kinds.CU_MEM_HANDLE_TYPE_NONE,
            kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ):
            raise SimError(Code.NOT_SUPPORTED, "handle type not simulated")
        posix = prop.requestedHandleTypes == kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(prop.location.id), posix, bool(prop.allocFlags.gpuDirectRDMACapable)

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        def body() -> int:
            self.current_device()
            granularity = self.machine.prop_granularity(*self._read_prop(prop))
            flags = self._real.CUmemAllocationGranularity_flags
            return granularity * (2 if option == flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED else 1)

        return self._call("cuMemGetAllocationGranularity", (prop, option), body, 1)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> Any:
        def body() -> Any:
            self.current_device()
            return self._real.CUdeviceptr(self.machine.reserve(size, alignment, int(addr), flags))

        return self._call("cuMemAddressReserve", (size, alignment, addr, flags), body, 1)

    def cuMemAddressFree(self, ptr: Any, size: int) -> Any:
        def body() -> None:
            self.current_device()
            self.machine.free_reserved(int(ptr), size)

        return self._call("cuMemAddressFree", (ptr, size), body, 0)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        def body() -> Any:
            self.current_device()
            device, posix, rdma = self._read_prop(prop)
            handle = self.machine.create(size, device, posix, rdma, flags)
            return self._real.CUmemGenericAllocationHandle(handle)

        return self._call("cuMemCreate", (size, prop, flags), body, 1)

    def cuMemRelease(self, handle: Any) -> Any:
        def body() -> None:
            self.current_device()
            self.machine.release(int(handle))

        return self._call("cuMemRelease", (handle,), body, 0)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> Any:
        def body() -> None:
            self.current_device()
            self.machine.map(int(ptr), size, offset, int(handle), flags)

        return self._call("cuMemMap", (ptr, size, offset, handle, flags), body, 0)

    def cuMemUnmap(self, ptr: Any, size: int) -> Any:
        def body() -> None:
            self.current_device()
            self.machine.unmap(int(ptr), size)

        return self._call("cuMemUnmap", (ptr, size), body, 0)

    def cuMemSetAccess(self, ptr: Any, size: int, descs: Any, count: int) -> Any:
        def body() -> None:
            self.current_device()
            if count != len(descs):
                raise SimError(Code.INVALID_VALUE, "count differs from the descriptors")
            flags = self._real.CUmemAccess_flags
            kinds = (flags.CU_MEM_ACCESS_FLAGS_PROT_READ, flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            device_kind = self._real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            if any(d.flags not in kinds or d.location.type != device_kind for d in descs):
                raise SimError(Code.INVALID_VALUE, "only device read or read-write access")
            if len({d.flags for d in descs}) > 1:
                raise SimError(Code.INVALID_VALUE, "one kind of access per call is simulated")
            read_only = descs[0].flags == flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            devices = [int(d.location.id) for d in descs]
            self.machine.set_access(int(ptr), size, devices, read_only=read_only)

        return self._call("cuMemSetAccess", (ptr, size, descs, count), body, 0)

    def cuMemRetainAllocationHandle(self, addr: Any) -> Any:
        def body() -> Any:
            self.current_device()
            return self._real.CUmemGenericAllocationHandle(self.machine.retain(int(addr)))

        return self._call("cuMemRetainAllocationHandle", (addr,), body, 1)

    def cuMemsetD8(self, ptr: Any, value: int, size: int) -> Any:
        def body() -> None:
            self.machine.memset(int(ptr), value, size, self.current_device())

        return self._call("cuMemsetD8", (ptr, value, size), body, 0)

    def cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: int) -> Any:
        def body() -> int:
            self.current_device()
            self._posix(kind, flags)
            return self.machine.export(int(handle))

        return self._call("cuMemExportToShareableHandle", (handle, kind, flags), body, 1)

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> Any:
        def body() -> Any:
            self.current_device()
            self._posix(kind, 0)
            return self._real.CUmemGenericAllocationHandle(self.machine.import_(int(fd)))

        return self._call("cuMemImportFromShareableHandle", (fd, kind), body, 1)

    def _posix(self, kind: Any, flags: int) -> None:
        posix = self._real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if kind != posix or flags:
            raise SimError(Code.INVALID_VALUE, "only POSIX fds, flags 0, are simulated")


class _HipLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _HipAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
    ]


class HipMemAllocationPropC(ctypes.Structure):
    """``hipMemAllocationProp`` as the C header lays it out: what the ROCm
    runtime reads, whatever the Python bindings expose."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleType", ctypes.c_int),
        ("location", _HipLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _HipAllocFlags),
    ]


class SimHip(_Bindings):
    """SIMULATED ``hip.hip``: no contexts, but a current device per thread,
    which ``hipMemCreate``, the granularity query and imports act on (a
    property naming another device is refused)."""

    PINNED = 1
    DEVICE = 1
    POSIX_FD = 1
    READ = 1
    READWRITE = 3

    def __init__(self, real: Any, machine: SimMachine, version: int = 70_100_000) -> None:
        super().__init__(real, machine)
        self.version = version

    def _code(self, code: int) -> Any:
        return self._real.hipError_t(int(code))

    def current_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def hipInit(self, flags: int) -> Any:
        return self._call("hipInit", (flags,), lambda: None, 0)

    def hipRuntimeGetVersion(self) -> Any:
        return self._call("hipRuntimeGetVersion", (), lambda: self.version, 1)

    def hipGetErrorName(self, error: Any) -> Any:
        return (self._code(0), self._real.hipError_t(int(error)).name.encode())

    def hipGetErrorString(self, error: Any) -> Any:
        return (self._code(0), f"simulated: {Code(int(error)).name}".encode())

    def hipGetDeviceCount(self) -> Any:
        return self._call("hipGetDeviceCount", (), lambda: len(self.machine.devices), 1)

    def hipDeviceGetAttribute(self, attribute: Any, device: int) -> Any:
        def body() -> int:
            return int(self.machine.check_device(device).vmm)

        return self._call("hipDeviceGetAttribute", (attribute, device), body, 1)

    def hipDeviceGetUuid(self, device: int) -> Any:
        def body() -> Any:
            raw = (ctypes.c_char * 16).from_buffer_copy(self.machine.check_device(device).uuid)
            self._keep.append(raw)
            return self._real.hipUUID.fromObj(ctypes.addressof(raw))

        return self._call("hipDeviceGetUuid", (device,), body, 1)

    def hipGetDevice(self) -> Any:
        return self._call("hipGetDevice", (), self.current_device, 1)

    def hipSetDevice(self, device: int) -> Any:
        def body() -> None:
            self.machine.check_device(device)
            self._tls.device = device

        return self._call("hipSetDevice", (device,), body, 0)

    def hipDeviceSynchronize(self) -> Any:
        return self._call(
            "hipDeviceSynchronize", (), lambda: self.machine.synchronize(self.current_device()), 0
        )

    def hipStreamSynchronize(self, stream: int) -> Any:
        def body() -> None:
            self.machine.synchronize(self.current_device(), int(stream))

        return self._call("hipStreamSynchronize", (stream,), body, 0)

    def _read_prop(self, prop: Any) -> tuple[int, bool, bool]:
        """(device, POSIX fd asked for, RDMA asked for), read from the C struct;
        the device must be the current one."""
        c = HipMemAllocationPropC.from_address(prop.as_c_void_p().value)
        if c.type != self.PINNED or c.location.type != self.DEVICE:
            raise SimError(Code.INVALID_VALUE, "not pinned device memory")
        if c.requestedHandleType not in (0, self.POSIX_FD):
            raise SimError(Code.NOT_SUPPORTED, "handle type not simulated")
        if c.location.id != self.current_device():
            raise SimError(
                Code.INVALID_DEVICE,
                f"the property names device {c.location.id}; the current device is "
                f"{self.current_device()}",
            )
        return (
            c.location.id,
            c.requestedHandleType == self.POSIX_FD,
            bool(c.allocFlags.gpuDirectRDMACapable),
        )

    def hipMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        def body() -> int:
            granularity = self.machine.prop_granularity(*self._read_prop(prop))
            return granularity * (2 if int(option) == 1 else 1)

        return self._call("hipMemGetAllocationGranularity", (prop, option), body, 1)

    def hipMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> Any:
        def body() -> int:
            return self.machine.reserve(size, alignment, int(addr), flags)

        return self._call("hipMemAddressReserve", (size, alignment, addr, flags), body, 1)

    def hipMemAddressFree(self, ptr: int, size: int) -> Any:
        return self._call(
            "hipMemAddressFree", (ptr, size), lambda: self.machine.free_reserved(ptr, size), 0
        )

    def hipMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        def body() -> Any:
            device, posix, rdma = self._read_prop(prop)
            handle = self.machine.create(size, device, posix, rdma, flags)
            return self._real.ihipMemGenericAllocationHandle.fromObj(handle)

        return self._call("hipMemCreate", (size, prop, flags), body, 1)

    def hipMemRelease(self, handle: Any) -> Any:
        return self._call("hipMemRelease", (handle,), lambda: self.machine.release(int(handle)), 0)

    def hipMemMap(self, ptr: int, size: int, offset: int, handle: Any, flags: int) -> Any:
        def body() -> None:
            self.machine.map(ptr, size, offset, int(handle), flags)

        return self._call("hipMemMap", (ptr, size, offset, handle, flags), body, 0)

    def hipMemUnmap(self, ptr: int, size: int) -> Any:
        return self._call("hipMemUnmap", (ptr, size), lambda: self.machine.unmap(ptr, size), 0)

    def hipMemSetAccess(self, ptr: int, size: int, desc: Any, count: int) -> Any:
        def body() -> None:
            if isinstance(desc, list) or count != 1:
                raise SimError(Code.INVALID_VALUE, "one descriptor (a pointer), count 1")
            flags = int(desc.flags)
            if flags not in (self.READ, self.READWRITE) or int(desc.location.type) != self.DEVICE:
                raise SimError(Code.INVALID_VALUE, "only device read or read-write access")
            read_only = flags == self.READ
            self.machine.set_access(ptr, size, [int(desc.location.id)], read_only=read_only)

        return self._call("hipMemSetAccess", (ptr, size, desc, count), body, 0)

    def hipMemRetainAllocationHandle(self, addr: int) -> Any:
        def body() -> Any:
            handle = self.machine.retain(int(addr))
            return self._real.ihipMemGenericAllocationHandle.fromObj(handle)

        return self._call("hipMemRetainAllocationHandle", (addr,), body, 1)

    def hipMemset(self, ptr: int, value: int, size: int) -> Any:
        def body() -> None:
            self.machine.memset(int(ptr), value, size, self.current_device())

        return self._call("hipMemset", (ptr, value, size), body, 0)

    def hipMemExportToShareableHandle(self, out: int, handle: Any, kind: Any, flags: int) -> Any:
        def body() -> None:
            if int(kind) != self.POSIX_FD or flags:
                raise SimError(Code.INVALID_VALUE, "only POSIX fds, flags 0, are simulated")
            ctypes.c_int.from_address(out).value = self.machine.export(int(handle))

        return self._call("hipMemExportToShareableHandle", (out, handle, kind, flags), body, 0)

    def hipMemImportFromShareableHandle(self, os_handle: int, kind: Any) -> Any:
        def body() -> Any:
            if int(kind) != self.POSIX_FD:
                raise SimError(Code.INVALID_VALUE, "only POSIX fds are simulated")
            by_value = self.version >= 70_100_000
            fd = os_handle if by_value else ctypes.c_int.from_address(os_handle).value
            handle = self.machine.import_(fd, current=self.current_device())
            return self._real.ihipMemGenericAllocationHandle.fromObj(handle)

        return self._call("hipMemImportFromShareableHandle", (os_handle, kind), body, 1)
