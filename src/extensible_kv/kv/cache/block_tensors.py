"""A KV cache's tensors held in lockstep by blocks, and the all-or-nothing
operations that change how many blocks they hold.

Every tensor of a :class:`~extensible_kv.kv.KVCacheBuffers` holds the same
number of blocks in each of its segments: :class:`BlockTensors` keeps the
tensors with that count, and grows, remaps, shrinks, releases and restores
them together. It decides nothing about sleep, connectors or threads: the
cache checks what a call may do, under its lock, and then calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from extensible_kv.kv.cache.backup import HostBackup
from extensible_kv.tensor import (
    ExtensibleTensor,
    holding_growth,
    in_one_chunk_per_segment,
    release_physical_all,
    remap_per_segment_all,
    resize_per_segment_all,
    shrink_per_segment_all,
)

__all__ = ["BlockTensors"]


class BlockTensors:
    """A cache's tensors and the blocks they hold, owned by the cache.

    ``members``: ``(tensor, bytes_per_block_per_segment)`` pairs, in order
    (the tensors are the cache's: checked before they join, freed by
    :meth:`free`). ``committed``: blocks every tensor holds in each segment
    (0 while asleep); only the operations below change it.
    """

    def __init__(self) -> None:
        self.members: list[tuple[ExtensibleTensor, int]] = []
        self.committed = 0

    @property
    def physical_bytes(self) -> int:
        """Physical memory held, summed over tensors (whole granules)."""
        return sum(tensor.physical_bytes for tensor, _ in self.members)

    @property
    def device(self) -> torch.device:
        """The tensors' device (the host with no tensor)."""
        return self.members[0][0].device if self.members else torch.device("cpu")

    def append(self, tensor: ExtensibleTensor, bytes_per_block: int) -> None:
        """Take ``tensor`` as it stands, for a cache holding no block yet."""
        self.members.append((tensor, bytes_per_block))

    def join(self, items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
        """Commit ``items`` (checked pairs) to the block count, zeroed, then
        take them in; all or none: if one fails, none joins or keeps memory."""
        resize_per_segment_all(
            [(tensor, self.committed * per_block) for tensor, per_block in items], zero_new=True
        )
        self.members.extend(items)

    def holds(self, num_blocks: int) -> bool:
        """True when every tensor holds exactly ``num_blocks`` blocks in each segment."""
        return all(b.bytes_per_segment == num_blocks * per_block for b, per_block in self.members)

    def holds_exactly(self, num_blocks: int) -> bool:
        """True when a defragmenting commit of ``num_blocks`` has nothing to do."""
        return num_blocks == self.committed and all(
            in_one_chunk_per_segment(tensor) for tensor, _ in self.members
        )

    def grow(self, num_blocks: int, zero_new: bool = True) -> None:
        """Hold ``num_blocks`` blocks (at least the committed count), the new
        ones zeroed unless not ``zero_new``; all or nothing."""
        resize_per_segment_all(self._sizes(num_blocks), zero_new=zero_new)
        self.committed = num_blocks

    def remap(self, num_blocks: int) -> None:
        """Hold exactly ``num_blocks`` blocks, one chunk per segment, zeroed;
        all or nothing."""
        if self.holds_exactly(num_blocks):
            # Already laid out so: no remap, but a defragment still discards.
            for region in self.regions(num_blocks):
                region.zero_()
            return
        self._resize(remap_per_segment_all, num_blocks)

    def shrink(self, num_blocks: int) -> None:
        """Hold the first ``num_blocks`` blocks (at most the committed count)
        and give back the memory past them; all or nothing (see
        :func:`~extensible_kv.tensor.shrink_per_segment_all`)."""
        self._resize(shrink_per_segment_all, num_blocks)

    def _sizes(self, num_blocks: int) -> list[tuple[ExtensibleTensor, int]]:
        """Each tensor with its bytes per segment at ``num_blocks`` blocks."""
        return [(tensor, num_blocks * per_block) for tensor, per_block in self.members]

    def _resize(
        self, operation: Callable[[list[tuple[ExtensibleTensor, int]]], object], num_blocks: int
    ) -> None:
        """Run ``operation`` over every tensor at ``num_blocks`` blocks. The
        count follows the tensors even when it raises: a failure past its
        point of no return leaves them resized."""
        try:
            operation(self._sizes(num_blocks))
        finally:
            if self.holds(num_blocks):
                self.committed = num_blocks

    def release(self) -> None:
        """Give back every tensor's physical memory; the block count is 0
        once they hold none (see :func:`~extensible_kv.tensor.release_physical_all`
        for what a failure leaves)."""
        try:
            release_physical_all([tensor for tensor, _ in self.members])
        finally:
            if self.physical_bytes == 0:
                self.committed = 0

    def restore(self, backup: HostBackup, num_blocks: int, staging_bytes: int) -> None:
        """Commit ``num_blocks`` again, tensor by tensor, and fill each from
        ``backup`` (the caller's) while the next one commits, through a
        pinned ring of ``2 * staging_bytes`` bytes on a GPU; all or nothing.

        If a commit or a copy fails, the tensors committed so far are
        released again: the cache stays asleep with its backup, for a retry.
        The caller holds the memory (:meth:`holding`), tensor by tensor but
        all at once: a wake waiting for room holds none of it, so two
        engines waking together cannot each hold half and wait on the other.
        """
        restorer = backup.restorer(self.regions(num_blocks), staging_bytes=staging_bytes)
        committed: list[ExtensibleTensor] = []
        try:
            try:
                first = 0
                for tensor, per_block in self.members:
                    tensor.resize_per_segment_(num_blocks * per_block)
                    committed.append(tensor)
                    restorer.copy(range(first, first + tensor.num_segments))
                    first += tensor.num_segments
            finally:
                restorer.finish()  # no copy may run into memory released below
        except BaseException:
            release_physical_all(committed)
            raise
        self.committed = num_blocks

    def regions(self, num_blocks: int) -> list[torch.Tensor]:
        """The first ``num_blocks`` blocks of every segment of every tensor,
        as bytes (uint8 views of the tensors' memory, in order)."""
        found = []
        for tensor, per_block in self.members:
            full = tensor.full_view()
            for segment in range(tensor.num_segments):
                start = segment * tensor.segment_capacity_bytes
                found.append(full[start : start + num_blocks * per_block])
        return found

    def holding(self, num_blocks: int) -> AbstractContextManager[object]:
        """Hold at once what committing ``num_blocks`` blocks in every
        tensor will map from here (see
        :func:`~extensible_kv.tensor.holding_growth`)."""
        return holding_growth(
            [(b, max(num_blocks * per_block, b.bytes_per_segment)) for b, per_block in self.members]
        )

    def free(self) -> None:
        """Free every tensor (its memory now, its addresses once its views
        are gone) and forget them: no tensor, no block."""
        for tensor, _ in self.members:
            tensor.free()
        self.members = []
        self.committed = 0
