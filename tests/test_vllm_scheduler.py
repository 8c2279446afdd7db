"""The elastic scheduler's plan over vLLM's own block pool, as a state
machine: requests take, cache and free blocks; each step the plan sends
orders and a worker (a model: the units it holds, under a budget of
units) answers. Runs in ``nox -s vllm``; skipped where vLLM is not
installed.

Invariants, after every rule:

- every block a request holds lies in a unit the scheduler counts as
  committed, and after every step the worker holds exactly those units;
- every block with a prefix hash lies in a committed unit (a unit goes back
  only once empty: the cache's blocks are never lost under it);
- vLLM's free count is the free blocks of committed units (the cached
  ones only while the plan lends them: no more units can be committed);
- cached blocks are not lent while more units can be committed and no
  budget refused;
- units held only for cached blocks stay within the cache's bound, and
  the bound drops the units used longest ago first;
- the worker never holds more units than its budget.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

from extensible_kv.integrations.vllm.scheduler import plan as plan_module
from extensible_kv.integrations.vllm.scheduler.plan import (
    REFUSED_FOR_PLANS,
    REFUSED_RETRY_S,
    RELEASE_PER_STEP,
    ElasticPlan,
)
from extensible_kv.kv.growth.elastic import ElasticOrders, ElasticReport, units_of

NUM_BLOCKS = 70  # 9 units of 8, the last one short
PER_UNIT = 8


class Worker:
    """What ElasticBlocks does with orders (tests/test_elastic.py checks
    that against real memory), with a budget of units."""

    def __init__(self, budget_units: int) -> None:
        self.budget_units = budget_units
        self.held = {0}

    def apply(self, orders: ElasticOrders) -> ElasticReport:
        wanted = units_of(orders.wanted)
        self.held = set(units_of(orders.held)) | {0} | (self.held & set(wanted))
        assert len(self.held) <= self.budget_units, "held units past the budget"
        granted = 0
        for unit in wanted:
            if unit not in self.held and len(self.held) >= self.budget_units:
                break
            self.held.add(unit)
            granted += 1
        return ElasticReport(orders.seq, granted)


def free(pool: Any, blocks: list[Any], hashes: Iterator[int] | None = None) -> None:
    """A request's end: its blocks go back to ``pool``, each given a hash
    (kept by the prefix cache) when ``hashes`` are given."""
    if hashes is not None:
        for block in blocks:
            if block.block_hash is None and block.ref_cnt == 1:
                digest = BlockHash(next(hashes).to_bytes(8, "little"))
                hashed = make_block_hash_with_group_id(digest, 0)
                block.set_block_hash(hashed)
                pool.cached_block_hash_to_block.insert(hashed, block)
    pool.free_blocks(reversed(blocks))


def only_cached_by_last_use(queue: Any) -> list[int]:
    """The units but unit 0 that no request holds and that hold cached
    blocks, the one whose latest use is oldest first (from the free queue's
    least-recently-used order, not from the plan)."""
    last_use = {block_id // PER_UNIT: n for n, block_id in enumerate(queue.cached_oldest_first())}
    units = [unit for unit in last_use if unit and queue.holds_no_request(unit)]
    return sorted(units, key=last_use.__getitem__)


class ElasticScheduling(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
        self.plan: ElasticPlan | None = None
        self.worker = Worker(budget_units=9)
        self.requests: dict[int, list[Any]] = {}
        self.ids = itertools.count()
        self.hashes = itertools.count()
        #: Whether the worker ever refused units (the budget said no).
        self.refused = False

    @rule(cache_units=st.integers(0, 4), budget=st.integers(1, 9))
    @precondition(lambda self: self.plan is None)
    def start(self, cache_units: int, budget: int) -> None:
        self.plan = ElasticPlan(self.pool, PER_UNIT, cache_units * PER_UNIT)
        self.worker.budget_units = budget

    @rule(blocks=st.integers(1, 20))
    @precondition(lambda self: self.plan is not None)
    def allocate(self, blocks: int) -> None:
        if self.pool.get_num_free_blocks() >= blocks:
            self.requests[next(self.ids)] = self.pool.get_new_blocks(blocks)

    @rule(data=st.data(), cache=st.booleans())
    @precondition(lambda self: self.requests)
    def finish(self, data: st.DataObject, cache: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.requests)))
        free(self.pool, self.requests.pop(key), self.hashes if cache else None)

    @rule(data=st.data())
    @precondition(lambda self: self.plan is not None)
    def hit(self, data: st.DataObject) -> None:
        cached = [b for b in self.pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
        if cached:
            block = data.draw(st.sampled_from(cached))
            self.pool.touch([block])
            self.requests[next(self.ids)] = [block]

    @rule(demand=st.integers(0, 40), ahead=st.integers(0, 16))
    @precondition(lambda self: self.plan is not None)
    def step(self, demand: int, ahead: int) -> None:
        assert self.plan is not None
        queue = self.plan.queue
        could_commit = not all(self.plan.committed)
        by_last_use = only_cached_by_last_use(queue)
        orders = self.plan.plan(demand, ahead_blocks=ahead)
        if could_commit and not self.refused:
            # The cache is not spent on new blocks while memory can still be
            # committed: vLLM sees only the clean blocks as free.
            assert not queue.lend_cached
            assert self.pool.get_num_free_blocks() == queue.num_clean
        # The cache's bound drops whole units, those used longest ago first.
        dropped = [unit for unit in by_last_use if not queue.cached_in[unit]]
        assert by_last_use[: len(dropped)] == dropped, (by_last_use, dropped)
        if orders is not None and orders.ask_others:
            # Others are asked only after a refusal, and only for what the
            # engine's own free and cached blocks cannot lend.
            assert self.refused
            assert queue.num_clean + queue.num_cached < demand
        report = None if orders is None else self.worker.apply(orders)
        if orders is not None and report.granted < len(units_of(orders.wanted)):
            self.refused = True
        self.plan.confirm(orders, report)
        committed = {u for u, flag in enumerate(self.plan.committed) if flag}
        if orders is not None or not self.plan.needs_step():
            # The workers hold what the scheduler counts, once told.
            assert self.worker.held == committed | ({0} & self.worker.held)

    @rule()
    @precondition(lambda self: self.plan is not None and not self.requests)
    def reset(self) -> None:
        assert self.plan is not None
        with self.plan.all_visible():
            assert self.pool.reset_prefix_cache()

    @invariant()
    def blocks_in_use_lie_in_committed_units(self) -> None:
        if self.plan is None:
            return
        for blocks in self.requests.values():
            for block in blocks:
                assert self.plan.committed[block.block_id // PER_UNIT], block.block_id

    @invariant()
    def blocks_with_a_hash_lie_in_committed_units(self) -> None:
        if self.plan is None:
            return
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.plan.committed[block.block_id // PER_UNIT], block.block_id

    @invariant()
    def the_free_count_is_the_free_blocks_of_committed_units(self) -> None:
        if self.plan is None:
            return
        lend = self.plan.queue.lend_cached
        free = [
            b
            for b in self.pool.blocks[1:]
            if b.ref_cnt == 0
            and self.plan.committed[b.block_id // PER_UNIT]
            and (lend or b.block_hash is None)
        ]
        assert self.pool.get_num_free_blocks() == len(free)
        assert {b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()} == {
            b.block_id for b in free
        }

    @invariant()
    def the_cache_stays_within_its_bound_after_a_plan(self) -> None:
        if self.plan is None:
            return
        queue = self.plan.queue
        only_cached = [
            u
            for u in range(1, queue.num_units)
            if self.plan.committed[u] and queue.cached_in[u] and queue.holds_no_request(u)
        ]
        blocks = sum(len(queue.unit_blocks(u)) for u in only_cached)
        assert queue.units.only_cached_blocks == blocks  # the index, kept as blocks change
        if queue.changed:
            return
        assert blocks <= self.plan.cache_blocks


ElasticScheduling.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_elastic_scheduling = ElasticScheduling.TestCase


def refused_once() -> tuple[ElasticOrders, ElasticOrders | None]:
    """A plan whose first orders a budget of two units refuses in part: the
    first orders and the ones after the retry's wait."""
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, PER_UNIT, 4 * PER_UNIT)
    worker = Worker(budget_units=2)
    first = plan.plan(40)
    assert first is not None
    assert first.wanted
    report = worker.apply(first)
    assert report.granted < len(units_of(first.wanted))
    plan.confirm(first, report)
    time.sleep(REFUSED_RETRY_S)
    return first, plan.plan(40)


