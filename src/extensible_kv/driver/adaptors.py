"""Drivers that wrap a driver and keep its protocol (RMM's resource-adaptor idea).

* :class:`StatisticsDriver` counts calls, failures and time per call, and the
  live handles, reservations and mappings made through it.
* :class:`FaultInjectingDriver` fails a chosen call, or any allocation past a
  byte budget, the way a real driver fails when memory runs out.

They stack: ``FaultInjectingDriver(StatisticsDriver(HostDriver()))`` injects
failures above a statistics layer that sees only the calls that reach the
real driver, so its live counts mirror the driver's own state.
"""

from __future__ import annotations

import bisect
import errno
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from extensible_kv.driver.errors import DriverError, OutOfMemoryError
from extensible_kv.driver.protocol import DRIVER_CALLS, Driver

_V = TypeVar("_V")


class MappingLedger(Generic[_V]):
    """What an adaptor records per mapping, by start address: an unmap
    takes every mapping that starts in its range."""

    def __init__(self) -> None:
        self._at: dict[int, _V] = {}
        self._starts: list[int] = []

    def __len__(self) -> int:
        return len(self._at)

    def values(self) -> list[_V]:
        return list(self._at.values())

    def add(self, ptr: int, value: _V) -> None:
        self._at[ptr] = value
        bisect.insort(self._starts, ptr)

    def pop_within(self, ptr: int, size: int) -> list[_V]:
        """Forget the mappings starting in ``[ptr, ptr + size)``; their values."""
        lo = bisect.bisect_left(self._starts, ptr)
        hi = bisect.bisect_left(self._starts, ptr + size)
        taken = [self._at.pop(start) for start in self._starts[lo:hi]]
        del self._starts[lo:hi]
        return taken


class DriverAdaptor:
    """Forwards every call to ``inner``; subclasses hook :meth:`_call`."""

    def __init__(self, inner: Driver) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def dlpack_device_type(self) -> int:
        return self.inner.dlpack_device_type

    @property
    def zeroes_new_memory(self) -> bool:
        return self.inner.zeroes_new_memory

    def _call(self, name: str, *args: Any) -> Any:
        return getattr(self.inner, name)(*args)

    def granularity(self, device: int, shareable: bool) -> int:
        return int(self._call("granularity", device, shareable))

    def device_count(self) -> int:
        return int(self._call("device_count"))

    def device_uuid(self, device: int) -> str:
        return str(self._call("device_uuid", device))

    def reserve(self, size: int, alignment: int) -> int:
        return int(self._call("reserve", size, alignment))

    def reserve_zeroed(self, size: int, alignment: int, device: int) -> int:
        return int(self._call("reserve_zeroed", size, alignment, device))

    def free_reserved(self, ptr: int, size: int) -> None:
        self._call("free_reserved", ptr, size)

    def create(self, size: int, device: int, shareable: bool) -> int:
        return int(self._call("create", size, device, shareable))

    def release(self, handle: int) -> None:
        self._call("release", handle)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._call("map", ptr, size, handle)

    def unmap(self, ptr: int, size: int) -> None:
        self._call("unmap", ptr, size)

    def set_access(self, ptr: int, size: int, device: int) -> None:
        self._call("set_access", ptr, size, device)

    def synchronize(self, device: int) -> None:
        self._call("synchronize", device)

    def synchronize_streams(self, device: int, streams: Sequence[int]) -> None:
        self._call("synchronize_streams", device, streams)

    def export_handle(self, handle: int) -> int:
        return int(self._call("export_handle", handle))

    def import_handle(self, fd: int) -> int:
        return int(self._call("import_handle", fd))

    def context(self, device: int) -> AbstractContextManager[None]:
        manager: AbstractContextManager[None] = self._call("context", device)
        return manager

    # The adaptor calls: forwarded, for the adaptors below to interpret.

    def holding(self, device: int, size: int, *, credit: int = 0) -> AbstractContextManager[object]:
        return self.inner.holding(device, size, credit=credit)

    def release_idle(self) -> int:
        return self.inner.release_idle()

    def create_ahead(self, size: int, count: int, device: int, shareable: bool) -> int:
        return self.inner.create_ahead(size, count, device, shareable)

    def accounting(self, device: int) -> tuple[str, str] | None:
        return self.inner.accounting(device)

    def adopt_import(self, handle: int, device: int, size: int) -> None:
        self.inner.adopt_import(handle, device, size)


@dataclass
class CallStats:
    """Counts for one kind of call. ``seconds`` is wall time, failures included."""

    calls: int = 0
    failures: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LiveUsage:
    """What is alive through a :class:`StatisticsDriver` right now.

    ``handle_bytes`` counts memory created through it; imported handles count
    in ``handles`` only, since an import does not say its size.
    """

    handles: int = 0
    handle_bytes: int = 0
    reservations: int = 0
    reserved_bytes: int = 0
    mappings: int = 0
    mapped_bytes: int = 0


