"""VirtualBuffer: one virtual address reservation and the physical chunks in it."""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from extensible_kv._checks import check_int, round_up
from extensible_kv.driver import Driver
from extensible_kv.intervals import IntervalSet

logger = logging.getLogger(__name__)


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


class VirtualBuffer:
    """A virtual address range reserved once, with physical memory committed,
    released and committed again underneath it.

    The buffer owns its reservation and every chunk mapped in it. Byte ranges
    are committed by granule: a range widens to granule boundaries, granules
    already mapped are skipped, and each run of unmapped granules is mapped as
    chunks of at most ``chunk_bytes`` (default: one chunk per run).

    A commit either maps everything asked or nothing: a failing driver call
    unmaps and releases what that call had made before the error propagates.
    Releasing is done in two phases: unmapping (undone by mapping back if any
    unmap fails), then releasing handles; a handle whose release fails is kept
    and released by the next call that changes the buffer.

    Args:
        size: bytes of address space wanted; reserved rounded up to the granularity.
        driver: the backend; the buffer makes every call through it.
        device: device ordinal the memory lives on and is accessible from.
        shareable: create memory that can be exported as file descriptors.
        chunk_bytes: largest chunk mapped by a commit, a granule multiple;
            None maps each run of new granules as one chunk.
    """

    def __init__(
        self,
        size: int,
        driver: Driver,
        device: int = 0,
        *,
        shareable: bool = False,
        chunk_bytes: int | None = None,
    ) -> None:
        check_int("size", size)
        if size < 0:
            raise ValueError(f"size must be non-negative, got {size}")
        driver.ensure_context(device)
        granularity = driver.granularity(device, shareable)
        if chunk_bytes is not None and (
            check_int("chunk_bytes", chunk_bytes) <= 0 or chunk_bytes % granularity
        ):
            raise ValueError(
                f"chunk_bytes must be a positive multiple of the granularity "
                f"({granularity} bytes), got {chunk_bytes}"
            )
        self.driver = driver
        self.device = device
        self.shareable = shareable
        self.granularity = granularity
        self.chunk_bytes = chunk_bytes
        self.size = round_up(max(size, 1), granularity)
        self.base_ptr = driver.reserve(self.size)
        self._lock = threading.RLock()
        self._chunks: list[Chunk] = []
        self._chunk_offsets: list[int] = []
        self._mapped = IntervalSet()
        self._unreleased: list[int] = []
        self._views = 0
        self._freed = False
        self._reserved = True
        # A buffer dropped without free() still returns everything. Not at
        # interpreter exit: the process's memory goes anyway, and views may
        # still be read by code running after atexit handlers.
        self._finalizer = weakref.finalize(
            self,
            _teardown,
            driver,
            device,
            self.base_ptr,
            self.size,
            self._chunks,
            self._unreleased,
        )
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return (
            f"VirtualBuffer(base_ptr={self.base_ptr:#x}, size={self.size}, "
            f"physical_bytes={self.physical_bytes}, chunks={len(self._chunks)}, "
            f"device={self.device}, freed={self._freed})"
        )

    # -- state ----------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical memory mapped: granularity x mapped granules."""
        return self._mapped.total

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The mapped chunks, by offset."""
        with self._lock:
            return tuple(self._chunks)

    @property
    def mapped_runs(self) -> list[tuple[int, int]]:
        """Maximal runs of mapped bytes, as ``(offset, size)``, by offset."""
        with self._lock:
            return [(start, end - start) for start, end in self._mapped]

    def mapped_in(self, offset: int, size: int) -> list[tuple[int, int]]:
        """The parts of ``[offset, offset + size)`` already mapped, as ``(offset, size)``."""
        with self._lock:
            return [(lo, hi - lo) for lo, hi in self._mapped.overlaps(offset, offset + size)]

    @property
    def freed(self) -> bool:
        """True once :meth:`free` has run: no more commits."""
        return self._freed

    @property
    def reserved(self) -> bool:
        """True while the address range is held (until free() and the last view)."""
        return self._reserved

    @property
    def live_views(self) -> int:
        return self._views

    # -- commit ---------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._freed:
            raise ValueError("the buffer has been freed; it cannot commit or release memory")

    def _widened(self, ranges: Iterable[tuple[int, int]]) -> IntervalSet:
        """The granules covering ``ranges``, validated, as one merged set."""
        needed = IntervalSet()
        for offset, size in ranges:
            check_int("offset", offset)
            check_int("size", size)
            if offset < 0 or size < 0:
                raise ValueError(f"range (offset={offset}, size={size}) must not be negative")
            if offset + size > self.size:
                raise ValueError(
                    f"range [{offset}, {offset + size}) lies outside the "
                    f"{self.size}-byte reservation"
                )
            if size:
                start = offset - offset % self.granularity
                needed.add(start, round_up(offset + size, self.granularity))
        return needed

    def commit(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Back every byte of ``ranges`` (``(offset, size)`` pairs) with memory.

        Returns the newly mapped runs as ``(offset, size)``; memory mapped
        earlier is untouched. All or nothing: on error nothing changes.
        """
        with self._lock:
            self._check_usable()
            needed = self._widened(list(ranges))
            todo = [gap for run in needed for gap in self._mapped.gaps(*run)]
            if not todo:
                return []
            self.driver.ensure_context(self.device)
            self._release_unreleased()
            made: list[Chunk] = []
            try:
                for start, end in todo:
                    self._map_run(start, end, made)
            except BaseException:
                self._undo_commit(made)
                raise
            for chunk in made:
                i = bisect.bisect_left(self._chunk_offsets, chunk.offset)
                self._chunks.insert(i, chunk)
                self._chunk_offsets.insert(i, chunk.offset)
            for start, end in todo:
                self._mapped.add(start, end)
            return [(start, end - start) for start, end in todo]

    def _map_run(self, start: int, end: int, made: list[Chunk]) -> None:
        """Map ``[start, end)`` as chunks, then grant access once for all of them."""
        step = self.chunk_bytes or end - start
        for offset in range(start, end, step):
            size = min(step, end - offset)
            handle = self.driver.create(size, self.device, self.shareable)
            try:
                self.driver.map(self.base_ptr + offset, size, handle)
            except BaseException:
                self.driver.release(handle)
                raise
            made.append(Chunk(offset, size, handle))
        # One set_access may span adjacent mappings, and it is one of the
        # costlier driver calls: grant the whole run at once.
        self.driver.set_access(self.base_ptr + start, end - start, self.device)

    def _undo_commit(self, made: list[Chunk]) -> None:
        for chunk in reversed(made):
            try:
                self.driver.unmap(self.base_ptr + chunk.offset, chunk.size)
                self.driver.release(chunk.handle)
            except Exception:
                logger.exception("rolling back a failed commit leaked %r", chunk)

    # -- release --------------------------------------------------------------

    def release_physical(self) -> int:
        """Unmap and release all physical memory; the address range stays.

        Returns the bytes released. Views stay valid as pointers but must not
        be touched until memory is committed again; contents are discarded.
        """
        with self._lock:
            if self._freed:
                return 0
            return self._release(list(self._chunks))

    def release_outside(self, keep: Iterable[tuple[int, int]]) -> int:
        """Release every chunk holding no byte of ``keep`` (``(offset, size)`` pairs).

        This is how a buffer shrinks: chunks that straddle a kept range stay
        whole (the driver cannot unmap part of a mapping). Returns the bytes
        released.
        """
        with self._lock:
            self._check_usable()
            needed = self._widened(list(keep))
            doomed = [c for c in self._chunks if not needed.overlaps(c.offset, c.end)]
            return self._release(doomed)

    def _release(self, chunks: Sequence[Chunk]) -> int:
        if not chunks:
            self._release_unreleased()
            return 0
        self.driver.ensure_context(self.device)
        # Unmapping does not wait for kernels still reading the memory.
        self.driver.synchronize(self.device)
        self._unmap_all_or_none(chunks)
        for chunk in chunks:
            i = bisect.bisect_left(self._chunk_offsets, chunk.offset)
            del self._chunks[i]
            del self._chunk_offsets[i]
            self._mapped.remove(chunk.offset, chunk.end)
            self._unreleased.append(chunk.handle)
        self._release_unreleased()
        return sum(chunk.size for chunk in chunks)

    def _unmap_all_or_none(self, chunks: Sequence[Chunk]) -> None:
        done: list[Chunk] = []
        try:
            for chunk in chunks:
                self.driver.unmap(self.base_ptr + chunk.offset, chunk.size)
                done.append(chunk)
        except BaseException:
            for chunk in done:
                self.driver.map(self.base_ptr + chunk.offset, chunk.size, chunk.handle)
                self.driver.set_access(self.base_ptr + chunk.offset, chunk.size, self.device)
            raise

    def _release_unreleased(self) -> None:
        """Release handles already unmapped; a failure keeps the rest for a retry."""
        while self._unreleased:
            self.driver.release(self._unreleased[-1])
            self._unreleased.pop()

    # -- lifetime -------------------------------------------------------------

    def free(self) -> None:
        """Release all physical memory now, and the address range once no view
        is left. Idempotent; a failed free can be called again."""
        with self._lock:
            if not self._reserved:
                return
            self.driver.ensure_context(self.device)
            self.release_physical()
            self._release_unreleased()
            self._freed = True
            if self._views == 0:
                self._free_reservation()

    def _free_reservation(self) -> None:
        self.driver.free_reserved(self.base_ptr, self.size)
        self._reserved = False
        self._finalizer.detach()

    def add_view_ref(self) -> None:
        """Record a view over the buffer: the range outlives it."""
        with self._lock:
            if not self._reserved:
                raise ValueError("the buffer has been freed; no view can be made")
            self._views += 1

    def drop_view_ref(self) -> None:
        """Forget a view; the last one of a freed buffer returns the range."""
        with self._lock:
            self._views -= 1
            if self._views == 0 and self._freed and self._reserved:
                try:
                    # The last view may go in any thread: give it a context.
                    self.driver.ensure_context(self.device)
                    self._free_reservation()
                except Exception:
                    logger.exception("returning the address range of %r failed", self)


def _teardown(
    driver: Driver,
    device: int,
    base_ptr: int,
    size: int,
    chunks: list[Chunk],
    unreleased: list[int],
) -> None:
    """Return everything of a buffer garbage-collected without ``free()``."""
    try:
        driver.ensure_context(device)
        driver.synchronize(device)
        for chunk in chunks:
            driver.unmap(base_ptr + chunk.offset, chunk.size)
            driver.release(chunk.handle)
        for handle in unreleased:
            driver.release(handle)
        driver.free_reserved(base_ptr, size)
    except Exception:
        logger.exception("a VirtualBuffer dropped without free() leaked memory")
