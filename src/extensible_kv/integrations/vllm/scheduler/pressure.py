"""What other processes on an engine's devices want, in the engine's blocks:
the scheduler's side of memory flowing between engines (``growth:
"elastic"`` under a device budget).

A process whose claim a device's limit refuses posts a want in the device's
ledger (:meth:`~extensible_kv.budget.Ledger.pressure`). The scheduler reads
the ledgers its workers named in their first report, and gives back blocks
no running request holds (the prefix cache's, least recently used first,
then free ones) until the want is met, never below the engine's floor.
An engine refused itself lends its own prefix cache before its claims
post a want (:class:`~extensible_kv.kv.growth.elastic.ElasticOrders`'
``ask_others``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from extensible_kv.integrations.vllm.seam import Ledger, StallWatch

#: Seconds a reading of the ledgers is reused: the engine's loop asks for
#: every step, and a want waits a step or two at most for it.
READ_EVERY_S = 0.02
#: Seconds between looks for a stalled want of this engine (each reads
#: every ledger under its lock).
STALL_EVERY_S = 1.0
#: Seconds after another process last wanted memory of this engine during
#: which the engine keeps no blocks ahead of its requests
#: (:meth:`Pressure.wanted_lately`).
WANTED_LATELY_S = 10.0


@dataclass(frozen=True)
class Room:
    """The most KV memory an engine could ever hold, on its tightest device.

    Attributes:
        blocks: that memory in the engine's blocks.
        bytes_per_block: bytes one of the engine's blocks takes there (on
            every rank of the engine on the device).
        device: the device's UUID.
        limit_bytes: the device's limit (None: none, the engine's caps bound it).
        floors_bytes: the floors of the device's other processes.
        most_bytes: what the engine's ranks there could hold together.
    """

    blocks: int
    bytes_per_block: int
    device: str
    limit_bytes: int | None
    floors_bytes: int
    most_bytes: int


class Pressure:
    """The ledgers of an engine's workers, read for what others want.

    Args:
        bytes_per_block: bytes one block takes on one rank (every tensor,
            every segment).
    """

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        #: Per ledger: the ledger and the engine's ranks that claim there.
        self._ledgers: dict[tuple[str, str], tuple[Ledger, int]] = {}
        self._pids: set[int] = set()
        self._read_at = 0.0
        self._blocks = 0
        #: Blocks the engine keeps under others' wants: its ranks' floors in
        #: the budget (the ``floor_bytes`` option, or set with
        #: ``extensible-kv limit --floor``), as last read.
        self.floor_blocks = 0
        self._stalls = StallWatch()
        self._stall_read_at = 0.0
        #: When a reading last found another process wanting (``time.monotonic``).
        self._wanted_at = float("-inf")

    def learn(self, ledgers: tuple[tuple[str, str, int], ...]) -> None:
        """The ranks' ``(device_uuid, state_dir, pid)`` from a report."""
        # New values, swapped in whole: :meth:`others_want` reads them on
        # another thread.
        known, pids = dict(self._ledgers), set(self._pids)
        for device, where, pid in ledgers:
            key = (device, where)
            ledger, ranks = known.get(key) or (Ledger(Path(where), device), 0)
            known[key] = (ledger, ranks + 1)
            pids.add(pid)
        self._ledgers, self._pids = known, pids

    @property
    def known(self) -> bool:
        """Whether any worker named a ledger (it claims under a budget)."""
        return bool(self._ledgers)

    def blocks_wanted(self) -> int:
        """Blocks this engine should give back now so that others' wants
        are met (0: none), on the device that lacks the most; read at most
        every :data:`READ_EVERY_S` seconds."""
        now = time.monotonic()
        if now - self._read_at < READ_EVERY_S:
            return self._blocks
        self._read_at = now
        most, floor = 0, 0
        for ledger, ranks in self._ledgers.values():
            per_block = self.bytes_per_block * ranks
            most = max(most, -(-ledger.pressure(self._pids) // per_block))
            floor = max(floor, -(-ledger.floors_of(self._pids) // per_block))
        self._blocks, self.floor_blocks = most, floor
        if most:
            self._wanted_at = now
        return most

    def wanted_lately(self) -> bool:
        """Whether another process wanted memory of this engine within the
        last :data:`WANTED_LATELY_S` seconds (as :meth:`blocks_wanted` read)."""
        return time.monotonic() - self._wanted_at < WANTED_LATELY_S

    def room(self) -> Room | None:
        """The most this engine could ever hold: on each of its devices the
        limit less the other processes' floors, within its ranks' caps
        (:meth:`~extensible_kv.budget.LedgerView.most_for`); the tightest.
        None before a worker named a ledger, or with no limit and no cap."""
        tightest: Room | None = None
        for ledger, ranks in self._ledgers.values():
            view = ledger.read()
            most = view.most_for(self._pids)
            if most is None:
                continue
            per_block = self.bytes_per_block * ranks
            if tightest is None or most // per_block < tightest.blocks:
                floors = view.floors_besides(self._pids)
                limit = view.limit.bytes
                tightest = Room(most // per_block, per_block, view.device, limit, floors, most)
        return tightest

    def others_want(self) -> bool:
        """Whether another process on the engine's devices wants memory now:
        read from the ledgers alone, so safe on a thread beside the
        scheduler's (:class:`~extensible_kv.integrations.vllm.scheduler.give_way.GiveWay`)."""
        ledgers, mine = self._ledgers, self._pids
        return any(ledger.pressure(mine) for ledger, _ in ledgers.values())

    def stalled(self) -> list[str]:
        """What to log about this engine's wants that stalled (see
        :class:`~extensible_kv.budget.stall.StallWatch`): one message per
        device the first time, nothing again until that want is met; looks
        at most every :data:`STALL_EVERY_S` seconds."""
        now = time.monotonic()
        if now - self._stall_read_at < STALL_EVERY_S:
            return []
        self._stall_read_at = now
        found = (self._stalls.check(ledger, self._pids) for ledger, _ in self._ledgers.values())
        return [message for message in found if message is not None]

    def spent(self) -> None:
        """Blocks were given back: the next question reads the ledgers again."""
        self._read_at = 0.0

    def close(self) -> None:
        for ledger, _ in self._ledgers.values():
            ledger.close()
        self._ledgers.clear()
