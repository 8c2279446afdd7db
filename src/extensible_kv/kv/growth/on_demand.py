"""Physical memory that follows the load: commit KV blocks as an engine
hands their ids out, not all at start.

An engine's scheduler sizes its block pool once and hands out the block
ids never used yet first, lowest first (vLLM's free-block queue does; the
blocks it frees join the queue's far end, so under a steady load the ids
climb until every block has been used once, and the growth with them).
:class:`OnDemandGrowth` keeps
the committed prefix just ahead of the highest id handed out: the engine
reports the ids a step is about to use, before the step's kernels are
queued, and the growth commits, in steps of whole granules, the blocks up
to them. A new block is never touched before that, so nothing reads memory
still being mapped, and nothing is committed inside a captured graph.
"""

from __future__ import annotations

from collections.abc import Iterable

from extensible_kv._checks import check_int, round_up
from extensible_kv.kv.cache.core import KVCacheBuffers


class OnDemandGrowth:
    """Commit a :class:`KVCacheBuffers` up to the block ids in use.

    Args:
        cache: the KV cache (reserved at its capacity); this object
            commits and trims it, the caller still owns it.
        num_blocks: the engine's block count, the highest any id may reach
            (at most the capacity).
        step_blocks: blocks committed at a time; by default a granule's
            worth (:attr:`KVCacheBuffers.blocks_per_granule`), since a commit
            maps whole granules anyway.
    """

    def __init__(
        self, cache: KVCacheBuffers, num_blocks: int, step_blocks: int | None = None
    ) -> None:
        check_int("num_blocks", num_blocks)
        if not 1 <= num_blocks <= cache.num_blocks_capacity:
            raise ValueError(
                f"num_blocks must be 1 to the capacity {cache.num_blocks_capacity}, "
                f"got {num_blocks}"
            )
        step = cache.blocks_per_granule if step_blocks is None else step_blocks
        check_int("step_blocks", step)
        if step < 1:
            raise ValueError(f"step_blocks must be positive, got {step}")
        self.cache = cache
        self.num_blocks = num_blocks
        self.step_blocks = step
        #: The most blocks committed at once so far.
        self.high_water = cache.num_blocks_committed

    @property
    def first_blocks(self) -> int:
        """What is committed before any id is handed out: the first step,
        which holds block 0 (the null block engines pad block tables with)."""
        return min(self.step_blocks, self.num_blocks)

    def _target(self, blocks: int) -> int:
        """``blocks`` rounded up to a whole step, within the engine's count."""
        return min(self.num_blocks, round_up(max(blocks, 1), self.step_blocks))

    def start(self) -> None:
        """Commit the first step (before warm-up)."""
        self.ensure([0])

    def ensure(self, block_ids: Iterable[int]) -> int:
        """Commit every block up to the highest of ``block_ids`` (rounded up
        to a step), before the step using them runs; returns the blocks
        committed. Ids past the engine's count are refused, committing
        nothing. A sleeping cache is woken first (:meth:`wake`)."""
        highest = -1
        for block_id in block_ids:
            check_int("block id", block_id)
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"block id {block_id} is outside the engine's {self.num_blocks} blocks"
                )
            highest = max(highest, block_id)
        if self.cache.asleep:
            self.wake()
        if highest >= self.cache.num_blocks_committed:
            self.cache.commit(self._target(highest + 1))
        self.high_water = max(self.high_water, self.cache.num_blocks_committed)
        return self.cache.num_blocks_committed

    def wake(self) -> None:
        """Wake after a sleep. A discarding one (the engine's prefix cache
        was reset with it) commits only the first step, and memory grows
        again with the load; a preserving one restores every block kept."""
        self.cache.recommit(num_blocks=self.first_blocks)

    def trim(self, keep_blocks: int) -> int:
        """Give back the memory past ``keep_blocks`` blocks (rounded up to a
        step, and at least the first one); returns the blocks kept.

        The caller vouches that no block past them is in use or cached: for
        vLLM, no request running and the prefix cache reset. A freed cache
        raises ValueError, as every call on it does.
        """
        self.cache._check_alive("trim()")
        check_int("keep_blocks", keep_blocks)
        if not 0 <= keep_blocks <= self.num_blocks:
            raise ValueError(f"keep_blocks must be 0 to {self.num_blocks}, got {keep_blocks}")
        keep = max(self._target(keep_blocks), self.first_blocks)
        if keep < self.cache.num_blocks_committed:
            self.cache.trim(keep)
        return self.cache.num_blocks_committed
