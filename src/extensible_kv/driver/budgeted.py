"""A per-device memory budget shared by every process: RMM's limiting adaptor,
across processes.

:class:`BudgetDriver` claims the bytes of every ``create`` from the device's
ledger (:mod:`extensible_kv.budget.ledger`) before calling the driver, and
gives them back when the memory really goes: once the handle is released and
its last mapping is unmapped (a released handle that is still mapped keeps
its memory). A claim past the device's limit raises
:class:`~extensible_kv.driver.BudgetExceededError` instead of calling the
driver, so nothing changes below and the caller's rollback leaves its cache
as it was. Handles a pool above keeps idle stay claimed, since they hold
memory. Imported handles claim nothing: their memory is the exporter's.

``get_driver`` puts one under every backend it hands out. With no limit set
on a device, a claim is a store into a shared mapping, with no lock and no
system call.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from extensible_kv.budget.ledger import Ledger
from extensible_kv.budget.publish import Publisher, publisher
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.driver.adaptors import DriverAdaptor, MappingLedger
from extensible_kv.driver.protocol import Driver

_waits = threading.local()


@contextmanager
def waiting_for_budget(timeout_s: float) -> Iterator[None]:
    """Within this block, on this thread, a claim that does not fit under a
    device's limit waits up to ``timeout_s`` seconds for other processes to
    give memory back (an engine waking while another goes to sleep), and
    only then raises :class:`~extensible_kv.driver.BudgetExceededError`.

    Each handle's claim waits on its own: a commit of several handles holds
    the ones it has while it waits for the next, and gives them all back if
    it times out.
    """
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be a non-negative number of seconds, got {timeout_s}")
    before = getattr(_waits, "timeout_s", 0.0)
    _waits.timeout_s = timeout_s
    try:
        yield
    finally:
        _waits.timeout_s = before


class BudgetDriver(DriverAdaptor):
    """Claims every created handle's bytes from its device's shared budget.

    Args:
        inner: the driver below.
        state_dir: the state directory; None reads it (``state_dir()``) at
            the first claim.
    """

    def __init__(self, inner: Driver, *, state_dir: Path | None = None) -> None:
        super().__init__(inner)
        self._state_dir = state_dir
        self._lock = threading.Lock()
        self._ledgers: dict[int, Ledger] = {}
        self._publisher: Publisher | None = None
        #: Live handles made here: their ledger and bytes, and whether released.
        self._claimed: dict[int, tuple[Ledger, int]] = {}
        self._released: set[int] = set()
        self._mapped_at: MappingLedger[int] = MappingLedger()
        self._mappings_of: dict[int, int] = {}
        _instances.add(self)

    def ledger(self, device: int) -> Ledger:
        """The budget ledger of ``device`` (an ordinal of this process)."""
        with self._lock:
            found = self._ledgers.get(device)
        if found is not None:
            return found
        where = self._state_dir or state_dir()
        made = Ledger(where, self.inner.device_uuid(device))
        with self._lock:
            found = self._ledgers.setdefault(device, made)
            if self._publisher is None:
                self._publisher = publisher(where)
        if found is not made:
            made.close()
        return found

    def known_uuid(self, device: int) -> str | None:
        """``device``'s UUID once a claim has opened its ledger, else None."""
        with self._lock:
            found = self._ledgers.get(device)
        return None if found is None else found.device

    def create(self, size: int, device: int, shareable: bool) -> int:
        ledger = self.ledger(device)
        ledger.claim(size, getattr(_waits, "timeout_s", 0.0))
        try:
            handle = self.inner.create(size, device, shareable)
        except BaseException:
            ledger.give_back(size)
            raise
        with self._lock:
            self._claimed[handle] = (ledger, size)
        self._touch()
        return handle

    def release(self, handle: int) -> None:
        self.inner.release(handle)
        with self._lock:
            gone = self._forget(handle, released=True)
        self._give_back(gone)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.inner.map(ptr, size, handle)
        with self._lock:
            if handle in self._claimed:
                self._mapped_at.add(ptr, handle)
                self._mappings_of[handle] = self._mappings_of.get(handle, 0) + 1

    def unmap(self, ptr: int, size: int) -> None:
        self.inner.unmap(ptr, size)
        gone = []
        with self._lock:
            for handle in self._mapped_at.pop_within(ptr, size):
                left = self._mappings_of.pop(handle) - 1
                if left:
                    self._mappings_of[handle] = left
                else:
                    gone.extend(self._forget(handle, released=False))
        self._give_back(gone)

    def _forget(self, handle: int, released: bool) -> list[tuple[Ledger, int]]:
        """Drop ``handle`` from the books once it is released and unmapped;
        the claim to give back, if it is (caller holds the lock)."""
        if handle not in self._claimed:
            return []
        if released:
            self._released.add(handle)
        if handle not in self._released or self._mappings_of.get(handle):
            return []
        self._released.discard(handle)
        return [self._claimed.pop(handle)]

    def _give_back(self, claims: list[tuple[Ledger, int]]) -> None:
        for ledger, size in claims:
            ledger.give_back(size)
        if claims:
            self._touch()

    def _touch(self) -> None:
        if self._publisher is not None:
            self._publisher.touch()


def find_budget(driver: object) -> BudgetDriver | None:
    """The first :class:`BudgetDriver` in ``driver``'s adaptor chain, if any."""
    while driver is not None:
        if isinstance(driver, BudgetDriver):
            return driver
        driver = getattr(driver, "inner", None)
    return None


_instances: weakref.WeakSet[BudgetDriver] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A child owns none of its parent's handles nor its ledger slots."""
    for driver in list(_instances):
        driver._lock = threading.Lock()
        driver._ledgers.clear()
        driver._publisher = None
        driver._claimed.clear()
        driver._released.clear()
        driver._mapped_at = MappingLedger()
        driver._mappings_of.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
