"""Which units a batch still running may touch (``growth: "elastic"``).

vLLM runs a batch queue whenever ``max_concurrent_batches`` is above 1 (its
async scheduling, vLLM's GPU default, or pipeline parallelism): the engine
core schedules batch N+1 while batch N still executes, and only then reads
N's output (``EngineCore.step_with_batch_queue``). A request preempted by
the second schedule, finished by N's output or aborted in between gives its
blocks back while a batch that uses them still runs. A unit holding such a
block must not go back (its pages unmapped under the running batch) until
every batch scheduled before the block was given back has finished.

:class:`BatchesInFlight` counts the batches scheduled and finished (vLLM
finishes them in order) and pins a unit when a block of it is given back
while batches run, until those batches are done. Its cost is one entry per
block given back, never a scan of the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["BatchesInFlight"]


class BatchesInFlight:
    """Batches scheduled and not yet finished, and the units they may use
    blocks of that requests gave back meanwhile."""

    def __init__(self) -> None:
        #: Batches scheduled and finished so far (vLLM finishes them in order).
        self.scheduled = 0
        self.finished = 0
        #: Per pinned unit: the batches scheduled when its last block came
        #: back; it is free to go once that many have finished.
        self._until: dict[int, int] = {}
        self._order: deque[tuple[int, int]] = deque()

    def given_back(self, units: Iterable[int]) -> None:
        """Blocks of ``units`` came back from requests just now: while any
        batch runs, they stay until every batch scheduled so far finishes."""
        until = self.scheduled
        if until == self.finished:
            return
        for unit in units:
            if self._until.get(unit) != until:
                self._until[unit] = until
                self._order.append((until, unit))

    def batch_scheduled(self) -> None:
        self.scheduled += 1

    def batch_finished(self) -> bool:
        """A batch's output is in: the units only it (and the batches
        before it) pinned are free. Whether any was."""
        self.finished += 1
        order, freed = self._order, False
        while order and order[0][0] <= self.finished:
            until, unit = order.popleft()
            if self._until.get(unit) == until:
                del self._until[unit]
                freed = True
        return freed

    def pinned(self, unit: int) -> bool:
        """Whether a batch still running may use a block of ``unit``."""
        return unit in self._until

    @property
    def any_pinned(self) -> bool:
        return bool(self._until)
