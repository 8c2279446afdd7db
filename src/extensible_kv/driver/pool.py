"""A pool of physical handles: released memory kept for the next commit.

Creating physical memory is the costliest call on a GPU (``cuMemCreate``
averages about 200 us per 2 MiB granule; mapping costs about 1.5 us), and a
cache that trims and grows again, or defragments, gives back memory it soon
asks for again. :class:`PoolingDriver` is an adaptor in the style of RMM's
pool resource: a handle released while unmapped is kept, up to a cap in
bytes per device, and the next ``create`` of the same size, device and kind
takes it instead of calling the driver. Shareable memory is never kept once
used: a peer may still map it.

A sleep drains the pools below the buffers it releases (the protocol's
``release_idle``, which this adaptor answers with :meth:`PoolingDriver.drain`):
sleeping returns every byte to the driver. A piece of work that holds a
budget for what it creates (``holding``) holds only what the idle handles
will not serve, and ``create_ahead`` fills the pool.
"""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future
from contextlib import AbstractContextManager

from extensible_kv._checks import check_bool, check_bytes, check_int
from extensible_kv.driver.adaptors import DriverAdaptor, MappingLedger
from extensible_kv.driver.ahead import Kind, in_background
from extensible_kv.driver.errors import DriverError
from extensible_kv.driver.protocol import Driver

MiB = 1 << 20
#: Idle bytes a pool keeps per device by default.
DEFAULT_CAP_BYTES = 256 * MiB


