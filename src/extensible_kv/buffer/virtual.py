"""VirtualBuffer: one virtual address reservation and the physical chunks in it."""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

from extensible_kv._checks import check_bytes, check_int, round_up
from extensible_kv.buffer.chunks import Chunk, LeftoverMemory, Remap, Span, Staging, teardown
from extensible_kv.buffer.group import (
    commit_together,
    defragment_together,
    release_outside_together,
    release_together,
    synchronize_buffers,
)
from extensible_kv.buffer.remap import plan_remaps, stage
from extensible_kv.buffer.sharing import export_chunks, map_imported
from extensible_kv.driver import Driver
from extensible_kv.intervals import IntervalSet

__all__ = ["VirtualBuffer"]

logger = logging.getLogger(__name__)


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

    Chunks can be mapped again with their contents (:meth:`plan_remaps`,
    :meth:`stage`, :func:`swap_in_together`), exported to other processes and
    imported from them (:meth:`export_chunks`, :meth:`map_imported`).

    Args:
        size: bytes of address space wanted; reserved rounded up to the granularity.
        driver: the backend; the buffer makes every call through it.
        device: device ordinal the memory lives on and is accessible from.
        shareable: create memory that can be exported as file descriptors.
        chunk_bytes: largest chunk mapped by a commit, a granule multiple;
            None maps each run of new granules as one chunk.
        zero_backed: every byte no chunk covers reads as zero from the
            device and faults on write (``Driver.reserve_zeroed``), instead
            of faulting on any access.
    """

    def __init__(
        self,
        size: int,
        driver: Driver,
        device: int = 0,
        *,
        shareable: bool = False,
        chunk_bytes: int | None = None,
        zero_backed: bool = False,
    ) -> None:
        check_bytes("size", size)
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
        self.zero_backed = zero_backed
        #: Streams whose work a release waits for (driver stream handles);
        #: None waits for the whole device.
        self.wait_streams: tuple[int, ...] | None = None
        self.size = round_up(max(size, 1), granularity)
        # Aligned to the granularity of what will be mapped here: shareable
        # and RDMA-capable memory may have a coarser one than the driver's
        # default alignment.
        with driver.context(device):
            if zero_backed:
                self.base_ptr = driver.reserve_zeroed(self.size, granularity, device)
            else:
                self.base_ptr = driver.reserve(self.size, granularity)
        self._lock = threading.RLock()
        self._chunks: list[Chunk] = []
        self._chunk_offsets: list[int] = []
        self._mapped = IntervalSet()
        #: What failed clean-ups left, returned by the next call that
        #: changes the buffer: memory, and scratch buffers of remaps.
        self._leftover_memory = LeftoverMemory()
        self._leftovers: list[VirtualBuffer] = []
        self._views = 0
        self._context_depth = 0
        self._freed = False
        self._reserved = True
        # A buffer dropped without free() still returns everything. Not at
        # interpreter exit: the process's memory goes anyway, and views may
        # still be read by code running after atexit handlers.
        self._finalizer = weakref.finalize(
            self,
            teardown,
            driver,
            device,
            self.base_ptr,
            self.size,
            self._chunks,
            self._leftover_memory,
        )
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return (
            f"VirtualBuffer(base_ptr={self.base_ptr:#x}, size={self.size}, "
            f"physical_bytes={self.physical_bytes}, chunks={len(self._chunks)}, "
            f"device={self.device}, freed={self._freed})"
        )

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """This buffer's device current on this thread, for driver calls.

        Operations enter it once, before their first change, so that failing
        to make the context current changes nothing; the helpers they call
        enter it again for free (the buffer's lock keeps other threads out).
        """
        if self._context_depth:
            self._context_depth += 1
            try:
                yield
            finally:
                self._context_depth -= 1
            return
        with self.driver.context(self.device):
            self._context_depth = 1
            try:
                yield
            finally:
                self._context_depth = 0

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

    def granules_covering(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The merged runs of granules covering ``ranges`` (``(offset, size)``
        pairs), as ``(start, end)`` byte offsets; validates, changes nothing."""
        return list(self._widened(ranges))

    def _plan(self, ranges: Iterable[tuple[int, int]], whole_runs: bool) -> list[list[Span]]:
        """The chunks a commit of ``ranges`` maps: per run of unmapped granules,
        its chunks as ``(offset, size)``. Validates; changes nothing."""
        self._check_usable()
        needed = self._widened(list(ranges))
        step = None if whole_runs else self.chunk_bytes
        plan = []
        for run in needed:
            for start, end in self._mapped.gaps(*run):
                width = step or end - start
                plan.append([(o, min(width, end - o)) for o in range(start, end, width)])
        return plan

    def bytes_to_map(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Bytes of the granules of ``ranges`` not mapped yet: what a commit
        of them holds, counted without planning its chunks. Validates."""
        with self._lock:
            self._check_usable()
            return sum(e - s for r in self._widened(list(ranges)) for s, e in self._mapped.gaps(*r))

    def chunk_sizes(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The sizes in bytes of the handles a commit of ``ranges`` would
        create now, in order; validates, changes nothing."""
        with self._lock:
            return [size for run in self._plan(ranges, False) for _, size in run]

    def _map_chunks(self, plan: list[list[Span]]) -> list[Chunk]:
        """Create and map every chunk of ``plan``, granting access once per run.

        All or nothing: on error what this call made is undone.
        """
        made: list[Chunk] = []
        with self._context():
            try:
                for run in plan:
                    for offset, size in run:
                        handle = self.driver.create(size, self.device, self.shareable)
                        made.append(self._map_new(offset, size, handle))
                    # One set_access may span adjacent mappings, and it is one
                    # of the costlier driver calls: grant the whole run at once.
                    start, end = run[0][0], run[-1][0] + run[-1][1]
                    self.driver.set_access(self.base_ptr + start, end - start, self.device)
            except BaseException:
                self._unmap_and_release(made)
                raise
        self._add(made)
        return made

    def _map_new(self, offset: int, size: int, handle: int) -> Chunk:
        """Map a handle just made or imported; if that fails, release it."""
        try:
            self.driver.map(self.base_ptr + offset, size, handle)
        except BaseException:
            self.driver.release(handle)
            raise
        return Chunk(offset, size, handle)

    def _unmake(self, chunks: Sequence[Chunk]) -> None:
        """Undo a commit of ``chunks``: forget, unmap and release them."""
        self._remove(chunks)
        self._unmap_and_release(chunks)

    def _unmap_and_release(self, chunks: Sequence[Chunk]) -> None:
        """Undo chunks just made, that no kernel can have used yet."""
        for chunk in reversed(chunks):
            try:
                with self._context():
                    self.driver.unmap(self.base_ptr + chunk.offset, chunk.size)
                    self.driver.release(chunk.handle)
            except Exception:
                logger.exception("rolling back a failed commit leaked %r", chunk)

    def _add(self, chunks: Iterable[Chunk]) -> None:
        for chunk in chunks:
            i = bisect.bisect_left(self._chunk_offsets, chunk.offset)
            self._chunks.insert(i, chunk)
            self._chunk_offsets.insert(i, chunk.offset)
            self._mapped.add(chunk.offset, chunk.end)

    def _remove(self, chunks: Iterable[Chunk]) -> None:
        for chunk in chunks:
            i = bisect.bisect_left(self._chunk_offsets, chunk.offset)
            del self._chunks[i]
            del self._chunk_offsets[i]
            self._mapped.remove(chunk.offset, chunk.end)

    def commit(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Back every byte of ``ranges`` (``(offset, size)`` pairs) with memory.

        Returns the newly mapped runs as ``(offset, size)``; memory mapped
        earlier is untouched. All or nothing: on error nothing changes.
        """
        return commit_together([(self, ranges)])[0]

    # -- release --------------------------------------------------------------

    def release_physical(self) -> int:
        """Unmap and release all physical memory; the address range stays.

        Returns the bytes released. Views stay valid as pointers but must not
        be touched until memory is committed again; contents are discarded.
        A sleep: memory the driver stack keeps idle for reuse goes back too.
        """
        return release_together([self], idle=True)

    def release_outside(self, keep: Iterable[tuple[int, int]]) -> int:
        """Release every chunk holding no byte of ``keep`` (``(offset, size)`` pairs).

        This is how a buffer shrinks: chunks that straddle a kept range stay
        whole (the driver cannot unmap part of a mapping). Returns the bytes
        released.
        """
        return release_outside_together([(self, keep)])

    def _outside(self, keep: Iterable[tuple[int, int]]) -> list[Chunk]:
        """The chunks holding no byte of ``keep``; validates ``keep``."""
        self._check_usable()
        needed = self._widened(list(keep))
        return [c for c in self._chunks if not needed.overlaps(c.offset, c.end)]

    def synchronize(self) -> None:
        """Wait until no work queued on the buffer's device can still touch it."""
        synchronize_buffers([self])

    def defragment(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Map ``ranges`` again with one chunk per run, discarding all contents.

        See :func:`defragment_together`.
        """
        defragment_together([(self, ranges)])

    # -- sharing ----------------------------------------------------------------

    def export_chunks(self) -> list[tuple[Chunk, int]]:
        """Every chunk with a new file descriptor for its memory (the caller
        owns and closes them). Needs a buffer made ``shareable``."""
        return export_chunks(self)

    def map_imported(self, chunks: Sequence[tuple[int, int, int]], *, adopt: bool = False) -> None:
        """Map memory another process exported, ``(offset, size, fd)`` per
        chunk, into unmapped granules; the fds stay the caller's. All or
        nothing. ``adopt``: this process counts it (``Driver.adopt_import``)."""
        map_imported(self, chunks, adopt=adopt)

    # -- remapping with contents kept ------------------------------------------

    def plan_remaps(self, keep: Iterable[tuple[int, int]], *, merge: bool) -> list[Remap]:
        """Which chunks to map again, and how, so that exactly the granules
        covering ``keep`` stay mapped (call :meth:`release_outside` first).

        Each chunk whose granules are not all needed becomes the runs of
        needed granules it holds; with ``merge`` every run of adjacent chunks
        becomes one chunk per run of needed granules (defragmenting).
        """
        return plan_remaps(self, keep, merge=merge)

    def stage(self, remaps: Sequence[Remap]) -> Staging:
        """Make the new chunks of ``remaps`` in one scratch reservation,
        mapped and accessible, for the caller to copy the live bytes into
        (at :attr:`Staging.places`) before
        :func:`~extensible_kv.buffer.swap_in_together`.

        One reservation serves every remap; its chunks sit a granule apart so
        that each stays a chunk of its own. All or nothing: on error nothing
        is left staged. The caller swaps the staging in or discards it.
        """
        return stage(self, remaps)

    def free_quietly(self) -> None:
        """:meth:`free`, logging instead of raising: for clean-up paths, where
        a failure must not hide the error being handled. What could not be
        returned is returned when the buffer is garbage-collected."""
        try:
            self.free()
        except Exception:
            logger.exception("freeing %r failed; it is retried when the buffer is dropped", self)

    def _detach(self, chunks: Sequence[Chunk]) -> None:
        """Unmap ``chunks`` (all or none), keeping their handles to release.
        The caller has synchronized the device (:func:`synchronize_buffers`)."""
        if not chunks:
            return
        done: list[Chunk] = []
        with self._context():
            try:
                for chunk in chunks:
                    self.driver.unmap(self.base_ptr + chunk.offset, chunk.size)
                    done.append(chunk)
            except BaseException:
                self._map_back(done)
                raise
        self._remove(chunks)
        self._leftover_memory.handles.extend(chunk.handle for chunk in chunks)

    def _map_back(self, chunks: Sequence[Chunk]) -> None:
        with self._context():
            for chunk in chunks:
                self.driver.map(self.base_ptr + chunk.offset, chunk.size, chunk.handle)
                self.driver.set_access(self.base_ptr + chunk.offset, chunk.size, self.device)

    def _reattach(self, chunks: Sequence[Chunk]) -> None:
        """Undo :meth:`_detach`: the chunks' memory, contents and all, comes back."""
        self._map_back(chunks)
        self._add(chunks)
        handles = {chunk.handle for chunk in chunks}
        kept = self._leftover_memory.handles
        kept[:] = [handle for handle in kept if handle not in handles]

    def _discard(self, chunks: Sequence[Chunk]) -> None:
        """Release each chunk's handle, then unmap it (its memory goes then).

        Memory whose handle is released needs no room to be kept while
        unmapped, so this works when the address space has run out; but it
        cannot be rolled back: a failure leaves the chunks before it gone,
        and a range whose unmap failed is unmapped by the next call.
        """
        with self._context():
            for chunk in chunks:
                self.driver.release(chunk.handle)
                self._remove([chunk])
                try:
                    self.driver.unmap(self.base_ptr + chunk.offset, chunk.size)
                except BaseException:
                    self._leftover_memory.ranges.append((chunk.offset, chunk.size))
                    raise

    @property
    def _has_leftovers(self) -> bool:
        """True while an earlier failure left something to return."""
        return bool(self._leftover_memory or self._leftovers)

    def _return_leftovers(self) -> None:
        """Return what an earlier failure left (see :class:`LeftoverMemory`),
        and free leftover scratch buffers; a failure keeps the rest for a retry."""
        while self._leftovers:
            self._leftovers[-1].free()
            self._leftovers.pop()
        if self._leftover_memory:
            with self._context():
                self._leftover_memory.return_to(self.driver, self.base_ptr)

    # -- lifetime -------------------------------------------------------------

    def free(self) -> None:
        """Release all physical memory now, and the address range once no view
        is left. Idempotent; a failed free can be called again."""
        with self._lock:
            if not self._reserved:
                return
            with self._context():
                # Kept for reuse below, if the stack keeps memory: a sleep's to free.
                release_together([self])
                self._freed = True
                if self._views == 0:
                    self._free_reservation()

    def _free_reservation(self) -> None:
        # The last view may go in any thread: the context goes with the call.
        with self._context():
            self.driver.free_reserved(self.base_ptr, self.size)
        self._reserved = False
        self._finalizer.detach()

    def add_view_ref(self) -> None:
        """Record a view over the buffer: the range outlives it."""
        with self._lock:
            if self._freed:
                raise ValueError("the buffer has been freed; no view can be made")
            self._views += 1

    def drop_view_ref(self) -> None:
        """Forget a view; the last one of a freed buffer returns the range."""
        with self._lock:
            self._views -= 1
            if self._views == 0 and self._freed and self._reserved:
                try:
                    self._free_reservation()
                except Exception:
                    logger.exception("returning the address range of %r failed", self)
