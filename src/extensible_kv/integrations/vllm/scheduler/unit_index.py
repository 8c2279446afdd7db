"""What the elastic scheduler asks of its units each step, kept as blocks
change (``growth: "elastic"``): which units are empty, highest first (the
next to go back), and which hold only cached blocks, the one used longest
ago first (the next to lose their cache), with the blocks those take.

:class:`~extensible_kv.integrations.vllm.scheduler.free_queue.PackedFreeQueue` tells
:class:`UnitIndex` of every block that changes state (one call a block, or
one a run of units that come into or go out of circulation); the index
updates the unit in O(1) (O(blocks per unit) when a unit's newest cached
block leaves the cache), and the plan reads the next unit of either order
in O(log units). So a step costs what changed, never a scan of the cache
(at 30,720 one-block units a scan is milliseconds of Python a step).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["UnitIndex"]


class UnitIndex:
    """Per unit: its blocks (``sizes``), free blocks without a hash
    (``clean_in``) and cached ones (``cached_in``), and the two orders above.

    Args:
        sizes: blocks of each unit (the last may be shorter).
        newest_cached: the tick of a unit's newest cached block (it has
            one), for the rare recount when its newest one leaves the cache.
    """

    def __init__(self, sizes: list[int], newest_cached: Callable[[int], int]) -> None:
        self.sizes = sizes
        self._newest_cached = newest_cached
        self.clean_in = [0] * len(sizes)
        self.cached_in = [0] * len(sizes)
        #: Per unit: the tick its newest cached block entered the cache.
        self._tick = [0] * len(sizes)
        #: Per unit: 1 while it holds only free blocks, some cached.
        self._only = bytearray(len(sizes))
        #: Blocks of the only-cached units but unit 0.
        self.only_cached_blocks = 0
        #: (tick, unit) of only-cached units, oldest first; entries whose
        #: unit has changed since are skipped when met.
        self._by_age: list[tuple[int, int]] = []
        self._num_only = 0
        #: -unit of units that became empty (every block free, no hash),
        #: highest first; likewise skipped once they are not.
        self._empty: list[int] = []

    # -- what the queue tells ---------------------------------------------------

    def change(
        self, unit: int, clean: int = 0, cached: int = 0, tick: int = 0, left: int = 0
    ) -> None:
        """``clean`` more (or fewer) free blocks without a hash in ``unit``,
        and ``cached`` more (or fewer) cached ones; ``tick``: a block
        entered the cache then (the newest); ``left``: the tick of a cached
        block that left it."""
        free = self.clean_in[unit] + clean
        self.clean_in[unit] = free
        kept = self.cached_in[unit] + cached
        self.cached_in[unit] = kept
        size = self.sizes[unit]
        aged = False
        if tick:
            self._tick[unit], aged = tick, True
        elif left and left == self._tick[unit]:
            self._tick[unit], aged = (self._newest_cached(unit) if kept else 0), True
        if clean > 0 and free == size:
            self.push_empty(unit)
        only = kept > 0 and free + kept == size
        if only != self._only[unit]:
            self._only[unit] = only
            self._num_only += 1 if only else -1
            if unit:
                self.only_cached_blocks += size if only else -size
            aged = only
        if only and aged:
            heapq.heappush(self._by_age, (self._tick[unit], unit))
            if len(self._by_age) > 4 * self._num_only + 1024:
                self._by_age = [e for e in set(self._by_age) if self._is_current(*e)]
                heapq.heapify(self._by_age)

    def circulating(self, start: int, end: int, empty: bool) -> None:
        """Units ``[start, end)``, every block free without a hash, came
        into circulation (``empty``: each is empty now) or went out of it
        (none has a free block in circulation now)."""
        sizes = self.sizes[start:end]
        self.clean_in[start:end] = sizes if empty else [0] * (end - start)
        if empty:
            for unit in range(start, end):
                self.push_empty(unit)

    def newest(self, unit: int) -> int:
        """The tick of ``unit``'s newest cached block (0: none)."""
        return self._tick[unit]

    def _is_current(self, tick: int, unit: int) -> bool:
        return bool(self._only[unit]) and tick == self._tick[unit]

    # -- what the plan reads ----------------------------------------------------

    def is_empty(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free without a hash."""
        return self.clean_in[unit] == self.sizes[unit]

    def holds_no_request(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free (cached or not)."""
        return self.clean_in[unit] + self.cached_in[unit] == self.sizes[unit]

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

    def set_aside(self, unit: int) -> None:
        """Take ``unit`` out of the age order for now (the caller is about
        to evict it: :meth:`oldest_only_cached` goes on to the next)."""
        heap = self._by_age
        while heap and heap[0][1] == unit:  # itself, and any copy pushed again
            heapq.heappop(heap)

    def pop_empty(self) -> int | None:
        """Take out the highest empty unit but unit 0 (None if there is
        none); :meth:`push_empty` puts back one the caller keeps."""
        heap = self._empty
        while heap:
            unit = -heapq.heappop(heap)
            if unit and self.clean_in[unit] == self.sizes[unit]:
                while heap and heap[0] == -unit:  # the same unit, pushed again
                    heapq.heappop(heap)
                return unit
        return None

    def push_empty(self, unit: int) -> None:
        heapq.heappush(self._empty, -unit)
        if len(self._empty) > 4 * len(self.sizes) + 1024:
            self._empty = [-u for u in {-e for e in self._empty} if self.is_empty(u)]
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
