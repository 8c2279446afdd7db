"""Mapping tensors again with their contents kept: a shrink (the chunks
straddling a new end mapped again smaller) and a preserving defragment (each
run of chunks as one). New chunks are staged at a scratch reservation, the
live bytes copied into them by the device, then swapped in under the same
addresses (:func:`~extensible_kv.buffer.swap_in_together`). The tensor
package's own, as ``group.py`` is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from extensible_kv._checks import check_int
from extensible_kv.buffer import (
    Remap,
    Staging,
    Transaction,
    hold_locks,
    holding,
    release_outside_together,
    swap_in_together,
    synchronize_buffers,
)
from extensible_kv.dlpack import as_tensor
from extensible_kv.tensor.group import remap

if TYPE_CHECKING:
    from extensible_kv.tensor.core import ExtensibleTensor

__all__ = ["defragment_all", "shrink_per_segment_all"]

Plan = tuple["ExtensibleTensor", list[Remap]]


def shrink_per_segment_all(items: Sequence[tuple[ExtensibleTensor, int]]) -> int:
    """Cut several tensors, each to its ``bytes_per_segment``, and give back
    the physical memory past the new ends. Returns the bytes given back.

    All or nothing up to a point of no return, then done:

    1. one synchronize of their devices, so that work queued on any stream,
       not only the caller's, is done before anything is copied or unmapped;
    2. the chunks straddling a new end are staged smaller and their live
       bytes copied (this needs memory for the kept part of each such
       chunk: with ``chunk_bytes`` set, at most a chunk per segment);
    3. the staged chunks are swapped in and the chunks past the ends
       unmapped, all or nothing across the tensors;
    4. the point of no return: the prefixes are cut and the old handles
       released. A failure from here on (releasing a handle, returning a
       scratch reservation) leaves the shrink done, keeps what could not
       be returned for the next call to return, and propagates.

    A failure before it (out of memory while staging, a failing map or
    unmap) leaves every tensor as it was.
    """
    buffers = [tensor.buffer for tensor, _ in items]
    # The transaction logs no undo of its own (staging and swapping undo
    # theirs); it collects what fails past the swap's point of no return,
    # to raise once the prefixes are cut.
    with Transaction(buffers) as txn:
        for tensor, bytes_per_segment in items:
            _check_shrink(tensor, bytes_per_segment)
        before = sum(buffer.physical_bytes for buffer in buffers)
        synchronize_buffers(buffers)
        doomed, plans = [], []
        for tensor, n in items:
            remaps = tensor.buffer.plan_remaps(tensor._segment_ranges(0, n), merge=False)
            doomed.append((tensor.buffer, [c for r in remaps if not r.runs for c in r.old]))
            plans.append((tensor, [r for r in remaps if r.runs]))
        # The copies of the chunks cut through replace them: they are
        # claimed as credit, so a cache can trim under a full or lowered limit.
        copies = [(t.buffer, 0, sum(n for r in rs for _, n in r.runs)) for t, rs in plans]
        with holding(copies):
            stagings = _stage_all(plans)
            swap_in_together([(t.buffer, staging) for t, staging in stagings], doomed=doomed)
            txn.commit()
        for tensor, bytes_per_segment in items:
            tensor._bytes_per_segment = bytes_per_segment
            tensor._zero_tails()  # past the prefixes, the kept granules' old bytes go
        return before - sum(buffer.physical_bytes for buffer in buffers)


def _check_shrink(tensor: ExtensibleTensor, bytes_per_segment: int) -> None:
    tensor._check_alive("shrink_per_segment_")
    check_int("bytes_per_segment", bytes_per_segment)
    old = tensor.bytes_per_segment
    if bytes_per_segment < 0:
        raise ValueError(f"bytes_per_segment must be non-negative, got {bytes_per_segment}")
    if bytes_per_segment > old:
        raise ValueError(
            f"shrink_per_segment_ cannot grow from {old} to {bytes_per_segment} "
            f"bytes per segment; use resize_per_segment_"
        )


def _stage_all(plans: Sequence[Plan]) -> list[tuple[ExtensibleTensor, Staging]]:
    """Stage every plan's new chunks and copy the live bytes into them, then
    synchronize once (the copies are done). All or nothing: if staging
    fails (out of memory), nothing is left staged."""
    staged: list[tuple[ExtensibleTensor, Staging]] = []
    with Transaction(()) as txn:
        for tensor, remaps in plans:
            if remaps:
                staging = tensor.buffer.stage(remaps)
                txn.undo(staging.discard)
                staged.append((tensor, staging))
                _fill(tensor, staging)
        synchronize_buffers(tensor.buffer for tensor, _ in staged)
        txn.commit()
    return staged


def _fill(tensor: ExtensibleTensor, staging: Staging) -> None:
    """Copy the live bytes of the chunks being replaced into ``staging``
    (device copies on the current stream)."""
    for offset, size, at in staging.places:
        as_tensor(staging.scratch, at, size).copy_(as_tensor(tensor.buffer, offset, size))


def _remap_all(
    items: Sequence[tuple[ExtensibleTensor, list[tuple[int, int]]]], *, merge: bool, headroom: int
) -> None:
    """Map again, contents kept, each tensor's chunks holding granules its
    kept ranges do not need (with ``merge``: every run of chunks, as one
    chunk per run of kept granules).

    The new chunks of a tensor are made at a scratch reservation and filled
    by device copies; a batch of tensors is then synchronized once and
    swapped in under the same addresses. A batch stages at most ``headroom``
    bytes (what was just released) or one tensor's worth, so memory never
    peaks above what the tensors held before plus one tensor's new chunks.
    Each batch is all or nothing (:func:`swap_in_together`): a failure
    leaves it, and the batches after it, as they were; contents are intact
    either way.
    """
    plans = [(tensor, tensor.buffer.plan_remaps(keep, merge=merge)) for tensor, keep in items]
    for batch in _batches([(t, remaps) for t, remaps in plans if remaps], headroom):
        stagings = _stage_all(batch)
        swap_in_together([(tensor.buffer, staging) for tensor, staging in stagings])


def _batches(plans: list[Plan], headroom: int) -> list[list[Plan]]:
    """``plans`` in order, grouped so that a group's new bytes stay within
    ``headroom`` or the largest plan's, whichever is more."""
    sizes = [sum(n for remap in remaps for _, n in remap.runs) for _, remaps in plans]
    most = max([headroom, *sizes])  # bytes a batch may stage
    batches: list[list[Plan]] = []
    total = 0
    for plan, size in zip(plans, sizes, strict=True):
        if not batches or total + size > most:
            batches.append([])
            total = 0
        batches[-1].append(plan)
        total += size
    return batches


