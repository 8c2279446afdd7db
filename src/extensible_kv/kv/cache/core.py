"""KVCacheBuffers: every KV cache tensor of an engine, committed in lockstep by blocks.

The cache checks each call and runs it under its lock, in the order issued;
the work is done by parts it owns, one idea each: its tensors and the blocks
they hold (``kv/cache/block_tensors.py``; who may join, ``kv/cache/members.py``), growth,
trim and defragment (``kv/cache/resize.py``), sleep and wake with their host
copies (``kv/cache/sleep_wake.py``), KV connector registrations
(``kv/cache/registrations.py``), background commits (``kv/cache/commit_queue.py``) and
the units of blocks an :class:`~extensible_kv.kv.growth.elastic.ElasticBlocks`
holds outside the prefix (``kv/cache/held_units.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

import extensible_kv.kv.cache.members as members
from extensible_kv._checks import check_bool, check_int
from extensible_kv.budget.publish import register_cache
from extensible_kv.devices import stream_handles
from extensible_kv.kv.cache.backup import DEFAULT_STAGING_BYTES, HostBackup
from extensible_kv.kv.cache.block_tensors import BlockTensors
from extensible_kv.kv.cache.commit_queue import CommitQueue, serialized
from extensible_kv.kv.cache.commit_ticket import CommitTicket
from extensible_kv.kv.cache.held_units import HeldUnits
from extensible_kv.kv.cache.published import published
from extensible_kv.kv.cache.registrations import ConnectorRegistrationWarning, Registrations
from extensible_kv.kv.cache.resize import Resizer
from extensible_kv.kv.cache.sleep import Sleep, SleepState
from extensible_kv.kv.cache.sleep_wake import SleepWake
from extensible_kv.tensor import ExtensibleTensor, create_ahead_all

__all__ = ["ConnectorRegistrationWarning", "ExtensibleKVCacheBuffers", "KVCacheBuffers"]


class KVCacheBuffers:
    """The physical backing of a KV cache: one :class:`ExtensibleTensor` per
    cache tensor, each holding ``num_blocks`` blocks of
    ``bytes_per_block_per_segment`` bytes in every segment.

    Every operation is all or nothing across the tensors: if tensor 7 of 40
    cannot commit, tensors 0 to 6 are rolled back too. Base pointers, views
    and captured CUDA graphs stay valid through commit, release and recommit.

    Args:
        buffers: ``(ExtensibleTensor, bytes_per_block_per_segment)`` pairs
            (vLLM's signature and name); the KV cache owns the tensors from
            now on, as :attr:`tensors`.
        num_blocks_capacity: blocks every tensor has address space for.
    """

    def __init__(
        self, buffers: Sequence[tuple[ExtensibleTensor, int]], num_blocks_capacity: int
    ) -> None:
        check_int("num_blocks_capacity", num_blocks_capacity)
        if num_blocks_capacity < 1:
            raise ValueError(f"num_blocks_capacity must be positive, got {num_blocks_capacity}")
        self.num_blocks_capacity = num_blocks_capacity
        self._blocks = BlockTensors()
        self._cycle = SleepWake(self._blocks)
        self._registrations = Registrations()
        self._resizer = Resizer(self._blocks, self._cycle, self._registrations)
        self._lock = threading.RLock()
        self._commits = CommitQueue(self._lock)
        self._wait_streams: tuple[int, ...] | None = None
        self._freed = False
        #: The units an ElasticBlocks holds (its books, kept here so that
        #: the figures, a sleep and clear() see them).
        self._units = HeldUnits()
        #: ``(in_use, cached)`` blocks, as the engine's scheduler last
        #: counted them (elastic growth), for ``extensible-kv top``.
        self.block_use: tuple[int, int] | None = None
        for tensor, bytes_per_block in members.as_pairs(buffers):
            members.check_joining(tensor, bytes_per_block, num_blocks_capacity, self.tensors)
            self._blocks.append(tensor, bytes_per_block)
            tensor.publish_within(self)
        register_cache(self, published)

    def __repr__(self) -> str:
        return (
            f"KVCacheBuffers({len(self.tensors)} tensors, {self.num_blocks_committed}/"
            f"{self.num_blocks_capacity} blocks, {self.physical_bytes} physical bytes, "
            f"{self.state.value})"
        )

    # -- state ------------------------------------------------------------------

    def _check_alive(self, what: str) -> None:
        if self._freed:
            raise ValueError(f"the KV cache has been freed; {what} is no longer possible")

    @property
    def tensors(self) -> list[tuple[ExtensibleTensor, int]]:
        """The ``(ExtensibleTensor, bytes_per_block_per_segment)`` pairs, in
        the order they joined (empty once freed)."""
        return self._blocks.members

    @property
    def buffers(self) -> list[tuple[ExtensibleTensor, int]]:
        """:attr:`tensors` by vLLM's name for them."""
        return self.tensors

    @property
    def _sleep(self) -> Sleep:
        """Where the cache stands in its sleep cycle, with the host copy of a
        preserving sleep."""
        return self._cycle.sleep

    @property
    def _spare(self) -> HostBackup | None:
        """The host copy a wake kept for the next preserving sleep."""
        return self._cycle.spare

    @property
    def num_blocks_committed(self) -> int:
        """Blocks backed by physical memory now: the committed prefix, or the
        blocks of the units an :class:`~extensible_kv.kv.growth.elastic.ElasticBlocks`
        holds anywhere in the cache (0 while asleep)."""
        return self._blocks.committed + self._units.num_blocks_held

    @property
    def asleep(self) -> bool:
        """True between :meth:`release_physical` and :meth:`recommit` (the
        cache's sleep; see :attr:`state` for what it kept)."""
        return self._sleep.asleep

    @property
    def state(self) -> SleepState:
        """Awake, asleep (contents discarded or kept), or partly awake (a
        commit while asleep woke some blocks; :meth:`recommit` grows back)."""
        return self._sleep.state

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all tensors and segments (before
        rounding to granules): what sizing divides the budget by."""
        return sum(tensor.num_segments * per_block for tensor, per_block in self.tensors)

    @property
    def blocks_per_granule(self) -> int:
        """Blocks one granule holds in the tensor whose blocks are largest
        (at least 1): the step a growth that follows the load commits in,
        since a commit maps whole granules anyway (0 with no tensor)."""
        steps = [
            max(1, tensor.buffer.granularity // per_block) for tensor, per_block in self.tensors
        ]
        return min(steps, default=0)

    @property
    def physical_bytes(self) -> int:
        """Physical memory held, summed over tensors (whole granules)."""
        return self._blocks.physical_bytes

    @property
    def reserved_bytes(self) -> int:
        """Address space reserved, summed over tensors (whole granules)."""
        return sum(tensor.capacity_bytes for tensor, _ in self.tensors)

    @property
    def committed_bytes(self) -> int:
        """Bytes of the committed blocks (:attr:`num_blocks_committed`),
        summed over tensors and segments, before rounding to granules (0
        while asleep)."""
        return self.num_blocks_committed * self.bytes_per_block

    @property
    def base_ptrs(self) -> list[int]:
        """Each tensor's base address, in order: constant until :meth:`free`."""
        return [tensor.base_ptr for tensor, _ in self.tensors]

    def _check_awake(self, what: str) -> None:
        self._check_alive(what)
        if self.asleep:
            raise ValueError(
                f"the KV cache is asleep (released by release_physical()); "
                f"call recommit() before {what}"
            )

    def _device(self) -> torch.device:
        """The tensors' device (the host with no tensor)."""
        return self._blocks.device

    # -- KV connectors ----------------------------------------------------------

    @property
    def external_registrations(self) -> tuple[str, ...]:
        """Names under which connectors registered this cache's memory."""
        return self._registrations.names

    @serialized
    def register_external(self, name: str) -> None:
        """Record that a KV connector (NIXL, UCX, an RDMA library) registered
        this cache's memory, so that nothing pulls it from under it.

        Call it when the connector registers :meth:`KVCache.narrowed_views`.
        Registered memory must be shareable (``allocate_kv_cache(...,
        shareable=True)``) and mapped one chunk per segment (register after
        ``commit(n, defragment=True)``): UCX cannot transfer a region
        spanning several physical allocations. While registered, a
        discarding sleep, a trim, a defragment and a commit that grows or
        remaps are refused; a preserving sleep drops the registrations with
        a :class:`ConnectorRegistrationWarning` (register again after
        :meth:`recommit`).
        """
        self._check_awake("register_external()")
        self._registrations.add(name, [tensor for tensor, _ in self.tensors])

    @serialized
    def unregister_external(self, name: str) -> None:
        """Forget a registration made by :meth:`register_external`."""
        self._registrations.remove(name)

    # -- growth -----------------------------------------------------------------

    @serialized
    def add(self, buffer: ExtensibleTensor, bytes_per_block_per_segment: int) -> None:
        """Take one more tensor (e.g. a draft model's KV) into the lockstep;
        it is committed to the current block count, zeroed."""
        self._add([(buffer, bytes_per_block_per_segment)])

    @serialized
    def add_all(self, items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
        """:meth:`add` for several tensors, all or none: if committing one
        fails, none joins and none keeps memory."""
        self._add(items)

    def _add(self, items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
        self._check_awake("add()")
        for tensor in self._resizer.add(items, self.num_blocks_capacity):
            tensor.publish_within(self)
        self._apply_wait_streams()

    def wait_for_streams(self, streams: Iterable[Any] | None) -> None:
        """What releases, trims, defragments and sleeps wait for.

        None (the default): the whole device. Otherwise the work queued so
        far on ``streams`` (``torch.cuda.Stream`` objects or driver stream
        handles), and on the cache's own :meth:`commit_async` stream: an
        engine's work on other streams, or another engine's on the same GPU,
        is not waited for. Name every stream that reads or writes the cache,
        the ones it commits from included: work on a stream left out may
        still run when its memory is unmapped.
        """
        self._wait_streams = stream_handles(streams)
        self._apply_wait_streams()

    def _apply_wait_streams(self) -> None:
        handles = self._wait_streams
        commit_stream = self._commits.stream_handle
        if handles is not None and commit_stream is not None:
            handles = (*handles, commit_stream)
        for tensor, _ in self.tensors:
            tensor.buffer.wait_streams = handles

    @serialized
    def commit(self, num_blocks: int, defragment: bool = False) -> None:
        """Back the first ``num_blocks`` blocks of every tensor; new blocks read zero.

        A count at or below the committed one changes nothing, unless
        ``defragment``. With ``defragment`` (what a KV connector needs before
        it registers memory, as vLLM's runner does) the cache is remapped to
        hold exactly ``num_blocks`` blocks, each segment as one physical
        chunk: all memory is released first, so a warm-up prefix past
        ``num_blocks`` is given back, and every block reads zero after. If
        the cache already holds exactly that (the same count, one chunk per
        segment), nothing is remapped, but the blocks are still zeroed: a
        defragmented cache reads as zeros, as engines expect after warm-up.
        If it fails, the block count and the memory are as before.

        While released (asleep), a commit wakes the cache: after a discarding
        release only the first ``num_blocks`` blocks are committed (zeroed),
        as vLLM's runner expects when it warms up again before waking the
        cache, and :meth:`recommit` later grows it to the count it slept at;
        after a preserving release the whole cache is restored first, so no
        block of the host copy is lost.
        """
        self._commit(num_blocks, defragment)

    def _check_count(self, what: str, num_blocks: int) -> None:
        """Refuse a block count outside 0 to the capacity, naming ``what`` it was for."""
        check_int("num_blocks", num_blocks)
        if not 0 <= num_blocks <= self.num_blocks_capacity:
            raise ValueError(
                f"cannot {what} {num_blocks} blocks; the capacity is "
                f"{self.num_blocks_capacity} blocks"
            )

    def _commit(self, num_blocks: int, defragment: bool = False) -> None:
        self._check_alive("commit()")
        self._units.check_none("commit()", "clear() first")
        self._check_count("commit", num_blocks)
        check_bool("defragment", defragment)
        self._resizer.commit(num_blocks, defragment)

    def _regions(self, num_blocks: int) -> list[torch.Tensor]:
        """The first ``num_blocks`` blocks of every segment of every tensor, as bytes."""
        return self._blocks.regions(num_blocks)

    @serialized
    def trim(self, num_blocks: int) -> None:
        """Give back the memory past the first ``num_blocks`` blocks.

        Blocks past the new count are discarded; a chunk straddling the new
        end is mapped again smaller with its live blocks kept, so
        :attr:`physical_bytes` ends at the minimum the granularity allows.
        Waits first for all work on the device (every stream, not only the
        caller's). All or nothing: if mapping a straddling chunk again
        smaller fails (the driver is out of memory) or an unmap fails,
        nothing changed and the error propagates. A device budget never
        refuses a trim: its copy of a straddling chunk is claimed past a
        full or lowered limit if it must (docs/budget.md), since the trim
        ends holding less.
        """
        self._check_awake("trim()")
        self._units.check_none("trim()", "clear() first")
        self._resizer.trim(num_blocks)

    @serialized
    def clear(self) -> None:
        """Forget every block, from any state: awake after, with no block, no
        memory and no host copy (a cache forgetting its tokens; blocks that
        warm-up wrote, to be handed out as zeros). Refused while registered."""
        self._check_alive("clear()")
        self._resizer.clear()
        self._units.forget()

    @serialized
    def defragment(self, preserve: bool = True) -> None:
        """Map each segment's committed prefix again as one physical chunk.

        With ``preserve`` (the default) every committed block keeps its
        contents; old and new memory coexist for a moment, one tensor at a
        time. Without, contents are discarded, as ``commit(n, defragment=True)``.
        """
        self._check_awake("defragment()")
        self._units.check_none("defragment()", "clear() first")
        self._resizer.defragment(preserve)

    def extend(self, num_blocks: int, defragment: bool = False) -> None:
        """vLLM's name for the final commit, once sizing decided: :meth:`commit`."""
        self.commit(num_blocks, defragment=defragment)

    @serialized
    def ensure_blocks(self, num_blocks: int) -> None:
        """Commit at least ``num_blocks`` blocks, capped at the capacity.

        Warm-up and graph capture call this with whatever block ids they are
        about to touch.
        """
        check_int("num_blocks", num_blocks)
        self._commit(min(num_blocks, self.num_blocks_capacity))

    # -- background commit -------------------------------------------------------

    @serialized
    def create_ahead(self, num_blocks: int) -> Future[int]:
        """Create, on a background thread, the physical memory that growing
        to ``num_blocks`` (or, asleep, waking to that count) will map, into
        the handle pools of the tensors' driver stacks
        (:meth:`~extensible_kv.driver.Driver.create_ahead`): the growth or
        wake then only maps. For a wake, call it while the engine reloads
        its weights. The future gives the bytes added; each pool stops at
        its cap (size it to the growth), the rest is created at the commit.
        A sleep gives the pools' idle memory back: create ahead after it.
        """
        self._check_alive("create_ahead()")
        self._check_count("create ahead for", num_blocks)
        return create_ahead_all(
            [(tensor, num_blocks * per_block) for tensor, per_block in self.tensors]
        )

    #: The name before 0.2 ("reserve" now means address space only).
    reserve_ahead = create_ahead

    def commit_async(self, num_blocks: int) -> Future[CommitTicket]:
        """Commit ``num_blocks`` on a worker thread, so that the driver calls
        overlap the caller's compute (vAttention's idea).

        One worker per cache runs queued commits in order; every other
        method first waits for them, so calls stay ordered as issued. On a
        GPU the new blocks are zeroed on the cache's commit stream: before
        kernels touch them, call ``future.result().wait()`` (or make the
        stream wait on the ticket's event). Errors surface in the future.
        """
        check_int("num_blocks", num_blocks)
        return self._commits.submit(
            num_blocks, self._commit, self._device, self._apply_wait_streams
        )

    # -- sleep and wake ---------------------------------------------------------

    @serialized
    def release_physical(
        self, preserve: bool = False, *, staging_bytes: int = DEFAULT_STAGING_BYTES
    ) -> None:
        """Sleep: give every byte of physical memory back.

        Addresses, views and captured graphs stay valid; touching the blocks
        before :meth:`recommit` is a device fault. With ``preserve`` the
        committed blocks are first copied to host memory (on a GPU through a
        pinned ring of ``2 * staging_bytes``) and :meth:`recommit` restores
        them, so a prefix cache survives the sleep; otherwise contents are
        discarded (a host copy a preserving sleep made is dropped too).
        Idempotent.

        With KV connector registrations (:meth:`register_external`), a
        discarding release is refused, as vLLM refuses to sleep with a
        connector; a preserving one drops them with a
        :class:`ConnectorRegistrationWarning`: the connector must register
        the views again after :meth:`recommit`.
        """
        self._check_alive("release_physical()")
        if not preserve:
            self._registrations.check_unregistered("a discarding release_physical()")
        else:
            self._units.check_none("a preserving release_physical()", "release without preserve")
        try:
            self._cycle.release(preserve=preserve, staging_bytes=staging_bytes)
        finally:
            if self._sleep.asleep:
                # Asleep, nothing is mapped that a connector could still use,
                # and no unit is held.
                self._registrations.drop_released()
                self._units.forget()

    @serialized
    def recommit(
        self,
        *,
        keep_host_memory: bool = False,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        num_blocks: int | None = None,
    ) -> None:
        """Wake: commit the block count held before :meth:`release_physical`.

        Blocks read zero, or, after a preserving release, what they held. The
        host copy is then dropped (its memory goes back to the OS) unless
        ``keep_host_memory``, which keeps it for the next preserving sleep
        and, on a GPU, pins it (once) so that later sleeps and wakes copy by
        direct DMA. The memory is committed tensor by tensor, each one's copy
        running while the next commits.

        After a commit while asleep woke the cache partly, this grows it
        (zeroed) to the count it slept at. Does nothing otherwise.

        ``num_blocks`` wakes to that count instead of the one slept at, for
        memory that follows the load: after a discarding release exactly
        that many blocks are committed (zeroed; 0 commits nothing); after a
        preserving one the host copy is restored whole, then grown to
        ``num_blocks`` if that is more.
        """
        self._check_alive("recommit()")
        if num_blocks is not None:
            self._check_count("recommit", num_blocks)
        self._cycle.recommit(
            keep_host_memory=keep_host_memory, staging_bytes=staging_bytes, num_blocks=num_blocks
        )

    @property
    def host_backup_bytes(self) -> int:
        """Host memory held for a preserving sleep (while asleep, or kept)."""
        return self._cycle.host_backup_bytes

    def free(self) -> None:
        """Return all memory and, once their views are gone, the address ranges.

        Commits queued by :meth:`commit_async` run first; later ones are
        refused. Idempotent.
        """
        with self._lock:
            self._commits.close()
        # Not under the lock: the queued commits take it to run.
        self._commits.finish()
        with self._lock:
            self._freed = True
            self._blocks.free()
            self._units.forget()
            self._registrations.clear()
            self._cycle.drop_copies()
            self._cycle.settle()


#: vLLM's in-tree name.
ExtensibleKVCacheBuffers = KVCacheBuffers
