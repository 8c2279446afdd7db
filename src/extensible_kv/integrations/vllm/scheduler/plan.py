"""The elastic scheduler's plan (``growth: "elastic"``): which units of
blocks the workers hold, and the orders that change it each step.

Its cost follows what changed: the units given back, asked for, evicted
or answered, each run of them in one change of the free queue, the units
to look at read from the queue's index
(:mod:`~extensible_kv.integrations.vllm.scheduler.unit_index`) and the committed
units kept as ranges; never a scan of every unit, every cached block or
every request. A step evicts from the prefix cache, and gives back, at
most :data:`RELEASE_PER_STEP` units each, and asks for another step while
more could go, so the step where the load falls costs about what any other
does (at 30,720 one-block units, evicting and giving back all at once took
6 ms of Python; the rest now goes over the next empty steps, each well
under a millisecond).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from extensible_kv.integrations.vllm.scheduler.free_queue import PackedFreeQueue
from extensible_kv.integrations.vllm.scheduler.in_flight import BatchesInFlight
from extensible_kv.integrations.vllm.seam import (
    ElasticOrders,
    ElasticReport,
    IntervalSet,
    UnitRanges,
)

__all__ = ["REFUSED_RETRY_S", "RELEASE_PER_STEP", "ElasticPlan"]

logger = logging.getLogger(__name__)

#: Seconds before units a budget refused are asked for again.
REFUSED_RETRY_S = 0.05
#: A refusal counts as recent (:meth:`ElasticPlan.refused_recently`) for
#: this many seconds after the retry's wait, and for this many plans,
#: whichever lasts longer: on a loaded host a step can take more than a
#: second, and a window in seconds alone closed between two steps (the
#: engine then kept its prefix cache from its waiting requests and asked
#: again at every other step; docs/performance.md, the trace replay).
REFUSED_FOR_S = 1.0
REFUSED_FOR_PLANS = 4
#: The most units a step evicts from the prefix cache, and the most it
#: looks at to give back (each costs a few microseconds of Python); the
#: engine steps again for the rest.
RELEASE_PER_STEP = 128


class ElasticPlan:
    """Which units the workers hold, and the orders that change it.

    Args:
        pool: vLLM's ``BlockPool`` (its free queue is replaced by a
            :class:`PackedFreeQueue`).
        blocks_per_unit: blocks per unit.
        cache_blocks: the most blocks kept for the prefix cache.
        floor_blocks: blocks never given back to other processes' wants.
    """

    def __init__(
        self, pool: Any, blocks_per_unit: int, cache_blocks: int, floor_blocks: int = 0
    ) -> None:
        self.pool = pool
        self.queue = PackedFreeQueue(
            pool.blocks, pool.free_block_queue.get_all_free_blocks(), blocks_per_unit
        )
        pool.free_block_queue = self.queue
        self.cache_blocks = cache_blocks
        self.floor_blocks = floor_blocks
        #: Per unit, whether the workers hold it (1) or not (0); as ranges.
        self.committed = bytearray(self.queue.num_units)
        self.committed[0] = 1
        self._committed = IntervalSet()
        self._committed.add(0, 1)
        #: Blocks of the committed units.
        self.held_blocks = self.queue.units.sizes[0]
        #: Batches vLLM scheduled and has not had the output of yet.
        self.in_flight = BatchesInFlight()
        #: Units asked for that no report has granted or refused yet.
        self._pending = IntervalSet()
        self._sent_held: UnitRanges = ()  # the first plan sends
        self._sent_use = (0, 0)
        #: Whether the last orders let the workers keep memory idle.
        self.keeps_idle = False
        #: Whether the last plan kept blocks ahead of the demand (an idle
        #: plan gives them back).
        self._kept_ahead = False
        self._seq = 0
        self._retry_at = 0.0
        #: Plans made, and how many had been made when a budget last refused units.
        self._plans = 0
        self._refused_plan = -REFUSED_FOR_PLANS
        self._held_cache: UnitRanges | None = None

    @property
    def blocks_per_unit(self) -> int:
        return self.queue.blocks_per_unit

    def needs_step(self) -> bool:
        """Whether a step would change what the workers hold (checked when
        no request runs, so that memory follows the load down): a change,
        units that go back once the batches running are done, or blocks
        kept ahead of a demand that is gone."""
        return self.queue.changed or self.in_flight.any_pinned or self._kept_ahead

    def batch_scheduled(self) -> None:
        """vLLM scheduled a batch (after the plan of its orders)."""
        self.in_flight.given_back(self.queue.take_freed())
        self.in_flight.batch_scheduled()

    def batch_finished(self) -> None:
        """vLLM took a batch's output in (its requests' blocks given back).
        Units it unpins may go back now: the next step, if the engine is
        idle, is there to give them (:meth:`needs_step`)."""
        self.in_flight.given_back(self.queue.take_freed())
        if self.in_flight.batch_finished():
            self.queue.changed = True

    def plan(
        self, demand_blocks: int, give_blocks: int = 0, ahead_blocks: int = 0
    ) -> ElasticOrders | None:
        """Orders for the next step, if they change anything: trim the cache
        to its bound (and by ``give_blocks`` more that other processes
        want), give back empty units past ``demand_blocks`` free blocks, ask
        for units up to it; and ``ahead_blocks`` free blocks more while no
        budget refuses and no other process wants memory."""
        orders = self._orders(demand_blocks, give_blocks, ahead_blocks)
        self._plans += 1
        return orders

    def _orders(
        self, demand_blocks: int, give_blocks: int, ahead_blocks: int
    ) -> ElasticOrders | None:
        """:meth:`plan`'s orders (the plan's state changed as they say)."""
        queue = self.queue
        self.in_flight.given_back(queue.take_freed())
        more = self._bound_cache()
        if give_blocks:
            if not self._pending:
                # Empty units (the blocks kept ahead through the linger,
                # above all) go first, so that the floor counts only what
                # stays: counted, they let the cache go below it.
                more |= self._release(queue.num_clean - demand_blocks)
            more |= self._give(give_blocks)
        # Requests that arrive while a step runs find, at the next one, only
        # what this plan committed: without blocks ahead, a burst's first
        # step grows for the requests it saw, and the rest wait a step more
        # for their units (a step's time on every first token but the first).
        if give_blocks or self.refused_recently():
            ahead_blocks = 0
        # Handles of units given back may wait idle for the next commits
        # (a burst then creates none) only while the engine runs and no one
        # else wants memory: idle, they would hold what should go back.
        keep_idle = self._kept_ahead = ahead_blocks > 0
        # The prefix cache is not spent on new blocks while memory can
        # still be committed: a burst waits a step for its units instead.
        # Once the budget refuses, the engine lends its own cache before it
        # asks other engines for theirs (orders' ``ask_others``): asking
        # costs the idle engine a step (and on vLLM's CPU build, a core for
        # a second after it: a worker busy-waits on its queue that long),
        # and its cache is what lets its next request start warm.
        queue.lend_cached = self.refused_recently() or self._all_committed()
        ask = False
        short = demand_blocks + ahead_blocks - queue.num_clean
        if self._pending:
            # Asked for by orders whose report is not in yet (a batch in
            # flight): asked for again, so these orders do not give back
            # what a worker committed for the ones before.
            pass
        elif short <= 0:
            more |= self._release(-short)
        elif time.monotonic() >= self._retry_at:
            own = queue.num_clean + queue.num_cached
            ask = self.refused_recently() and own < demand_blocks
            self._ask_for(short)
        queue.changed = more
        wanted = tuple(self._pending)
        held = self._held_ranges()
        use = (self.held_blocks - queue.num_clean - queue.num_cached, queue.num_cached)
        if (
            not wanted
            and held == self._sent_held
            and use == self._sent_use
            and keep_idle == self.keeps_idle
        ):
            return None
        self._seq += 1
        self._sent_held, self._sent_use, self.keeps_idle = held, use, keep_idle
        return ElasticOrders(
            self._seq, self.blocks_per_unit, held, wanted, *use, ask, keep_idle=keep_idle
        )

    # -- the prefix cache ---------------------------------------------------------

    def _give(self, blocks: int) -> bool:
        """Drop the prefix cache's units, least recently used first, until
        ``blocks`` blocks are free to go back (the release that follows
        gives them), keeping at least the floor's blocks held; at most
        :data:`RELEASE_PER_STEP` units. Whether more are to go."""
        units, left = self.queue.units, self.held_blocks
        doomed: list[int] = []
        while blocks > 0 and len(doomed) < RELEASE_PER_STEP:
            unit = units.oldest_only_cached()
            if unit is None or left - units.sizes[unit] < self.floor_blocks:
                break
            doomed.append(unit)
            units.set_aside(unit)
            blocks -= units.sizes[unit]
            left -= units.sizes[unit]
        self._evict(doomed)
        return len(doomed) == RELEASE_PER_STEP

    def can_give(self) -> bool:
        """Whether a unit no request holds could go back, above the floor."""
        units, last = self.queue.units, self.queue.num_units - 1
        if self.held_blocks - self.blocks_per_unit >= self.floor_blocks:
            return units.any_holding_no_request()
        # Only the last unit, which may be shorter, could go and keep the floor.
        return (
            last > 0
            and bool(self.committed[last])
            and units.holds_no_request(last)
            and self.held_blocks - units.sizes[last] >= self.floor_blocks
        )

    def _evict(self, doomed: list[int]) -> None:
        """Drop the cached blocks of units ``doomed`` from the prefix cache
        (one call of vLLM's ``evict_blocks``): the units are empty after."""
        if not doomed:
            return
        blocks = {unit: self.queue.cached_of(unit) for unit in doomed}
        self.pool.evict_blocks({block for ids in blocks.values() for block in ids})
        for unit, ids in blocks.items():
            self.queue.forget(unit, ids)

    def _bound_cache(self) -> bool:
        """Keep the units held only for cached blocks within ``cache_blocks``
        blocks: the unit whose latest use is oldest loses its cached blocks
        first (vLLM's ``evict_blocks``), at most :data:`RELEASE_PER_STEP`
        units a step. Cached blocks in a unit a request uses cost no memory
        of their own, and stay. Whether more are to go."""
        units = self.queue.units
        doomed: list[int] = []
        excess = units.only_cached_blocks - self.cache_blocks
        while excess > 0 and len(doomed) < RELEASE_PER_STEP:
            unit = units.oldest_only_cached()
            if unit is None:
                break
            doomed.append(unit)
            units.set_aside(unit)
            excess -= units.sizes[unit]
        self._evict(doomed)
        return excess > 0 and len(doomed) == RELEASE_PER_STEP

    # -- the units held -----------------------------------------------------------

    def refused_recently(self) -> bool:
        """Whether a budget refused units within the last
        :data:`REFUSED_FOR_S` seconds (after the retry's wait) or
        :data:`REFUSED_FOR_PLANS` plans, whichever lasts longer."""
        if self._plans - self._refused_plan < REFUSED_FOR_PLANS:
            return True
        return time.monotonic() < self._retry_at + REFUSED_FOR_S

    def _all_committed(self) -> bool:
        return self._committed.total == self.queue.num_units

    def _held_ranges(self) -> UnitRanges:
        """The committed units as ranges, made again only after a change."""
        if self._held_cache is None:
            self._held_cache = tuple(self._committed)
        return self._held_cache

    def _ask_for(self, blocks: int) -> None:
        """Ask for the lowest units not committed whose blocks cover ``blocks``."""
        sizes = self.queue.units.sizes
        for start, end in self._committed.gaps(0, self.queue.num_units):
            if blocks <= 0:
                return
            # Whole units but (maybe) the last; the shorter last one is
            # counted by its own size.
            count = min(end - start, -(-blocks // self.blocks_per_unit))
            self._pending.add(start, start + count)
            blocks -= sum(sizes[start : start + count])

    def _release(self, surplus_blocks: int) -> bool:
        """Give back empty units, highest first, while the free blocks left
        still cover the demand; none a batch in flight may still use, and
        at most :data:`RELEASE_PER_STEP` looked at. Whether more may go (the
        engine then steps again)."""
        if surplus_blocks < self.blocks_per_unit:
            return False  # not a whole unit to spare (the last, shorter one waits)
        units, more, looked = self.queue.units, False, 0
        kept: list[int] = []
        going: list[list[int]] = []  # runs [start, end), highest first
        while surplus_blocks > 0:
            if looked == RELEASE_PER_STEP:
                more = True
                break
            looked += 1
            unit = units.pop_empty()
            if unit is None:
                break
            kept.append(unit)
            if self.in_flight.pinned(unit):
                continue
            if units.sizes[unit] > surplus_blocks:
                break  # the units below are whole ones, no smaller
            kept.pop()
            if going and going[-1][0] == unit + 1:
                going[-1][0] = unit
            else:
                going.append([unit, unit + 1])
            surplus_blocks -= units.sizes[unit]
        for start, end in going:
            self._set_committed(start, end, False)
        for unit in kept:
            units.push_empty(unit)
        return more

    def adopt(self, units: Iterable[tuple[int, int]], cached: Iterable[Any]) -> None:
        """Before the first plan: the workers hold ``units`` (ranges, unit 0
        aside), adopted from a stopped engine, and the pool names
        ``cached`` (vLLM's blocks in them, their hashes inserted, free):
        count the units held and the blocks cached, oldest first."""
        for start, end in units:
            self._set_committed(start, end, True)
        for block in cached:
            # Through the queue's own calls: a free block vLLM takes and
            # gives back with its hash is what counts as cached.
            self.queue.remove(block)
            self.queue.append(block)
        self.queue.take_freed()

    def _set_committed(self, start: int, end: int, committed: bool) -> None:
        """Count units ``[start, end)`` as held by the workers or not, their
        blocks in circulation or out of it."""
        blocks = sum(self.queue.units.sizes[start:end])
        if committed:
            self.queue.reveal(start, end)
            self._committed.add(start, end)
        else:
            self.queue.hide(start, end)
            self._committed.remove(start, end)
        self.committed[start:end] = bytes([committed]) * (end - start)
        self.held_blocks += blocks if committed else -blocks
        self._held_cache = None

    def confirm(self, orders: ElasticOrders | None, report: ElasticReport | None) -> None:
        """The workers' answer: the units of ``orders.wanted`` they
        committed join the free blocks; the rest are asked for again later.
        With a batch queue the answer may be to orders before the last
        ones, which asked for the same units again: what it grants counts,
        and what it refuses is left to the last orders' answer."""
        if orders is None or not orders.wanted:
            return
        granted = report.granted if report is not None and report.seq == orders.seq else 0
        latest = orders.seq == self._seq
        for start, end in _first_units(orders.wanted, granted):
            # Not pending: an answer to orders before granted it already,
            # and the plan may have given it back since.
            for lo, hi in self._pending.overlaps(start, end):
                self._set_committed(lo, hi, True)
                self._pending.remove(lo, hi)
        asked = sum(end - start for start, end in orders.wanted)
        if latest:
            # What the workers hold now: a later release must be sent even
            # when it brings the held units back to what the last orders said.
            self._sent_held = self._held_ranges()
        if granted < asked:
            self._retry_at = time.monotonic() + REFUSED_RETRY_S
            self._refused_plan = self._plans
            # A worker may hold units it could not report (a peer refused
            # them, a report went missing): the next orders say what to keep.
            self._sent_held = ()
            logger.debug("extensible-kv: %d of %d units refused", asked - granted, asked)
            if latest:
                self._pending.clear()
        self.queue.changed = True

    @contextmanager
    def all_visible(self) -> Iterator[None]:
        """Every block in circulation for a moment (vLLM's prefix-cache reset
        counts free blocks); hidden again after, and cached ones forgotten if
        the reset dropped their hashes."""
        hidden = self._committed.gaps(0, self.queue.num_units)
        for start, end in hidden:
            self.queue.reveal(start, end)
        lend, self.queue.lend_cached = self.queue.lend_cached, True
        try:
            yield
        finally:
            self.queue.lend_cached = lend
            if all(block.block_hash is None for block in self.pool.blocks):
                self.queue.forget_all()
            for start, end in hidden:
                self.queue.hide(start, end)


def _first_units(ranges: UnitRanges, count: int) -> Iterator[tuple[int, int]]:
    """The first ``count`` units of ``ranges``, as ranges."""
    for start, end in ranges:
        if count <= 0:
            return
        take = min(count, end - start)
        yield start, start + take
        count -= take
