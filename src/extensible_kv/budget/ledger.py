"""One device's budget, shared by every process: its limit, and each
process's claim, want, floor and cap.

The ledger is a small file (:mod:`extensible_kv.budget.ledger_file`) that
every process using the device maps ``MAP_SHARED``. Asking whether there is
a limit and adding to one's own claim are loads and stores into the mapping,
with no system call; a claim against a limit or a cap, taking a slot, and
setting or reading the limit, floors and caps with their revision hold the
file's ``flock``, so claims are checked and recorded atomically across
processes, and with no limit nothing is locked at all.

**The rules.** A process's claim never passes its cap; the claims of all
never pass the limit; and a process's **floor** is kept for it while it
holds less: another's claim fits only if the room left covers every other
process's unmet floor. So ``sum(max(claim, floor))`` stays within the limit
once it is there, and a burst on one engine cannot take what another's floor
guarantees.

**Wants.** A claim that does not fit posts a **want**: the bytes it asked
for, kept for :data:`WANT_TTL_S` and renewed while the claim waits or is
asked again; what the process claims later pays its want down. Other
processes read :meth:`Ledger.pressure` (the wants the room does not cover)
and give back memory they hold idle (an elastic engine's cached and free
blocks) until it is met. When a want is paid off, the ledger keeps how long
it waited.

A slot whose process died still shows its claim until a process needs the
room: a claim that does not fit first asks whether each holder lives
(:mod:`extensible_kv.budget.liveness`) and zeroes the slots of the dead.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from extensible_kv.budget.holders import (
    STALLED_S,
    Holder,
    LedgerView,
    Limit,
    ProcessSum,
    StaleRevisionError,
    check_limit,
    check_revision,
    check_size,
    refusal,
)
from extensible_kv.budget.ledger_file import HIGH as _HIGH
from extensible_kv.budget.ledger_file import LIMIT as _LIMIT
from extensible_kv.budget.ledger_file import REVISION as _REVISION
from extensible_kv.budget.ledger_file import SLOTS, LedgerFile
from extensible_kv.budget.liveness import (
    ProcessId,
    forget_dead,
    is_alive,
    this_process,
)
from extensible_kv.budget.sizes import format_bytes
from extensible_kv.budget.state_dir import StateDirError, prepare
from extensible_kv.driver.errors import BudgetExceededError

#: Called once, with the seconds waited, by a claim waiting past STALLED_S.
Stall = Callable[[float], object] | None
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Seconds between tries while a claim waits for room.
POLL_S = 0.01
#: Seconds a want is kept after the claim that posted it, unless asked again.
WANT_TTL_S = 0.5
_WANT_TTL_NS = int(WANT_TTL_S * 1e9)


def check_uuid(device: str) -> None:
    """Refuse a device UUID that cannot name a ledger file: ValueError."""
    if _UUID_RE.fullmatch(device) is None:
        raise ValueError(
            f"device name {device!r} is not a device UUID (letters, digits, '.', '_' "
            f"and '-', at most 128)"
        )


def ledger_path(state_dir: Path, device: str) -> Path:
    check_uuid(device)
    return state_dir / "devices" / f"{device}.ledger"


class Ledger:
    """This process's handle on one device's ledger (made if missing).

    Args:
        state_dir: the state directory.
        device: the device's UUID (``Driver.device_uuid``), the same in
            every process.

    Raises :class:`StateDirError` when the file is not a ledger.
    """

    def __init__(self, state_dir: Path, device: str) -> None:
        self.state_dir = state_dir
        self.device = device
        self.path = ledger_path(state_dir, device)
        prepare(state_dir)
        # Reentrant: a finalizer releasing a dropped buffer's memory may run
        # at an allocation inside a claim, on the same thread (see BudgetDriver).
        self._mutex = threading.RLock()
        self._file = LedgerFile(self.path)
        self._fd = self._file.fd
        self._header = self._file.header
        self._pids = self._file.pids
        self._tokens = self._file.tokens
        self._claims = self._file.claims
        self._slot: int | None = None

    def close(self) -> None:
        """Unmap and close (the claim stays: it is given back by releasing)."""
        self._file.close()

    # -- the limit ------------------------------------------------------------

    @property
    def limited(self) -> bool:
        """True while the device has a limit (one load from the mapping)."""
        return self._header[_LIMIT] >= 0

    def limit(self) -> Limit:
        """The limit and its revision, as one write left them.

        Read under the file's lock, which every write of the limit holds: the
        limit and its revision are two stores, and two loads without the lock
        could pair one write's bytes with the next's revision, which a
        controller would then pass as ``expect_revision``.
        """
        with self._locked():
            return self._limit_now()

    def _limit_now(self) -> Limit:
        """The limit and its revision (caller holds the flock)."""
        raw = self._header[_LIMIT]
        return Limit(None if raw < 0 else raw, self._header[_REVISION])

    def set_limit(self, limit_bytes: int | None, expect_revision: int | None = None) -> Limit:
        """Set the limit in bytes (None: none); with ``expect_revision`` (an
        int), only if the revision is still that one, else
        :class:`StaleRevisionError`. A limit below the live processes'
        floors together is refused (ValueError): lower a floor first."""
        check_limit("limit_bytes", limit_bytes)
        check_revision("expect_revision", expect_revision)
        with self._locked():
            revision = self._check_revision(expect_revision)
            floors = sum(process.floor for process in self._processes(forget=True).values())
            if limit_bytes is not None and limit_bytes < floors:
                raise ValueError(
                    f"a limit of {format_bytes(limit_bytes)} on {self.device} is below the "
                    f"floors its processes hold together ({format_bytes(floors)}); lower "
                    f"a floor first (extensible-kv limit --pid PID --floor SIZE)"
                )
            self._header[_LIMIT] = -1 if limit_bytes is None else limit_bytes
            self._header[_REVISION] = revision + 1
            return Limit(limit_bytes, revision + 1)

    def _check_revision(self, expect_revision: int | None) -> int:
        """The revision now, if it is ``expect_revision`` (caller holds the flock)."""
        revision: int = self._header[_REVISION]
        if expect_revision is not None and expect_revision != revision:
            raise StaleRevisionError(
                f"the budget of {self.device} is at revision {revision}, not "
                f"{expect_revision}: someone set it since it was read; read it again"
            )
        return revision

    # -- floors and caps ------------------------------------------------------------

    def set_floor_and_cap(
        self,
        floor_bytes: int,
        cap_bytes: int | None,
        pid: int | None = None,
        expect_revision: int | None = None,
    ) -> Limit:
        """Give process ``pid`` (None: this one) a floor and a cap in bytes
        (0 and None: none), in place of what it had; the revision moves on
        as for a limit. Returns the limit and the new revision.

        Refused with ValueError, changing nothing: a floor above the cap, a
        ``pid`` that holds no slot here (it has claimed nothing on this
        device), floors that would add up past the limit.
        """
        check_size("floor_bytes", floor_bytes)
        check_limit("cap_bytes", cap_bytes)
        check_revision("expect_revision", expect_revision)
        if cap_bytes is not None and floor_bytes > cap_bytes:
            raise ValueError(
                f"a floor of {format_bytes(floor_bytes)} is above the cap of "
                f"{format_bytes(cap_bytes)}: a process cannot be kept more than it may hold"
            )
        if pid is None:
            with self._mutex:  # taking a slot takes the file's lock itself
                self._own_slot()
        with self._locked():
            revision = self._check_revision(expect_revision)
            slot = self._own_slot() if pid is None else self._slot_of(pid)
            me = self._holder(slot)
            others = sum(
                process.floor for key, process in self._processes(forget=True).items() if key != me
            )
            limit = self._header[_LIMIT]
            if limit >= 0 and others + floor_bytes > limit:
                raise ValueError(
                    f"a floor of {format_bytes(floor_bytes)} for pid {self._pids[slot]} "
                    f"and the other floors ({format_bytes(others)}) would pass the limit of "
                    f"{format_bytes(limit)} on {self.device}"
                )
            for i in range(self._high()):
                if self._holder(i) == me:  # the process's other slots hold none
                    self._file.floors[i] = self._file.caps[i] = 0
            self._file.floors[slot] = floor_bytes
            self._file.caps[slot] = cap_bytes or 0
            self._header[_REVISION] = revision + 1
            return Limit(None if limit < 0 else limit, revision + 1)

    def _slot_of(self, pid: int) -> int:
        """The lowest slot of live process ``pid`` (caller holds the flock)."""
        self._forget_dead()
        for i in range(self._high()):
            if self._pids[i] == pid:
                return i
        raise ValueError(
            f"pid {pid} holds no slot on {self.device}: it has claimed nothing there "
            f"(a floor or cap is set on a process that uses the device)"
        )

    # -- claims ---------------------------------------------------------------

    @property
    def held(self) -> int:
        """Bytes this process claims on the device."""
        return 0 if self._slot is None else self._claims[self._slot]

    def claim(
        self, size: int, timeout_s: float = 0.0, *, want: bool = True, on_stall: Stall = None
    ) -> None:
        """Claim ``size`` bytes for this process, before it creates them.

        With no limit and no cap this is a store into the mapping. Otherwise
        a claim that does not fit posts a want of ``size`` bytes (see the
        module; not with ``want=False``, for a try that has another way)
        and waits up to ``timeout_s`` seconds for room, then raises
        :class:`BudgetExceededError`. A wait past :data:`STALLED_S` seconds
        calls ``on_stall`` once, with the seconds waited.
        """
        slot = self._slot
        if slot is not None and self._header[_LIMIT] < 0 and self._unbounded(slot):
            with self._mutex:  # the common case, inlined
                self._claims[slot] += size
            return
        if self._try_claim(size, want):
            return
        start = time.monotonic()
        while not self._try_claim(size, want):
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise self._refusal(size)
            if waited >= STALLED_S and on_stall is not None:
                on_stall(waited)
                on_stall = None  # told once
            time.sleep(POLL_S)

    def _unbounded(self, slot: int) -> bool:
        """No cap on this slot and no want to pay down (two loads)."""
        return not self._file.caps[slot] and not self._file.wants[slot]

    def claim_unchecked(self, size: int) -> None:
        """Claim ``size`` bytes without the limit's check: only for memory the
        caller gives back before it is done (see ``BudgetDriver.holding``)."""
        with self._mutex:
            self._claims[self._own_slot()] += size

    def give_back(self, size: int) -> None:
        """Return ``size`` bytes of this process's claim (memory freed)."""
        with self._mutex:
            assert self._slot is not None, "giving back what was never claimed"
            self._claims[self._slot] -= size

    def _try_claim(self, size: int, want: bool) -> bool:
        with self._mutex:
            slot = self._own_slot()
            with self._flocked():
                fits = self._fits(slot, size)
                if not fits and self._forget_dead():
                    fits = self._fits(slot, size)
                now = time.monotonic_ns()
                if fits:
                    self._claims[slot] += size
                    self._pay_want(slot, size, now)
                elif want:
                    self._post_want(slot, size, now)
                return fits

    def _fits(self, slot: int, size: int) -> bool:
        """Whether ``size`` more bytes for ``slot``'s process keep within its
        cap, and within the limit with every other process's unmet floor
        kept (caller holds the flock)."""
        limit = self._header[_LIMIT]
        high = self._high()
        if not any(self._file.floors[:high]) and not any(self._file.caps[:high]):
            return limit < 0 or sum(self._claims[:high]) + size <= limit
        processes = self._processes(forget=False)
        me = processes[self._holder(slot) or ProcessId(0, 0)]
        if me.cap and me.claimed + size > me.cap:
            return False
        if limit < 0:
            return True
        kept = sum(p.unmet_floor for p in processes.values() if p is not me)
        return sum(p.claimed for p in processes.values()) + size + kept <= limit

    def _post_want(self, slot: int, size: int, now: int) -> None:
        """A refused claim of ``size`` bytes: the want is at least that, for
        :data:`WANT_TTL_S` more (caller holds the flock)."""
        file = self._file
        if file.want_until[slot] <= now or not file.wants[slot]:
            file.wants[slot] = 0
            file.want_since[slot] = now
        file.wants[slot] = max(file.wants[slot], size)
        file.want_until[slot] = now + _WANT_TTL_NS

    def _pay_want(self, slot: int, size: int, now: int) -> None:
        """A claim of ``size`` bytes pays down the want; one paid off
        records how long it waited (caller holds the flock)."""
        file = self._file
        if not file.wants[slot]:
            return
        if file.want_until[slot] <= now:
            file.wants[slot] = 0
            return
        file.wants[slot] = max(0, file.wants[slot] - size)
        if not file.wants[slot]:
            file.waited[slot] = now - file.want_since[slot]

    # -- pressure ---------------------------------------------------------------

    def pressure(self, mine: Collection[int] | None = None) -> int:
        """Bytes the other live processes want that the room cannot give
        them now: what processes holding memory idle should give back (0:
        none). ``mine`` are the pids that ask (an engine's processes; None:
        this one): their wants are not counted. Costs a few loads when no
        one else wants; reads under the lock otherwise.

        The room is the limit less every claim and the unmet floors of the
        processes that do not want (a wanting process's own floor is room
        for it); a want counts up to its process's cap. With no limit, 0: a cap no other
        process's memory can lift.
        """
        own = {os.getpid()} if mine is None else set(mine)
        file, now = self._file, time.monotonic_ns()
        if not any(
            file.wants[i] and file.want_until[i] > now and file.pids[i] not in own
            for i in range(self._high())
        ):
            return 0
        with self._locked():
            limit = self._header[_LIMIT]
            if limit < 0:
                return 0
            processes = self._processes(forget=False)
            asked, kept = 0, 0
            for key, process in processes.items():
                if key.pid in own or not process.wanted:
                    kept += process.unmet_floor
                    continue
                want = process.wanted
                if process.cap:
                    want = min(want, max(0, process.cap - process.claimed))
                asked += want
            claimed = sum(p.claimed for p in processes.values())
            return max(0, asked - max(0, limit - claimed - kept))

    def floors_of(self, pids: Collection[int]) -> int:
        """Bytes of the floors of the processes ``pids`` together (loads from
        the mapping, no lock: a floor is one store)."""
        file = self._file
        return sum(file.floors[i] for i in range(self._high()) if file.pids[i] in pids)

    def _processes(self, *, forget: bool) -> dict[ProcessId, ProcessSum]:
        """Every live process's slots summed, wants that lapsed left out;
        with ``forget``, dead processes' slots zeroed first (caller holds
        the flock)."""
        if forget:
            self._forget_dead()
        file, now = self._file, time.monotonic_ns()
        found: dict[ProcessId, ProcessSum] = {}
        for i in range(self._high()):
            key = self._holder(i)
            if key is None:
                continue
            process = found.setdefault(key, ProcessSum())
            process.claimed += file.claims[i]
            if file.wants[i] and file.want_until[i] > now:
                process.wanted += file.wants[i]
                since = file.want_since[i]
                process.wanting_since = min(process.wanting_since or since, since)
            process.floor += file.floors[i]
            process.cap += file.caps[i]
        return found

    def _refusal(self, size: int) -> BudgetExceededError:
        return refusal(self.read(), size, this_process(self.state_dir))

    # -- slots and the file lock -------------------------------------------

    def _high(self) -> int:
        """Slots ever taken: only those below count (taken lowest first)."""
        high: int = self._header[_HIGH]
        return high

    def _own_slot(self) -> int:
        """This process's slot, taken on first use (caller holds the mutex)."""
        if self._slot is not None:
            return self._slot
        me = this_process(self.state_dir)
        with self._flocked():
            free = [i for i in range(SLOTS) if self._pids[i] == 0]
            if not free:
                self._forget_dead()
                free = [i for i in range(SLOTS) if self._pids[i] == 0]
            if not free:
                raise StateDirError(
                    f"{self.path} has a slot for {SLOTS} live processes and all are taken"
                )
            slot = free[0]
            self._clear(slot)
            self._tokens[slot] = me.token
            self._pids[slot] = me.pid
            self._header[_HIGH] = max(self._header[_HIGH], slot + 1)
        self._slot = slot
        return slot

    def _clear(self, slot: int) -> None:
        """Zero every field of ``slot`` (caller holds the flock)."""
        file = self._file
        for view in (file.claims, file.wants, file.want_until, file.want_since, file.waited):
            view[slot] = 0
        file.floors[slot] = file.caps[slot] = 0
        file.pids[slot] = file.tokens[slot] = 0

    def _forget_dead(self) -> bool:
        """Zero the slots of processes that died (caller holds the flock);
        True if any claim came back."""
        returned = False
        for i in range(SLOTS):
            process = self._holder(i)
            if process is None or i == self._slot or is_alive(self.state_dir, process):
                continue
            returned |= self._claims[i] != 0 or self._file.floors[i] != 0
            self._clear(i)
            forget_dead(self.state_dir, process)
        return returned

    def _holder(self, slot: int) -> ProcessId | None:
        pid = self._pids[slot]
        return None if pid == 0 else ProcessId(pid, self._tokens[slot])

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex, self._flocked():
            yield

    @contextmanager
    def _flocked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- reading ----------------------------------------------------------------

    def read(self) -> LedgerView:
        """The limit and the live processes (dead ones' slots are cleared on
        the way)."""
        with self._locked():
            file, now = self._file, time.monotonic_ns()
            holders = {}
            for key, process in self._processes(forget=True).items():
                waited = [file.waited[i] for i in range(self._high()) if self._holder(i) == key]
                holders[key] = Holder(
                    process.claimed,
                    process.wanted,
                    process.floor,
                    process.cap or None,
                    max(waited) / 1e9 if any(waited) else None,
                    (now - process.wanting_since) / 1e9 if process.wanted else None,
                )
            return LedgerView(self.device, self._limit_now(), holders)