def test_an_engine_asks_others_only_once_refused_and_out_of_its_own_cache() -> None:
    first, retry = refused_once()
    assert not first.ask_others  # the first try asks nobody
    assert retry is not None
    assert retry.ask_others  # refused, nothing of its own to lend


def test_a_refusal_stays_recent_for_a_few_plans_however_slow_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps slower than the window in seconds (here it is none at all): the
    plans right after a refusal still lend the prefix cache and keep no
    blocks ahead; the one after them no longer does."""
    monkeypatch.setattr(plan_module, "REFUSED_FOR_S", 0.0)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, PER_UNIT, 4 * PER_UNIT)
    worker = Worker(budget_units=2)
    orders = plan.plan(40)
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))  # refused in part
    time.sleep(REFUSED_RETRY_S)
    for _ in range(REFUSED_FOR_PLANS):
        assert plan.refused_recently()
        orders = plan.plan(4, ahead_blocks=16)
        assert plan.queue.lend_cached
        assert orders is None or not orders.wanted  # nothing asked ahead
    assert not plan.refused_recently()
    orders = plan.plan(4, ahead_blocks=16)
    assert not plan.queue.lend_cached
    assert orders is not None
    assert orders.wanted  # the blocks ahead, asked for again


def test_an_engine_lends_its_own_prefix_cache_before_asking_others() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, PER_UNIT, 8 * PER_UNIT)
    worker = Worker(budget_units=9)
    orders = plan.plan(40)  # five units more, granted
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    free(pool, pool.get_new_blocks(40), itertools.count())  # all cached now
    worker.budget_units = len(worker.held)  # the budget full
    orders = plan.plan(60)
    assert orders is not None
    assert orders.wanted
    assert not orders.ask_others
    plan.confirm(orders, worker.apply(orders))
    time.sleep(REFUSED_RETRY_S)
    orders = plan.plan(44)  # its 40 cached blocks and 7 free ones lend it
    assert orders is not None
    assert orders.wanted
    assert not orders.ask_others
    assert plan.queue.lend_cached


def granted_plan(demand: int, ahead: int, budget_units: int = 9) -> tuple[ElasticPlan, Worker]:
    """A plan that asked once for ``demand`` blocks and ``ahead`` more, and
    a worker with ``budget_units`` that answered."""
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, PER_UNIT, 4 * PER_UNIT)
    worker = Worker(budget_units)
    orders = plan.plan(demand, ahead_blocks=ahead)
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    return plan, worker


def test_blocks_ahead_are_committed_beyond_the_demand_and_go_back_with_it() -> None:
    plan, worker = granted_plan(20, 16)
    assert plan.queue.num_clean >= 36  # unit 0's 7 free blocks, and 4 units more
    assert len(worker.held) == 5
    orders = plan.plan(20, ahead_blocks=16)
    assert orders is None  # nothing changes while the demand stays
    orders = plan.plan(0)  # idle: the blocks ahead go back too
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    assert worker.held == {0}


def test_no_blocks_ahead_once_a_budget_refused_or_another_process_wants_memory() -> None:
    plan, worker = granted_plan(20, 0, budget_units=4)
    held = len(worker.held)
    time.sleep(REFUSED_RETRY_S)
    orders = plan.plan(20, ahead_blocks=16)  # refused: only part of these
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    assert len(worker.held) == held + 1
    time.sleep(REFUSED_RETRY_S)
    orders = plan.plan(20, ahead_blocks=16)  # refused recently: the demand alone
    assert orders is not None
    assert not orders.wanted
    plan.confirm(orders, worker.apply(orders))
    assert len(worker.held) == held  # the unit ahead went back
    plan, worker = granted_plan(20, 16)
    orders = plan.plan(20, give_blocks=8, ahead_blocks=16)  # others want memory
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    assert plan.queue.num_clean < 20 + 8


def test_a_unit_holding_cached_blocks_stays_committed_when_units_go_back() -> None:
    plan, worker = granted_plan(24, 0)  # units 0 to 3
    pool = plan.pool
    pool.get_new_blocks(7)  # unit 0 (block 0 is vLLM's null block)
    emptied, cached = pool.get_new_blocks(8), pool.get_new_blocks(8)  # units 1 and 2
    pool.get_new_blocks(1)  # unit 3, partly used
    free(pool, emptied)
    free(pool, cached, itertools.count())
    orders = plan.plan(0)  # 15 free blocks: one unit goes back
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    # The empty unit went back, not the one below the used unit that only
    # its cached blocks hold.
    assert units_of(orders.held) == [0, 2, 3]
    assert worker.held == {0, 2, 3}
    hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert hashed == [b.block_id for b in cached]
    assert all(plan.committed[block_id // PER_UNIT] for block_id in hashed)


def test_cached_blocks_are_not_lent_while_units_can_be_committed() -> None:
    plan, worker = granted_plan(16, 0)  # units 0 to 2: 23 free blocks
    pool = plan.pool
    cached = pool.get_new_blocks(16)
    free(pool, cached, itertools.count())  # 16 cached, 7 clean
    orders = plan.plan(16)  # 9 blocks short: units asked for, none refused yet
    assert orders is not None
    assert orders.wanted
    assert not plan.queue.lend_cached
    assert pool.get_num_free_blocks() == plan.queue.num_clean == 7
    plan.confirm(orders, worker.apply(orders))  # granted
    assert not plan.queue.lend_cached
    assert pool.get_num_free_blocks() == plan.queue.num_clean == 23
    pool.get_new_blocks(pool.get_num_free_blocks())  # a burst takes every free block
    hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert hashed == [b.block_id for b in cached]  # and leaves the cache whole


def test_the_cache_bound_drops_the_unit_used_longest_ago() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, PER_UNIT, PER_UNIT)  # a cache of one unit
    worker = Worker(budget_units=9)
    orders = plan.plan(23)  # units 0 to 2
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    pool.get_new_blocks(7)  # unit 0, in use throughout
    first, second = pool.get_new_blocks(8), pool.get_new_blocks(8)  # units 1 and 2
    hashes = itertools.count()
    free(pool, first, hashes)
    free(pool, second, hashes)
    pool.touch(first[-1:])  # a hit in unit 1, freed after: unit 2's latest use is older
    free(pool, first[-1:])
    orders = plan.plan(0)  # two units of cache, one allowed
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert hashed == [b.block_id for b in first]  # unit 2's cached blocks were dropped
    assert units_of(orders.held) == [0, 1]
    assert worker.held == {0, 1}


def test_at_thirty_thousand_units_the_load_falls_in_bounded_steps() -> None:
    """One-block units, as a block-outermost 60 GiB cache makes (30,720 of
    them): a burst fills 20,000 blocks, then ends with every block cached.
    Each step after evicts and gives back at most RELEASE_PER_STEP units,
    asks for another step while more could go, and once it asks no more the
    workers hold unit 0 and the prefix cache within its bound, nothing else."""
    blocks, cache = 30_720, 256
    pool = BlockPool(blocks, enable_caching=True, hash_block_size=16)
    plan = ElasticPlan(pool, 1, cache)
    worker = Worker(budget_units=blocks)
    orders = plan.plan(20_000)
    assert orders is not None
    plan.confirm(orders, worker.apply(orders))
    free(pool, pool.get_new_blocks(20_000), itertools.count())
    steps = 0
    while plan.needs_step():
        steps += 1
        assert steps < 1000, "the load never finished falling"
        before = set(worker.held)
        cached = plan.queue.num_cached
        orders = plan.plan(0)
        assert cached - plan.queue.num_cached <= RELEASE_PER_STEP  # evicted this step
        if orders is not None:
            plan.confirm(orders, worker.apply(orders))
        assert len(before - worker.held) <= RELEASE_PER_STEP  # given back this step
    assert steps >= (20_000 - cache) // RELEASE_PER_STEP
    committed = {u for u, flag in enumerate(plan.committed) if flag}
    assert worker.held == committed
    assert committed == {0} | {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert plan.queue.num_cached == cache


def test_workers_keep_memory_idle_only_while_the_engine_runs_and_no_one_wants_it() -> None:
    """keep_idle goes with a step's blocks ahead: on while requests run,
    off once idle, once other processes want memory (a step that gives),
    or once a budget refused; orders go out when it changes alone."""
    plan, worker = granted_plan(20, 16)
    orders = plan.plan(20, ahead_blocks=16)
    assert orders is None  # nothing changed: still kept
    assert plan.keeps_idle
    orders = plan.plan(20, give_blocks=8, ahead_blocks=16)  # another process wants
    assert orders is not None
    assert not orders.keep_idle
    plan.confirm(orders, worker.apply(orders))
    orders = plan.plan(20, ahead_blocks=16)
    assert orders is not None
    assert orders.keep_idle
    plan.confirm(orders, worker.apply(orders))
    orders = plan.plan(0)  # idle
    assert orders is not None
    assert not orders.keep_idle
    plan.confirm(orders, worker.apply(orders))
    assert not plan.keeps_idle
