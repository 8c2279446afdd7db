"""What a device's ledger holds, as values (a limit, each process's entry,
one look at the whole), and the checks of what may be written into it."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from extensible_kv._checks import check_int
from extensible_kv.budget.liveness import ProcessId, command_line, one_line
from extensible_kv.budget.sizes import MAX_SIZE_BYTES, format_bytes
from extensible_kv.driver.errors import BudgetExceededError

#: Seconds after which a want still unmet is **stalled**: the waiting
#: process logs once who holds the memory, and ``extensible-kv top`` marks it.
#: Long enough that a want met by an idle engine's next step never counts.
STALLED_S = 3.0


class StaleRevisionError(ValueError):
    """A limit, floor or cap was written by someone who had read an older
    revision."""


@dataclass(frozen=True)
class Limit:
    """A device's limit in bytes (None: unlimited) and its revision, which
    every write of the limit, a floor or a cap increments."""

    bytes: int | None
    revision: int


@dataclass(frozen=True)
class Holder:
    """One process's entry in a ledger, in bytes.

    Attributes:
        claimed_bytes: what it claims (holds).
        wanted_bytes: what it asked for, was refused, and has not got
            (0 once that lapsed, :data:`WANT_TTL_S` after the last ask).
        floor_bytes: kept for it while it holds less (0: none).
        cap_bytes: the most it may claim (None: no cap).
        waited_s: seconds its last want that was met waited (None: none yet).
        wanting_s: seconds its standing want has stood unmet (None: it
            wants nothing now); :data:`STALLED_S` or more is a stalled want.
    """

    claimed_bytes: int
    wanted_bytes: int = 0
    floor_bytes: int = 0
    cap_bytes: int | None = None
    waited_s: float | None = None
    wanting_s: float | None = None

    @property
    def stalled(self) -> bool:
        """Whether its want has stood unmet for :data:`STALLED_S` seconds or more."""
        return self.wanting_s is not None and self.wanting_s >= STALLED_S


@dataclass(frozen=True)
class LedgerView:
    """What a ledger holds at one moment: the limit and the live processes."""

    device: str
    limit: Limit
    holders: dict[ProcessId, Holder]

    @property
    def claims(self) -> dict[ProcessId, int]:
        """Bytes each live process claims."""
        return {process: held.claimed_bytes for process, held in self.holders.items()}

    @property
    def claimed_bytes(self) -> int:
        return sum(held.claimed_bytes for held in self.holders.values())

    def floors_besides(self, pids: Collection[int]) -> int:
        """Bytes of the floors of every live process not in ``pids``: what
        the limit keeps for them whatever ``pids`` claim."""
        return sum(h.floor_bytes for p, h in self.holders.items() if p.pid not in pids)

    def most_for(self, pids: Collection[int]) -> int | None:
        """The most bytes the processes ``pids`` could ever hold together:
        the limit less the other live processes' floors, and within their
        caps where every one has a cap; None with neither."""
        mine = [h for p, h in self.holders.items() if p.pid in pids]
        caps = [h.cap_bytes for h in mine]
        capped = sum(c for c in caps if c is not None) if caps and None not in caps else None
        if self.limit.bytes is None:
            return capped
        room = max(0, self.limit.bytes - self.floors_besides(pids))
        return room if capped is None else min(room, capped)


def check_limit(name: str, limit_bytes: object) -> None:
    """Refuse a limit that is not None or an int of 1 to :data:`MAX_SIZE_BYTES`
    bytes (what a ledger holds): TypeError or ValueError naming ``name``."""
    if limit_bytes is None:
        return
    limit = check_int(name, limit_bytes)
    if limit < 1:
        raise ValueError(f"a limit must be at least 1 byte, got {limit}; use None for none")
    if limit > MAX_SIZE_BYTES:
        raise ValueError(
            f"{name} must be at most {MAX_SIZE_BYTES} bytes (2**63 - 1, what a ledger "
            f"holds), got {limit}"
        )


def check_size(name: str, size: object) -> None:
    """Refuse a size that is not an int of 0 to :data:`MAX_SIZE_BYTES`
    bytes: TypeError or ValueError naming ``name``."""
    value = check_int(name, size)
    if not 0 <= value <= MAX_SIZE_BYTES:
        raise ValueError(f"{name} must be 0 to {MAX_SIZE_BYTES} bytes, got {value}")


def check_revision(name: str, revision: object) -> None:
    """Refuse a revision that is not None or an int of at least 0:
    TypeError or ValueError naming ``name``."""
    if revision is not None and check_int(name, revision) < 0:
        raise ValueError(f"{name} must be at least 0, got {revision}")


@dataclass
class ProcessSum:
    """One process's slots summed (a process may hold more than one: one
    per :class:`Ledger` it opened); the caller holds the flock."""

    claimed: int = 0
    wanted: int = 0
    floor: int = 0
    cap: int = 0  # 0: none
    #: ``time.monotonic_ns()`` when its oldest standing want was first
    #: posted (0: it wants nothing).
    wanting_since: int = 0

    @property
    def unmet_floor(self) -> int:
        return max(0, self.floor - self.claimed)


def refusal(view: LedgerView, size: int, me: ProcessId) -> BudgetExceededError:
    """The error for a claim of ``size`` bytes by ``me`` that does not fit
    ``view``: which rule it breaks (its cap, or the limit with the floors
    kept), who holds what, and what to do."""
    limit = view.limit.bytes
    holders = tuple(
        (process.pid, claimed, command_line(process.pid))
        for process, claimed in sorted(view.claims.items(), key=lambda item: -item[1])
        if claimed
    )
    who = ", ".join(
        f"pid {pid} ({one_line(command)}) {format_bytes(claimed)}"
        for pid, claimed, command in holders
    )
    mine = view.holders.get(me)
    if (
        mine is not None
        and mine.cap_bytes is not None
        and (mine.claimed_bytes + size > mine.cap_bytes)
    ):
        detail = (
            f"pid {me.pid} asked {format_bytes(size)} more on device {view.device}, "
            f"past its cap of {format_bytes(mine.cap_bytes)} "
            f"({format_bytes(mine.claimed_bytes)} claimed); give memory back or raise "
            f"the cap (extensible-kv limit --pid {me.pid} --cap SIZE)"
        )
        return BudgetExceededError(view.device, mine.cap_bytes, size, holders, detail)
    floors = sum(
        max(0, held.floor_bytes - held.claimed_bytes)
        for process, held in view.holders.items()
        if held is not mine
    )
    kept = f", {format_bytes(floors)} more is kept for others' floors" if floors else ""
    detail = (
        f"the budget of device {view.device} is {format_bytes(limit or 0)} and "
        f"{format_bytes(view.claimed_bytes)} of it is claimed ({who or 'by nobody now'})"
        f"{kept}; {format_bytes(size)} more was asked by pid {me.pid}. Wait for "
        f"the room (extensible_kv.waiting_for_budget), free memory elsewhere, or raise "
        f"the limit (extensible-kv limit)"
    )
    return BudgetExceededError(view.device, limit or 0, size, holders, detail)
