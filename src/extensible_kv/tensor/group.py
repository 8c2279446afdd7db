"""Operations over several tensors at once, each all or nothing: grow,
commit ranges, release, and remap to a new size discarding the contents;
and the hold of a growth done in steps (:func:`holding_growth`). A
tensor's own methods are these
over one tensor. They are the tensor package's own: they read and set a
tensor's committed size directly, as its methods do, and reach the memory
only through the tensor's :class:`~extensible_kv.buffer.VirtualBuffer`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from extensible_kv._checks import check_int
from extensible_kv.buffer import (
    Chunk,
    Transaction,
    VirtualBuffer,
    commit_together,
    defragment_together,
    hold_locks,
    holding,
    release_together,
)
from extensible_kv.driver import Driver
from extensible_kv.driver.ahead import Kind, create_ahead_in_background

if TYPE_CHECKING:
    from extensible_kv.tensor.core import ExtensibleTensor

__all__ = [
    "commit_ranges_all",
    "holding_growth",
    "in_one_chunk_per_segment",
    "release_physical_all",
    "remap_per_segment_all",
    "create_ahead_all",
    "resize_per_segment_all",
]

Ranges = list[tuple[int, int]]


def grow_plan(
    tensor: ExtensibleTensor, bytes_per_segment: int, zero_new: bool
) -> tuple[Ranges, Ranges]:
    """Validate a grow of ``tensor`` to ``bytes_per_segment``; the ranges
    to commit and the ranges to zero after, as ``(offset, size)``."""
    tensor._check_alive("resize_per_segment_")
    check_int("bytes_per_segment", bytes_per_segment)
    old, capacity = tensor.bytes_per_segment, tensor.segment_capacity_bytes
    if bytes_per_segment < 0:
        raise ValueError(f"bytes_per_segment must be non-negative, got {bytes_per_segment}")
    if bytes_per_segment < old:
        raise ValueError(
            f"ExtensibleTensor is grow-only: cannot resize from {old} to "
            f"{bytes_per_segment} bytes per segment; use shrink_per_segment_ "
            f"to give memory back"
        )
    if bytes_per_segment > capacity:
        raise ValueError(
            f"Requested {bytes_per_segment} bytes per segment exceeds the "
            f"segment capacity {capacity}"
        )
    if bytes_per_segment == old:
        return [], []
    ranges = tensor._segment_ranges(old, bytes_per_segment)
    return ranges, _to_zero(tensor.buffer, ranges) if zero_new else []


def _to_zero(buffer: VirtualBuffer, ranges: Ranges) -> Ranges:
    """The parts of ``ranges`` a commit of them must zero."""
    if buffer.driver.zeroes_new_memory:
        # Fresh memory arrives zeroed: only granules mapped before this
        # commit (shared with a neighbour, kept by a shrink) can hold old bytes.
        return [part for r in ranges for part in buffer.mapped_in(*r)]
    return ranges


def resize_per_segment_all(
    items: Sequence[tuple[ExtensibleTensor, int]], *, zero_new: bool = False
) -> None:
    """Grow several tensors to ``bytes_per_segment`` each, all or nothing.

    Like :meth:`ExtensibleTensor.resize_per_segment_` on each, but if any
    driver call fails no tensor has grown.
    """
    with hold_locks(tensor.buffer for tensor, _ in items):
        plans = [(tensor, n, *grow_plan(tensor, n, zero_new)) for tensor, n in items]
        mapped = commit_together([(tensor.buffer, ranges) for tensor, _, ranges, _ in plans])
        for (tensor, n, ranges, to_zero), runs in zip(plans, mapped, strict=True):
            if ranges:
                tensor._bytes_per_segment = n
            tensor._zero(to_zero)
            tensor._zero_tails(within=runs)


def create_ahead_all(items: Sequence[tuple[ExtensibleTensor, int]]) -> Future[int]:
    """:meth:`ExtensibleTensor.create_ahead` for several tensors, each to
    its ``bytes_per_segment``, on one background thread."""
    return create_ahead_in_background(
        [handle for tensor, n in items for handle in _handles_to_grow(tensor, n)]
    )


def _handles_to_grow(tensor: ExtensibleTensor, bytes_per_segment: int) -> list[tuple[Driver, Kind]]:
    """One ``(driver, kind)`` per handle a growth of ``tensor`` to
    ``bytes_per_segment`` would create now (none if it is not a growth);
    validates, and refuses a stack with no pool to fill."""
    buffer = tensor.buffer
    buffer.driver.create_ahead(buffer.granularity, 0, buffer.device, buffer.shareable)
    tensor._check_alive("create_ahead")
    check_int("bytes_per_segment", bytes_per_segment)
    if 0 <= bytes_per_segment <= tensor.bytes_per_segment:
        return []
    ranges, _ = grow_plan(tensor, bytes_per_segment, False)
    kind = (buffer.device, buffer.shareable)
    return [(buffer.driver, (size, *kind)) for size in buffer.chunk_sizes(ranges)]


def commit_ranges_all(items: Sequence[tuple[ExtensibleTensor, Ranges]]) -> None:
    """Back ``(offset, size)`` byte ranges of several tensors with memory,
    all or nothing: memory anywhere in a tensor's reservation, not only its
    committed prefix (a cache's elastic units). What this maps reads zero;
    bytes mapped before keep their contents. The tensors' committed sizes
    stay; their :attr:`~ExtensibleTensor.physical_bytes` count the new memory."""
    with hold_locks(tensor.buffer for tensor, _ in items):
        for tensor, _ in items:
            tensor._check_alive("commit_ranges_all")
        mapped = commit_together([(tensor.buffer, ranges) for tensor, ranges in items])
        for (tensor, _), runs in zip(items, mapped, strict=True):
            if not tensor.buffer.driver.zeroes_new_memory:
                tensor._zero(runs)


def holding_growth(
    items: Sequence[tuple[ExtensibleTensor, int]],
) -> contextlib.AbstractContextManager[object]:
    """Hold at once what growing each tensor to its ``bytes_per_segment``
    will map, for work that grows them one at a time (a wake restoring
    tensor by tensor): under a limit it is refused, or waits, before any of
    it is made, and holds nothing while it waits; the growths inside draw
    on it. Validates the sizes."""
    with hold_locks(tensor.buffer for tensor, _ in items):
        plans = [(tensor.buffer, grow_plan(tensor, n, False)[0]) for tensor, n in items]
        sizes = [(buffer, buffer.bytes_to_map(ranges), 0) for buffer, ranges in plans]
    return holding([item for item in sizes if item[1]])


def release_physical_all(tensors: Sequence[ExtensibleTensor]) -> None:
    """Release several tensors' memory; if an unmap fails, all are as they were.

    See :func:`~extensible_kv.buffer.release_together` for what a failure
    while releasing handles leaves (a retry finishes it). A tensor's
    committed size follows its memory: 0 once its buffer holds none.
    """
    with hold_locks(tensor.buffer for tensor in tensors):
        for tensor in tensors:
            tensor._check_alive("release_physical")
        try:
            release_together([tensor.buffer for tensor in tensors], idle=True)
        finally:
            for tensor in tensors:
                if tensor.buffer.physical_bytes == 0:
                    tensor._bytes_per_segment = 0


def remap_per_segment_all(items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
    """Discard every tensor's memory and commit each segment's first
    ``bytes_per_segment`` bytes again as one chunk, reading zero.

    The size may be smaller or larger than the committed one: this is a
    discarding defragment to a new size, what a KV connector's final commit
    needs. All or nothing: if the new chunks cannot be made, each tensor
    keeps its committed size on its previous chunk layout, zeroed, and the
    error propagates.
    """
    with hold_locks(tensor.buffer for tensor, _ in items):
        for tensor, bytes_per_segment in items:
            tensor._check_alive("remap_per_segment_all")
            check_int("bytes_per_segment", bytes_per_segment)
            capacity = tensor.segment_capacity_bytes
            if not 0 <= bytes_per_segment <= capacity:
                raise ValueError(
                    f"bytes_per_segment must be 0 to the segment capacity "
                    f"{capacity}, got {bytes_per_segment}"
                )
        remap(items)


def remap(items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
    """Map each tensor again, discarding its contents, as one chunk per
    segment holding its first ``bytes_per_segment`` bytes (validated by the
    caller, who holds the locks); one transaction around the buffers'."""
    tensors = [tensor for tensor, _ in items]
    buffers = [tensor.buffer for tensor in tensors]
    old = [tensor._segment_ranges(0, tensor.bytes_per_segment) for tensor in tensors]
    new = [tensor._segment_ranges(0, size) for tensor, size in items]
    # The new chunks are claimed before the old memory goes, and the old
    # memory's claim stays this remap's until it ends: another process cannot
    # take the room between the release and the creates, so a refusal comes
    # first, with nothing changed, and the old layout can always come back.
    growth = [
        (buffer, _granule_bytes(buffer, ranges) - buffer.physical_bytes, 0)
        for buffer, ranges in zip(buffers, new, strict=True)
    ]
    with holding(growth), Transaction(buffers) as txn:
        txn.undo(_zero_restored, tensors, old, [buffer.chunks for buffer in buffers])
        defragment_together(list(zip(buffers, new, strict=True)))
        txn.commit()
        for (tensor, size), ranges in zip(items, new, strict=True):
            tensor._bytes_per_segment = size
            if not tensor.buffer.driver.zeroes_new_memory:
                tensor._zero(ranges)
                tensor._zero_tails()


def _zero_restored(
    tensors: Sequence[ExtensibleTensor],
    kept: Sequence[Ranges],
    layouts: Sequence[tuple[Chunk, ...]],
) -> None:
    """After a failed remap: where a tensor's old layout came back on new
    memory (a handle pool may give the same handle back, so chunks are told
    apart by identity), its committed bytes read zero; they were to be
    discarded anyway. A tensor left unbacked (the restore failed) is skipped."""
    for tensor, ranges, layout in zip(tensors, kept, layouts, strict=True):
        buffer = tensor.buffer
        now = buffer.chunks
        remapped = len(now) != len(layout) or any(
            a is not b for a, b in zip(now, layout, strict=True)
        )
        backed = all(sum(n for _, n in buffer.mapped_in(*r)) == r[1] for r in ranges)
        if remapped and backed and not buffer.driver.zeroes_new_memory:
            tensor._zero(ranges)
            tensor._zero_tails()


def in_one_chunk_per_segment(tensor: ExtensibleTensor) -> bool:
    """True when each segment's committed prefix is mapped by one chunk of
    exactly its granules (what :func:`remap_per_segment_all` makes)."""
    buffer = tensor.buffer
    chunks = {(c.offset, c.end) for c in buffer.chunks}
    runs = buffer.granules_covering(tensor._segment_ranges(0, tensor.bytes_per_segment))
    return all((start, end) in chunks for start, end in runs) and len(chunks) == len(runs)


def _granule_bytes(buffer: VirtualBuffer, ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of the granules covering ``ranges`` in ``buffer``."""
    return sum(end - start for start, end in buffer.granules_covering(ranges))
