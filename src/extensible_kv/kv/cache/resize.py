"""Growth, trim and defragment of a KV cache: what each may do, given the
connectors' registrations and the sleep cycle, and the work it hands to the
cache's tensors.

:class:`Resizer` does the work of
:meth:`~extensible_kv.kv.KVCacheBuffers.commit`,
:meth:`~extensible_kv.kv.KVCacheBuffers.trim`,
:meth:`~extensible_kv.kv.KVCacheBuffers.clear`,
:meth:`~extensible_kv.kv.KVCacheBuffers.defragment` and
:meth:`~extensible_kv.kv.KVCacheBuffers.add_all`: it refuses what would
change memory a connector registered, wakes a sleeping cache that a commit
needs, and then grows, remaps or shrinks the
:class:`~extensible_kv.kv.cache.block_tensors.BlockTensors`. The cache checks first, under
its lock, that it is alive (and awake, where a call needs it) and that a
block count is within its capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import extensible_kv.kv.cache.members as members
from extensible_kv._checks import check_int
from extensible_kv.kv.cache.backup import DEFAULT_STAGING_BYTES
from extensible_kv.kv.cache.block_tensors import BlockTensors
from extensible_kv.kv.cache.registrations import Registrations
from extensible_kv.kv.cache.sleep_wake import SleepWake
from extensible_kv.tensor import ExtensibleTensor, defragment_all

__all__ = ["Resizer"]


class Resizer:
    """Changes to one cache's blocks, over its parts (all owned by the
    cache): ``blocks``, its tensors; ``cycle``, its sleep and wake;
    ``registrations``, its connectors'. It keeps no state of its own."""

    def __init__(
        self, blocks: BlockTensors, cycle: SleepWake, registrations: Registrations
    ) -> None:
        self._blocks = blocks
        self._cycle = cycle
        self._registrations = registrations

    def commit(self, num_blocks: int, defragment: bool) -> None:
        """Back the first ``num_blocks`` blocks (a count within the capacity),
        or with ``defragment`` hold exactly them, one chunk per segment,
        zeroed; while asleep, wake (see :meth:`KVCacheBuffers.commit
        <extensible_kv.kv.KVCacheBuffers.commit>`). All or nothing."""
        if defragment:
            if not self._blocks.holds_exactly(num_blocks):
                self._registrations.check_unregistered("a defragmenting commit")
        elif num_blocks > self._blocks.committed:
            self._registrations.check_unregistered(f"growing to {num_blocks} blocks")
        if self._cycle.sleep.asleep:
            self._wake_for_commit(num_blocks, defragment)
            return
        if defragment:
            self._blocks.remap(num_blocks)
            self._cycle.settle()
        elif num_blocks > self._blocks.committed:
            self._blocks.grow(num_blocks)

    def _wake_for_commit(self, num_blocks: int, defragment: bool) -> None:
        """A commit while asleep: restore a host copy whole, else commit
        only what was asked and leave the rest to the next wake."""
        sleep = self._cycle.sleep
        assert sleep.asleep_at is not None
        if sleep.backup is None:
            self._cycle.wake_partly(num_blocks, defragment)
            return
        # Restore and growth claim their memory together: a refusal comes
        # before either, and leaves the cache asleep with its copy.
        with self._blocks.holding(max(num_blocks, sleep.asleep_at)):
            self._cycle.wake(keep_host_memory=False, staging_bytes=DEFAULT_STAGING_BYTES)
            self.commit(num_blocks, defragment)

    def trim(self, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` blocks of an awake cache and give
        back the memory past them; all or nothing."""
        self._registrations.check_unregistered("trim()")
        check_int("num_blocks", num_blocks)
        committed = self._blocks.committed
        if not 0 <= num_blocks <= committed:
            raise ValueError(
                f"trim keeps 0 to {committed} blocks (the committed count), "
                f"not {num_blocks}; commit() grows"
            )
        try:
            self._blocks.shrink(num_blocks)
        finally:
            if self._blocks.holds(num_blocks):
                self._cycle.settle()

    def clear(self) -> None:
        """Forget every block, from any state: awake after, with no block,
        no memory and no host copy of a sleep."""
        self._registrations.check_unregistered("clear()")
        if not self._cycle.sleep.asleep:
            self.trim(0)
            return
        self._cycle.clear()

    def defragment(self, preserve: bool) -> None:
        """Map each segment of an awake cache's committed blocks again as one
        chunk, keeping their contents with ``preserve``, zeroing them without."""
        self._registrations.check_unregistered("defragment()")
        if preserve:
            defragment_all([tensor for tensor, _ in self._blocks.members], preserve=True)
        else:
            self.commit(self._blocks.committed, defragment=True)

    def add(
        self, items: Sequence[tuple[ExtensibleTensor, int]], num_blocks_capacity: int
    ) -> list[ExtensibleTensor]:
        """Take ``items``, ``(tensor, bytes_per_block_per_segment)`` pairs,
        into an awake cache of ``num_blocks_capacity`` blocks, each committed
        to the block count, zeroed; all or none. Returns the tensors taken."""
        self._registrations.check_unregistered("add()")
        pairs = members.as_pairs(items)
        members.check_all_joining(pairs, num_blocks_capacity, self._blocks.members)
        self._blocks.join(pairs)
        return [tensor for tensor, _ in pairs]
