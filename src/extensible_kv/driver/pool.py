"""A pool of physical handles: released memory kept for the next commit.

Creating physical memory is the costliest call on a GPU (``cuMemCreate``
averages about 200 us per 2 MiB granule; mapping costs about 1.5 us), and a
cache that trims and grows again, or defragments, gives back memory it soon
asks for again. :class:`PoolingDriver` is an adaptor in the style of RMM's
pool resource: a handle released while unmapped is kept, up to a cap in
bytes per device, and the next ``create`` of the same size, device and kind
takes it instead of calling the driver.

A full release (a sleep, or ``free``) drains the pools below the buffers it
releases (:func:`drain_pools`): sleeping returns every byte to the driver.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from extensible_kv.driver.adaptors import DriverAdaptor, MappingLedger
from extensible_kv.driver.protocol import Driver

MiB = 1 << 20
#: Idle bytes a pool keeps per device by default.
DEFAULT_CAP_BYTES = 256 * MiB

#: What a pooled handle must match: (size in bytes, device, shareable).
Kind = tuple[int, int, bool]


class PoolingDriver(DriverAdaptor):
    """Keeps released handles for the next ``create`` of the same kind.

    A handle created through this adaptor and released while unmapped goes
    to the idle pool, unless the device's idle bytes would pass
    ``cap_bytes``; ``create`` takes an idle handle of exactly that size,
    device and shareability before asking the driver. Handles released
    while still mapped, and imported ones, go to the driver at once.

    Reused memory holds the bytes it had: ``zeroes_new_memory`` is False,
    so the library zeroes what it commits when asked to.

    Args:
        inner: the driver below.
        cap_bytes: idle bytes kept per device; 0 keeps nothing.
    """

    def __init__(self, inner: Driver, *, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must not be negative, got {cap_bytes}")
        super().__init__(inner)
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        #: Handles created here and not yet released to the driver.
        self._kinds: dict[int, Kind] = {}
        self._idle: dict[Kind, list[int]] = {}
        self._idle_bytes: dict[int, int] = {}
        #: Mapping start -> handle, for the mappings made through here, and
        #: how many mappings each handle has.
        self._mapped_at: MappingLedger[int] = MappingLedger()
        self._mappings_of: dict[int, int] = {}
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"PoolingDriver({self.inner!r}, cap_bytes={self.cap_bytes})"

    @property
    def zeroes_new_memory(self) -> bool:
        return False

    @property
    def idle_bytes(self) -> int:
        """Bytes held idle, on every device."""
        with self._lock:
            return sum(self._idle_bytes.values())

    @property
    def idle_handles(self) -> int:
        with self._lock:
            return sum(len(handles) for handles in self._idle.values())

    # -- the calls it changes -------------------------------------------------

    def create(self, size: int, device: int, shareable: bool) -> int:
        kind = (size, device, shareable)
        with self._lock:
            idle = self._idle.get(kind)
            if idle:
                self.hits += 1
                self._idle_bytes[device] -= size
                return idle.pop()
            self.misses += 1
        return self._create(kind)

    def _create(self, kind: Kind) -> int:
        handle = int(self._call("create", *kind))
        with self._lock:
            self._kinds[handle] = kind
        return handle

    def release(self, handle: int) -> None:
        with self._lock:
            kind = self._kinds.get(handle)
            if kind is not None and not self._mappings_of.get(handle) and self._fits(kind):
                self._keep_idle(kind, handle)
                return
        self._call("release", handle)
        with self._lock:
            self._kinds.pop(handle, None)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._call("map", ptr, size, handle)
        with self._lock:
            self._mapped_at.add(ptr, handle)
            self._mappings_of[handle] = self._mappings_of.get(handle, 0) + 1

    def unmap(self, ptr: int, size: int) -> None:
        self._call("unmap", ptr, size)
        with self._lock:
            for handle in self._mapped_at.pop_within(ptr, size):
                left = self._mappings_of[handle] - 1
                if left:
                    self._mappings_of[handle] = left
                else:
                    del self._mappings_of[handle]

    # -- the pool itself ---------------------------------------------------------

    def _fits(self, kind: Kind) -> bool:
        """Whether one more idle handle of ``kind`` stays within the cap (under the lock)."""
        size, device, _ = kind
        return self._idle_bytes.get(device, 0) + size <= self.cap_bytes

    def _keep_idle(self, kind: Kind, handle: int) -> None:
        """Put ``handle`` in the idle pool (under the lock)."""
        size, device, _ = kind
        self._idle.setdefault(kind, []).append(handle)
        self._idle_bytes[device] = self._idle_bytes.get(device, 0) + size

    def drain(self) -> int:
        """Release every idle handle to the driver; returns the bytes.

        A release that fails keeps that handle and the ones after it idle
        for a later drain, and raises.
        """
        drained = 0
        while True:
            with self._lock:
                kind = next((k for k, handles in self._idle.items() if handles), None)
                if kind is None:
                    return drained
                handle = self._idle[kind][-1]
            with self.context(kind[1]):
                self._call("release", handle)
            with self._lock:
                self._idle[kind].pop()
                self._idle_bytes[kind[1]] -= kind[0]
                del self._kinds[handle]
            drained += kind[0]

    def fill(self, size: int, count: int, device: int = 0, shareable: bool = False) -> int:
        """Create up to ``count`` handles of ``size`` bytes into the pool,
        ahead of a growth the caller knows is coming, as far as the cap
        allows. Returns how many were added; a failing create raises, the
        handles made before it staying idle."""
        added = 0
        kind = (size, device, shareable)
        for _ in range(count):
            with self._lock:
                if not self._fits(kind):
                    break
            handle = self._create(kind)
            with self._lock:
                self._keep_idle(kind, handle)
            added += 1
        return added

    def fill_in_background(
        self, size: int, count: int, device: int = 0, shareable: bool = False
    ) -> Future[int]:
        """:meth:`fill` on a thread of its own, off the caller's critical
        path; the future gives the count added (or the error)."""
        return _in_background(self.fill, size, count, device, shareable)


def _in_background(work: Callable[..., int], *args: Any) -> Future[int]:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extensible-kv-pool")
    future = executor.submit(work, *args)
    executor.shutdown(wait=False)
    return future


def _pools_in(driver: Any) -> Iterator[PoolingDriver]:
    """The :class:`PoolingDriver` adaptors in ``driver``'s chain, top down."""
    while driver is not None:
        if isinstance(driver, PoolingDriver):
            yield driver
        driver = getattr(driver, "inner", None)


def find_pool(driver: Any) -> PoolingDriver | None:
    """The first :class:`PoolingDriver` in ``driver``'s adaptor chain, if any."""
    return next(_pools_in(driver), None)


def fill_pools_in_background(handles: Iterable[tuple[PoolingDriver, Kind]]) -> Future[int]:
    """Create handles ahead into their pools, one ``(pool, (size, device,
    shareable))`` per handle, on a thread of its own; the future gives the
    bytes added. Each pool stops at its cap; a failing create ends the
    filling with that error, the handles made before it staying idle."""
    wanted = Counter(handles)

    def fill_all() -> int:
        return sum(
            pool.fill(size, count, device, shareable) * size
            for (pool, (size, device, shareable)), count in wanted.items()
        )

    return _in_background(fill_all)


def drain_pools(driver: Any) -> int:
    """Drain every :class:`PoolingDriver` in ``driver``'s adaptor chain;
    returns the bytes given back to the driver."""
    return sum(pool.drain() for pool in _pools_in(driver))
