"""The units of blocks an elastic cache holds outside its committed prefix.

:class:`~extensible_kv.kv.growth.elastic.ElasticBlocks` commits and gives back
units anywhere in a cache; its books are this object, which the cache
(:class:`~extensible_kv.kv.KVCacheBuffers`) owns, so that what the cache
reports (its committed blocks, what ``extensible-kv top`` shows), what a
sleep may keep and what ``clear()`` forgets see the units too.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HeldUnits", "ranges_of"]


def ranges_of(units: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted, merged ``(start, end)`` ranges of ``units``, end exclusive."""
    merged: list[tuple[int, int]] = []
    for unit in sorted(set(units)):
        if merged and merged[-1][1] == unit:
            merged[-1] = (merged[-1][0], unit + 1)
        else:
            merged.append((unit, unit + 1))
    return tuple(merged)


class HeldUnits:
    """Units of ``blocks_per_unit`` consecutive blocks held, each with
    memory behind every byte of its blocks in every tensor; the blocks past
    ``num_blocks`` (the engine's count) are not the engine's.

    ``units`` is read-only to callers; they change it through the methods
    below, which keep its ranges and block count at hand (a worker reads
    them every step, and at tens of thousands of units a recount costs
    milliseconds)."""

    def __init__(self) -> None:
        self.blocks_per_unit = 1
        self.num_blocks = 0
        self.units: frozenset[int] = frozenset()
        self._ranges: tuple[tuple[int, int], ...] | None = ()
        self._blocks: int | None = 0

    def set(self, units: Iterable[int], blocks_per_unit: int | None = None) -> None:
        """Hold exactly ``units`` (in units of ``blocks_per_unit`` blocks,
        if given)."""
        if blocks_per_unit is not None:
            self.blocks_per_unit = blocks_per_unit
        self.units = frozenset(units)
        self._ranges = self._blocks = None

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The units held, as sorted ``(start, end)`` ranges."""
        if self._ranges is None:
            self._ranges = ranges_of(self.units)
        return self._ranges

    def block_ranges(self, units: Iterable[int]) -> list[tuple[int, int]]:
        """The ``(start, end)`` block ranges of ``units``, within the engine's count."""
        return self.blocks_of(ranges_of(units))

    def blocks_of(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ``(start, end)`` block ranges of unit ``ranges``, within the
        engine's count."""
        per, out = self.blocks_per_unit, []
        for start, end in ranges:
            lo, hi = start * per, min(end * per, self.num_blocks)
            if lo < hi:
                out.append((lo, hi))
        return out

    @property
    def num_blocks_held(self) -> int:
        """Blocks of the units held."""
        if self._blocks is None:
            self._blocks = sum(hi - lo for lo, hi in self.blocks_of(self.ranges))
        return self._blocks

    def check_none(self, what: str, instead: str) -> None:
        """Refuse ``what``, an operation on the cache's committed prefix
        (which would unmap units under these books, or copy none of them),
        while units are held; the error says to do ``instead``."""
        if self.units:
            raise ValueError(
                f"the KV cache holds elastic units (ElasticBlocks) outside its committed "
                f"prefix, which {what} would lose: {instead}"
            )

    def forget(self) -> None:
        """Hold nothing: the cache's memory has gone (a sleep, ``clear()``)."""
        self.set(())
