"""What the CUDA and HIP backends share: result checking, error translation,
probing, cached granularity and the shareable-memory fallback.

Both bindings return a tuple from every call whose first item is the error
code (0 on success) followed by the values the call produces.
"""

from __future__ import annotations

import bisect
import logging
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from extensible_kv.driver.errors import DriverError, OutOfMemoryError
from extensible_kv.driver.protocol import Backend
from extensible_kv.intervals import IntervalSet

logger = logging.getLogger(__name__)

#: CUDA_ERROR_INVALID_VALUE and hipErrorInvalidValue.
_INVALID_VALUE = 1


def format_uuid(raw: bytes) -> str:
    """16 bytes of a device UUID as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``
    (the form nvidia-smi and ``CUDA_VISIBLE_DEVICES`` use)."""
    h = bytes(raw[:16]).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass
class _Zeroed:
    """A reservation whose unmapped granules show the device's zero granule.

    Addresses are absolute; ``granule`` is the plain granularity, the size
    of the zero granule mapped at each of them.
    """

    size: int
    device: int
    granule: int
    #: Granules the zero granule is mapped at.
    aliased: IntervalSet = field(default_factory=IntervalSet)
    #: The caller's mappings in it: start -> size.
    mappings: dict[int, int] = field(default_factory=dict)


def _invalid(call: str, message: str) -> DriverError:
    return DriverError(call, _INVALID_VALUE, "INVALID_VALUE", message)


