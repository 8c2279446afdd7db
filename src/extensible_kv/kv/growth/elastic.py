"""Memory that follows an engine's blocks down as well as up: any unit of
blocks committed or given back, not only the tail.

An engine's scheduler knows which blocks are in use, which its prefix cache
keeps and which are free; the workers only map memory. The scheduler speaks
in **units** (``blocks_per_unit`` consecutive block ids, about a granule's
worth) and sends each worker, before every step that changes them, the
:class:`ElasticOrders`: the units the step may use (``held``) and the units
to commit ahead for the next steps if the memory is there (``wanted``).
:class:`ElasticBlocks` makes a :class:`~extensible_kv.kv.KVCacheBuffers`
hold exactly those units and answers with an :class:`ElasticReport`: how
many ``wanted`` units it got. Tensor-parallel ranks get the same orders and
so hold the same units.

Units map to memory in every buffer and segment: unit ``u`` is blocks
``[u * blocks_per_unit, (u + 1) * blocks_per_unit)``, bytes
``[block * per_block, ...)`` of each segment, widened to whole granules. A
granule is given back when no held unit has a byte in it, wherever it lies
(holes in the reservation, as kvcached frees any empty page): a request
started at the peak, holding high ids for minutes, does not keep the memory
below it. That needs every granule to be its own physical chunk (the driver
unmaps whole mappings), so the cache's buffers are allocated with ``chunk_bytes``
equal to their granularity.

The memory held this way is not the cache's committed prefix, which stays
0, but the cache keeps the books of it (``kv/cache/held_units.py``): it counts
the held blocks as its committed ones, and a sleep and ``clear()`` give them
back like any other. :meth:`ElasticBlocks.release` may first copy the units
the engine names to host memory (those its prefix cache holds blocks in,
never the free ones), and :meth:`ElasticBlocks.wake` commits unit 0 and
those units again, restored to the same block ids; the next orders commit
what the next step needs. Books and memory agree after any failure: a
unit is in the books exactly while every byte of it is mapped.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from extensible_kv._checks import check_int
from extensible_kv.buffer import (
    Transaction,
    release_idle,
    release_outside_together,
    synchronize_buffers,
)
from extensible_kv.driver import OutOfMemoryError
from extensible_kv.kv.cache.backup import HostBackup
from extensible_kv.kv.cache.commit_queue import serialized
from extensible_kv.kv.cache.core import KVCacheBuffers
from extensible_kv.kv.cache.held_units import ranges_of
from extensible_kv.tensor import commit_ranges_all

__all__ = [
    "ElasticBlocks",
    "ElasticOrders",
    "ElasticReport",
    "UnitRanges",
    "ranges_of",
    "units_of",
]

#: Ranges of units, ``(start, end)``, end exclusive.
UnitRanges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ElasticOrders:
    """What a worker holds for the next step, from the scheduler.

    Attributes:
        seq: the orders' number, increasing; the report names it.
        blocks_per_unit: blocks per unit (the scheduler's packing unit).
        held: unit ranges the step may use: committed before it runs, or
            the step fails (waiting for the budget as a wake does).
        wanted: unit ranges to commit ahead, lowest first, as far as the
            memory (a device budget) allows; the report says how many units.
        in_use_blocks: blocks running requests hold, as the scheduler
            counted them planning these orders (shown by ``extensible-kv top``).
        cached_blocks: free blocks the prefix cache keeps, counted alike.
        ask_others: whether a refused commit of ``wanted`` asks the other
            processes on the device to give memory back (posts a want in
            its budget); False while the engine's own prefix cache can
            still lend what the step lacks.
        keep_idle: whether the memory of units given back may stay idle in
            the buffers' driver stack for the next commits (a driver that
            keeps handles idle hands them to the next commit, so a burst
            creates none); False gives every idle byte back (the
            engine idle, another process wanting memory, a budget refused).
    """

    seq: int
    blocks_per_unit: int
    held: UnitRanges
    wanted: UnitRanges = ()
    in_use_blocks: int = 0
    cached_blocks: int = 0
    ask_others: bool = True
    keep_idle: bool = False


@dataclass(frozen=True)
class ElasticReport:
    """A worker's answer to :class:`ElasticOrders`: ``granted`` units of
    ``wanted`` (the first ones, in order) are committed. The first report
    also names, per rank, where its memory is claimed: ``(device_uuid,
    state_dir, pid)`` of each budget ledger (empty without a budget), so
    that the scheduler can read what other processes want there."""

    seq: int
    granted: int
    ledgers: tuple[tuple[str, str, int], ...] = ()


def units_of(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Every unit of ``ranges``, in order."""
    return [unit for start, end in ranges for unit in range(start, end)]


