"""The block pool's free queue in our scheduler (``growth: "elastic"``):
how vLLM's blocks are handed out so that memory can follow the load down.

:class:`PackedFreeQueue` stands in for vLLM's ``FreeKVCacheBlockQueue``
(``pool.free_block_queue``, the calls the block pool makes):

- **Lowest id first.** Free blocks without a prefix hash go out lowest id
  first, so use packs into the low units and the high ones empty.
- **Only blocks of committed units** are free as vLLM sees them. A block of
  a unit no worker has confirmed is kept out of the queue, so vLLM never
  hands it out: when the load needs more, the scheduler orders units ahead
  (what waiting and running requests need), and their blocks join the queue
  once the workers report them committed. What a device budget refuses is
  then simply blocks vLLM does not have: it queues or preempts as it does
  with a full pool, and no step fails on a refused commit.
- **The prefix cache within ``cache_bytes``.** Blocks no request holds
  that keep a prefix hash stay, least recently used first out, up to
  ``cache_bytes`` of them; past it the oldest lose their hash (vLLM's own
  ``evict_blocks``). A unit whose every block is free and uncached is given
  back while the free blocks of committed units cover what the requests
  need.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any

from extensible_kv.integrations.vllm.scheduler.unit_index import UnitIndex

_USED, _CLEAN, _CACHED, _HIDDEN = 0, 1, 2, 3


class PackedFreeQueue:
    """vLLM's free-block queue with the order and the hiding above.

    It offers what vLLM's ``BlockPool`` calls on its
    ``FreeKVCacheBlockQueue`` (``popleft``, ``popleft_n``, ``remove``,
    ``append``, ``append_n``, ``prepend_n``, ``get_all_free_blocks``,
    ``num_free_blocks``), in O(log n) per block: free blocks without a hash
    in a heap by id, the rest (cached blocks, and blocks vLLM appends as last
    resort) in least-recently-used order. Blocks of hidden units are in
    neither, and not counted free.

    Args:
        blocks: every block of the pool, by id (vLLM's ``KVCacheBlock``).
        free: the blocks free now (all hidden at first but unit 0's).
        blocks_per_unit: blocks per unit.
    """

    def __init__(self, blocks: list[Any], free: list[Any], blocks_per_unit: int) -> None:
        self._blocks = blocks
        self.blocks_per_unit = blocks_per_unit
        self.num_units = -(-len(blocks) // blocks_per_unit)
        self._state = bytearray(len(blocks))  # every block _USED
        self._heap: list[int] = []
        self._lru: dict[int, None] = {}
        self._clean = 0
        #: When each cached block entered the cache (a count of entries).
        self._tick = 0
        self._cached_at = array("q", bytes(8 * len(blocks)))
        #: Per unit: its free and cached blocks, and the orders the plan reads.
        per, count = blocks_per_unit, len(blocks)
        sizes = [min(per, count - unit * per) for unit in range(self.num_units)]
        self.units = UnitIndex(sizes, self._newest_cached)
        self.clean_in = self.units.clean_in
        self.cached_in = self.units.cached_in
        #: Whether cached blocks count as free (vLLM then evicts the least
        #: recently used for a new block, as with a full pool); the plan
        #: lends them only when no more memory can be committed.
        self.lend_cached = True
        #: Set by every change; the scheduler clears it when it plans.
        self.changed = True
        #: Units a block of which a request gave back since the scheduler
        #: last looked (:meth:`take_freed`): a batch still running may use it.
        self._freed: list[int] = []
        for block in free:
            self._state[block.block_id] = _HIDDEN
        self.reveal(0, 1)

    # -- what vLLM's block pool calls -----------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._clean + (len(self._lru) if self.lend_cached else 0)

    def popleft(self) -> Any:
        while self._heap:
            block_id = heapq.heappop(self._heap)
            if self._state[block_id] == _CLEAN:
                self._take(block_id)
                return self._blocks[block_id]
        if self._lru and self.lend_cached:
            block_id = next(iter(self._lru))
            self._take(block_id)
            return self._blocks[block_id]
        raise ValueError("No free block available")

    def popleft_n(self, n: int) -> list[Any]:
        if n > self.num_free_blocks:
            raise ValueError(f"{n} free blocks asked for, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: Any) -> None:
        self._take(block.block_id)

    def append(self, block: Any) -> None:
        self._to_cached(block.block_id)
        self._freed.append(block.block_id // self.blocks_per_unit)

    def append_n(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._to_cached(block.block_id)
            self._freed.append(block.block_id // self.blocks_per_unit)

    def prepend_n(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._to_clean(block.block_id)
            self._freed.append(block.block_id // self.blocks_per_unit)

    def get_all_free_blocks(self) -> list[Any]:
        clean = sorted(i for i in set(self._heap) if self._state[i] == _CLEAN)
        return [self._blocks[i] for i in (*clean, *(self._lru if self.lend_cached else ()))]

    # -- transitions -----------------------------------------------------------

    def _take(self, block_id: int) -> None:
        """A free block goes to use (handed out, or hit in the prefix cache)."""
        state, unit = self._state[block_id], block_id // self.blocks_per_unit
        if state == _CLEAN:
            self._clean -= 1
            self._state[block_id] = _USED
            self.units.change(unit, clean=-1)
        elif state == _CACHED:
            del self._lru[block_id]
            self._state[block_id] = _USED
            self.units.change(unit, cached=-1, left=self._cached_at[block_id])
        else:
            raise AssertionError(f"block {block_id} is not free")
        self.changed = True

    def _to_clean(self, block_id: int) -> None:
        unit, state = block_id // self.blocks_per_unit, self._state[block_id]
        self._state[block_id] = _CLEAN
        if state == _CACHED:
            del self._lru[block_id]
            self.units.change(unit, clean=1, cached=-1, left=self._cached_at[block_id])
        else:
            self.units.change(unit, clean=1)
        self._clean += 1
        self._push_clean(block_id)
        self.changed = True

    def _push_clean(self, block_id: int) -> None:
        heapq.heappush(self._heap, block_id)
        if len(self._heap) > 4 * self._clean + 1024:
            self._heap = [i for i in set(self._heap) if self._state[i] == _CLEAN]
            heapq.heapify(self._heap)

    def _to_cached(self, block_id: int) -> None:
        unit, state = block_id // self.blocks_per_unit, self._state[block_id]
        self._state[block_id] = _CACHED
        self._tick += 1
        self._cached_at[block_id] = self._tick
        if state == _CLEAN:
            self._clean -= 1
            self.units.change(unit, clean=-1, cached=1, tick=self._tick)
        elif state == _CACHED:  # appended again: the newest now
            del self._lru[block_id]
            self.units.change(unit, tick=self._tick)
        else:
            self.units.change(unit, cached=1, tick=self._tick)
        self._lru[block_id] = None
        self.changed = True

    def _newest_cached(self, unit: int) -> int:
        """The tick of ``unit``'s newest cached block (it has one)."""
        return max(self._cached_at[i] for i in self.unit_blocks(unit) if self._state[i] == _CACHED)

    # -- what the scheduler calls ------------------------------------------------

    def take_freed(self) -> list[int]:
        """The units of the blocks requests gave back since the last call
        (a unit once per block)."""
        freed, self._freed = self._freed, []
        return freed

    @property
    def num_cached(self) -> int:
        """Free blocks in least-recently-used order (cached ones)."""
        return len(self._lru)

    @property
    def num_clean(self) -> int:
        """Free blocks of committed units without a hash."""
        return self._clean

    def cached_oldest_first(self) -> list[int]:
        """The cached blocks' ids, least recently used first."""
        return list(self._lru)

    def cached_of(self, unit: int) -> list[int]:
        """The cached blocks of ``unit``."""
        return [i for i in self.unit_blocks(unit) if self._state[i] == _CACHED]

    def holds_no_request(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free (cached or not)."""
        return self.units.holds_no_request(unit)

    def forget(self, unit: int, block_ids: list[int]) -> None:
        """Cached blocks of ``unit`` lost their hash: they are free and
        clean now (one change of the unit, however many)."""
        for block_id in block_ids:
            del self._lru[block_id]
            self._state[block_id] = _CLEAN
            self._push_clean(block_id)
        count = len(block_ids)
        self._clean += count
        self.units.change(unit, clean=count, cached=-count, left=self.units.newest(unit))
        self.changed = True

    def forget_all(self) -> None:
        """Every cached block lost its hash (the prefix cache was reset)."""
        by_unit: dict[int, list[int]] = {}
        for block_id in self._lru:
            by_unit.setdefault(block_id // self.blocks_per_unit, []).append(block_id)
        for unit, block_ids in by_unit.items():
            self.forget(unit, block_ids)

    def unit_blocks(self, unit: int) -> range:
        per = self.blocks_per_unit
        return range(unit * per, min((unit + 1) * per, len(self._blocks)))

    def is_empty(self, unit: int) -> bool:
        """Whether every block of ``unit`` is free without a hash."""
        return self.units.is_empty(unit)

    def _blocks_of(self, start: int, end: int) -> tuple[int, int]:
        """The block ids ``[first, last)`` of units ``[start, end)``."""
        per = self.blocks_per_unit
        return start * per, min(end * per, len(self._blocks))

    def hide(self, start: int, end: int) -> None:
        """Take empty units ``[start, end)`` out of circulation (their
        blocks are all free without a hash: one slice, not a block at a time)."""
        first, last = self._blocks_of(start, end)
        state = self._state
        if state.count(_CLEAN, first, last) != last - first:
            raise AssertionError(f"units [{start}, {end}) are not empty")
        state[first:last] = bytes([_HIDDEN]) * (last - first)
        self._clean -= last - first
        self.units.circulating(start, end, empty=False)
        self.changed = True

    def reveal(self, start: int, end: int) -> None:
        """Put hidden units ``[start, end)``'s blocks into circulation."""
        first, last = self._blocks_of(start, end)
        state = self._state
        if state.count(_HIDDEN, first, last) != last - first:  # unit 0: the null block
            for block_id in range(first, last):
                if state[block_id] == _HIDDEN:
                    self._to_clean(block_id)
            return
        state[first:last] = bytes([_CLEAN]) * (last - first)
        self._clean += last - first
        if 4 * (last - first) > len(self._heap):
            self._heap.extend(range(first, last))
            heapq.heapify(self._heap)
        else:
            for block_id in range(first, last):
                heapq.heappush(self._heap, block_id)
        self.units.circulating(start, end, empty=True)
        self.changed = True