class StatisticsDriver(DriverAdaptor):
    """Counts calls and time per call, and tracks live resources."""

    def __init__(self, inner: Driver) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._calls = {name: CallStats() for name in DRIVER_CALLS}
        self._handles: dict[int, int] = {}
        self._reservations: dict[int, int] = {}
        self._mappings: MappingLedger[int] = MappingLedger()  # start -> size

    @property
    def calls(self) -> dict[str, CallStats]:
        """A snapshot of the per-call counters, by call name."""
        with self._lock:
            return {name: replace(stats) for name, stats in self._calls.items()}

    @property
    def live(self) -> LiveUsage:
        with self._lock:
            return LiveUsage(
                handles=len(self._handles),
                handle_bytes=sum(self._handles.values()),
                reservations=len(self._reservations),
                reserved_bytes=sum(self._reservations.values()),
                mappings=len(self._mappings),
                mapped_bytes=sum(self._mappings.values()),
            )

    def reset_calls(self) -> None:
        """Zero the per-call counters (live resources are kept)."""
        with self._lock:
            self._calls = {name: CallStats() for name in DRIVER_CALLS}

    def _call(self, name: str, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            result = super()._call(name, *args)
        except BaseException:
            self._count(name, start, failed=True)
            raise
        self._count(name, start, failed=False)
        with self._lock:
            self._track(name, args, result)
        return result

    def _count(self, name: str, start: float, failed: bool) -> None:
        elapsed = time.perf_counter() - start
        with self._lock:
            stats = self._calls[name]
            stats.calls += 1
            stats.failures += failed
            stats.seconds += elapsed

    def _track(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        if name == "create":
            self._handles[result] = args[0]
        elif name == "import_handle":
            self._handles[result] = 0
        elif name == "release":
            del self._handles[args[0]]
        elif name in ("reserve", "reserve_zeroed"):
            self._reservations[result] = args[0]
        elif name == "free_reserved":
            del self._reservations[args[0]]
        elif name == "map":
            self._mappings.add(args[0], args[1])
        elif name == "unmap":
            self._mappings.pop_within(*args)


class FaultInjectingDriver(DriverAdaptor):
    """Fails chosen calls the way a real driver does.

    Args:
        byte_limit: if set, a ``create`` that would take the bytes created
            through this driver (and not yet released) past it raises
            :class:`OutOfMemoryError`, as a full device would.

    A failure raised here happens *instead of* the call: the inner driver is
    not called, so nothing changes below.
    """

    def __init__(self, inner: Driver, *, byte_limit: int | None = None) -> None:
        super().__init__(inner)
        self.byte_limit = byte_limit
        self.injected = 0
        self._lock = threading.Lock()
        self._armed: dict[str, int] = {}
        self._handle_bytes: dict[int, int] = {}

    def fail_at(self, call: str, nth: int = 1) -> None:
        """Make the ``nth`` call of kind ``call``, counted from now, fail once."""
        if call not in DRIVER_CALLS:
            raise ValueError(f"unknown driver call {call!r}; calls are {DRIVER_CALLS}")
        if nth < 1:
            raise ValueError(f"nth counts calls from 1, got {nth}")
        with self._lock:
            self._armed[call] = nth

    def clear(self) -> None:
        """Disarm every pending failure and lift the byte limit."""
        with self._lock:
            self._armed.clear()
        self.byte_limit = None

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            self._maybe_fail(name, args)
        result = super()._call(name, *args)
        with self._lock:
            if name == "create":
                self._handle_bytes[result] = args[0]
            elif name == "release":
                self._handle_bytes.pop(args[0], None)
        return result

    def _maybe_fail(self, name: str, args: tuple[Any, ...]) -> None:
        countdown = self._armed.get(name)
        if countdown is not None:
            if countdown > 1:
                self._armed[name] = countdown - 1
            else:
                del self._armed[name]
                self.injected += 1
                raise _injected(name, f"injected failure of the call {name}")
        if name == "create" and self.byte_limit is not None:
            held = sum(self._handle_bytes.values())
            if held + args[0] > self.byte_limit:
                self.injected += 1
                raise OutOfMemoryError(
                    name,
                    errno.ENOMEM,
                    "ENOMEM",
                    f"byte limit {self.byte_limit} reached: {held} bytes held, {args[0]} asked",
                )


def _injected(name: str, message: str) -> DriverError:
    if name in ("create", "reserve", "reserve_zeroed", "map"):
        return OutOfMemoryError(name, errno.ENOMEM, "ENOMEM", message)
    return DriverError(name, errno.EIO, "EIO", message)
