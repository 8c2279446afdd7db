"""A per-device memory budget shared by every process: RMM's limiting adaptor,
across processes.

:class:`BudgetDriver` claims the bytes of every ``create`` from the device's
ledger (:mod:`extensible_kv.budget.ledger`) before calling the driver, and
gives them back when the handle is released. A claim past the device's limit raises
:class:`~extensible_kv.driver.BudgetExceededError` instead of calling the
driver, so nothing changes below and the caller's rollback leaves its cache
as it was. Handles a pool above keeps idle stay claimed, since they hold
memory. Imported handles claim nothing: their memory is the exporter's.

``get_driver`` (:mod:`extensible_kv.devices`) puts one under every backend
it hands out. With no limit set on a device, a claim is a store into a
shared mapping, with no lock and no system call. The layers above reach it
only through the driver protocol: a piece of work's ``holding`` block is
an account here (:meth:`BudgetDriver.holding`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from extensible_kv._checks import check_bytes, check_seconds
from extensible_kv.budget.ledger import Ledger
from extensible_kv.budget.publish import Publisher, publisher
from extensible_kv.budget.stall import stall_message
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.driver.adaptors import DriverAdaptor
from extensible_kv.driver.errors import BudgetExceededError
from extensible_kv.driver.protocol import DRIVER_CALLS, Driver

logger = logging.getLogger(__name__)

_waits = threading.local()
#: The protocol's calls a budget passes through untouched.
_UNCHANGED = tuple(name for name in DRIVER_CALLS if name not in ("create", "release"))


@contextmanager
def waiting_for_budget(timeout_s: float) -> Iterator[None]:
    """Within this block, on this thread, a claim that does not fit under a
    device's limit waits up to ``timeout_s`` seconds for other processes to
    give memory back (an engine waking while another goes to sleep), and
    only then raises :class:`~extensible_kv.driver.BudgetExceededError`.

    Under a limit, a tensor's or KV cache's commit or wake claims its whole
    size at once (:meth:`BudgetDriver.holding`), so it waits holding
    nothing; under a pool, what its idle handles will not serve.

    ``timeout_s`` is an int or a float, at least 0; ``float("inf")`` waits
    as long as it takes.
    """
    check_seconds("timeout_s", timeout_s)
    before = getattr(_waits, "timeout_s", 0.0)
    _waits.timeout_s = timeout_s
    try:
        yield
    finally:
        _waits.timeout_s = before


@contextmanager
def without_wants() -> Iterator[None]:
    """Within this block, on this thread, a claim the device's limit refuses
    posts no want (:meth:`~extensible_kv.budget.Ledger.pressure`): the other
    processes are not asked to give memory back. For a try that has another
    way to the memory (an elastic cache that can still lend its own prefix
    cache first)."""
    before = getattr(_waits, "want", True)
    _waits.want = False
    try:
        yield
    finally:
        _waits.want = before


def _claim(ledger: Ledger, size: int) -> None:
    """Claim ``size`` bytes from ``ledger`` as this thread's blocks say:
    how long to wait (:func:`waiting_for_budget`), whether a refusal posts
    a want (:func:`without_wants`). A wait that stalls logs who holds the
    memory, once (:mod:`~extensible_kv.budget.stall`)."""
    ledger.claim(
        size,
        getattr(_waits, "timeout_s", 0.0),
        want=getattr(_waits, "want", True),
        on_stall=lambda waited: logger.warning(
            stall_message(ledger.state_dir, ledger.device, size, waited, {os.getpid()})
        ),
    )


def _draw(ledger: Ledger, account: _Account, lacking: int) -> None:
    """Add ``lacking`` bytes to ``account``'s balance: claimed from
    ``ledger``, or, if the limit refuses them and the account's credit
    covers them, claimed without the limit's check, on that credit."""
    if lacking > account.credit:
        _claim(ledger, lacking)
    else:
        try:
            ledger.claim(lacking, want=False)
        except BudgetExceededError:
            ledger.claim_unchecked(lacking)
            account.credit -= lacking
    account.balance += lacking


def _check_hold(size: object, credit: object) -> None:
    """Refuse a hold of ``size`` and ``credit`` bytes that are not ints of 0
    to 2**48: a TypeError or ValueError naming the argument."""
    check_bytes("size", size)
    check_bytes("credit", credit)