def defragment_all(tensors: Sequence[ExtensibleTensor], *, preserve: bool = False) -> None:
    """:meth:`ExtensibleTensor.defragment_` on several tensors.

    Discarding: all or nothing; if the new chunks cannot be made, each tensor
    keeps its committed size on its previous chunk layout, zeroed, and the
    error propagates. Preserving: contents are kept whatever fails; tensors
    are remapped in batches (see :func:`_remap_all`), and if making the new
    chunks fails (out of memory) the tensors of that batch are as they were.
    """
    with hold_locks(tensor.buffer for tensor in tensors):
        for tensor in tensors:
            tensor._check_alive("defragment_")
        if not preserve:
            remap([(tensor, tensor.bytes_per_segment) for tensor in tensors])
            return
        prefixes = [tensor._segment_ranges(0, tensor.bytes_per_segment) for tensor in tensors]
        buffers = [tensor.buffer for tensor in tensors]
        synchronize_buffers(buffers)
        # The release and each batch's swap are transactions of their own,
        # nested in this one: a handle whose release fails past their point
        # of no return is kept for a retry and its failure raised once every
        # batch is done, so one tensor's failure does not leave the rest undone.
        # What the release gives back stays this defragment's for its new chunks.
        with Transaction(buffers) as txn, holding([(buffer, 0, 0) for buffer in buffers]):
            released = release_outside_together(
                list(zip(buffers, prefixes, strict=True)), synchronized=True
            )
            _remap_all(list(zip(tensors, prefixes, strict=True)), merge=True, headroom=released)
            txn.commit()
