"""KVCacheBuffers: every KV cache tensor of an engine, committed in lockstep by blocks."""

from __future__ import annotations

from collections.abc import Sequence

from extensible_kv._checks import check_int
from extensible_kv.tensor import (
    ExtensibleTensor,
    defragment_all,
    release_physical_all,
    resize_per_segment_all,
)


class KVCacheBuffers:
    """The physical backing of a KV cache: one :class:`ExtensibleTensor` per
    cache tensor, each holding ``num_blocks`` blocks of
    ``bytes_per_block_per_segment`` bytes in every segment.

    Every operation is all or nothing across the buffers: if buffer 7 of 40
    cannot commit, buffers 0 to 6 are rolled back too. Base pointers, views
    and captured CUDA graphs stay valid through commit, release and recommit.

    Args:
        buffers: ``(ExtensibleTensor, bytes_per_block_per_segment)`` pairs
            (vLLM's signature); the KV cache owns the tensors from now on.
        num_blocks_capacity: blocks every buffer has address space for.
    """

    def __init__(
        self, buffers: Sequence[tuple[ExtensibleTensor, int]], num_blocks_capacity: int
    ) -> None:
        check_int("num_blocks_capacity", num_blocks_capacity)
        if num_blocks_capacity < 1:
            raise ValueError(f"num_blocks_capacity must be positive, got {num_blocks_capacity}")
        self.num_blocks_capacity = num_blocks_capacity
        self.buffers: list[tuple[ExtensibleTensor, int]] = []
        self._committed = 0
        self._asleep_at: int | None = None
        for buffer, bytes_per_block in buffers:
            self._check_buffer(buffer, bytes_per_block)
            self.buffers.append((buffer, bytes_per_block))

    def __repr__(self) -> str:
        state = f"released from {self._asleep_at}" if self.released else "awake"
        return (
            f"KVCacheBuffers({len(self.buffers)} buffers, {self._committed}/"
            f"{self.num_blocks_capacity} blocks, {self.physical_bytes} physical bytes, {state})"
        )

    def _check_buffer(self, buffer: ExtensibleTensor, bytes_per_block: int) -> None:
        check_int("bytes_per_block_per_segment", bytes_per_block)
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block_per_segment must be positive, got {bytes_per_block}")
        needed = self.num_blocks_capacity * bytes_per_block
        if needed > buffer.segment_capacity_bytes:
            raise ValueError(
                f"{self.num_blocks_capacity} blocks of {bytes_per_block} bytes per segment "
                f"({needed} bytes) exceed the segment capacity "
                f"{buffer.segment_capacity_bytes} of {buffer!r}"
            )

    # -- state ------------------------------------------------------------------

    @property
    def num_blocks_committed(self) -> int:
        """Blocks backed by physical memory now (0 while released)."""
        return self._committed

    @property
    def released(self) -> bool:
        """True between :meth:`release_physical` and :meth:`recommit`."""
        return self._asleep_at is not None

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all buffers and segments (before
        rounding to granules): what sizing divides the budget by."""
        return sum(buffer.num_segments * per_block for buffer, per_block in self.buffers)

    @property
    def physical_bytes(self) -> int:
        """Physical memory held, summed over buffers (whole granules)."""
        return sum(buffer.physical_bytes for buffer, _ in self.buffers)

    def _check_awake(self, what: str) -> None:
        if self.released:
            raise ValueError(f"the KV cache is released (asleep); call recommit() before {what}")

    # -- growth -----------------------------------------------------------------

    def add(self, buffer: ExtensibleTensor, bytes_per_block_per_segment: int) -> None:
        """Take one more buffer (e.g. a draft model's KV) into the lockstep;
        it is committed to the current block count, zeroed."""
        self._check_awake("add()")
        self._check_buffer(buffer, bytes_per_block_per_segment)
        buffer.resize_per_segment_(self._committed * bytes_per_block_per_segment, zero_new=True)
        self.buffers.append((buffer, bytes_per_block_per_segment))

    def commit(self, num_blocks: int, defragment: bool = False) -> None:
        """Back the first ``num_blocks`` blocks of every buffer; new blocks read zero.

        A count at or below the committed one changes nothing, unless
        ``defragment``: then each segment's committed prefix is mapped again
        as one physical chunk, and its contents are discarded (zeroed), as
        KV connectors need before they register memory.
        """
        self._check_awake("commit()")
        check_int("num_blocks", num_blocks)
        if not 0 <= num_blocks <= self.num_blocks_capacity:
            raise ValueError(
                f"cannot commit {num_blocks} blocks; the capacity is "
                f"{self.num_blocks_capacity} blocks"
            )
        before = self._committed
        if num_blocks > before:
            self._grow(num_blocks)
        if defragment:
            try:
                defragment_all([buffer for buffer, _ in self.buffers])
            except BaseException:
                self._shrink_back(before)
                raise

    def _shrink_back(self, num_blocks: int) -> None:
        """Undo a grow: release the chunks it made (they hold no older block)."""
        for buffer, per_block in self.buffers:
            buffer.shrink_per_segment_(num_blocks * per_block)
        self._committed = num_blocks

    def _grow(self, num_blocks: int) -> None:
        resize_per_segment_all(
            [(buffer, num_blocks * per_block) for buffer, per_block in self.buffers],
            zero_new=True,
        )
        self._committed = num_blocks

    def ensure_blocks(self, num_blocks: int) -> None:
        """Commit at least ``num_blocks`` blocks, capped at the capacity.

        Warm-up and graph capture call this with whatever block ids they are
        about to touch.
        """
        check_int("num_blocks", num_blocks)
        self.commit(min(num_blocks, self.num_blocks_capacity))

    # -- sleep and wake ---------------------------------------------------------

    def release_physical(self) -> None:
        """Sleep: give every byte of physical memory back, contents discarded.

        Addresses, views and captured graphs stay valid; touching the blocks
        before :meth:`recommit` is a device fault. Idempotent.
        """
        committed = self._committed if self._asleep_at is None else self._asleep_at
        try:
            # Called again while asleep, this still releases any handle a
            # failed release left behind.
            release_physical_all([buffer for buffer, _ in self.buffers])
        finally:
            # Unmapping is all or nothing; if it happened, the cache sleeps
            # even when releasing a handle failed (a second call retries it).
            if all(buffer.physical_bytes == 0 for buffer, _ in self.buffers):
                self._asleep_at = committed
                self._committed = 0

    def recommit(self) -> None:
        """Wake: commit the block count held before :meth:`release_physical`,
        zeroed. Does nothing when awake."""
        if self._asleep_at is None:
            return
        self._grow(self._asleep_at)
        self._asleep_at = None

    def free(self) -> None:
        """Return all memory and, once their views are gone, the address ranges."""
        for buffer, _ in self.buffers:
            buffer.free()
        self.buffers = []
        self._committed = 0
        self._asleep_at = None


#: vLLM's in-tree name.
ExtensibleKVCacheBuffers = KVCacheBuffers