@dataclass
class _Account:
    """One thread's open :meth:`BudgetDriver.holding` block on one device:
    bytes claimed and not yet drawn, and bytes it may still claim without
    the limit's check."""

    balance: int
    credit: int


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
        self._lock = threading.Lock()  # guards opening ledgers only
        self._ledgers: dict[int, Ledger] = {}
        self._publisher: Publisher | None = None
        self._local = threading.local()
        #: The handles made here and not released: their ledger and bytes. No
        #: lock: one dict operation each, atomic under the GIL; so a buffer
        #: dropped without free(), whose finalizer releases its memory at any
        #: allocation on any thread, can never wait on a lock held below it.
        self._claims: dict[int, tuple[Ledger, int]] = {}
        _instances.add(self)
        # Every commit goes through here: the calls the budget leaves alone
        # are the driver's own bound methods, set on the instance (which
        # shadows the class's forwarding methods), so they cost no extra call.
        for name in _UNCHANGED:
            self.__dict__[name] = getattr(inner, name)

    def ledger(self, device: int) -> Ledger:
        """The budget ledger of ``device`` (an ordinal of this process)."""
        found = self._ledgers.get(device)  # entries are only ever added, under the lock
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

    def accounting(self, device: int) -> tuple[str, str] | None:
        """The protocol's answer: ``device``'s ledger once a claim has opened
        it, else None (calls no driver, makes no file)."""
        ledger = self._ledgers.get(device)
        return None if ledger is None else (ledger.device, str(ledger.state_dir))

    def holding(self, device: int, size: int, *, credit: int = 0) -> AbstractContextManager[object]:
        """The protocol's hold for a piece of work: under a limit, an
        account (:meth:`_account`); without one a claim can neither fail nor
        wait, so the creates claim one by one and the work costs no more.
        ``size`` and ``credit`` are bytes (ints, 0 to 2**48): anything else
        is refused before anything is held."""
        _check_hold(size, credit)
        below = self.inner.holding(device, size, credit=credit)
        if not self.ledger(device).limited:
            return below
        stack = ExitStack()
        try:
            stack.enter_context(below)  # closed too if the claim is refused
            stack.enter_context(self._account(device, size, credit=credit))
        except BaseException:
            stack.close()
            raise
        return stack

    @contextmanager
    def _account(self, device: int, size: int, *, credit: int = 0) -> Iterator[None]:
        """Open this thread's account on ``device`` for one piece of work
        (a commit, a wake, a defragment, a trim), so that under a limit it
        is refused, or waits (:func:`waiting_for_budget`), before it has made
        anything, and never holds part of its memory while it waits for the
        rest.

        Within the block, on this thread:

        * ``size`` bytes are claimed on entry, and creates draw on them
          instead of claiming one by one;
        * a release pays its bytes into the account instead of back to the
          ledger, so memory the work frees stays its own until it ends: a
          defragment that releases and then creates again cannot lose the
          room to another process in between;
        * past the balance, a create the limit refuses draws on ``credit``
          bytes claimed without the limit's check: memory the same block
          gives back before it ends (a trim's copy of the chunk it cuts
          through, which replaces that chunk), so that a cache can always
          trim its way back under a full or lowered limit;
        * what is left is given back at the end.

        A block nested in one open on the same device tops the account up
        to ``size`` (claiming only what it lacks, as a create does: past the
        limit, on the open block's credit) and adds its ``credit``
        until it ends (what it did not draw goes with it); the outermost
        block gives back.
        """
        _check_hold(size, credit)
        ledger = self.ledger(device)
        accounts = self._accounts()
        account = accounts.get(ledger)
        if account is not None:
            credit_before = account.credit
            if size > account.balance:
                _draw(ledger, account, size - account.balance)
            account.credit += credit
            try:
                yield
            finally:
                account.credit = min(account.credit, credit_before)
            return
        if size:  # nothing to claim is never refused, not even over a lowered limit
            _claim(ledger, size)
        accounts[ledger] = _Account(size, credit)
        try:
            yield
        finally:
            left = accounts.pop(ledger).balance
            if left:
                ledger.give_back(left)

    def _accounts(self) -> dict[Ledger, _Account]:
        """This thread's open accounts, by ledger."""
        found: dict[Ledger, _Account] | None = getattr(self._local, "accounts", None)
        if found is None:
            found = self._local.accounts = {}
        return found

    def _open_account(self, ledger: Ledger) -> _Account | None:
        """This thread's open account on ``ledger``, if any (makes nothing:
        every create and release asks)."""
        accounts: dict[Ledger, _Account] | None = getattr(self._local, "accounts", None)
        return None if not accounts else accounts.get(ledger)

    def _claim_for_create(self, ledger: Ledger, size: int) -> _Account | None:
        """Claim ``size`` bytes for a create: from this thread's open account
        on ``ledger`` if there is one (its balance, then the ledger, then,
        if the limit refuses, its credit), else from the ledger. Returns the
        account drawn on."""
        account = self._open_account(ledger)
        if account is None:
            _claim(ledger, size)
            return None
        if size > account.balance:
            _draw(ledger, account, size - account.balance)
        account.balance -= size
        return account

    def create(self, size: int, device: int, shareable: bool) -> int:
        ledger = self._ledgers.get(device) or self.ledger(device)
        account = self._claim_for_create(ledger, size)
        try:
            handle = self.inner.create(size, device, shareable)
        except BaseException:
            if account is not None:
                account.balance += size
            else:
                ledger.give_back(size)
            raise
        self._claims[handle] = (ledger, size)
        self._touch()
        return handle

    def adopt_import(self, handle: int, device: int, size: int) -> None:
        ledger = self._ledgers.get(device) or self.ledger(device)
        # Past any limit: the memory exists already, and the process that
        # held it counts it until it gives it up (a moment counted twice,
        # never uncounted).
        ledger.claim_unchecked(size)
        self._claims[handle] = (ledger, size)
        self._touch()
        self.inner.adopt_import(handle, device, size)

    def release(self, handle: int) -> None:
        # The claim entry goes first: a driver may hand a released handle's
        # value out again at once (the host backend's descriptors do, CUDA
        # may), and another thread's create landing between the release and
        # the pop would otherwise have its entry taken for this one's.
        claim = self._claims.pop(handle, None)
        try:
            self.inner.release(handle)
        except BaseException:
            if claim is not None:
                self._claims[handle] = claim
            raise
        if claim is None:
            return
        # The protocol lets a handle be released while mapped, its memory
        # going at the unmap; the library does that only just before
        # unmapping it (a discard), so the claim is early by one call at most.
        ledger, size = claim
        account = self._open_account(ledger)
        if account is not None:
            account.balance += size
        else:
            ledger.give_back(size)
        self._touch()

    def _touch(self) -> None:
        if self._publisher is not None:
            self._publisher.touch()


_instances: weakref.WeakSet[BudgetDriver] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A child owns none of its parent's handles nor its ledger slots."""
    for driver in list(_instances):
        driver._lock = threading.Lock()
        driver._ledgers.clear()
        driver._publisher = None
        driver._local = threading.local()
        driver._claims.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
