"""What the elastic scheduler asks of its units each step, kept as blocks
change (``growth: "elastic"``): which units are empty, highest first (the
next to go back), and which hold only cached blocks, the one used longest
ago first (the next to lose their cache), with the blocks those take.

:class:`~extensible_kv.integrations.vllm_free_queue.PackedFreeQueue` tells
:class:`UnitIndex` of every block that changes state; the index updates
the block's unit in O(1) (O(blocks per unit) when a unit's newest cached
block leaves the cache), and the plan reads the next unit of either order
in O(log units). So a step costs what changed, never a scan of the cache
(at 30,720 one-block units a scan is milliseconds of Python a step).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["UnitIndex"]


class UnitIndex:
    """Per unit: free blocks without a hash (``clean_in``), cached ones
    (``cached_in``) and its blocks (``size``), and the two orders above.

    Args:
        num_units: the units.
        unit_size: blocks of a unit (the last may be shorter).
        cached_ticks: the ticks of a unit's cached blocks (the queue's
            record of when each entered the cache), for the rare recount
            when its newest one leaves.
    """

    def __init__(
        self, num_units: int, unit_size: Callable[[int], int], cached_ticks: Callable[[int], int]
    ) -> None:
        self.size = unit_size
        self._newest_cached = cached_ticks
        self.clean_in = [0] * num_units
        self.cached_in = [0] * num_units
        #: Per unit: the tick its newest cached block entered the cache.
        self._tick = [0] * num_units
        #: Units holding only free blocks, some cached (unit 0 among them,
        #: but never counted), and the blocks of those but unit 0.
        self._only_cached: set[int] = set()
        self.only_cached_blocks = 0
        #: (tick, unit) of only-cached units, oldest first; entries whose
        #: unit has changed since are skipped when met.
        self._by_age: list[tuple[int, int]] = []
        #: -unit of units that became empty (every block free, no hash).
        self._empty: list[int] = []

    # -- what the queue tells ---------------------------------------------------

    def cached(self, unit: int, tick: int) -> None:
        """A block of ``unit`` entered the cache at ``tick`` (the newest)."""
        self.cached_in[unit] += 1
        self._tick[unit] = tick
        self._restate(unit, aged=True)

    def uncached(self, unit: int, tick: int) -> None:
        """A cached block of ``unit`` (entered at ``tick``) left the cache."""
        self.cached_in[unit] -= 1
        if tick == self._tick[unit]:
            self._tick[unit] = self._newest_cached(unit) if self.cached_in[unit] else 0
            self._restate(unit, aged=True)
        else:
            self._restate(unit)

    def cleaned(self, unit: int, delta: int) -> None:
        """``delta`` blocks of ``unit`` became (positive) or stopped being
        (negative) free without a hash."""
        self.clean_in[unit] += delta
        if delta > 0 and self.clean_in[unit] == self.size(unit):
            self.push_empty(unit)
        self._restate(unit)

    def _restate(self, unit: int, *, aged: bool = False) -> None:
        only = self.cached_in[unit] > 0 and (
            self.clean_in[unit] + self.cached_in[unit] == self.size(unit)
        )
        was = unit in self._only_cached
        if only and not was:
            self._only_cached.add(unit)
            self.only_cached_blocks += self.size(unit) if unit else 0
        elif was and not only:
            self._only_cached.discard(unit)
            self.only_cached_blocks -= self.size(unit) if unit else 0
        if only and (aged or not was):
            heapq.heappush(self._by_age, (self._tick[unit], unit))
            if len(self._by_age) > 4 * len(self._only_cached) + 1024:
                self._by_age = [e for e in set(self._by_age) if self._is_current(*e)]
                heapq.heapify(self._by_age)

    def _is_current(self, tick: int, unit: int) -> bool:
        return unit in self._only_cached and tick == self._tick[unit]

    # -- what the plan reads ----------------------------------------------------

    def is_empty(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free without a hash."""
        return self.clean_in[unit] == self.size(unit)

    def holds_no_request(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free (cached or not)."""
        return self.clean_in[unit] + self.cached_in[unit] == self.size(unit)

    def oldest_only_cached(self) -> int | None:
        """The unit but unit 0 holding only free blocks, some cached, whose
        newest cached block is oldest; None if there is none."""
        heap = self._by_age
        while heap:
            tick, unit = heap[0]
            if unit and self._is_current(tick, unit):
                return unit
            heapq.heappop(heap)
        return None

    def pop_empty(self) -> int | None:
        """Take out the highest empty unit but unit 0 (None if there is
        none); :meth:`push_empty` puts back one the caller keeps."""
        heap = self._empty
        while heap:
            unit = -heapq.heappop(heap)
            if unit and self.is_empty(unit):
                while heap and heap[0] == -unit:  # the same unit, pushed again
                    heapq.heappop(heap)
                return unit
        return None

    def push_empty(self, unit: int) -> None:
        heapq.heappush(self._empty, -unit)
        if len(self._empty) > 4 * len(self.clean_in) + 1024:
            self._empty = [-u for u in set(-e for e in self._empty) if self.is_empty(u)]
            heapq.heapify(self._empty)

    def any_holding_no_request(self) -> bool:
        """Whether a unit but unit 0 holds no request (empty or only cached)."""
        if self.only_cached_blocks:
            return True
        unit = self.pop_empty()
        if unit is None:
            return False
        self.push_empty(unit)
        return True
