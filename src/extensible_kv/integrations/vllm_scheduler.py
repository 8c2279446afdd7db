"""vLLM's scheduler deciding what KV memory its workers hold (``growth: "elastic"``).

::

    LLM(model,
        worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker",
        scheduler_cls="extensible_kv.integrations.vllm.ExtensibleKVScheduler",
        additional_config={"extensible_kv": {"growth": "elastic"}})

vLLM tells a worker which blocks a step uses, never which blocks were freed
or which its prefix cache keeps; the scheduler knows. This subclass of
vLLM's :class:`Scheduler` (chosen with vLLM's ``scheduler_cls``, no patch)
keeps the blocks in use and the cached ones packed in as few **units**
(about a granule's worth of consecutive block ids) as it can, and sends every
worker, on the :class:`SchedulerOutput` vLLM already sends each step, the
:class:`~extensible_kv.kv.elastic.ElasticOrders`: the units the step may use
and the units to commit ahead (what the requests need, and one step's
token budget more while requests run). Workers answer on the output they
return (:class:`~extensible_kv.kv.elastic.ElasticReport`).

How the blocks are handed out (lowest id first, only blocks of committed
units, the prefix cache within ``cache_bytes``) is the block pool's free
queue in this scheduler,
:class:`~extensible_kv.integrations.vllm_free_queue.PackedFreeQueue`.

When no request runs, :meth:`ExtensibleKVScheduler.has_requests` stays true
while orders wait to go out, so vLLM's engine-core loop (the default, a
process of its own) runs one empty step that carries them: memory is back
within a step of the load falling. An engine stepped in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only while ``generate`` runs,
so there the orders go with the next step.

It runs on whichever scheduler vLLM chose: its ``AsyncScheduler`` where
async scheduling is on (vLLM's default on a GPU; the CPU build turns it
off), its ``Scheduler`` otherwise (:class:`ExtensibleKVScheduler` makes an
:class:`ExtensibleKVAsyncScheduler` for the first). With async scheduling
or pipeline parallelism vLLM runs a batch queue, scheduling a batch while
the one before still executes: a unit goes back only once no batch running
may use a block of it (:mod:`~extensible_kv.integrations.vllm_in_flight`),
and units asked for stay asked for until the workers' report on them is
in, so that orders sent meanwhile never give them back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from extensible_kv.integrations.vllm_free_queue import PackedFreeQueue
from extensible_kv.integrations.vllm_in_flight import BatchesInFlight
from extensible_kv.integrations.vllm_options import options_of
from extensible_kv.integrations.vllm_pressure import Pressure
from extensible_kv.intervals import IntervalSet
from extensible_kv.kv.elastic import ElasticOrders, ElasticReport, ranges_of, units_of
from extensible_kv.kv.strided import segmentation

logger = logging.getLogger(__name__)

#: The memory a unit of blocks is packed to: a granule of the host backend
#: and of CUDA's device memory (2 MiB). Workers map exactly whatever their
#: granularity; this only sizes the units the scheduler packs and counts.
UNIT_BYTES = 2 << 20
#: Seconds before units a budget refused are asked for again.
REFUSED_RETRY_S = 0.05


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
        self._committed_ranges = IntervalSet()
        self._committed_ranges.add(0, 1)
        #: Blocks of the committed units.
        self.held_blocks = len(self.queue.unit_blocks(0))
        #: Batches vLLM scheduled and has not had the output of yet.
        self.in_flight = BatchesInFlight()
        #: Units asked for that no report has granted or refused yet.
        self._pending: list[int] = []
        self._sent_held: tuple[tuple[int, int], ...] = ()  # the first plan sends
        self._sent_use = (0, 0)
        self._seq = 0
        self._retry_at = 0.0
        self._held_cache: tuple[tuple[int, int], ...] | None = None

    @property
    def blocks_per_unit(self) -> int:
        return self.queue.blocks_per_unit

    def needs_step(self) -> bool:
        """Whether a step would change what the workers hold (checked when
        no request runs, so that memory follows the load down): a change,
        or units that go back once the batches running are done."""
        return self.queue.changed or self.in_flight.any_pinned

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
        queue = self.queue
        self.in_flight.given_back(queue.take_freed())
        self._bound_cache()
        if give_blocks:
            self._give(give_blocks)
        # Requests that arrive while a step runs find, at the next one, only
        # what this plan committed: without blocks ahead, a burst's first
        # step grows for the requests it saw, and the rest wait a step more
        # for their units (a step's time on every first token but the first).
        if give_blocks or self._refused_recently():
            ahead_blocks = 0
        # The prefix cache is not spent on new blocks while memory can
        # still be committed: a burst waits a step for its units instead.
        # Once the budget refuses, the engine lends its own cache before it
        # asks other engines for theirs (orders' ``ask_others``): asking
        # costs the idle engine a step (and on vLLM's CPU build, a core for
        # a second after it: a worker busy-waits on its queue that long),
        # and its cache is what lets its next request start warm.
        queue.lend_cached = self._refused_recently() or self._all_committed()
        wanted: list[int] = []
        ask = False
        short = demand_blocks + ahead_blocks - queue.num_clean
        if self._pending:
            # Asked for by orders whose report is not in yet (a batch in
            # flight): asked for again, so these orders do not give back
            # what a worker committed for the ones before.
            wanted = self._pending
        elif short <= 0:
            self._release(-short)
        elif time.monotonic() >= self._retry_at:
            own = queue.num_clean + queue.num_cached
            ask = self._refused_recently() and own < demand_blocks
            wanted = self._units_to_commit(short)
        queue.changed = False
        held = self._held_ranges()
        use = (self.held_blocks - queue.num_clean - queue.num_cached, queue.num_cached)
        if not wanted and held == self._sent_held and use == self._sent_use:
            return None
        self._seq += 1
        self._pending = wanted
        self._sent_held, self._sent_use = held, use
        return ElasticOrders(self._seq, self.blocks_per_unit, held, ranges_of(wanted), *use, ask)

    def _give(self, blocks: int) -> None:
        """Drop the prefix cache's units, least recently used first, until
        ``blocks`` blocks are free to go back (the release that follows
        gives them), keeping at least the floor's blocks held."""
        units = self.queue.units
        left = self.held_blocks
        while blocks > 0:
            unit = units.oldest_only_cached()
            if unit is None or left - units.size(unit) < self.floor_blocks:
                break
            self._evict(unit)
            blocks -= units.size(unit)
            left -= units.size(unit)

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
            and self.held_blocks - units.size(last) >= self.floor_blocks
        )

    def _all_committed(self) -> bool:
        return self._committed_ranges.total == self.queue.num_units

    def _evict(self, unit: int) -> None:
        """Drop ``unit``'s cached blocks from the prefix cache (vLLM's
        ``evict_blocks``): the unit is empty after."""
        doomed = self.queue.cached_of(unit)
        self.pool.evict_blocks(set(doomed))
        for block_id in doomed:
            self.queue.forget(block_id)

    def _bound_cache(self) -> None:
        """Keep the units held only for cached blocks within ``cache_blocks``
        blocks: the unit whose latest use is oldest loses its cached blocks
        first (vLLM's ``evict_blocks``). Cached blocks in a unit a request
        uses cost no memory of their own, and stay."""
        units = self.queue.units
        while units.only_cached_blocks > self.cache_blocks:
            unit = units.oldest_only_cached()
            if unit is None:
                break
            self._evict(unit)

    def _refused_recently(self) -> bool:
        return time.monotonic() < self._retry_at + 1.0

    def _held_ranges(self) -> tuple[tuple[int, int], ...]:
        """The committed units as ranges, made again only after a change."""
        if self._held_cache is None:
            self._held_cache = tuple(self._committed_ranges)
        return self._held_cache

    def _units_to_commit(self, blocks: int) -> list[int]:
        """The lowest units not committed whose blocks cover ``blocks``."""
        units: list[int] = []
        for start, end in self._committed_ranges.gaps(0, self.queue.num_units):
            for unit in range(start, end):
                if blocks <= 0:
                    return units
                units.append(unit)
                blocks -= self.queue.units.size(unit)
        return units

    def _release(self, surplus_blocks: int) -> None:
        """Give back empty units, highest first, while the free blocks left
        still cover the demand; none a batch in flight may still use."""
        if surplus_blocks < self.blocks_per_unit:
            return  # not a whole unit to spare (the last, shorter one waits)
        units, kept = self.queue.units, []
        while surplus_blocks > 0:
            unit = units.pop_empty()
            if unit is None:
                break
            kept.append(unit)
            if self.in_flight.pinned(unit):
                continue
            size = units.size(unit)
            if size > surplus_blocks:
                break  # the units below are whole ones, no smaller
            kept.pop()
            self._set_committed(unit, False)
            surplus_blocks -= size
        for unit in kept:
            units.push_empty(unit)

    def _set_committed(self, unit: int, committed: bool) -> None:
        """Count ``unit`` as held by the workers or not, its blocks in
        circulation or out of it."""
        size = self.queue.units.size(unit)
        if committed:
            self.queue.reveal(unit)
            self._committed_ranges.add(unit, unit + 1)
        else:
            self.queue.hide(unit)
            self._committed_ranges.remove(unit, unit + 1)
        self.committed[unit] = committed
        self.held_blocks += size if committed else -size
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
        units = units_of(orders.wanted)
        pending = set(self._pending)
        for unit in units[:granted]:
            # Not pending: an answer to orders before granted it already,
            # and the plan may have given it back since.
            if unit in pending:
                self._set_committed(unit, True)
        latest = orders.seq == self._seq
        if latest:
            # What the workers hold now: a later release must be sent even
            # when it brings the held units back to what the last orders said.
            self._sent_held = self._held_ranges()
        if granted < len(units):
            self._retry_at = time.monotonic() + REFUSED_RETRY_S
            # A worker may hold units it could not report (a peer refused
            # them, a report went missing): the next orders say what to keep.
            self._sent_held = ()
            logger.debug("extensible-kv: %d of %d units refused", len(units) - granted, len(units))
        done = set(units if latest else units[:granted])
        self._pending = [unit for unit in self._pending if unit not in done]
        self.queue.changed = True

    @contextmanager
    def all_visible(self) -> Iterator[None]:
        """Every block in circulation for a moment (vLLM's prefix-cache reset
        counts free blocks); hidden again after, and cached ones forgotten if
        the reset dropped their hashes."""
        hidden = [u for u in range(self.queue.num_units) if not self.committed[u]]
        for unit in hidden:
            self.queue.reveal(unit)
        lend, self.queue.lend_cached = self.queue.lend_cached, True
        try:
            yield
        finally:
            self.queue.lend_cached = lend
            if all(block.block_hash is None for block in self.pool.blocks):
                self.queue.forget_all()
            for unit in hidden:
                self.queue.hide(unit)


