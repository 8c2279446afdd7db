"""Operations over several buffers at once, each one :class:`Transaction`:
commit, release, release outside kept ranges, and defragment (the swap of
remapped chunks is in ``remap.py``). A buffer's own methods are these over
one buffer; they are the buffer package's own, reading a buffer's chunk
bookkeeping directly."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from extensible_kv.buffer.chunks import Chunk, Span, runs_of
from extensible_kv.buffer.hold import holding
from extensible_kv.buffer.txn import Transaction, hold_locks
from extensible_kv.driver import OutOfMemoryError

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = [
    "commit_together",
    "defragment_together",
    "release_idle",
    "release_outside_together",
    "release_together",
    "synchronize_buffers",
]

logger = logging.getLogger(__name__)


def commit_together(
    requests: Sequence[tuple[VirtualBuffer, Iterable[tuple[int, int]]]], *, whole_runs: bool = False
) -> list[list[tuple[int, int]]]:
    """Commit ranges in several buffers, all or nothing.

    ``requests`` pairs each buffer with its ``(offset, size)`` ranges. The
    chunks are planned once, under the buffers' locks; that plan is what
    the commit holds from the driver stacks (:func:`holding`: under a
    budget, claimed at once, or refused before anything is made) and what
    it maps. If any driver call fails, every buffer is left as it was.
    Returns, per request, the newly mapped runs as ``(offset, size)``.
    With ``whole_runs`` each run of new granules is one chunk, whatever the
    buffers' ``chunk_bytes``.
    """
    requests = [(buffer, list(ranges)) for buffer, ranges in requests]
    buffers = [buffer for buffer, _ in requests]
    with hold_locks(buffers):
        plans = [buffer._plan(ranges, whole_runs) for buffer, ranges in requests]
        sizes = [(buffer, _bytes(plan), 0) for buffer, plan in zip(buffers, plans, strict=True)]
        with holding([item for item in sizes if item[1]]), Transaction(buffers) as txn:
            work = [(buffer, plan) for buffer, plan in zip(buffers, plans, strict=True) if plan]
            txn.enter_contexts(buffer for buffer, _ in work)
            for buffer, plan in work:
                buffer._return_leftovers()
                txn.undo(buffer._unmake, buffer._map_chunks(plan))
            txn.commit()
    return [[(run[0][0], _bytes([run])) for run in plan] for plan in plans]


def _bytes(plan: Sequence[Sequence[Span]]) -> int:
    """The bytes of the chunks of ``plan`` (runs of ``(offset, size)``)."""
    return sum(size for run in plan for _, size in run)


def release_together(buffers: Sequence[VirtualBuffer], *, idle: bool = False) -> int:
    """Release all physical memory of several buffers; freed buffers are skipped.

    Unmapping is all or nothing across the buffers: if one unmap fails, every
    chunk unmapped so far is mapped back, contents intact. Then the handles
    are released; one whose release fails is kept, and released by the next
    call that changes its buffer. With ``idle`` (a sleep), the memory the
    buffers' driver stacks keep idle for reuse goes back too
    (:meth:`~extensible_kv.driver.Driver.release_idle`), so every byte goes
    back to the driver. Returns the bytes released by the buffers.
    """
    with Transaction(buffers) as txn:
        released = _release_chunks(txn, [(b, list(b._chunks)) for b in buffers if not b._freed])
        if idle:
            release_idle(buffers)
        return released


def release_idle(buffers: Iterable[VirtualBuffer]) -> int:
    """Give back the memory the driver stacks of ``buffers`` keep idle for
    reuse (:meth:`~extensible_kv.driver.Driver.release_idle`), once per
    stack; returns the bytes."""
    drivers = {id(buffer.driver): buffer.driver for buffer in buffers}
    return sum(driver.release_idle() for driver in drivers.values())


def release_outside_together(
    requests: Sequence[tuple[VirtualBuffer, Iterable[tuple[int, int]]]],
    *,
    synchronized: bool = False,
) -> int:
    """:meth:`VirtualBuffer.release_outside` on several buffers, unmapping
    all or nothing across them. With ``synchronized`` the caller has just
    synchronized their devices (:func:`synchronize_buffers`). Returns the
    bytes released."""
    with Transaction(buffer for buffer, _ in requests) as txn:
        doomed = [(buffer, buffer._outside(keep)) for buffer, keep in requests]
        return _release_chunks(txn, doomed, synchronized=synchronized)


def synchronize_buffers(buffers: Iterable[VirtualBuffer]) -> None:
    """Wait until no work queued on the devices of ``buffers`` can still
    touch them: for the whole device, or for the streams the buffers name
    (:attr:`VirtualBuffer.wait_streams`), once per device.

    Unmapping does not wait for kernels still reading the memory, and a copy
    issued on one stream is not ordered after writers on others: this is
    the wait both need. One wait per device covers every buffer on it (a
    cache has one per layer). A device where any buffer names no streams is
    synchronized whole.
    """
    waits: dict[tuple[int, int], tuple[VirtualBuffer, set[int] | None]] = {}
    for buffer in buffers:
        key = (id(buffer.driver), buffer.device)
        _, streams = waits.get(key, (buffer, set()))
        if streams is not None and buffer.wait_streams is not None:
            streams = streams | set(buffer.wait_streams)
        else:
            streams = None
        waits[key] = (buffer, streams)
    for buffer, streams in waits.values():
        if streams is None:
            buffer.driver.synchronize(buffer.device)
        else:
            buffer.driver.synchronize_streams(buffer.device, sorted(streams))


def _release_chunks(
    txn: Transaction,
    requests: Sequence[tuple[VirtualBuffer, Sequence[Chunk]]],
    *,
    synchronized: bool = False,
) -> int:
    """Unmap ``requests``' chunks, all or nothing, then release their
    handles: the work of ``txn``, the caller's transaction over the
    buffers, which this commits (it has changed nothing before)."""
    if not synchronized:
        synchronize_buffers(buffer for buffer, chunks in requests if chunks)
    touched = [buffer for buffer, chunks in requests if chunks or buffer._has_leftovers]
    txn.enter_contexts(touched)
    try:
        for buffer, chunks in requests:
            buffer._detach(chunks)
            txn.undo(buffer._reattach, chunks)
    except OutOfMemoryError:
        # Unmapping keeps the memory for a rollback, and on the host that
        # needs address space as big as the chunk: when it has run out
        # (RLIMIT_AS), give up the rollback rather than the memory.
        txn.rollback()
        for buffer, chunks in requests:
            buffer._discard(chunks)
    for buffer in touched:
        txn.after(buffer._return_leftovers)
    txn.commit()
    return sum(chunk.size for _, chunks in requests for chunk in chunks)


def defragment_together(
    requests: Sequence[tuple[VirtualBuffer, Iterable[tuple[int, int]]]],
) -> None:
    """Map each buffer's ranges again as one chunk per run, discarding contents.

    Memory is released before the new chunks are made, so the peak is not
    twice the cache. If making them fails, each buffer gets its previous
    chunk layout back (zeroed: its contents were to be discarded anyway) and
    the error propagates; a handle that cannot be released is kept for a
    later call, the defragment done, and the error propagates. Memory that
    connectors register must be
    defragmented: UCX cannot transfer a region spanning several handles.
    """
    requests = [(buffer, list(ranges)) for buffer, ranges in requests]
    buffers = [buffer for buffer, _ in requests]
    with Transaction(buffers) as txn:
        txn.enter_contexts(buffers)
        for buffer, ranges in requests:
            buffer._plan(ranges, True)
        layouts = [runs_of(buffer._chunks) for buffer in buffers]
        # A handle whose release fails is kept for a retry and its failure
        # raised at the end (the release is a transaction nested in this
        # one): the memory is unmapped, so the defragment goes on.
        release_together(buffers)
        txn.undo(_restore, buffers, layouts)
        commit_together(requests, whole_runs=True)
        txn.commit()


def _restore(buffers: Sequence[VirtualBuffer], layouts: Sequence[list[list[Span]]]) -> None:
    """Map each buffer's previous chunk layout again, after a failed defragment."""
    for buffer, layout in zip(buffers, layouts, strict=False):
        try:
            buffer._map_chunks(layout)
        except Exception:
            logger.exception("restoring %r after a failed defragment failed", buffer)
