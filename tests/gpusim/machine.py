"""SIMULATOR: the GPUs and their memory behind the simulated bindings.

Memory is real host memory: each allocation is a memfd (filled with garbage
when created, as GPU memory is not zeroed), mapped ``MAP_SHARED`` at the
simulated reservations, which are real ``PROT_NONE`` address ranges. So the
library's views of it are ordinary CPU memory that torch can read and write.

Every rule below is one the CUDA driver documentation states (HIP mirrors
it); a call that breaks one fails with the driver's own code, and changes
nothing. Kernels are not run: a test *launches* pending work on a range
(:meth:`SimMachine.launch`), which writes its value when a synchronize
completes it; unmapping memory that pending work touches is an illegal
address, sticky for every later call, as on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from enum import IntEnum

from extensible_kv.driver import _libc

MiB = 1 << 20


class Code(IntEnum):
    """Error codes; CUDA's ``CUresult`` and HIP's ``hipError_t`` agree on these."""

    SUCCESS = 0
    INVALID_VALUE = 1
    OUT_OF_MEMORY = 2
    NOT_INITIALIZED = 3
    NO_DEVICE = 100
    INVALID_DEVICE = 101
    INVALID_CONTEXT = 201
    INVALID_HANDLE = 400
    ILLEGAL_ADDRESS = 700
    NOT_SUPPORTED = 801


class SimError(Exception):
    """A simulated call failed with ``code``."""

    def __init__(self, code: Code, why: str) -> None:
        super().__init__(f"{code.name}: {why}")
        self.code = code


def _fail(code: Code, why: str) -> SimError:
    return SimError(code, why)


def device_uuid(index: int) -> bytes:
    """The UUID of simulated GPU ``index``: the same in every process."""
    return hashlib.sha256(f"gpusim-{index}".encode()).digest()[:16]


@dataclass
class SimDevice:
    """One simulated GPU."""

    uuid: bytes
    capacity: int
    posix_fd: bool
    rdma: bool
    vmm: bool
    used: int = 0


@dataclass
class Allocation:
    """Physical memory behind one or more handles (imports share it)."""

    device: int
    size: int
    fd: int
    posix_fd: bool
    granularity: int
    charged: bool
    mapped_at: set[int] = field(default_factory=set)
    handles: int = 1


@dataclass
class Mapping:
    size: int
    allocation: Allocation
    access: set[int] = field(default_factory=set)
    read_only: bool = False


@dataclass
class Kernel:
    """Pending work: writes ``value`` over ``[ptr, ptr + size)`` when completed."""

    device: int
    stream: int
    ptr: int
    size: int
    value: int


_MEMFD_NAME = re.compile(r"gpusim:([0-9a-f]{32}):(\d+):(\d)")


class SimMachine:
    """The simulated GPUs of one process.

    Args:
        devices: how many GPUs; ``order`` permutes which physical GPU each
            ordinal is (as ``CUDA_VISIBLE_DEVICES`` would): ordinal ``i``
            is GPU ``order[i]``, whose UUID is :func:`device_uuid`.
        granularity: minimum granularity of plain memory.
        shareable_granularity: minimum granularity when a POSIX fd handle
            type or the RDMA flag is asked for (coarser, as drivers may make it).
        capacity: bytes of memory per GPU.
        posix_fd, rdma, vmm: what the device attributes report.
        read_only_access: whether read-only access can be set (a driver
            that refuses it answers NOT_SUPPORTED).
    """

    def __init__(
        self,
        devices: int = 1,
        *,
        order: list[int] | None = None,
        granularity: int = 2 * MiB,
        shareable_granularity: int = 4 * MiB,
        capacity: int = 1 << 30,
        posix_fd: bool = True,
        rdma: bool = True,
        vmm: bool = True,
        read_only_access: bool = True,
    ) -> None:
        physical = order if order is not None else list(range(devices))
        self.devices = [SimDevice(device_uuid(p), capacity, posix_fd, rdma, vmm) for p in physical]
        self.granularity = granularity
        self.shareable_granularity = shareable_granularity
        self.read_only_access = read_only_access
        self.lock = threading.RLock()
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, Allocation] = {}
        self.mappings: dict[int, Mapping] = {}
        self.pending: list[Kernel] = []
        self.sticky: Code | None = None
        self.completed: list[Kernel] = []
        self._next_handle = 1
        #: Values of released handles, the last released on top: a driver
        #: hands them out again (HIP's handles are pointers to its objects,
        #: and CUDA promises no uniqueness), so a stale handle names new memory.
        self._freed_handles: list[int] = []

    # -- state a test inspects -------------------------------------------------

    def empty(self) -> bool:
        """Nothing reserved, allocated or mapped."""
        return not (self.reservations or self.handles or self.mappings)

    def used(self, device: int = 0) -> int:
        return self.devices[device].used

    # -- checks -----------------------------------------------------------------

    def check_alive(self) -> None:
        if self.sticky is not None:
            raise _fail(self.sticky, "a kernel touched an illegal address earlier (sticky)")

    def check_device(self, device: int) -> SimDevice:
        if not 0 <= device < len(self.devices):
            raise _fail(Code.INVALID_DEVICE, f"no device {device}")
        return self.devices[device]

    def _aligned(self, *values: int, to: int) -> None:
        for value in values:
            if value <= 0 or value % to:
                raise _fail(Code.INVALID_VALUE, f"{value:#x} is not a multiple of {to:#x}")

    def _reservation_of(self, ptr: int, size: int) -> int:
        for start, length in self.reservations.items():
            if start <= ptr and ptr + size <= start + length:
                return start
        raise _fail(Code.INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is not inside one reservation")

    def _covering(self, ptr: int, size: int, *, whole: bool) -> list[int]:
        """Starts of the mappings covering every byte of the range; with
        ``whole`` the range must start and end at mapping boundaries."""
        starts = sorted(
            m for m, mp in self.mappings.items() if m < ptr + size and ptr < m + mp.size
        )
        cursor = ptr
        for start in starts:
            if start > cursor or (whole and start < ptr):
                raise _fail(Code.INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is not fully mapped")
            cursor = start + self.mappings[start].size
        if not starts or cursor < ptr + size or (whole and cursor != ptr + size):
            raise _fail(
                Code.INVALID_VALUE,
                f"[{ptr:#x}, +{size:#x}) is not {'whole mappings' if whole else 'fully mapped'}",
            )
        return starts

    def _pending_in(self, ptr: int, size: int) -> bool:
        return any(k.ptr < ptr + size and ptr < k.ptr + k.size for k in self.pending)

    def _die(self, why: str) -> SimError:
        self.sticky = Code.ILLEGAL_ADDRESS
        return _fail(Code.ILLEGAL_ADDRESS, why)

    # -- properties ---------------------------------------------------------------

    def prop_granularity(self, device: int, posix_fd: bool, rdma: bool) -> int:
        """Minimum granularity for these properties; refuses what the device lacks."""
        sim = self.check_device(device)
        if posix_fd and not sim.posix_fd:
            raise _fail(Code.NOT_SUPPORTED, "POSIX fd handles are not supported on this device")
        if rdma and not sim.rdma:
            raise _fail(Code.NOT_SUPPORTED, "GPU-direct RDMA is not supported on this device")
        return self.shareable_granularity if posix_fd or rdma else self.granularity

    # -- address space ------------------------------------------------------------

    def reserve(self, size: int, alignment: int, addr: int, flags: int) -> int:
        if flags or addr:
            raise _fail(Code.INVALID_VALUE, "flags and addr must be 0 here")
        if alignment < 0 or alignment & (alignment - 1):
            raise _fail(Code.INVALID_VALUE, f"alignment {alignment} is not a power of two")
        self._aligned(size, to=self.granularity)
        # The default alignment is the smallest granularity; place the range
        # at an address aligned to what was asked and to nothing coarser, so
        # that a caller relying on luck for a coarser alignment fails.
        align = max(alignment, self.granularity)
        raw = _libc.mmap_(
            0,
            size + 2 * align,
            _libc.PROT_NONE,
            _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_NORESERVE,
        )
        start = -(-raw // align) * align
        if start % (2 * align) == 0:
            start += align
        if start > raw:
            _libc.munmap(raw, start - raw)
        tail = raw + size + 2 * align - (start + size)
        if tail:
            _libc.munmap(start + size, tail)
        with self.lock:
            self.reservations[start] = size
        return start

    def free_reserved(self, ptr: int, size: int) -> None:
        with self.lock:
            if self.reservations.get(ptr) != size:
                raise _fail(Code.INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is not a reservation")
            if any(ptr <= m < ptr + size for m in self.mappings):
                raise _fail(Code.INVALID_VALUE, "the reservation still holds mappings")
            _libc.munmap(ptr, size)
            del self.reservations[ptr]

    # -- physical memory ---------------------------------------------------------

    def create(self, size: int, device: int, posix_fd: bool, rdma: bool, flags: int) -> int:
        if flags:
            raise _fail(Code.INVALID_VALUE, "flags must be 0")
        granularity = self.prop_granularity(device, posix_fd, rdma)
        self._aligned(size, to=granularity)
        with self.lock:
            sim = self.devices[device]
            if sim.used + size > sim.capacity:
                raise _fail(Code.OUT_OF_MEMORY, f"{sim.used} of {sim.capacity} bytes in use")
            fd = os.memfd_create(
                f"gpusim:{sim.uuid.hex()}:{granularity}:{int(posix_fd)}", os.MFD_CLOEXEC
            )
            os.ftruncate(fd, size)
            _fill_garbage(fd, size)
            sim.used += size
            return self._new_handle(Allocation(device, size, fd, posix_fd, granularity, True))

    def _new_handle(self, allocation: Allocation) -> int:
        if self._freed_handles:
            handle = self._freed_handles.pop()
        else:
            handle = self._next_handle
            self._next_handle += 1
        self.handles[handle] = allocation
        return handle

    def release(self, handle: int) -> None:
        with self.lock:
            allocation = self.handles.pop(handle, None)
            if allocation is None:
                raise _fail(Code.INVALID_VALUE, f"no live handle {handle}")
            self._freed_handles.append(handle)
            allocation.handles -= 1
            self._maybe_free(allocation)

    def _maybe_free(self, allocation: Allocation) -> None:
        """Memory goes when its last handle and its last mapping are gone."""
        if allocation.handles == 0 and not allocation.mapped_at:
            os.close(allocation.fd)
            if allocation.charged:
                self.devices[allocation.device].used -= allocation.size

    def map(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
        with self.lock:
            allocation = self.handles.get(handle)
            if allocation is None:
                raise _fail(Code.INVALID_VALUE, f"no live handle {handle}")
            if offset or flags:
                raise _fail(Code.INVALID_VALUE, "offset and flags must be 0")
            self._aligned(ptr, size, to=allocation.granularity)
            if size != allocation.size:
                raise _fail(Code.INVALID_VALUE, "size differs from the allocation's")
            self._reservation_of(ptr, size)
            if any(m < ptr + size and ptr < m + mp.size for m, mp in self.mappings.items()):
                raise _fail(Code.INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is already mapped")
            _libc.mmap_(
                ptr, size, _libc.PROT_NONE, _libc.MAP_SHARED | _libc.MAP_FIXED, allocation.fd
            )
            self.mappings[ptr] = Mapping(size, allocation)
            allocation.mapped_at.add(ptr)

    def unmap(self, ptr: int, size: int) -> None:
        with self.lock:
            self._aligned(ptr, size, to=self.granularity)
            starts = self._covering(ptr, size, whole=True)
            if self._pending_in(ptr, size):
                raise self._die(f"unmapped [{ptr:#x}, +{size:#x}) under a kernel in flight")
            for start in starts:
                mapping = self.mappings.pop(start)
                _libc.mmap_(
                    start,
                    mapping.size,
                    _libc.PROT_NONE,
                    _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED | _libc.MAP_NORESERVE,
                )
                mapping.allocation.mapped_at.discard(start)
                self._maybe_free(mapping.allocation)

    def set_access(
        self, ptr: int, size: int, devices: list[int], *, read_only: bool = False
    ) -> None:
        with self.lock:
            self._aligned(ptr, size, to=self.granularity)
            for device in devices:
                self.check_device(device)
            if read_only and not self.read_only_access:
                raise _fail(Code.NOT_SUPPORTED, "read-only access is not supported here")
            starts = self._covering(ptr, size, whole=False)
            for start in starts:
                if any(d != self.mappings[start].allocation.device for d in devices):
                    raise _fail(
                        Code.INVALID_DEVICE, "access for a device other than the memory's own"
                    )
            _libc.mprotect(ptr, size, _libc.PROT_READ if read_only else _libc.PROT_READ_WRITE)
            for start in starts:
                self.mappings[start].access.update(devices)
                self.mappings[start].read_only = read_only

    def retain(self, ptr: int) -> int:
        """A new handle for the allocation mapped at ``ptr``."""
        with self.lock:
            start = self._covering(ptr, 1, whole=False)[0]
            allocation = self.mappings[start].allocation
            allocation.handles += 1
            return self._new_handle(allocation)

    def memset(self, ptr: int, value: int, size: int, device: int) -> None:
        """A memset on ``device``: the range must be mapped writable for it."""
        with self.lock:
            try:
                starts = self._covering(ptr, size, whole=False)
            except SimError:
                raise self._die(f"memset of unmapped [{ptr:#x}, +{size:#x})") from None
            if any(
                device not in self.mappings[s].access or self.mappings[s].read_only for s in starts
            ):
                raise self._die("memset of memory without write access")
            ctypes.memset(ptr, value, size)

    # -- sharing ------------------------------------------------------------------

    def export(self, handle: int) -> int:
        with self.lock:
            allocation = self.handles.get(handle)
            if allocation is None:
                raise _fail(Code.INVALID_VALUE, f"no live handle {handle}")
            if not allocation.posix_fd:
                raise _fail(
                    Code.INVALID_VALUE, "the allocation was not created with a POSIX fd handle type"
                )
            return os.dup(allocation.fd)

    def import_(self, fd: int, current: int | None = None) -> int:
        """A handle for the memory behind ``fd``; ``current`` (HIP) is the
        device the import lands on, which must be the memory's."""
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise _fail(Code.INVALID_VALUE, f"fd {fd}: {exc}") from None
        found = _MEMFD_NAME.search(name)
        if found is None:
            raise _fail(Code.INVALID_VALUE, f"fd {fd} is not simulated GPU memory")
        uuid, granularity, posix_fd = bytes.fromhex(found[1]), int(found[2]), found[3] == "1"
        with self.lock:
            ordinals = [i for i, d in enumerate(self.devices) if d.uuid == uuid]
            if not ordinals:
                raise _fail(Code.INVALID_DEVICE, "the memory's GPU is not visible here")
            if current is not None and current != ordinals[0]:
                raise _fail(
                    Code.INVALID_DEVICE,
                    f"import on device {current}, but the memory lives on device {ordinals[0]}",
                )
            allocation = Allocation(ordinals[0], size, os.dup(fd), posix_fd, granularity, False)
            return self._new_handle(allocation)

    # -- work in flight -----------------------------------------------------------

    def launch(self, ptr: int, size: int, value: int, *, device: int = 0, stream: int = 0) -> None:
        """Queue a kernel on ``stream`` that writes ``value`` over the range
        when it completes (at a synchronize). Touching memory that is not
        mapped with access for ``device`` is an illegal address."""
        with self.lock:
            self.check_alive()
            try:
                starts = self._covering(ptr, size, whole=False)
            except SimError:
                raise self._die(f"kernel touched unmapped [{ptr:#x}, +{size:#x})") from None
            if any(device not in self.mappings[s].access for s in starts):
                raise self._die("kernel touched memory without access")
            if any(self.mappings[s].read_only for s in starts):
                raise self._die("kernel wrote read-only memory")
            self.pending.append(Kernel(device, stream, ptr, size, value))

    def synchronize(self, device: int, stream: int | None = None) -> None:
        """Complete every kernel queued on ``device``, on every stream or on
        ``stream`` only."""
        with self.lock:

            def due(k: Kernel) -> bool:
                return k.device == device and stream in (None, k.stream)

            done = [k for k in self.pending if due(k)]
            self.pending = [k for k in self.pending if not due(k)]
            for kernel in done:
                ctypes.memset(kernel.ptr, kernel.value, kernel.size)
                self.completed.append(kernel)


def _fill_garbage(fd: int, size: int) -> None:
    """New GPU memory holds whatever was there: not zeros."""
    ptr = _libc.mmap_(0, size, _libc.PROT_READ_WRITE, _libc.MAP_SHARED, fd)
    try:
        ctypes.memset(ptr, 0xA5, size)
    finally:
        _libc.munmap(ptr, size)
