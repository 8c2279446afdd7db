"""KVCacheBuffers: every KV cache tensor of an engine, committed in lockstep by blocks."""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

import torch

from extensible_kv._checks import check_bool, check_int
from extensible_kv.budget.publish import register_cache
from extensible_kv.buffer import synchronize_buffers
from extensible_kv.driver.ahead import create_ahead_in_background
from extensible_kv.kv.backup import DEFAULT_STAGING_BYTES, HostBackup
from extensible_kv.kv.commit_ticket import CommitTicket
from extensible_kv.kv.sleep import Sleep, SleepState
from extensible_kv.tensor import (
    ExtensibleTensor,
    claimed_at_once,
    defragment_all,
    in_one_chunk_per_segment,
    published_figures,
    release_physical_all,
    remap_per_segment_all,
    resize_per_segment_all,
    shrink_per_segment_all,
    stream_handles,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialized(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a public method after the commits queued by ``commit_async`` and
    under the cache's lock. Internal calls use the undecorated bodies, so
    nothing waits while holding the lock."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        cache = args[0]
        assert isinstance(cache, KVCacheBuffers)
        cache._wait_for_queued()
        with cache._lock:
            return method(*args, **kwargs)

    return wrapper


def _pairs(items: Sequence[Any]) -> list[tuple[ExtensibleTensor, int]]:
    """``items`` as ``(buffer, bytes_per_block_per_segment)`` pairs, or a
    TypeError saying that is what a KV cache takes."""
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(
                f"a KV cache takes (ExtensibleTensor, bytes_per_block_per_segment) pairs, "
                f"got {type(item).__name__}"
            )
        pairs.append((item[0], item[1]))
    return pairs


def _published(cache: KVCacheBuffers) -> dict[str, Any] | None:
    """What ``extensible-kv top`` shows of a KV cache."""
    if cache._freed or not cache.buffers:
        return None
    return published_figures(
        cache.buffers[0][0],
        "KVCacheBuffers",
        reserved_bytes=cache.reserved_bytes,
        committed_bytes=cache.committed_bytes,
        physical_bytes=cache.physical_bytes,
        asleep=cache.released,
        blocks=cache.num_blocks_committed,
        capacity_blocks=cache.num_blocks_capacity,
    )


class ConnectorRegistrationWarning(UserWarning):
    """A sleep released memory a KV connector had registered: the connector
    must register the views again after :meth:`KVCacheBuffers.recommit`."""


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
        self._sleep = Sleep()
        self._registered: list[str] = []
        self._spare: HostBackup | None = None  # kept by a wake for the next sleep
        self._lock = threading.RLock()
        self._queue: ThreadPoolExecutor | None = None
        self._queued: Future[CommitTicket] | None = None
        self._commit_stream: torch.cuda.Stream | None = None
        self._wait_streams: tuple[int, ...] | None = None
        self._closing = False
        self._freed = False
        for buffer, bytes_per_block in _pairs(buffers):
            self._check_buffer(buffer, bytes_per_block)
            self.buffers.append((buffer, bytes_per_block))
            buffer._cache = weakref.ref(self)
        register_cache(self, _published)

    def __repr__(self) -> str:
        return (
            f"KVCacheBuffers({len(self.buffers)} buffers, {self._committed}/"
            f"{self.num_blocks_capacity} blocks, {self.physical_bytes} physical bytes, "
            f"{self.state.value})"
        )

    def _check_buffer(self, buffer: ExtensibleTensor, bytes_per_block: int) -> None:
        if not isinstance(buffer, ExtensibleTensor):
            raise TypeError(
                f"a KV cache buffer is an ExtensibleTensor, got {type(buffer).__name__}"
            )
        if any(buffer is mine for mine, _ in self.buffers):
            raise ValueError(f"{buffer!r} is already in this KV cache; each buffer joins once")
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

    def _check_alive(self, what: str) -> None:
        if self._freed:
            raise ValueError(f"the KV cache has been freed; {what} is no longer possible")

    @property
    def num_blocks_committed(self) -> int:
        """Blocks backed by physical memory now (0 while released)."""
        return self._committed

    @property
    def released(self) -> bool:
        """True while asleep: between :meth:`release_physical` and :meth:`recommit`."""
        return self._sleep.asleep

    @property
    def state(self) -> SleepState:
        """Awake, asleep (contents discarded or kept), or partly awake (a
        commit while asleep woke some blocks; :meth:`recommit` grows back)."""
        return self._sleep.state

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all buffers and segments (before
        rounding to granules): what sizing divides the budget by."""
        return sum(buffer.num_segments * per_block for buffer, per_block in self.buffers)

    @property
    def blocks_per_granule(self) -> int:
        """Blocks one granule holds in the buffer whose blocks are largest
        (at least 1): the step a growth that follows the load commits in,
        since a commit maps whole granules anyway (0 with no buffer)."""
        steps = [
            max(1, buffer.buffer.granularity // per_block) for buffer, per_block in self.buffers
        ]
        return min(steps, default=0)

    @property
    def physical_bytes(self) -> int:
        """Physical memory held, summed over buffers (whole granules)."""
        return sum(buffer.physical_bytes for buffer, _ in self.buffers)

    @property
    def reserved_bytes(self) -> int:
        """Address space reserved, summed over buffers (whole granules)."""
        return sum(buffer.capacity_bytes for buffer, _ in self.buffers)

    @property
    def committed_bytes(self) -> int:
        """Bytes of the committed blocks, summed over buffers and segments,
        before rounding to granules (0 while released)."""
        return sum(buffer.num_bytes for buffer, _ in self.buffers)

    @property
    def base_ptrs(self) -> list[int]:
        """Each buffer's base address, in order: constant until :meth:`free`."""
        return [buffer.base_ptr for buffer, _ in self.buffers]

    def _check_awake(self, what: str) -> None:
        self._check_alive(what)
        if self.released:
            raise ValueError(f"the KV cache is released (asleep); call recommit() before {what}")

    def _check_unregistered(self, what: str) -> None:
        """Refuse what would unmap or change memory a connector registered."""
        if self._registered:
            raise ValueError(
                f"{what} would change memory that KV connector registrations "
                f"({', '.join(self._registered)}) point at; unregister_external() first, "
                f"then register the views again after"
            )

    # -- KV connectors ----------------------------------------------------------

    @property
    def external_registrations(self) -> tuple[str, ...]:
        """Names under which connectors registered this cache's memory."""
        return tuple(self._registered)

    @_serialized
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
        if not isinstance(name, str) or not name:
            raise ValueError(f"a registration is named by a non-empty str, got {name!r}")
        if name in self._registered:
            raise ValueError(f"{name!r} is already registered")
        plain = [b for b, _ in self.buffers if not b.buffer.shareable]
        if plain:
            raise ValueError(
                f"{len(plain)} of {len(self.buffers)} buffers are not shareable; a KV connector "
                f"needs memory made with shareable=True (allocate_kv_cache(..., shareable=True))"
            )
        scattered = [b for b, _ in self.buffers if not in_one_chunk_per_segment(b)]
        if scattered:
            raise ValueError(
                f"{len(scattered)} of {len(self.buffers)} buffers span several physical "
                f"allocations per segment, which UCX cannot transfer; call "
                f"commit(num_blocks, defragment=True) before registering"
            )
        self._registered.append(name)

    @_serialized
    def unregister_external(self, name: str) -> None:
        """Forget a registration made by :meth:`register_external`."""
        if name not in self._registered:
            listed = ", ".join(map(repr, self._registered)) or "none"
            raise ValueError(f"{name!r} is not registered (registered: {listed})")
        self._registered.remove(name)

    # -- growth -----------------------------------------------------------------

    @_serialized
    def add(self, buffer: ExtensibleTensor, bytes_per_block_per_segment: int) -> None:
        """Take one more buffer (e.g. a draft model's KV) into the lockstep;
        it is committed to the current block count, zeroed."""
        self._add([(buffer, bytes_per_block_per_segment)])

    @_serialized
    def add_all(self, items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
        """:meth:`add` for several buffers, all or none: if committing one
        fails, none joins and none keeps memory."""
        self._add(items)

    def _add(self, items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
        self._check_awake("add()")
        self._check_unregistered("add()")
        items = _pairs(items)
        for index, (buffer, per_block) in enumerate(items):
            if any(buffer is other for other, _ in items[:index]):
                raise ValueError(f"{buffer!r} is given twice; each buffer joins once")
            self._check_buffer(buffer, per_block)
        resize_per_segment_all(
            [(buffer, self._committed * per_block) for buffer, per_block in items], zero_new=True
        )
        self.buffers.extend(items)
        for buffer, _ in items:
            buffer._cache = weakref.ref(self)
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
        if handles is not None and self._commit_stream is not None:
            handles = (*handles, int(self._commit_stream.cuda_stream))
        for buffer, _ in self.buffers:
            buffer.buffer.wait_streams = handles

    @_serialized
    def commit(self, num_blocks: int, defragment: bool = False) -> None:
        """Back the first ``num_blocks`` blocks of every buffer; new blocks read zero.

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
        self._check_count("commit", num_blocks)
        check_bool("defragment", defragment)
        if defragment:
            if not self._holds_exactly(num_blocks):
                self._check_unregistered("a defragmenting commit")
        elif num_blocks > self._committed:
            self._check_unregistered(f"growing to {num_blocks} blocks")
        if self._sleep.asleep:
            self._wake_for_commit(num_blocks, defragment)
            return
        if defragment:
            self._remap(num_blocks)
            self._sleep = Sleep()
        elif num_blocks > self._committed:
            self._grow(num_blocks)

    def _wake_for_commit(self, num_blocks: int, defragment: bool) -> None:
        """A commit while released: restore a host copy whole, else commit
        only what was asked and leave the rest to :meth:`recommit`."""
        sleep = self._sleep
        assert sleep.asleep_at is not None
        if sleep.backup is not None:
            # Restore and growth claim their memory together: a refusal comes
            # before either, and leaves the cache asleep with its copy.
            with self._claimed(max(num_blocks, sleep.asleep_at)):
                self._recommit(keep_host_memory=False, staging_bytes=DEFAULT_STAGING_BYTES)
                self._commit(num_blocks, defragment)
            return
        self._sleep = sleep.woken()
        try:
            if defragment:
                self._remap(num_blocks)
            else:
                self._grow(num_blocks)
        except BaseException:
            # Nothing committed: still asleep.
            committed = any(buffer.physical_bytes for buffer, _ in self.buffers)
            self._sleep = sleep.partly_woken() if committed else sleep
            raise
        self._sleep = Sleep() if defragment else sleep.partly_woken()

    def _remap(self, num_blocks: int) -> None:
        """Hold exactly ``num_blocks`` blocks, one chunk per segment, zeroed;
        all or nothing."""
        if self._holds_exactly(num_blocks):
            # Already laid out so: no remap, but a defragment still discards.
            for region in self._regions(num_blocks):
                region.zero_()
            return
        sizes = [(buffer, num_blocks * per_block) for buffer, per_block in self.buffers]
        try:
            remap_per_segment_all(sizes)
        finally:
            if all(buffer.bytes_per_segment == size for buffer, size in sizes):
                self._committed = num_blocks

    def _holds_exactly(self, num_blocks: int) -> bool:
        """True when a defragmenting commit of ``num_blocks`` has nothing to do."""
        return num_blocks == self._committed and all(
            in_one_chunk_per_segment(buffer) for buffer, _ in self.buffers
        )

    def _grow(self, num_blocks: int, zero_new: bool = True) -> None:
        resize_per_segment_all(
            [(buffer, num_blocks * per_block) for buffer, per_block in self.buffers],
            zero_new=zero_new,
        )
        self._committed = num_blocks

    def _regions(self, num_blocks: int) -> list[torch.Tensor]:
        """The first ``num_blocks`` blocks of every segment of every buffer, as bytes."""
        regions = []
        for buffer, per_block in self.buffers:
            full = buffer.full_view()
            for segment in range(buffer.num_segments):
                start = segment * buffer.segment_capacity_bytes
                regions.append(full[start : start + num_blocks * per_block])
        return regions

    @_serialized
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
        self._trim(num_blocks)

    def _trim(self, num_blocks: int) -> None:
        self._check_awake("trim()")
        self._check_unregistered("trim()")
        check_int("num_blocks", num_blocks)
        if not 0 <= num_blocks <= self._committed:
            raise ValueError(
                f"trim keeps 0 to {self._committed} blocks (the committed count), "
                f"not {num_blocks}; commit() grows"
            )
        try:
            shrink_per_segment_all(
                [(buffer, num_blocks * per_block) for buffer, per_block in self.buffers]
            )
        finally:
            if all(b.bytes_per_segment == num_blocks * per_block for b, per_block in self.buffers):
                self._committed = num_blocks
                self._sleep = Sleep()

    @_serialized
    def clear(self) -> None:
        """Forget every block, from any state: awake after, with no block, no
        memory and no host copy (a cache forgetting its tokens; blocks that
        warm-up wrote, to be handed out as zeros). Refused while registered."""
        self._check_alive("clear()")
        self._check_unregistered("clear()")
        if not self._sleep.asleep:
            self._trim(0)
            return
        release_physical_all([buffer for buffer, _ in self.buffers])
        if self._sleep.backup is not None:
            self._sleep.backup.free()
        self._sleep = Sleep()

    @_serialized
    def defragment(self, preserve: bool = True) -> None:
        """Map each segment's committed prefix again as one physical chunk.

        With ``preserve`` (the default) every committed block keeps its
        contents; old and new memory coexist for a moment, one buffer at a
        time. Without, contents are discarded, as ``commit(n, defragment=True)``.
        """
        self._check_awake("defragment()")
        self._check_unregistered("defragment()")
        if preserve:
            defragment_all([buffer for buffer, _ in self.buffers], preserve=True)
        else:
            self._commit(self._committed, defragment=True)

    def extend(self, num_blocks: int, defragment: bool = False) -> None:
        """vLLM's name for the final commit, once sizing decided: :meth:`commit`."""
        self.commit(num_blocks, defragment=defragment)

    @_serialized
    def ensure_blocks(self, num_blocks: int) -> None:
        """Commit at least ``num_blocks`` blocks, capped at the capacity.

        Warm-up and graph capture call this with whatever block ids they are
        about to touch.
        """
        check_int("num_blocks", num_blocks)
        self._commit(min(num_blocks, self.num_blocks_capacity))

    # -- background commit -------------------------------------------------------

    @_serialized
    def reserve_ahead(self, num_blocks: int) -> Future[int]:
        """Create, on a background thread, the physical memory that growing
        to ``num_blocks`` (or, asleep, waking to that count) will map, into
        the handle pools of the buffers' driver stacks
        (:meth:`~extensible_kv.driver.Driver.create_ahead`): the growth or
        wake then only maps. For a wake, call it while the engine reloads
        its weights. The future gives the bytes added; each pool stops at
        its cap (size it to the growth), the rest is created at the commit.
        A sleep gives the pools' idle memory back: reserve after it.
        """
        self._check_alive("reserve_ahead()")
        self._check_count("reserve for", num_blocks)
        handles = [
            handle
            for buffer, per_block in self.buffers
            for handle in buffer._handles_to_grow(num_blocks * per_block)
        ]
        return create_ahead_in_background(handles)

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
        with self._lock:
            if self._closing:
                raise ValueError("the KV cache has been freed; commit_async is no longer possible")
            if self._queue is None:
                self._queue = ThreadPoolExecutor(1, thread_name_prefix="extensible-kv-commit")
            future = self._queue.submit(self._commit_job, num_blocks)
            self._queued = future
        return future

    def _commit_job(self, num_blocks: int) -> CommitTicket:
        with self._lock:
            device = self.buffers[0][0].device if self.buffers else torch.device("cpu")
            if device.type != "cuda":
                self._commit(num_blocks)
                return CommitTicket(num_blocks, None, device)
            if self._commit_stream is None:
                self._commit_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._apply_wait_streams()
            with torch.cuda.stream(self._commit_stream):
                self._commit(num_blocks)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._commit_stream)
            return CommitTicket(num_blocks, event, device)

    def _wait_for_queued(self) -> None:
        """Wait until the commits queued so far have run (their errors stay
        in their futures). The worker itself never waits."""
        queued = self._queued
        if queued is not None and not threading.current_thread().name.startswith(
            "extensible-kv-commit"
        ):
            queued.exception()

    # -- sleep and wake ---------------------------------------------------------

    @_serialized
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
            self._check_unregistered("a discarding release_physical()")
            if self._sleep.backup is not None:
                # Asleep with a host copy: a discarding sleep forgets it, so
                # that the wake does not restore what was to be discarded.
                self._sleep.backup.free()
                self._sleep = self._sleep.without_backup()
        backup = None
        if not self._sleep.asleep and preserve:
            # Writers on any stream (an engine's side streams, the zeroing
            # of commit_async) must be done before the copy reads the blocks.
            synchronize_buffers(buffer.buffer for buffer, _ in self.buffers)
            backup = HostBackup.capture(
                self._regions(self._committed), staging_bytes=staging_bytes, reuse=self._spare
            )
            self._spare = None
        try:
            # Called again while asleep, this still releases any handle a
            # failed release left behind.
            release_physical_all([buffer for buffer, _ in self.buffers])
        except BaseException:
            if not self._sleep.asleep and any(b.physical_bytes for b, _ in self.buffers):
                self._drop_backup(backup)
            raise
        finally:
            # Unmapping is all or nothing; if it happened, the cache sleeps
            # even when releasing a handle failed (a second call retries it).
            if all(buffer.physical_bytes == 0 for buffer, _ in self.buffers):
                self._sleep = self._sleep.fallen_asleep(self._committed, backup)
                self._committed = 0
                self._drop_registrations()

    def _drop_registrations(self) -> None:
        if self._registered:
            warnings.warn(
                f"release_physical(preserve=True) released memory that KV connector "
                f"registrations ({', '.join(self._registered)}) point at; they are dropped: "
                f"register kv.narrowed_views() again after recommit()",
                ConnectorRegistrationWarning,
                stacklevel=4,
            )
            self._registered.clear()

    @_serialized
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
        direct DMA. The memory is committed buffer by buffer, each one's copy
        running while the next commits.

        After a commit while released woke the cache partly, this grows it
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
        sleep = self._sleep
        if num_blocks is not None and sleep.state is SleepState.ASLEEP_DISCARDED:
            self._grow(num_blocks)
            self._sleep = Sleep()
            return
        if sleep.state is SleepState.AWAKE:
            return
        target = sleep.wake_to if num_blocks is None else num_blocks
        # The restore and the growth past it claim their memory together: a
        # refusal comes before either, and leaves the cache asleep with its copy.
        with self._claimed(max(target or 0, sleep.asleep_at or 0)):
            self._recommit(keep_host_memory=keep_host_memory, staging_bytes=staging_bytes)
            if target is not None and target > self._committed:
                self._grow(target)
        self._sleep = Sleep()

    def _recommit(self, *, keep_host_memory: bool, staging_bytes: int) -> None:
        asleep_at, backup = self._sleep.asleep_at, self._sleep.backup
        if asleep_at is None:
            return
        if backup is None:
            self._grow(asleep_at)
            self._sleep = self._sleep.woken()
            return
        self._restore(backup, asleep_at, staging_bytes)
        self._sleep = self._sleep.woken()
        if not keep_host_memory:
            backup.free()
            return
        if self.buffers and self.buffers[0][0].device.type == "cuda":
            backup.pin()
        self._spare = backup

    def _restore(self, backup: HostBackup, num_blocks: int, staging_bytes: int) -> None:
        """Commit ``num_blocks`` again, buffer by buffer, and fill each from
        ``backup`` while the next one commits; all or nothing.

        If a commit or a copy fails, the buffers committed so far are
        released again: the cache stays asleep with its backup, for a retry.
        """
        # Buffer by buffer, but claimed at once: a wake waiting for room
        # holds none of it, so two engines waking together cannot each hold
        # half and wait on the other.
        with self._claimed(num_blocks):
            restorer = backup.restorer(self._regions(num_blocks), staging_bytes=staging_bytes)
            committed: list[ExtensibleTensor] = []
            try:
                try:
                    first = 0
                    for buffer, per_block in self.buffers:
                        buffer.resize_per_segment_(num_blocks * per_block)
                        committed.append(buffer)
                        restorer.copy(range(first, first + buffer.num_segments))
                        first += buffer.num_segments
                finally:
                    restorer.finish()  # no copy may run into memory released below
            except BaseException:
                release_physical_all(committed)
                raise
        self._committed = num_blocks

    def _claimed(self, num_blocks: int) -> AbstractContextManager[object]:
        """Claim at once what committing ``num_blocks`` blocks in every
        buffer will create from here (see
        :func:`~extensible_kv.tensor.claimed_at_once`)."""
        return claimed_at_once(
            [(b, max(num_blocks * per_block, b.bytes_per_segment)) for b, per_block in self.buffers]
        )

    def _drop_backup(self, made: HostBackup | None = None) -> None:
        """Free the sleep's host copy, the kept one, and ``made`` (a failed sleep's)."""
        for backup in (self._sleep.backup, self._spare, made):
            if backup is not None:
                backup.free()
        self._sleep, self._spare = self._sleep.without_backup(), None

    @property
    def host_backup_bytes(self) -> int:
        """Host memory held for a preserving sleep (while asleep, or kept)."""
        return sum(b.nbytes for b in (self._sleep.backup, self._spare) if b is not None)

    def free(self) -> None:
        """Return all memory and, once their views are gone, the address ranges.

        Commits queued by :meth:`commit_async` run first; later ones are
        refused. Idempotent.
        """
        with self._lock:
            self._closing = True
            queue, self._queue = self._queue, None
        # Not under the lock: the queued commits take it to run.
        if queue is not None:
            queue.shutdown(wait=True)
        with self._lock:
            self._freed = True
            for buffer, _ in self.buffers:
                buffer.free()
            self.buffers = []
            self._committed = 0
            self._registered.clear()
            self._drop_backup()
            self._sleep = Sleep()


#: vLLM's in-tree name.
ExtensibleKVCacheBuffers = KVCacheBuffers
