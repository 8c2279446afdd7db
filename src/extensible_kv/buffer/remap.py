"""Mapping a buffer's chunks again with their contents kept: which chunks to
replace and by what (:func:`plan_remaps`), the new chunks made at a scratch
reservation of their own (:func:`stage`), and the swap that moves them
under the old addresses (:func:`swap_in_together`), all or nothing.

The live bytes are copied by the caller between staging and swapping (the
buffer layer has no torch). These functions are the buffer package's own:
they read a buffer's chunk bookkeeping directly, as its methods do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from extensible_kv.buffer.chunks import Chunk, Remap, Staging, runs_of_chunks
from extensible_kv.buffer.group import commit_together
from extensible_kv.buffer.txn import Transaction

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = ["plan_remaps", "stage", "swap_in_together"]

#: A chunk swapped in, as it sits in the buffer and as it sat in the scratch buffer.
Moved = tuple[Chunk, Chunk]


def plan_remaps(
    buffer: VirtualBuffer, keep: Iterable[tuple[int, int]], *, merge: bool
) -> list[Remap]:
    """See :meth:`VirtualBuffer.plan_remaps`."""
    with buffer._lock:
        buffer._check_usable()
        needed = buffer._widened(list(keep))
        chunks = buffer._chunks
        groups = runs_of_chunks(chunks) if merge else [[c] for c in chunks]
        plans = []
        for group in groups:
            start, end = group[0].offset, group[-1].end
            runs = [(lo, hi - lo) for lo, hi in needed.overlaps(start, end)]
            if runs != [(c.offset, c.size) for c in group]:
                plans.append(Remap(tuple(group), start, end, tuple(runs)))
        return plans


def stage(buffer: VirtualBuffer, remaps: Sequence[Remap]) -> Staging:
    """See :meth:`VirtualBuffer.stage`."""
    runs = [run for remap in remaps for run in remap.runs]
    places, cursor = [], 0
    for offset, size in runs:
        places.append((offset, size, cursor))
        cursor += size + buffer.granularity
    scratch = type(buffer)(cursor, buffer.driver, buffer.device, shareable=buffer.shareable)
    try:
        commit_together([(scratch, [(at, size) for _, size, at in places])], whole_runs=True)
    except BaseException:
        scratch.free_quietly()
        raise
    return Staging(scratch, tuple(remaps), tuple(places))


def swap_in_together(
    requests: Sequence[tuple[VirtualBuffer, Staging]],
    *,
    doomed: Sequence[tuple[VirtualBuffer, Sequence[Chunk]]] = (),
) -> None:
    """Replace old chunks by staged ones in several buffers, and unmap the
    ``doomed`` chunks, all or nothing across them; then release the old
    and doomed handles and free the scratch reservations.

    The memory moves with its contents (nothing is copied here). The caller
    has synchronized the devices since filling the staged chunks
    (:func:`~extensible_kv.buffer.synchronize_buffers`): unmapping does not
    wait for kernels. If a swap or an unmap fails, every buffer is as it
    was and the stagings are discarded. Past that point the operation is
    done: a handle or a scratch reservation that cannot be returned is kept
    for a later call, and the first such error propagates.
    """
    buffers = [b for b, _ in requests] + [b for b, chunks in doomed if chunks or b._has_leftovers]
    scratches = [staging.scratch for _, staging in requests]
    with Transaction([*buffers, *scratches]) as txn:
        txn.enter_contexts([*buffers, *scratches])
        for buffer in buffers:
            buffer._check_usable()
        txn.undo(_discard, [staging for _, staging in requests])
        for buffer, staging in requests:
            txn.undo(_unswap, buffer, staging, _swap(buffer, staging))
        for buffer, chunks in doomed:
            buffer._detach(chunks)
            txn.undo(buffer._reattach, chunks)
        for buffer in buffers:
            txn.after(buffer._return_leftovers)
        for buffer, staging in requests:
            txn.after(_free_scratch, buffer, staging.scratch)
        txn.commit()


def _swap(buffer: VirtualBuffer, staging: Staging) -> list[Moved]:
    """Unmap the old chunks (keeping their handles) and move the staged
    ones to their addresses; all or nothing. Returns each moved chunk
    here and as it was in the scratch buffer, for :func:`_unswap`."""
    scratch, driver = staging.scratch, buffer.driver
    old = [chunk for remap in staging.remaps for chunk in remap.old]
    at = {chunk.offset: chunk for chunk in scratch._chunks}
    moving = [(at[offset], target) for target, _, offset in staging.places]
    buffer._detach(old)
    moved: list[Moved] = []
    try:
        for chunk, target in moving:
            scratch.driver.unmap(scratch.base_ptr + chunk.offset, chunk.size)
            here = Chunk(target, chunk.size, chunk.handle)
            try:
                driver.map(buffer.base_ptr + here.offset, here.size, here.handle)
            except BaseException:
                scratch._map_back([chunk])
                raise
            moved.append((here, chunk))
        for here, _ in moved:
            driver.set_access(buffer.base_ptr + here.offset, here.size, buffer.device)
    except BaseException:
        _move_back(buffer, scratch, moved)
        buffer._reattach(old)
        raise
    scratch._remove(chunk for chunk, _ in moving)
    buffer._add(here for here, _ in moved)
    return moved


def _unswap(buffer: VirtualBuffer, staging: Staging, moved: list[Moved]) -> None:
    """Undo :func:`_swap`: staged chunks back to the scratch buffer, the
    old ones mapped again with their contents."""
    buffer._remove(here for here, _ in moved)
    staging.scratch._add(chunk for _, chunk in moved)
    _move_back(buffer, staging.scratch, moved)
    buffer._reattach([chunk for remap in staging.remaps for chunk in remap.old])


def _move_back(buffer: VirtualBuffer, scratch: VirtualBuffer, moved: list[Moved]) -> None:
    for here, chunk in moved:
        buffer.driver.unmap(buffer.base_ptr + here.offset, here.size)
        scratch._map_back([chunk])


def _discard(stagings: Sequence[Staging]) -> None:
    for staging in stagings:
        staging.discard()


def _free_scratch(buffer: VirtualBuffer, scratch: VirtualBuffer) -> None:
    """Free a swap's scratch reservation; if that fails, ``buffer`` keeps it
    as a leftover for its next call to free, and the failure propagates."""
    try:
        scratch.free()
    except BaseException:
        buffer._leftovers.append(scratch)
        raise