def blocks_per_unit(kv_cache_config: Any) -> int:
    """Blocks in :data:`UNIT_BYTES` of the buffer's largest blocks (at least 1)."""
    return max(1, UNIT_BYTES // segmentation(kv_cache_config).row_bytes)


class ExtensibleKVScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, deciding the KV memory of ``growth: "elastic"`` (see
    the module); with any other growth, vLLM's scheduler unchanged.

    The one name users pass as ``scheduler_cls``, whichever scheduler vLLM
    decided on: where its config has async scheduling on, making one makes
    an :class:`ExtensibleKVAsyncScheduler` (this class on vLLM's
    ``AsyncScheduler``), so a custom scheduler costs no overlap."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ExtensibleKVScheduler:
        # vLLM picks its scheduler class before it makes one, from the
        # config alone (SchedulerConfig.get_scheduler_cls); the choice
        # between the synchronous and the async base is made here, from
        # the same config, so that one public name serves both.
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is ExtensibleKVScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = ExtensibleKVAsyncScheduler
        made: ExtensibleKVScheduler = super().__new__(cls)
        return made

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        options = options_of(vllm_config)
        self._elastic: ElasticPlan | None = None
        if options.get("growth") != "elastic":
            return
        num_blocks = int(kv_cache_config.num_blocks)
        bytes_per_block = int(kv_cache_config.kv_cache_tensors[0].size) // num_blocks
        cache_bytes = options.get("cache_bytes")
        if cache_bytes is None:
            cache_bytes = default_cache_bytes(num_blocks * bytes_per_block)
        per_unit = blocks_per_unit(kv_cache_config)
        # A rank's block across every tensor: what the budget counts.
        rank_block = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) // num_blocks
        self._pressure = Pressure(rank_block)
        self._elastic = ElasticPlan(
            self.kv_cache_manager.block_pool, per_unit, cache_bytes // bytes_per_block
        )
        #: What one step's token budget (vLLM's ``max_num_scheduled_tokens``)
        #: can fill, in blocks: the most a step can start on before the next plan.
        self._step_blocks = -(-int(self.max_num_scheduled_tokens) // int(self.block_size))
        logger.info(
            "extensible-kv: elastic KV memory, units of %d blocks, the prefix cache "
            "within %d bytes (%d blocks)",
            per_unit,
            cache_bytes,
            cache_bytes // bytes_per_block,
        )

    def _demand(self) -> int:
        """Free blocks the requests need soon: the rest of every waiting
        prompt, and what running requests need for two more tokens (beyond
        the tokens async scheduling has scheduled ahead of their output)."""
        size = int(self.block_size)
        need: int = sum(-(-(r.num_tokens + 2) // size) for r in self.waiting)
        for request in self.running:
            held = -(-request.num_computed_tokens // size)
            ahead = request.num_tokens_with_spec + request.num_output_placeholders + 2
            need += max(0, -(-ahead // size) - held)
        return need

    def _ahead(self) -> int:
        """Free blocks kept ahead of the demand while requests wait or run
        (a step's worth); none when the engine is idle, so that its memory
        follows the load down."""
        return self._step_blocks if self.waiting or self.running else 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        orders = None
        if self._elastic is not None:
            give = self._pressure.blocks_wanted()
            self._elastic.floor_blocks = self._pressure.floor_blocks
            orders = self._elastic.plan(self._demand(), give, self._ahead())
            if give:
                self._pressure.spent()
        output = super().schedule(*args, **kwargs)
        if self._elastic is not None:
            self._elastic.batch_scheduled()
        if orders is not None:
            output.extensible_kv = orders
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._elastic is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        report = getattr(model_runner_output, "extensible_kv", None)
        if report is not None and report.ledgers:
            self._pressure.learn(report.ledgers)
        self._elastic.confirm(getattr(scheduler_output, "extensible_kv", None), report)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._elastic.batch_finished()
        return outputs

    def has_requests(self) -> bool:
        """vLLM's answer; with elastic growth also true while orders wait
        to go out, or while another process wants memory this engine holds
        idle (a step gives it back)."""
        if super().has_requests():
            return True
        elastic = self._elastic
        if elastic is None:
            return False
        return elastic.needs_step() or (self._pressure.blocks_wanted() > 0 and elastic.can_give())

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        if self._elastic is None:
            return bool(super().reset_prefix_cache(*args, **kwargs))
        with self._elastic.all_visible():
            return bool(super().reset_prefix_cache(*args, **kwargs))


class ExtensibleKVAsyncScheduler(ExtensibleKVScheduler, AsyncScheduler):  # type: ignore[misc]
    """:class:`ExtensibleKVScheduler` on vLLM's ``AsyncScheduler``: what it
    makes where vLLM's async scheduling is on (its method order runs ours,
    then vLLM's async scheduling, then vLLM's scheduler)."""


def default_cache_bytes(kv_cache_bytes: int) -> int:
    """The default ``cache_bytes``: an eighth of the KV cache vLLM sized."""
    return kv_cache_bytes // 8
