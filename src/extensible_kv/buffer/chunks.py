"""What a buffer's physical memory is made of: chunks, and the plans that
map them again elsewhere with their contents (remaps and their stagings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = ["Chunk", "Remap", "Span", "Staging", "runs_of", "runs_of_chunks"]

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
