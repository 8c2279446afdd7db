"""What a buffer's physical memory is made of: chunks, the plans that map
them again elsewhere with their contents (remaps and their stagings), what
a failed clean-up leaves to return (leftovers), and the return of all of it
when a buffer is dropped without ``free()``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer
    from extensible_kv.driver import Driver

__all__ = [
    "Chunk",
    "LeftoverMemory",
    "Remap",
    "Span",
    "Staging",
    "runs_of",
    "runs_of_chunks",
    "teardown",
]

logger = logging.getLogger("extensible_kv.buffer.virtual")

Span = tuple[int, int]


@dataclass(frozen=True)
class Chunk:
    """One physical allocation mapped into the buffer.

    ``offset`` and ``size`` are bytes from the buffer's base pointer, both
    granule multiples; ``handle`` is the driver's handle, owned by the buffer.
    """

    offset: int
    size: int
    handle: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass
class LeftoverMemory:
    """Memory of a buffer that a failed clean-up left for a later call to
    return: ``handles`` whose chunks are unmapped already, and ``ranges``
    (``(offset, size)``) whose unmap failed after their handle went."""

    handles: list[int] = field(default_factory=list)
    ranges: list[Span] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.handles or self.ranges)

    def return_to(self, driver: Driver, base_ptr: int) -> None:
        """Unmap the ranges (at ``base_ptr``), then release the handles; what
        fails stays for a retry. The caller makes the device current."""
        while self.ranges:
            offset, size = self.ranges[-1]
            driver.unmap(base_ptr + offset, size)
            self.ranges.pop()
        while self.handles:
            driver.release(self.handles[-1])
            self.handles.pop()


@dataclass(frozen=True)
class Remap:
    """Chunks ``old``, covering ``[start, end)``, to be replaced by one chunk
    per run of ``runs`` (``(offset, size)``, inside ``[start, end)``)."""

    old: tuple[Chunk, ...]
    start: int
    end: int
    runs: tuple[Span, ...]


@dataclass(frozen=True)
class Staging:
    """The new chunks of some remaps of one buffer, mapped and accessible in
    a scratch buffer of their own, waiting to be filled and swapped in.

    ``places`` holds, per new chunk, ``(offset, size, scratch_offset)``: its
    offset in the target buffer, its size and its offset in ``scratch``.
    """

    scratch: VirtualBuffer
    remaps: tuple[Remap, ...]
    places: tuple[tuple[int, int, int], ...]

    def discard(self) -> None:
        """Give the staged memory back without swapping it in."""
        self.scratch.free_quietly()


def runs_of_chunks(chunks: Sequence[Chunk]) -> list[list[Chunk]]:
    """Chunks grouped into runs of adjacent ones."""
    runs: list[list[Chunk]] = []
    for chunk in chunks:
        if runs and runs[-1][-1].end == chunk.offset:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def runs_of(chunks: Sequence[Chunk]) -> list[list[Span]]:
    """Chunks grouped into runs of adjacent ones, as a plan for ``VirtualBuffer._map_chunks``."""
    return [[(c.offset, c.size) for c in run] for run in runs_of_chunks(chunks)]


def teardown(
    driver: Driver,
    device: int,
    base_ptr: int,
    size: int,
    chunks: list[Chunk],
    leftovers: LeftoverMemory,
) -> None:
    """Return everything of a buffer garbage-collected without ``free()``."""
    try:
        driver.synchronize(device)
        with driver.context(device):
            leftovers.return_to(driver, base_ptr)
            for chunk in chunks:
                driver.unmap(base_ptr + chunk.offset, chunk.size)
                driver.release(chunk.handle)
            driver.free_reserved(base_ptr, size)
    except Exception:
        logger.exception("a VirtualBuffer dropped without free() leaked memory")
