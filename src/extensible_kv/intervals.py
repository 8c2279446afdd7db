"""A set of integers kept as sorted, disjoint, merged half-open runs."""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class IntervalSet:
    """Sorted disjoint runs ``[start, end)``; touching runs are merged.

    Queries cost O(log n + runs touched), so a buffer that grows as one
    prefix keeps one run and pays O(log 1) whatever its size.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._total = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self._starts, self._ends, strict=False)

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"IntervalSet({list(self)})"

    @property
    def total(self) -> int:
        """Number of integers in the set."""
        return self._total

    def _replace(self, i: int, j: int, starts: list[int], ends: list[int]) -> None:
        """Put the runs ``starts``/``ends`` in place of runs ``i`` to ``j``."""
        self._total += sum(ends) - sum(starts)
        self._total -= sum(self._ends[i:j]) - sum(self._starts[i:j])
        self._starts[i:j] = starts
        self._ends[i:j] = ends

    def _first_touching(self, start: int) -> int:
        """Index of the first run whose end is at or after ``start``."""
        return bisect.bisect_left(self._ends, start)

    def overlaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` inside the set, in order."""
        out: list[tuple[int, int]] = []
        if start >= end:
            return out
        i = bisect.bisect_right(self._ends, start)
        while i < len(self._starts) and self._starts[i] < end:
            out.append((max(start, self._starts[i]), min(end, self._ends[i])))
            i += 1
        return out

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` outside the set, in order."""
        out = []
        cursor = start
        for lo, hi in self.overlaps(start, end):
            if lo > cursor:
                out.append((cursor, lo))
            cursor = hi
        if cursor < end:
            out.append((cursor, end))
        return out

    def add(self, start: int, end: int) -> None:
        """Insert ``[start, end)``, merging with runs it overlaps or touches."""
        if start >= end:
            return
        i = self._first_touching(start)
        j = bisect.bisect_right(self._starts, end)
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
        self._replace(i, j, [start], [end])

    def remove(self, start: int, end: int) -> None:
        """Delete ``[start, end)`` from the set, splitting runs it cuts."""
        if start >= end:
            return
        i = bisect.bisect_right(self._ends, start)
        j = bisect.bisect_left(self._starts, end)
        if i >= j:
            return
        keep_starts, keep_ends = [], []
        if self._starts[i] < start:
            keep_starts.append(self._starts[i])
            keep_ends.append(start)
        if self._ends[j - 1] > end:
            keep_starts.append(end)
            keep_ends.append(self._ends[j - 1])
        self._replace(i, j, keep_starts, keep_ends)

    def clear(self) -> None:
        self._replace(0, len(self._starts), [], [])
