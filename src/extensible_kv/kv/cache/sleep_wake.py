"""Sleep and wake of a KV cache: releasing every byte of its physical
memory, and committing it again, its contents discarded or kept in host
memory.

:class:`SleepWake` does the work of
:meth:`~extensible_kv.kv.KVCacheBuffers.release_physical` and
:meth:`~extensible_kv.kv.KVCacheBuffers.recommit` on the cache's
:class:`~extensible_kv.kv.cache.block_tensors.BlockTensors`, and owns the host copies
involved: the one a preserving sleep makes (kept in the cache's
:class:`~extensible_kv.kv.cache.sleep.Sleep` value until the wake restores it) and
the one a wake keeps for the next sleep. The cache checks what a call may
do (alive, block counts, connector registrations) under its lock first.
"""

from __future__ import annotations

from extensible_kv.buffer import synchronize_buffers
from extensible_kv.kv.cache.backup import HostBackup
from extensible_kv.kv.cache.block_tensors import BlockTensors
from extensible_kv.kv.cache.sleep import Sleep, SleepState

__all__ = ["SleepWake"]


class SleepWake:
    """One cache's sleep cycle, over ``blocks`` (the cache's tensors).

    ``sleep``: where the cache stands, with the host copy a preserving sleep
    made (owned here). ``spare``: the host copy a wake kept
    (``keep_host_memory``) for the next preserving sleep to fill again
    (owned here; None otherwise). Only the methods below change them.
    """

    def __init__(self, blocks: BlockTensors) -> None:
        self.sleep = Sleep()
        self.spare: HostBackup | None = None
        self._blocks = blocks

    @property
    def host_backup_bytes(self) -> int:
        """Host memory held for a preserving sleep (while asleep, or kept)."""
        return sum(b.nbytes for b in (self.sleep.backup, self.spare) if b is not None)

    def release(self, *, preserve: bool, staging_bytes: int) -> None:
        """Give every byte of physical memory back, first copying the
        committed blocks to host memory with ``preserve`` (through a pinned
        ring of ``2 * staging_bytes`` bytes on a GPU); without, forget any
        host copy a preserving sleep made. Idempotent.

        Once every tensor holds no memory the cache is asleep, even if
        releasing a handle failed (a second call retries it); if unmapping
        failed, it stays awake and its host copies (one just made, one kept)
        are freed.
        """
        if not preserve and self.sleep.backup is not None:
            # Asleep with a host copy: a discarding sleep forgets it, so
            # that the wake does not restore what was to be discarded.
            self.sleep.backup.free()
            self.sleep = self.sleep.without_backup()
        held = self._blocks.committed
        backup = None
        if not self.sleep.asleep and preserve:
            # Writers on any stream (an engine's side streams, the zeroing
            # of commit_async) must be done before the copy reads the blocks.
            synchronize_buffers(tensor.buffer for tensor, _ in self._blocks.members)
            backup = HostBackup.capture(
                self._blocks.regions(held), staging_bytes=staging_bytes, reuse=self.spare
            )
            self.spare = None
        try:
            # Called again while asleep, this still releases any handle a
            # failed release left behind.
            self._blocks.release()
        except BaseException:
            if not self.sleep.asleep and self._blocks.physical_bytes:
                self.drop_copies(backup)
            raise
        finally:
            # Unmapping is all or nothing; if it happened, the cache sleeps
            # even when releasing a handle failed (a second call retries it).
            if self._blocks.physical_bytes == 0:
                self.sleep = self.sleep.fallen_asleep(held, backup)

    def recommit(
        self, *, keep_host_memory: bool, staging_bytes: int, num_blocks: int | None
    ) -> None:
        """Wake to the block count slept at, or to ``num_blocks`` (checked by
        the caller): see :meth:`KVCacheBuffers.recommit
        <extensible_kv.kv.KVCacheBuffers.recommit>`. Does nothing awake."""
        sleep = self.sleep
        if num_blocks is not None and sleep.state is SleepState.ASLEEP_DISCARDED:
            self._blocks.grow(num_blocks)
            self.sleep = Sleep()
            return
        if sleep.state is SleepState.AWAKE:
            return
        target = sleep.wake_to if num_blocks is None else num_blocks
        # The restore and the growth past it claim their memory together: a
        # refusal comes before either, and leaves the cache asleep with its copy.
        with self._blocks.holding(max(target or 0, sleep.asleep_at or 0)):
            self.wake(keep_host_memory=keep_host_memory, staging_bytes=staging_bytes)
            if target is not None and target > self._blocks.committed:
                self._blocks.grow(target)
        self.sleep = Sleep()

    def wake(self, *, keep_host_memory: bool, staging_bytes: int) -> None:
        """Commit the blocks slept at again: zeroed, or restored tensor by
        tensor from the host copy, which is then freed, or with
        ``keep_host_memory`` kept (on a GPU pinned, once) as the spare. A
        growth a partial wake asked for stays to do. Does nothing unless
        asleep; all or nothing."""
        asleep_at, backup = self.sleep.asleep_at, self.sleep.backup
        if asleep_at is None:
            return
        if backup is None:
            self._blocks.grow(asleep_at)
            self.sleep = self.sleep.woken()
            return
        self._blocks.restore(backup, asleep_at, staging_bytes)
        self.sleep = self.sleep.woken()
        if not keep_host_memory:
            backup.free()
            return
        if self._blocks.device.type == "cuda":
            backup.pin()
        self.spare = backup

    def wake_partly(self, num_blocks: int, defragment: bool) -> None:
        """A commit while asleep with no host copy: commit only the first
        ``num_blocks`` blocks, zeroed (with ``defragment``, exactly those,
        one chunk per segment), and leave the rest to the next wake."""
        sleep = self.sleep
        assert sleep.asleep_at is not None
        self.sleep = sleep.woken()
        try:
            if defragment:
                self._blocks.remap(num_blocks)
            else:
                self._blocks.grow(num_blocks)
        except BaseException:
            # Nothing committed: still asleep.
            self.sleep = sleep.partly_woken() if self._blocks.physical_bytes else sleep
            raise
        self.sleep = Sleep() if defragment else sleep.partly_woken()

    def settle(self) -> None:
        """Awake, with nothing left to grow back to: the block count was set
        by a trim or a defragmenting commit."""
        self.sleep = Sleep()

    def clear(self) -> None:
        """Asleep: release any handle a failed release left, free the host
        copy, and be awake with no block."""
        self._blocks.release()
        if self.sleep.backup is not None:
            self.sleep.backup.free()
        self.sleep = Sleep()

    def drop_copies(self, made: HostBackup | None = None) -> None:
        """Free the sleep's host copy, the kept one, and ``made`` (a failed sleep's)."""
        for backup in (self.sleep.backup, self.spare, made):
            if backup is not None:
                backup.free()
        self.sleep, self.spare = self.sleep.without_backup(), None
