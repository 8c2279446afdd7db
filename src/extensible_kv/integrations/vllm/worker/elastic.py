"""The worker's side of ``growth: "elastic"``: before each vLLM step, hold
what the scheduler's orders say (:class:`~extensible_kv.kv.growth.elastic.ElasticOrders`,
on the step's ``SchedulerOutput``), and answer with a report
(:class:`~extensible_kv.kv.growth.elastic.ElasticReport`) on the step's output. The
scheduler's side is :mod:`extensible_kv.integrations.vllm.scheduler.scheduler`."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from vllm.v1.outputs import AsyncModelRunnerOutput

from extensible_kv.integrations.vllm.seam import (
    Driver,
    ElasticBlocks,
    ElasticOrders,
    ElasticReport,
    PoolingDriver,
    accounting_of,
    get_driver,
    ranges_of,
    segmentation,
    units_of,
    without_wants,
)
from extensible_kv.integrations.vllm.worker.steps import scheduled_block_ids

__all__ = ["ElasticSteps", "elastic_driver", "pool_bytes"]


def elastic_driver(device: torch.device, kv_cache_config: Any, step_tokens: int) -> Driver | None:
    """The driver stack of an elastic KV cache on ``device``: on a GPU, the
    default one under a :class:`~extensible_kv.PoolingDriver` that keeps
    the handles of one step's units (:func:`pool_bytes`) given back while
    the engine runs, so that the next commits create none (the orders say
    when to give them back: :attr:`ElasticOrders.keep_idle`); None on the
    host, where creating memory costs nothing apart from mapping it."""
    if device.type == "cpu":
        return None
    inner = get_driver(device)
    granule = inner.granularity(device.index or 0, False)
    return PoolingDriver(inner, cap_bytes=pool_bytes(kv_cache_config, step_tokens, granule))


def pool_bytes(kv_cache_config: Any, step_tokens: int, granule: int) -> int:
    """Bytes of the handles one step's blocks (``step_tokens``, vLLM's token
    budget of a step) take in the cache ``kv_cache_config`` describes: in
    each segment, the ``granule``-byte handles they span, and one more for
    the ends."""
    layout = segmentation(kv_cache_config)
    block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    step_blocks = -(-step_tokens // block_size)
    granules = -(-step_blocks * layout.row_bytes // granule) + 1
    return layout.num_segments * granules * granule


class ElasticSteps:
    """Applies the scheduler's orders to a worker's elastic KV memory, step
    by step, and keeps the report on them until the step's output takes it.

    Args:
        blocks: the units of blocks held (committed in the worker's KV
            cache); this object orders them, the worker owns the cache.
    """

    def __init__(self, blocks: ElasticBlocks) -> None:
        self.blocks = blocks
        #: The scheduler's last orders, the units the scheduler counts as
        #: held after them, and the report on them that goes back with this
        #: step's output.
        self.orders: ElasticOrders | None = None
        self.holding: ElasticOrders | None = None
        self.report: ElasticReport | None = None
        #: Whether a report named this worker's budget ledgers yet.
        self._told_ledgers = False
        #: Units a step has written blocks of since they were committed
        #: (zeroed): the only ones that may hold what vLLM's prefix cache
        #: names, so the only ones a preserving sleep copies. At the start,
        #: the units held: unit 0, and those adopted from a stopped engine.
        self.dirty: set[int] = set(blocks.held)

    def with_report(self, output: Any) -> Any:
        """``output`` (a step's, from vLLM's runner) carrying the report on
        this step's orders to the scheduler, once; ``output`` itself when
        there is none. The report goes on a copy: vLLM reuses one empty
        output for every empty step. An output still being computed (vLLM's
        ``AsyncModelRunnerOutput``, what its GPU runner returns under async
        scheduling) carries it on the output it gives when done."""
        if output is None or self.report is None:
            return output
        report, self.report = self.report, None
        if isinstance(output, AsyncModelRunnerOutput):
            return _Reported(output, report)
        return _carrying(output, report)

    def before_step(self, scheduler_output: Any, wake: Callable[[], None]) -> None:
        """Hold what the scheduler's orders say before the step runs. An
        empty step while asleep only records them (the wake commits unit 0,
        the next orders the rest); a step with tokens while asleep calls
        ``wake`` (the worker's, which commits the cache again) first."""
        asleep = self.blocks.cache.asleep
        orders: ElasticOrders | None = getattr(scheduler_output, "extensible_kv", None)
        if orders is not None:
            self.orders = orders
            self.blocks.cache.block_use = (orders.in_use_blocks, orders.cached_blocks)
            if asleep:
                # Asleep: what the wake must come back to is these orders.
                self.holding = dataclasses.replace(orders, wanted=())
        if asleep:
            if not scheduler_output.total_num_scheduled_tokens:
                if orders is not None:
                    self.report = ElasticReport(orders.seq, 0)
                return
            wake()
        if orders is not None:
            with nullcontext() if orders.ask_others else without_wants():
                granted = self.blocks.apply(orders)
            self.report = self._with_ledgers(self._agreed(granted))
            # What the scheduler counts once it reads the report: the held
            # units and the wanted ones granted.
            self.holding = dataclasses.replace(orders, held=self.blocks.held_units, wanted=())
        elif self.holding is not None and not self.blocks.holds_units(self.holding.held):
            # Woken since: commit what the scheduler counts again.
            self.blocks.apply(self.holding)
        used = scheduled_block_ids(scheduler_output)
        per = self.blocks.blocks_per_unit
        self.dirty = {unit for unit in self.dirty if unit in self.blocks.held}
        self.dirty.update(block // per for block in used)
        if not self.blocks.holds(used):
            raise RuntimeError(
                f"vLLM scheduled blocks outside the units the scheduler ordered "
                f"({sorted(set(used))[:8]}...); run growth 'elastic' with "
                f"scheduler_cls='extensible_kv.integrations.vllm.ExtensibleKVScheduler'"
            )

    def release(self, preserve: bool) -> None:
        """Sleep: give every byte back; with ``preserve`` first copy the
        units steps have written to (:attr:`dirty`), which the wake restores
        at the same block ids, so vLLM's prefix cache stays valid. Asleep,
        a discarding call drops the copy a preserving one made."""
        if self.blocks.cache.asleep:
            if not preserve:
                self.blocks.release()
                self.dirty = set()
            return
        keep = ranges_of(self.dirty & self.blocks.held) if preserve else ()
        self.blocks.release(keep)
        self.dirty = set(units_of(keep))

    def _with_ledgers(self, report: ElasticReport) -> ElasticReport:
        """The first report also names every rank's budget ledger, so the
        scheduler reads what other processes want on this engine's devices."""
        if self._told_ledgers:
            return report
        self._told_ledgers = True
        accounting = accounting_of(self.blocks.cache)
        mine = () if accounting is None else ((*accounting, os.getpid()),)
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        every: list[Any] = [mine]
        if group.world_size > 1:
            import torch.distributed as dist

            every = [None] * group.world_size
            dist.all_gather_object(every, mine, group=group.cpu_group)
        ledgers = tuple(tuple(entry) for each in every for entry in each)
        return dataclasses.replace(report, ledgers=ledgers)

    def _agreed(self, report: ElasticReport) -> ElasticReport:
        """With tensor parallelism, the fewest units any rank got: every rank
        keeps that many, so the ranks hold the same blocks."""
        from vllm.distributed.parallel_state import get_tp_group

        assert self.orders is not None
        group = get_tp_group()
        if group.world_size == 1 or not self.orders.wanted:
            return report
        import torch.distributed as dist

        granted = torch.tensor([report.granted], dtype=torch.int64)
        dist.all_reduce(granted, op=dist.ReduceOp.MIN, group=group.cpu_group)
        agreed = int(granted.item())
        if agreed < report.granted:
            wanted = [u for lo, hi in self.orders.wanted for u in range(lo, hi)]
            self.blocks.give_back(wanted[agreed : report.granted])
        return ElasticReport(report.seq, agreed)


def _carrying(output: Any, report: ElasticReport) -> Any:
    """A copy of ``output`` (vLLM's ``ModelRunnerOutput``) with ``report``."""
    output = copy.copy(output)
    output.extensible_kv = report
    return output


class _Reported(AsyncModelRunnerOutput):  # type: ignore[misc]
    """vLLM's async output of a step, giving, when done, the step's output
    with the report on its orders."""

    def __init__(self, inner: AsyncModelRunnerOutput, report: ElasticReport) -> None:
        self._inner = inner
        self._report = report

    def get_output(self) -> Any:
        return _carrying(self._inner.get_output(), self._report)
