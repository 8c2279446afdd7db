"""The host backend: the driver protocol on Linux virtual memory.

Physical memory here is real: committed pages are present and zeroed, and
released pages go back to the kernel. It backs CPU KV caches and runs the
whole library on machines without a GPU.

* A reservation is an inaccessible, unaccounted mapping (``PROT_NONE`` +
  ``MAP_NORESERVE``); unmapping puts that mapping back, so the range stays
  reserved and nothing else can be placed there.
* Private memory is anonymous memory created at an address of its own,
  populated at once (huge pages as the system's policy gives them), then
  *moved* into the
  reservation by ``mremap`` (page tables move, bytes don't). Unmapping moves
  the pages out again, which is how a handle outlives its mapping as on a GPU.
  Such memory has one address at a time.
* Shareable memory is a memfd: mapped ``MAP_SHARED`` any number of times,
  exported as a file descriptor.
* As with ``cuMemMap``, a new mapping is inaccessible (``PROT_NONE``) until
  ``set_access``; touching it faults, as a GPU kernel would.
* A zeroed reservation is the same mapping made ``PROT_READ``: reading it
  maps the kernel's shared zero page, which takes no memory; writing faults.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import os
import stat
import sys
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from extensible_kv.driver import _libc, _populate
from extensible_kv.driver.errors import DriverError, OutOfMemoryError
from extensible_kv.driver.protocol import Backend

DEFAULT_GRANULARITY = 2 << 20
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass
class _Allocation:
    """One physical allocation behind a handle."""

    size: int
    #: memfd behind shareable and imported memory; None for private memory.
    fd: int | None
    #: Private memory while unmapped: the address its pages are parked at.
    parked_at: int | None = None
    #: Addresses it is mapped at.
    mapped_at: set[int] = field(default_factory=set)
    #: The handle was released while mapped: unmapping frees the pages.
    released: bool = False


@dataclass
class _Mapping:
    """One mapping of an allocation into a reservation."""

    size: int
    allocation: _Allocation
    accessible: bool = False


def _error(call: str, code: int, message: str) -> DriverError:
    name = errno.errorcode.get(code, str(code))
    if code in (errno.ENOMEM, errno.ENOSPC):
        return OutOfMemoryError(call, code, name, message)
    return DriverError(call, code, name, message)


def _invalid(call: str, message: str) -> DriverError:
    return _error(call, errno.EINVAL, message)


def _from_os(call: str, exc: OSError) -> DriverError:
    return _error(call, exc.errno or errno.EIO, exc.strerror or str(exc))


class HostDriver(Backend):
    """Driver protocol over Linux ``mmap``/``mremap``/``madvise`` and memfd.

    Args:
        granularity: mapping unit in bytes for every allocation kind; a power
            of two and a multiple of the page size. Defaults to 2 MiB, the
            GPU's granularity and the huge page size.
    """

    dlpack_device_type = 1
    zeroes_new_memory = True

    def __init__(self, granularity: int = DEFAULT_GRANULARITY) -> None:
        if not sys.platform.startswith("linux"):
            raise _error(
                "HostDriver",
                errno.ENOSYS,
                f"the host backend needs Linux virtual memory; this is {sys.platform}",
            )
        if (
            granularity < _libc.PAGE_BYTES
            or granularity & (granularity - 1)
            or granularity % _libc.PAGE_BYTES
        ):
            raise ValueError(
                f"granularity must be a power of two and a multiple of the "
                f"{_libc.PAGE_BYTES}-byte page, got {granularity}"
            )
        self._granularity = granularity
        self._alignment = max(granularity, _libc.HUGE_PAGE_BYTES)
        # Reentrant: the garbage collector may run a finalizer at any
        # allocation inside a call holding this lock, on the same thread, and
        # the finalizer calls back in (a DLPack deleter dropping a freed
        # buffer's last view returns its reservation; a buffer dropped
        # without free() returns everything). With a plain lock that thread
        # waits on itself forever. What such a call touches is another
        # buffer's reservation and handles, never the entries the
        # interrupted call is working on.
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._handles: dict[int, _Allocation] = {}
        self._reservations: dict[int, int] = {}
        self._reservation_starts: list[int] = []
        #: Starts of the reservations from reserve_zeroed.
        self._zeroed: set[int] = set()
        self._mappings: dict[int, _Mapping] = {}
        self._mapping_starts: list[int] = []

    def __repr__(self) -> str:
        return f"HostDriver(granularity={self._granularity})"

    # -- checks ---------------------------------------------------------------

    def _check_device(self, call: str, device: int) -> None:
        if device != 0:
            raise _invalid(call, f"the host backend has one device, 0; got {device}")

    def _check_aligned(self, call: str, *values: int) -> None:
        for value in values:
            # Past 2**63 a size would wrap around size_t in the libc call.
            if value <= 0 or value >= 1 << 63 or value % self._granularity:
                raise _invalid(
                    call,
                    f"{value:#x} is not a positive multiple of the granularity "
                    f"({self._granularity} bytes)",
                )

    def _check_reserved(self, call: str, ptr: int, size: int) -> None:
        if self._reservation_of(ptr, size) is None:
            raise _invalid(call, f"[{ptr:#x}, {ptr + size:#x}) is not inside one reservation")

    def _reservation_of(self, ptr: int, size: int) -> int | None:
        """The start of the reservation holding ``[ptr, ptr + size)``, if one does."""
        i = bisect.bisect_right(self._reservation_starts, ptr) - 1
        if i >= 0:
            start = self._reservation_starts[i]
            if ptr + size <= start + self._reservations[start]:
                return start
        return None

    def _mappings_covering(self, call: str, ptr: int, size: int) -> list[int]:
        """Starts of the mappings that tile ``[ptr, ptr + size)`` exactly."""
        starts = []
        i = bisect.bisect_left(self._mapping_starts, ptr)
        cursor = ptr
        while cursor < ptr + size:
            if i >= len(self._mapping_starts) or self._mapping_starts[i] != cursor:
                raise _invalid(
                    call, f"[{ptr:#x}, {ptr + size:#x}) is not covered by whole mappings"
                )
            starts.append(cursor)
            cursor += self._mappings[cursor].size
            i += 1
        if cursor != ptr + size:
            raise _invalid(call, f"[{ptr:#x}, {ptr + size:#x}) ends inside a mapping")
        return starts

    def _has_mapping_in(self, ptr: int, size: int) -> bool:
        i = bisect.bisect_left(self._mapping_starts, ptr)
        if i < len(self._mapping_starts) and self._mapping_starts[i] < ptr + size:
            return True
        if i > 0:
            start = self._mapping_starts[i - 1]
            return start + self._mappings[start].size > ptr
        return False

    def _allocation(self, call: str, handle: int) -> _Allocation:
        try:
            return self._handles[handle]
        except KeyError:
            raise _invalid(call, f"no live handle {handle}") from None

    # -- protocol -------------------------------------------------------------

    def granularity(self, device: int, shareable: bool) -> int:
        self._check_device("granularity", device)
        return self._granularity

    def context(self, device: int) -> AbstractContextManager[None]:
        """The host has no contexts: a block that changes nothing."""
        self._check_device("context", device)
        return contextlib.nullcontext()

    def device_count(self) -> int:
        return 1

    def device_uuid(self, device: int) -> str:
        """``host-`` and the kernel's boot id: every process of this boot shares it."""
        self._check_device("device_uuid", device)
        return f"host-{_BOOT_ID.read_text().strip()}"

    def synchronize(self, device: int) -> None:
        """Host memory operations are synchronous: nothing to wait for."""
        self._check_device("synchronize", device)

    def synchronize_streams(self, device: int, streams: Sequence[int]) -> None:
        """The host has no streams: nothing to wait for."""
        self._check_device("synchronize_streams", device)

    def reserve(self, size: int, alignment: int) -> int:
        return self._reserve("reserve", size, alignment, _libc.PROT_NONE)

    def reserve_zeroed(self, size: int, alignment: int, device: int) -> int:
        self._check_device("reserve_zeroed", device)
        ptr = self._reserve("reserve_zeroed", size, alignment, _libc.PROT_READ)
        with self._lock:
            self._zeroed.add(ptr)
        return ptr

    def _reserve(self, call: str, size: int, alignment: int, prot: int) -> int:
        self._check_aligned(call, size)
        if alignment <= 0 or alignment & (alignment - 1):
            raise _invalid(call, f"alignment must be a power of two, got {alignment}")
        try:
            ptr = _libc.map_aligned(
                size,
                max(alignment, self._alignment),
                prot,
                _libc.MAP_PRIVATE | _libc.MAP_NORESERVE,
            )
        except OSError as exc:
            raise _from_os(call, exc) from None
        with self._lock:
            self._reservations[ptr] = size
            bisect.insort(self._reservation_starts, ptr)
        return ptr

    def free_reserved(self, ptr: int, size: int) -> None:
        with self._lock:
            if self._reservations.get(ptr) != size:
                raise _invalid("free_reserved", f"[{ptr:#x}, +{size}) is not a reservation")
            if self._has_mapping_in(ptr, size):
                raise _invalid("free_reserved", "the reservation still holds mappings")
            try:
                _libc.munmap(ptr, size)
            except OSError as exc:
                raise _from_os("free_reserved", exc) from None
            del self._reservations[ptr]
            self._reservation_starts.remove(ptr)
            self._zeroed.discard(ptr)

    def create(self, size: int, device: int, shareable: bool) -> int:
        self._check_device("create", device)
        self._check_aligned("create", size)
        allocation = self._create_shared(size) if shareable else self._create_private(size)
        with self._lock:
            handle = next(self._ids)
            self._handles[handle] = allocation
        return handle

    def _create_private(self, size: int) -> _Allocation:
        try:
            ptr = _libc.map_aligned(
                size, _libc.HUGE_PAGE_BYTES, _libc.PROT_READ_WRITE, _libc.MAP_PRIVATE
            )
        except OSError as exc:
            raise _from_os("create", exc) from None
        # The pages follow the system's transparent-huge-page policy, as
        # torch's own CPU allocations do: no MADV_HUGEPAGE. Forcing huge pages
        # made vLLM's start 1.35x stock's (512 MiB took 0.34-1.35 s to
        # populate as huge pages on a 2-core VM, 0.16 s as 4 KiB pages: a huge
        # page needs a free 2 MiB block, which a VM's host may have taken
        # back) and decode no faster (docs/performance.md, "Page policy").
        # Under enabled=always the kernel still gives huge pages here; the
        # alignment leaves room for them.
        try:
            _populate.populate(ptr, size)
            _libc.mprotect(ptr, size, _libc.PROT_NONE)
        except OSError as exc:
            _libc.munmap(ptr, size)
            raise _from_os("create", exc) from None
        return _Allocation(size, fd=None, parked_at=ptr)

    def _create_shared(self, size: int) -> _Allocation:
        try:
            fd = os.memfd_create("extensible-kv", os.MFD_CLOEXEC)
        except OSError as exc:
            raise _from_os("create", exc) from None
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            raise _from_os("create", exc) from None
        return _Allocation(size, fd=fd)

    def release(self, handle: int) -> None:
        with self._lock:
            allocation = self._allocation("release", handle)
            if allocation.fd is not None:
                os.close(allocation.fd)
            elif allocation.parked_at is not None:
                _libc.munmap(allocation.parked_at, allocation.size)
            else:
                allocation.released = True
            del self._handles[handle]

    def map(self, ptr: int, size: int, handle: int) -> None:
        with self._lock:
            allocation = self._allocation("map", handle)
            self._check_aligned("map", ptr, size)
            if size != allocation.size:
                raise _invalid(
                    "map", f"size {size} differs from the allocation's {allocation.size}"
                )
            self._check_reserved("map", ptr, size)
            if self._has_mapping_in(ptr, size):
                raise _invalid("map", f"[{ptr:#x}, +{size}) is already mapped")
            try:
                self._map_pages(ptr, allocation)
            except OSError as exc:
                raise _from_os("map", exc) from None
            self._mappings[ptr] = _Mapping(size, allocation)
            bisect.insort(self._mapping_starts, ptr)
            allocation.mapped_at.add(ptr)

    def _map_pages(self, ptr: int, allocation: _Allocation) -> None:
        if allocation.fd is not None:
            _libc.mmap_(
                ptr,
                allocation.size,
                _libc.PROT_NONE,
                _libc.MAP_SHARED | _libc.MAP_FIXED,
                allocation.fd,
            )
            return
        if allocation.parked_at is None:
            raise OSError(
                errno.EINVAL,
                "private host memory is mapped at one address at a time; "
                "create it shareable to map it twice",
            )
        _libc.mremap_fixed(allocation.parked_at, allocation.size, ptr, keep_old=False)
        allocation.parked_at = None

    def unmap(self, ptr: int, size: int) -> None:
        with self._lock:
            starts = self._mappings_covering("unmap", ptr, size)
            if len(starts) > 1 and self._reservation_of(ptr, size) in self._zeroed:
                raise _invalid(
                    "unmap", "an unmap in a zeroed reservation covers exactly one mapping"
                )
            done: list[int] = []
            try:
                for start in starts:
                    self._unmap_pages(start, self._mappings[start])
                    done.append(start)
            except OSError as exc:
                for start in done:
                    self._restore(start, self._mappings[start])
                raise _from_os("unmap", exc) from None
            for start in starts:
                allocation = self._mappings.pop(start).allocation
                self._mapping_starts.remove(start)
                allocation.mapped_at.discard(start)

    def _unmap_pages(self, ptr: int, mapping: _Mapping) -> None:
        """Turn one mapping back into reservation, atomically."""
        allocation = mapping.allocation
        if allocation.fd is not None or allocation.released:
            self._reserve_again(ptr, mapping.size)
            return
        # Keep the pages: park them at an address of their own first.
        # MREMAP_DONTUNMAP leaves [ptr, +size) mapped (empty) meanwhile, so no
        # other thread's mmap can land in the range before it becomes
        # reservation again.
        parked = _libc.map_aligned(
            mapping.size,
            _libc.HUGE_PAGE_BYTES,
            _libc.PROT_NONE,
            _libc.MAP_PRIVATE | _libc.MAP_NORESERVE,
        )
        try:
            _libc.mremap_fixed(ptr, mapping.size, parked, keep_old=True)
        except OSError:
            _libc.munmap(parked, mapping.size)
            raise
        allocation.parked_at = parked
        try:
            _libc.mprotect(parked, mapping.size, _libc.PROT_NONE)
            self._reserve_again(ptr, mapping.size)
        except OSError:
            self._restore(ptr, mapping)
            raise

    def _reserve_again(self, ptr: int, size: int) -> None:
        zeroed = self._reservation_of(ptr, size) in self._zeroed
        _libc.mmap_(
            ptr,
            size,
            _libc.PROT_READ if zeroed else _libc.PROT_NONE,
            _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED | _libc.MAP_NORESERVE,
        )

    def _restore(self, ptr: int, mapping: _Mapping) -> None:
        """Undo ``_unmap_pages``: map the allocation back with its access."""
        self._map_pages(ptr, mapping.allocation)
        if mapping.accessible:
            _libc.mprotect(ptr, mapping.size, _libc.PROT_READ_WRITE)

    def set_access(self, ptr: int, size: int, device: int) -> None:
        self._check_device("set_access", device)
        with self._lock:
            starts = self._mappings_covering("set_access", ptr, size)
            try:
                _libc.mprotect(ptr, size, _libc.PROT_READ_WRITE)
            except OSError as exc:
                raise _from_os("set_access", exc) from None
            try:
                self._populate_shared(ptr, size, starts)
            except OSError as exc:
                for start in starts:
                    if not self._mappings[start].accessible:
                        _libc.mprotect(start, self._mappings[start].size, _libc.PROT_NONE)
                raise _from_os("set_access", exc) from None
            for start in starts:
                self._mappings[start].accessible = True

    def _populate_shared(self, ptr: int, size: int, starts: Sequence[int]) -> None:
        """Fill the page tables of ``[ptr, ptr + size)`` if a mapping at
        ``starts`` (those it covers) is shared, in one call over the whole
        range, so that a run of many 2 MiB mappings (an adoption, a commit
        of many units) is populated on every core, not one mapping at a time.

        A memfd's pages exist from ``create`` on, but a new ``MAP_SHARED``
        mapping of them has no page tables, and the shared memory of this
        system's policy is 4 KiB pages (``shmem_enabled``: never): each
        first touch faulted alone, in whichever step first read the memory:
        after a restart, the first request to a kept document (28 MiB of
        blocks in the restart case of docs/performance.md). Reading a
        fresh 28 MiB mapping took 15-20 ms of faults, populating it 5-7 ms
        (2026-12-06, this VM), and here that happens before the mapping is
        used. Private memory arrives populated (:meth:`_create_private`),
        and a GPU mapping never faults."""
        if any(self._mappings[start].allocation.fd is not None for start in starts):
            _populate.populate(ptr, size, keep_contents=True)

    def export_handle(self, handle: int) -> int:
        with self._lock:
            allocation = self._allocation("export_handle", handle)
            if allocation.fd is None:
                raise _invalid("export_handle", f"handle {handle} is not shareable")
            return os.dup(allocation.fd)

    def import_handle(self, fd: int) -> int:
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise _from_os("import_handle", exc) from None
        if not stat.S_ISREG(info.st_mode) or info.st_size % self._granularity:
            raise _invalid(
                "import_handle",
                f"fd {fd} is not shareable memory of a whole number of granules",
            )
        allocation = _Allocation(info.st_size, fd=os.dup(fd))
        with self._lock:
            handle = next(self._ids)
            self._handles[handle] = allocation
        return handle