class ElasticBlocks:
    """Holds exactly the units an engine's scheduler orders (see the module).

    Args:
        cache: the KV cache, reserved at its capacity with one chunk per
            granule and nothing committed; this object commits and releases
            its memory, and keeps its books in the cache; the caller still
            owns it.
        num_blocks: the engine's block count, the highest any id may reach.
    """

    def __init__(self, cache: KVCacheBuffers, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks)
        if not 1 <= num_blocks <= cache.num_blocks_capacity:
            raise ValueError(
                f"num_blocks must be 1 to the capacity {cache.num_blocks_capacity}, "
                f"got {num_blocks}"
            )
        for tensor, _ in cache.tensors:
            buffer = tensor.buffer
            if buffer.chunk_bytes != buffer.granularity:
                raise ValueError(
                    f"elastic memory gives back single granules, so every granule must be "
                    f"its own chunk: allocate the cache with chunk_bytes={buffer.granularity} "
                    f"(the granularity), not {buffer.chunk_bytes}"
                )
        if cache.num_blocks_committed:
            raise ValueError(
                f"elastic memory starts from an empty cache; {cache.num_blocks_committed} "
                f"blocks are committed (clear() first)"
            )
        self.cache = cache
        self.num_blocks = num_blocks
        self._books = cache._units
        #: The cache's queue, whose lock every change here takes (``serialized``).
        self._commits = cache._commits
        self._books.num_blocks = num_blocks
        self._books.set((), blocks_per_unit=1)
        #: The most blocks held at once so far.
        self.high_water = 0
        #: Over a sleep that keeps units: those units, and their blocks' host copy.
        self._kept: tuple[frozenset[int], HostBackup] | None = None

    @property
    def blocks_per_unit(self) -> int:
        """Blocks per unit of the last orders (1 until the first)."""
        return self._books.blocks_per_unit

    @property
    def held(self) -> frozenset[int]:
        """The units held now (empty while the cache sleeps)."""
        return self._books.units

    @property
    def _held(self) -> frozenset[int]:
        return self._books.units

    # -- what is held ---------------------------------------------------------

    @property
    def held_units(self) -> UnitRanges:
        """The units held now, as ranges (empty while the cache sleeps)."""
        return self._books.ranges

    @property
    def num_blocks_held(self) -> int:
        """Blocks of the units held (0 while the cache sleeps)."""
        return self._books.num_blocks_held

    def holds(self, block_ids: Iterable[int]) -> bool:
        """Whether every one of ``block_ids`` lies in a held unit."""
        if self.cache.asleep:
            return False
        per = self.blocks_per_unit
        return all(block_id // per in self._held for block_id in block_ids)

    def holds_units(self, ranges: Iterable[tuple[int, int]]) -> bool:
        """Whether every unit of ``ranges`` is held."""
        return not self.cache.asleep and set(units_of(ranges)) <= self._held

    def _byte_ranges(self, units: Iterable[int]) -> list[list[tuple[int, int]]]:
        """Per buffer, the ``(offset, size)`` bytes of ``units`` in every segment."""
        blocks = self._books.block_ranges(units)
        out = []
        for tensor, per_block in self.cache.tensors:
            cap = tensor.segment_capacity_bytes
            out.append(
                [
                    (segment * cap + lo * per_block, (hi - lo) * per_block)
                    for segment in range(tensor.num_segments)
                    for lo, hi in blocks
                ]
            )
        return out

    # -- changing it ----------------------------------------------------------

    @serialized
    def start(self) -> None:
        """Commit unit 0 (block 0, the null block engines pad block tables
        with), before warm-up or the first step."""
        self._commit({0})

    def adopted(self, units: UnitRanges, blocks_per_unit: int) -> None:
        """Hold ``units`` (of ``blocks_per_unit`` blocks), whose memory the
        caller has just mapped with what it held (pages a keeper kept over
        an engine's restart, :mod:`extensible_kv.kept`), then
        :meth:`start`. Before :meth:`start` only.

        Raises ValueError, changing nothing, if a unit is past the blocks
        or not mapped in every byte of every buffer."""
        check_int("blocks_per_unit", blocks_per_unit)
        if self._held or self.cache.asleep:
            raise ValueError("adopted units come before start(), with nothing held yet")
        adopted = set(units_of(units))
        per = blocks_per_unit
        if per < 1 or any(not 0 <= unit * per < self.num_blocks for unit in adopted):
            raise ValueError(
                f"units {ranges_of(adopted)} of {per} blocks are not all within the "
                f"{self.num_blocks} blocks"
            )
        before = self._books.blocks_per_unit
        self._books.set(adopted, blocks_per_unit=per)
        unmapped = [
            (offset, size)
            for (tensor, _), ranges in zip(
                self.cache.tensors, self._byte_ranges(adopted), strict=True
            )
            for offset, size in ranges
            if sum(n for _, n in tensor.buffer.mapped_in(offset, size)) != size
        ]
        if unmapped:
            self._books.set((), blocks_per_unit=before)
            raise ValueError(f"adopted units are not mapped at bytes {unmapped[:4]}")
        self.high_water = max(self.high_water, self.num_blocks_held)

    @serialized
    def apply(self, orders: ElasticOrders) -> ElasticReport:
        """Hold exactly ``orders.held`` plus as many ``orders.wanted`` units
        as the memory allows; give back every granule no held unit touches.

        Memory goes back first, so a budget has it for the commits. The
        ``held`` units are committed all together or the call fails (a
        device budget's refusal raises
        :class:`~extensible_kv.BudgetExceededError`, after the wait
        ``waiting_for_budget`` allows); ``wanted`` runs are committed in
        order until one is refused, then the refused run unit by unit as
        far as the memory goes, and the report counts the units committed.
        Each refused claim tells a device budget's other processes what is
        wanted (:meth:`~extensible_kv.budget.Ledger.pressure`).
        """
        self._check_orders(orders)
        if self.cache.asleep:
            raise ValueError("the KV cache sleeps; wake() before applying orders")
        if (
            not orders.wanted
            and orders.blocks_per_unit == self.blocks_per_unit
            and orders.held == self._books.ranges
        ):
            # Held already (orders go out whenever the blocks in use change):
            # nothing to map, and no walk of every unit held.
            self._keep_idle(orders.keep_idle)
            return ElasticReport(orders.seq, 0)
        if orders.blocks_per_unit != self.blocks_per_unit:
            self._rebase(orders.blocks_per_unit)
        held = set(units_of(orders.held)) | {0}
        try:
            self._release_outside(held | (self._held & set(units_of(orders.wanted))))
            self._commit(held)
        except BaseException:
            # The release kept the granules that units about to be committed
            # share with units given back; the commit did not happen, so
            # they go back too, and memory is what the books hold.
            self._release_outside(self._held, unheld=True)
            raise
        granted = 0
        for start, end in orders.wanted:
            try:
                self._commit(set(range(start, end)))
            except OutOfMemoryError:
                granted += self._commit_each(range(start, end))
                break
            granted += end - start
        self.high_water = max(self.high_water, self.num_blocks_held)
        self._keep_idle(orders.keep_idle)
        return ElasticReport(orders.seq, granted)

    def _keep_idle(self, keep: bool) -> None:
        """Unless ``keep``, give the memory the buffers' driver stacks keep
        idle back to the driver (a pool's handles of units given back)."""
        if not keep:
            release_idle(tensor.buffer for tensor, _ in self.cache.tensors)

    def _commit_each(self, units: range) -> int:
        """Commit ``units`` one by one until one is refused; how many were."""
        for count, unit in enumerate(units):
            try:
                self._commit({unit})
            except OutOfMemoryError:
                return count
        return len(units)

    @serialized
    def give_back(self, units: Iterable[int]) -> None:
        """Release ``units`` (ones the scheduler did not grant after all:
        a tensor-parallel peer could not commit them)."""
        self._release_outside(self._held - set(units))

    def _check_orders(self, orders: ElasticOrders) -> None:
        check_int("blocks_per_unit", orders.blocks_per_unit)
        if orders.blocks_per_unit < 1:
            raise ValueError(f"blocks_per_unit must be positive, got {orders.blocks_per_unit}")
        limit = -(-self.num_blocks // orders.blocks_per_unit)
        for start, end in (*orders.held, *orders.wanted):
            if not 0 <= start < end <= limit:
                raise ValueError(
                    f"unit range [{start}, {end}) is outside the engine's {limit} units "
                    f"of {orders.blocks_per_unit} blocks"
                )

    def _rebase(self, blocks_per_unit: int) -> None:
        """Count what is held in units of ``blocks_per_unit`` blocks: every
        new unit that overlaps a held block is held, and committed whole
        (or, if that fails, the books stay in the old units)."""
        books = self._books
        blocks = [b for lo, hi in books.blocks_of(books.ranges) for b in range(lo, hi)]
        before = books.blocks_per_unit, books.units
        books.set((), blocks_per_unit=blocks_per_unit)
        try:
            self._commit({block // blocks_per_unit for block in blocks})
        except BaseException:
            books.set(before[1], blocks_per_unit=before[0])
            raise

    def _commit(self, units: set[int]) -> None:
        """Commit ``units`` not held yet, zeroed, every buffer at once."""
        new = units - self._held
        if not new:
            return
        # One commit for the whole run: under a device budget it is claimed
        # (or refused) at once, so a refusal tells the other processes the
        # run's size, not one granule's (Ledger.pressure).
        tensors = [tensor for tensor, _ in self.cache.tensors]
        commit_ranges_all(list(zip(tensors, self._byte_ranges(new), strict=True)))
        self._books.set(self._held | new)

    def _release_outside(self, keep: AbstractSet[int], *, unheld: bool = False) -> None:
        """Give back every granule holding no byte of ``keep``'s units, when
        a held unit lies outside ``keep`` (with ``unheld``, whatever the
        books say: granules kept for units that were not committed after all).

        Unmapping is all or nothing; past it, a handle whose release fails
        is kept for the next call, and the units are out of the books before
        that failure is raised: they have no memory any more.
        """
        if not unheld and not self._held - keep:
            return
        ranges = self._byte_ranges(keep)
        buffers = [tensor.buffer for tensor, _ in self.cache.tensors]
        with Transaction(buffers) as txn:
            release_outside_together(list(zip(buffers, ranges, strict=True)))
            self._books.set(self._held & keep)
            txn.commit()

    # -- sleep ----------------------------------------------------------------

    def _regions(self, units: Iterable[int]) -> list[torch.Tensor]:
        """The bytes of ``units`` in every segment of every buffer, in order
        (uint8 views of the cache's memory)."""
        regions: list[torch.Tensor] = []
        for (tensor, _), ranges in zip(self.cache.tensors, self._byte_ranges(units), strict=True):
            full = tensor.full_view()
            regions.extend(full[offset : offset + size] for offset, size in ranges)
        return regions

    def release(self, keep: UnitRanges = ()) -> None:
        """Sleep: give every byte back. The blocks of the units ``keep``
        (held ones; the units whose blocks the engine's prefix cache names)
        are first copied to host memory, and :meth:`wake` commits those
        units again with what they held; nothing else is copied. Asleep, a
        call with ``keep`` does nothing, and one without drops the copy a
        sleep kept.

        Raises ValueError, changing nothing, if a unit of ``keep`` is not held.
        """
        if self.cache.asleep:
            if not keep:
                self._drop_kept()
            return
        kept = frozenset(units_of(keep))
        if not kept <= self._held:
            missing = ranges_of(kept - self._held)
            raise ValueError(f"units {missing} to keep over the sleep are not held")
        backup = None
        if kept:
            # Writers on any stream must be done before the copy reads the blocks.
            synchronize_buffers(tensor.buffer for tensor, _ in self.cache.tensors)
            backup = HostBackup.capture(self._regions(kept))
        try:
            self.cache.release_physical()
        except BaseException:
            if backup is not None:
                backup.free()
            raise
        self._kept = (kept, backup) if backup is not None else None

    def _drop_kept(self) -> None:
        """Free the copy kept over a sleep, if any: the wake commits unit 0 only."""
        if self._kept is not None:
            self._kept[1].free()
            self._kept = None

    @property
    def kept_bytes(self) -> int:
        """Host memory holding kept units' blocks over a sleep (0: none)."""
        return 0 if self._kept is None else self._kept[1].nbytes

    def wake(self) -> None:
        """Wake after :meth:`release`: commit unit 0, and the units kept over
        the sleep with what they held (the rest is the engine's to order:
        the next :meth:`apply` commits what the step needs). All or nothing:
        if a commit or the copy fails the cache stays asleep, its copy kept
        for the next try. Does nothing while awake."""
        if not self.cache.asleep:
            return
        units, backup = self._kept if self._kept is not None else (frozenset({0}), None)
        self.cache.recommit(num_blocks=0)
        try:
            self._commit(set(units) | {0})
            if backup is not None:
                backup.restore(self._regions(units))
        except BaseException:
            self.cache.release_physical()
            raise
        if backup is not None:
            backup.free()
        self._kept = None