class GpuDriver(Backend, ABC):
    """Base of the GPU backends; subclasses bind the calls to their module.

    Args:
        bindings: the bindings module (``cuda.bindings.driver`` or ``hip.hip``).
    """

    #: Name used in messages ("CUDA", "HIP").
    backend = ""
    dlpack_device_type = 0
    zeroes_new_memory = False
    #: The error code a backend returns when memory or addresses run out.
    out_of_memory_code = 2

    def __init__(self, bindings: Any) -> None:
        self._b = bindings
        self._lock = threading.Lock()
        self._granularity: dict[tuple[int, bool], int] = {}
        self._plain_only: set[int] = set()
        # Zeroed reservations by start, and one zero granule per device while
        # any of them exists there.
        self._zero_lock = threading.RLock()
        self._zeroed: dict[int, _Zeroed] = {}
        self._zeroed_starts: list[int] = []
        self._zero_handles: dict[int, int] = {}
        self._writable_zeros: set[int] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- results and errors ---------------------------------------------------

    @abstractmethod
    def _error_text(self, code: Any) -> tuple[str, str]:
        """The symbolic name and the description of an error code."""

    def _check(self, call: str, result: Any) -> Any:
        """The value(s) of a call's result tuple; raise on a failure code."""
        code = result[0]
        if int(code) != 0:
            name, message = self._error_text(code)
            error = OutOfMemoryError if int(code) == self.out_of_memory_code else DriverError
            raise error(call, int(code), name, message)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    # -- devices ----------------------------------------------------------------

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_uuid(self, device: int) -> str: ...

    @abstractmethod
    def supports_vmm(self, device: int) -> bool: ...

    @abstractmethod
    def context(self, device: int) -> AbstractContextManager[None]: ...

    def unavailable_reason(self, device: int) -> str | None:
        """Why ``device`` cannot use virtual memory management, or None.

        Checks that the device exists and supports VMM, then reserves and
        frees one granule. Never raises.
        """
        try:
            count = self.device_count()
            if count == 0:
                return f"no {self.backend} device is visible to this process"
            if device >= count:
                return f"cuda:{device} does not exist; {count} {self.backend} device(s) are visible"
            if not self.supports_vmm(device):
                return (
                    f"the {self.backend} driver does not support virtual memory management "
                    f"on cuda:{device} (WSL2 and some virtualized GPUs lack it)"
                )
            size = self.granularity(device, False)
            with self.context(device):
                self.free_reserved(self.reserve(size, size), size)
        except DriverError as exc:
            return f"probing cuda:{device} failed: {exc}"
        return None

    @abstractmethod
    def reserve(self, size: int, alignment: int) -> int: ...

    @abstractmethod
    def _free_reserved(self, ptr: int, size: int) -> None: ...

    # -- allocation properties ------------------------------------------------

    @abstractmethod
    def _allocation_prop(self, device: int, shareable: bool) -> Any: ...

    def _prop_for(self, device: int, shareable: bool) -> Any:
        return self._allocation_prop(device, shareable and device not in self._plain_only)

    @abstractmethod
    def _query_granularity(self, prop: Any) -> int: ...

    def granularity(self, device: int, shareable: bool) -> int:
        key = (device, shareable)
        if key not in self._granularity:
            with self.context(device):
                granularity = self._query_granularity(self._prop_for(device, shareable))
            with self._lock:
                self._granularity[key] = granularity
        return self._granularity[key]

    # -- allocation -------------------------------------------------------------

    @abstractmethod
    def _create(self, size: int, prop: Any) -> int: ...

    def create(self, size: int, device: int, shareable: bool) -> int:
        with self.context(device):
            return self._create_on(size, device, shareable)

    def _create_on(self, size: int, device: int, shareable: bool) -> int:
        if not shareable or device in self._plain_only:
            return self._create(size, self._allocation_prop(device, False))

        try:
            return self._create(size, self._allocation_prop(device, True))
        except OutOfMemoryError:
            raise
        except DriverError as exc:
            with self._lock:
                first = device not in self._plain_only
                self._plain_only.add(device)
            if first:
                warnings.warn(
                    f"{self.backend} device {device} refused shareable memory ({exc}); "
                    f"allocating plain memory instead: it cannot be exported to other "
                    f"processes or registered for RDMA",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return self._create(size, self._allocation_prop(device, False))

    @abstractmethod
    def synchronize(self, device: int) -> None: ...

    @abstractmethod
    def _synchronize_stream(self, stream: int) -> None: ...

    def synchronize_streams(self, device: int, streams: Sequence[int]) -> None:
        with self.context(device):
            for stream in streams:
                self._synchronize_stream(stream)

    @abstractmethod
    def release(self, handle: int) -> None: ...

    @abstractmethod
    def _map(self, ptr: int, size: int, handle: int) -> None: ...

    @abstractmethod
    def _unmap(self, ptr: int, size: int) -> None: ...

    @abstractmethod
    def _set_access(self, ptr: int, size: int, device: int, *, read_only: bool) -> None: ...

    @abstractmethod
    def _retain(self, ptr: int) -> int:
        """A new reference to the handle mapped at ``ptr`` (released by ``release``)."""

    @abstractmethod
    def _memset_zero(self, ptr: int, size: int) -> None:
        """Zero ``size`` bytes at ``ptr`` (device memory of the current context)."""

    @abstractmethod
    def export_handle(self, handle: int) -> int: ...

    @abstractmethod
    def import_handle(self, fd: int) -> int: ...

    # -- mapping, and zeroed reservations ----------------------------------------
    #
    # A zeroed reservation shows one physical granule per device, zeroed once
    # and mapped read-only at every granule no caller's mapping covers: the
    # driver maps one handle at any number of addresses, so the zeros cost
    # one granule whatever the reservations' size. A kernel reading past the
    # committed memory then reads zeros instead of raising an illegal
    # address, and writing there still faults. The caller sees plain
    # reservation semantics: map() first unmaps the zeros it covers, unmap()
    # maps them back, each all or nothing. Kernels may be reading the zeros
    # (a captured step attends over the full length): the device is
    # synchronized before they are unmapped, as before any unmap.

    def reserve_zeroed(self, size: int, alignment: int, device: int) -> int:
        granule = self.granularity(device, False)
        if size <= 0 or size % granule or alignment % granule:
            raise _invalid(
                "reserve_zeroed",
                f"size {size} and alignment {alignment} must be multiples of the "
                f"{granule}-byte granularity",
            )
        with self._zero_lock, self.context(device):
            made_zero = device not in self._zero_handles
            if made_zero:
                self._zero_handles[device] = self._make_zero_granule(device, granule)
            try:
                ptr = self.reserve(size, alignment)
                zeroed = _Zeroed(size, device, granule)
                try:
                    self._alias(zeroed, ptr, ptr + size)
                except BaseException:
                    self._free_reserved(ptr, size)
                    raise
            except BaseException:
                if made_zero:
                    self.release(self._zero_handles.pop(device))
                raise
            self._zeroed[ptr] = zeroed
            bisect.insort(self._zeroed_starts, ptr)
        return ptr

    def _make_zero_granule(self, device: int, granule: int) -> int:
        """One granule of ``device`` memory, zeroed through a scratch mapping."""
        handle = self._create(granule, self._allocation_prop(device, False))
        try:
            scratch = self.reserve(granule, granule)
            try:
                self._map(scratch, granule, handle)
                try:
                    self._set_access(scratch, granule, device, read_only=False)
                    self._memset_zero(scratch, granule)
                    self.synchronize(device)
                finally:
                    self._unmap(scratch, granule)
            finally:
                self._free_reserved(scratch, granule)
        except BaseException:
            self.release(handle)
            raise
        return handle

    def _alias(self, zeroed: _Zeroed, start: int, end: int) -> None:
        """Map the zero granule, read-only, at every granule of ``[start, end)``."""
        zero, step = self._zero_handles[zeroed.device], zeroed.granule
        done: list[int] = []
        try:
            for at in range(start, end, step):
                self._map(at, step, zero)
                done.append(at)
            self._grant_zeros(start, end - start, zeroed.device)
        except BaseException:
            for at in reversed(done):
                self._unmap(at, step)
            raise
        zeroed.aliased.add(start, end)

    def _grant_zeros(self, ptr: int, size: int, device: int) -> None:
        """Read access to zero aliases; read-write on a device that refuses
        read-only access (the zeros then survive only as long as nothing
        writes past the committed memory, which the library never does)."""
        if device not in self._writable_zeros:
            try:
                self._set_access(ptr, size, device, read_only=True)
                return
            except OutOfMemoryError:
                raise
            except DriverError as exc:
                with self._lock:
                    self._writable_zeros.add(device)
                warnings.warn(
                    f"{self.backend} device {device} refused read-only access ({exc}); "
                    f"its zero-backed reservations map their zeros read-write",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._set_access(ptr, size, device, read_only=False)

    def _unalias(self, zeroed: _Zeroed, start: int, end: int) -> None:
        """Unmap the zero granule from every granule of ``[start, end)``."""
        step = zeroed.granule
        done: list[int] = []
        try:
            for at in range(start, end, step):
                self._unmap(at, step)
                done.append(at)
        except BaseException:
            if done:
                self._alias(zeroed, start, done[-1] + step)
            raise
        zeroed.aliased.remove(start, end)

    def _zeroed_holding(self, ptr: int) -> tuple[int, _Zeroed] | None:
        """The zeroed reservation holding address ``ptr``, with its start."""
        with self._zero_lock:
            i = bisect.bisect_right(self._zeroed_starts, ptr) - 1
            if i >= 0:
                start = self._zeroed_starts[i]
                zeroed = self._zeroed[start]
                if ptr < start + zeroed.size:
                    return start, zeroed
        return None

    def free_reserved(self, ptr: int, size: int) -> None:
        found = self._zeroed_holding(ptr)
        if found is None:
            self._free_reserved(ptr, size)
            return
        start, zeroed = found
        with self._zero_lock:
            if start != ptr or zeroed.size != size:
                raise _invalid("free_reserved", f"[{ptr:#x}, +{size}) is not a reservation")
            if zeroed.mappings:
                raise _invalid("free_reserved", "the reservation still holds mappings")
            self.synchronize(zeroed.device)
            self._unalias(zeroed, ptr, ptr + size)
            try:
                self._free_reserved(ptr, size)
            except BaseException:
                self._alias(zeroed, ptr, ptr + size)
                raise
            del self._zeroed[ptr]
            self._zeroed_starts.remove(ptr)
            if all(z.device != zeroed.device for z in self._zeroed.values()):
                self.release(self._zero_handles.pop(zeroed.device))

    def map(self, ptr: int, size: int, handle: int) -> None:
        found = self._zeroed_holding(ptr)
        if found is None:
            self._map(ptr, size, handle)
            return
        start, zeroed = found
        if ptr + size > start + zeroed.size or zeroed.aliased.gaps(ptr, ptr + size):
            raise _invalid("map", f"[{ptr:#x}, +{size}) is not unmapped reservation")
        self.synchronize(zeroed.device)
        self._unalias(zeroed, ptr, ptr + size)
        try:
            self._map(ptr, size, handle)
        except BaseException:
            self._alias(zeroed, ptr, ptr + size)
            raise
        zeroed.mappings[ptr] = size

    def unmap(self, ptr: int, size: int) -> None:
        found = self._zeroed_holding(ptr)
        if found is None:
            self._unmap(ptr, size)
            return
        _, zeroed = found
        if zeroed.mappings.get(ptr) != size:
            raise _invalid("unmap", "an unmap in a zeroed reservation covers exactly one mapping")
        # Held so that a failure to show the zeros again can map the memory
        # back, whoever has released the caller's handle meanwhile.
        handle = self._retain(ptr)
        try:
            self._unmap(ptr, size)
            try:
                self._alias(zeroed, ptr, ptr + size)
            except BaseException:
                self._map(ptr, size, handle)
                self._set_access(ptr, size, zeroed.device, read_only=False)
                raise
        finally:
            self.release(handle)
        del zeroed.mappings[ptr]

    def set_access(self, ptr: int, size: int, device: int) -> None:
        self._set_access(ptr, size, device, read_only=False)