class PoolingDriver(DriverAdaptor):
    """Keeps released handles for the next ``create`` of the same kind.

    A handle created through this adaptor and released while unmapped goes
    to the idle pool, unless the device's pooled bytes would pass
    ``cap_bytes``; ``create`` takes an idle handle of exactly that size,
    device and shareability before asking the driver. Handles released
    while still mapped, and imported ones, go to the driver at once.

    A shareable handle released by its user goes to the driver too: it may
    have been exported (by :func:`~extensible_kv.share.send_tensor`, or by
    a KV connector from its address, which this adaptor never sees), and
    the peer's mapping keeps the memory alive, so handing it out again
    would give the next tensor memory a peer reads and writes. Only fresh
    shareable handles, made ahead by :meth:`fill`, wait in the pool.

    An idle handle is released as far as its user goes: releasing or
    mapping it again is refused, as the driver refuses a released handle.

    Reused memory holds the bytes it had: ``zeroes_new_memory`` is False,
    so the library zeroes what it commits when asked to. Thread-safe.

    Args:
        inner: the driver below.
        cap_bytes: bytes the pool may hold per device (idle handles, and
            those a fill is creating); 0 keeps nothing.
    """

    def __init__(self, inner: Driver, *, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        check_bytes("cap_bytes", cap_bytes)
        super().__init__(inner)
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        #: Fills running, and how many drains have begun: a fill that began
        #: before a drain stops and gives back what it makes.
        self._filling = 0
        self._generation = 0
        self._fills_done = threading.Condition(self._lock)
        #: Handles created here and not yet released to the driver.
        self._kinds: dict[int, Kind] = {}
        #: The handles ``create`` may take, by kind.
        self._idle: dict[Kind, list[int]] = {}
        #: Handles in the pool's hands: idle, or being released by a drain.
        self._pooled: set[int] = set()
        #: Bytes per device counted against the cap: idle handles, and those
        #: a fill is creating or a drain releasing.
        self._held_bytes: dict[int, int] = {}
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
        """Bytes of the idle handles, on every device."""
        with self._lock:
            return sum(kind[0] * len(handles) for kind, handles in self._idle.items())

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
                handle = idle.pop()
                self._pooled.discard(handle)
                self._count_held(kind, -1)
                return handle
            self.misses += 1
        return self._create(kind)

    def _create(self, kind: Kind) -> int:
        handle = int(self._call("create", *kind))
        with self._lock:
            self._kinds[handle] = kind
        return handle

    def release(self, handle: int) -> None:
        with self._lock:
            self._check_not_pooled("release", handle)
            kind = self._kinds.get(handle)
            if kind is not None and self._may_keep(kind, handle):
                self._count_held(kind, 1)
                self._shelve(kind, handle)
                return
        self._call("release", handle)
        with self._lock:
            self._kinds.pop(handle, None)

    def map(self, ptr: int, size: int, handle: int) -> None:
        with self._lock:
            self._check_not_pooled("map", handle)
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

    def _check_not_pooled(self, call: str, handle: int) -> None:
        """Refuse ``call`` on a handle its user released into the pool (under the lock)."""
        if handle in self._pooled:
            raise DriverError(
                call,
                errno.EINVAL,
                "EINVAL",
                f"handle {handle} is already released: it is idle in the pool, "
                "for the next create to take",
            )

    def _may_keep(self, kind: Kind, handle: int) -> bool:
        """Whether a handle its user releases may serve a later create (under
        the lock): not shareable (a peer may map it), unmapped, within the cap."""
        shareable = kind[2]
        return not shareable and not self._mappings_of.get(handle) and self._fits(kind)

    def _fits(self, kind: Kind) -> bool:
        """Whether one more handle of ``kind`` stays within the cap (under the lock)."""
        size, device, _ = kind
        return self._held_bytes.get(device, 0) + size <= self.cap_bytes

    def _count_held(self, kind: Kind, handles: int) -> None:
        """Add ``handles`` (negative: take) of ``kind`` to the bytes counted
        against the cap (under the lock)."""
        size, device, _ = kind
        self._held_bytes[device] = self._held_bytes.get(device, 0) + handles * size

    def _shelve(self, kind: Kind, handle: int) -> None:
        """Make ``handle``, its bytes already held, idle (under the lock)."""
        self._idle.setdefault(kind, []).append(handle)
        self._pooled.add(handle)

    def _take_any(self) -> tuple[Kind, int] | None:
        """An idle handle, taken out of create's reach but still held, or None."""
        with self._lock:
            kind = next((k for k, handles in self._idle.items() if handles), None)
            if kind is None:
                return None
            return kind, self._idle[kind].pop()

    def drain(self) -> int:
        """Release every idle handle to the driver; returns the bytes.

        Fills running meanwhile stop first: each gives back the handle it is
        creating, and the drain waits for that.

        Each handle leaves the idle pool before its release, so that a
        ``create`` meanwhile takes another handle, never this one. A release that
        fails puts that handle back, keeps the ones after it idle for a
        later drain, and raises.
        """
        with self._lock:
            # Fills in flight stop at their next handle, and give back the
            # one they are creating; wait for that, so that nothing they
            # make outlives the drain.
            self._generation += 1
            while self._filling:
                self._fills_done.wait()
        drained = 0
        while (taken := self._take_any()) is not None:
            kind, handle = taken
            try:
                with self.context(kind[1]):
                    self._call("release", handle)
            except BaseException:
                with self._lock:
                    self._shelve(kind, handle)
                raise
            with self._lock:
                self._pooled.discard(handle)
                self._count_held(kind, -1)
                del self._kinds[handle]
            drained += kind[0]
        return drained

    def fill(self, size: int, count: int, device: int = 0, shareable: bool = False) -> int:
        """Create up to ``count`` handles of ``size`` bytes into the pool,
        ahead of a growth the caller knows is coming, as far as the cap
        allows. Returns how many were added; a failing create raises, the
        handles made before it staying idle."""
        check_bytes("size", size)
        check_int("count", count)
        check_int("device", device)
        check_bool("shareable", shareable)
        if size == 0 or count < 0 or device < 0:
            raise ValueError(
                f"fill takes a positive size (bytes), a count and a device of at least 0, "
                f"got size {size}, count {count}, device {device}"
            )
        kind = (size, device, shareable)
        with self._lock:
            generation = self._generation
            self._filling += 1
        try:
            return self._fill(kind, count, generation)
        finally:
            with self._lock:
                self._filling -= 1
                self._fills_done.notify_all()

    def _fill(self, kind: Kind, count: int, generation: int) -> int:
        added = 0
        while added < count and self._hold_room(kind, generation):
            try:
                handle = self._create(kind)
            except BaseException:
                with self._lock:
                    self._count_held(kind, -1)
                raise
            with self._lock:
                stale = generation != self._generation
                if not stale:
                    self._shelve(kind, handle)
            if stale:
                # A drain (a sleep) ran while this handle was being made:
                # it goes back too, and the fill stops.
                self._give_back(kind, handle)
                break
            added += 1
        return added

    def _give_back(self, kind: Kind, handle: int) -> None:
        """Release a handle a stale fill made, and forget it."""
        try:
            with self.context(kind[1]):
                self._call("release", handle)
        finally:
            with self._lock:
                self._count_held(kind, -1)
                self._kinds.pop(handle, None)

    def _hold_room(self, kind: Kind, generation: int) -> bool:
        """Count a handle of ``kind`` about to be created against the cap,
        if it fits and no drain has run since the fill began. Held before it
        exists, so that a fill or a release running while its create is in
        flight sees the room as taken."""
        with self._lock:
            if generation != self._generation or not self._fits(kind):
                return False
            self._count_held(kind, 1)
            return True

    def fill_in_background(
        self, size: int, count: int, device: int = 0, shareable: bool = False
    ) -> Future[int]:
        """:meth:`fill` on a thread of its own, off the caller's critical
        path; the future gives the count added (or the error)."""
        return in_background(self.fill, size, count, device, shareable)

    # -- the adaptor calls, as a pool reads them -----------------------------------

    def holding(self, device: int, size: int, *, credit: int = 0) -> AbstractContextManager[object]:
        """Hold below what the idle handles on ``device`` will not serve:
        they hold their memory (and its claim) already. Where they are not
        of the sizes the work creates, its creates beyond claim one by one.
        ``size`` and ``credit`` are bytes, checked before anything is counted."""
        check_bytes("size", size)
        check_bytes("credit", credit)
        with self._lock:
            idle = sum(
                kind[0] * len(handles) for kind, handles in self._idle.items() if kind[1] == device
            )
        return self.inner.holding(device, max(0, size - idle), credit=credit)

    def release_idle(self) -> int:
        """:meth:`drain`, then the pools below."""
        return self.drain() + self.inner.release_idle()

    def create_ahead(self, size: int, count: int, device: int, shareable: bool) -> int:
        """:meth:`fill`: into this pool, not the ones below."""
        return self.fill(size, count, device, shareable)
