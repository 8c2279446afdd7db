"""The elastic scheduler as vLLM runs it on a GPU: under async scheduling
and a batch queue, with two batches in flight. Runs in ``nox -s vllm``.

A Hypothesis state machine drives our scheduler, made as vLLM's engine
core makes it (``ExtensibleKVScheduler`` from a ``VllmConfig`` and a
``KVCacheConfig``, no model), the way ``EngineCore.step_with_batch_queue``
does: ``schedule()`` runs again before the batch before it has its
``update_from_output()``, while requests arrive, finish, are aborted and
are preempted. A model of a worker applies each batch's orders when the
batch goes out (as our worker does before it runs a step) and answers on
the batch's output. Invariants:

- no unit goes back while a batch in flight uses a block in it;
- every block a batch uses lies in a unit the worker holds when it runs;
- no block is handed out twice: every block's reference count is the
  number of requests whose tables hold it;
- every block a request holds lies in a unit the scheduler counts as
  committed, and the worker holds every such unit (orders sent while a
  report is pending never give back what the worker committed for it).

The same machine runs over vLLM's ``AsyncScheduler`` (async scheduling on,
vLLM's GPU default) and over its ``Scheduler`` under a queue of two (what
pipeline parallelism makes).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from extensible_kv import ExtensibleTensor, KVCacheBuffers
from extensible_kv.demo.tiny_models import save_tiny_model
from extensible_kv.integrations.vllm.options import SCHEDULER, SCHEDULER_MARK, check_scheduler
from extensible_kv.integrations.vllm.scheduler import scheduler as scheduler_module
from extensible_kv.integrations.vllm.scheduler.demand import blocks_soon, blocks_to_finish
from extensible_kv.integrations.vllm.scheduler.plan import REFUSED_RETRY_S
from extensible_kv.integrations.vllm.scheduler.scheduler import (
    ExtensibleKVAsyncScheduler,
    ExtensibleKVScheduler,
)
from extensible_kv.integrations.vllm.worker.elastic import ElasticSteps, elastic_driver, pool_bytes
from extensible_kv.kv.growth.elastic import ElasticBlocks, ElasticOrders, ElasticReport, units_of

BLOCK_SIZE = 16
#: A 256 KiB page per block (one layer, 16 heads of 256, fp16, K and V):
#: eight blocks to a 2 MiB unit.
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=16, head_size=256, dtype=torch.float16)
PER_UNIT = 8
NUM_BLOCKS = 12 * PER_UNIT
VOCAB = 1000
PREFIXES = [[(7 * p + i) % VOCAB for i in range(3 * BLOCK_SIZE)] for p in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("async") / "llama"))


def make_scheduler(model: str, *, async_scheduling: bool, cache_units: int) -> Any:
    """Our scheduler as vLLM's engine core makes it, with async scheduling on
    or off (the CPU build turns it off; a GPU's config has it on)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=512, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=6,
            max_num_batched_tokens=96,
            max_model_len=512,
            is_encoder_decoder=False,
            scheduler_cls="extensible_kv.integrations.vllm.ExtensibleKVScheduler",
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        additional_config={
            "extensible_kv": {
                "growth": "elastic",
                "cache_bytes": cache_units * PER_UNIT * SPEC.page_size_bytes,
            }
        },
    )
    # What a GPU's config says (the CPU platform turns it off when the
    # config is made).
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS  # as the engine core sets it
    page = SPEC.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=NUM_BLOCKS * page,
                layers=["layer.0"],
                layer_stride=NUM_BLOCKS * page,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)],
    )
    return ExtensibleKVScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
    )


def test_the_one_public_name_makes_the_scheduler_vllm_chose(model: str) -> None:
    on = make_scheduler(model, async_scheduling=True, cache_units=2)
    off = make_scheduler(model, async_scheduling=False, cache_units=2)
    assert isinstance(on, ExtensibleKVAsyncScheduler)
    assert isinstance(on, AsyncScheduler)
    assert isinstance(off, ExtensibleKVScheduler)
    assert not isinstance(off, AsyncScheduler)
    assert on._elastic is not None
    assert off._elastic is not None
    assert on._elastic.blocks_per_unit == PER_UNIT


class Worker:
    """What a worker's ElasticBlocks does with orders (tests/test_elastic.py
    checks that against real memory), with a budget of units."""

    def __init__(self, budget_units: int) -> None:
        self.budget_units = budget_units
        self.held = {0}

    def apply(self, orders: ElasticOrders) -> ElasticReport:
        wanted = units_of(orders.wanted)
        self.held = set(units_of(orders.held)) | {0} | (self.held & set(wanted))
        granted = 0
        for unit in wanted:
            if unit not in self.held and len(self.held) >= self.budget_units:
                break
            self.held.add(unit)
            granted += 1
        return ElasticReport(orders.seq, granted)


@dataclass
class Batch:
    """A batch vLLM scheduled and runs: its output, the blocks it uses, the
    requests whose prompt it completes (they sample a token), and the
    worker's report on its orders."""

    output: Any
    blocks: set[int]
    sampling: list[str]
    report: ElasticReport | None


class ElasticUnderABatchQueue(RuleBasedStateMachine):
    model = ""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Any = None
        self.worker = Worker(budget_units=12)
        self.in_flight: deque[Batch] = deque()
        self.ids = itertools.count()
        init_none_hash(sha256)  # as the engine core does before hashing
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    @rule(async_scheduling=st.booleans(), cache_units=st.integers(0, 3), budget=st.integers(3, 12))
    @precondition(lambda self: self.scheduler is None)
    def start(self, async_scheduling: bool, cache_units: int, budget: int) -> None:
        self.scheduler = make_scheduler(
            self.model, async_scheduling=async_scheduling, cache_units=cache_units
        )
        self.worker.budget_units = budget

    @rule(
        prefix=st.sampled_from([None, 0, 1, 2]),
        length=st.integers(1, 60),
        max_tokens=st.integers(1, 24),
    )
    @precondition(lambda self: self.scheduler is not None)
    def arrive(self, prefix: int | None, length: int, max_tokens: int) -> None:
        request_id = f"r{next(self.ids)}"
        start = [] if prefix is None else PREFIXES[prefix]
        tokens = start + [(hash((request_id, i)) % VOCAB) for i in range(length)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id, tokens, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)

    @rule()
    @precondition(lambda self: self.scheduler is not None and len(self.in_flight) < 2)
    def schedule(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        blocks = {
            block_id
            for request_id in output.num_scheduled_tokens
            for block_id in scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        }
        orders: ElasticOrders | None = getattr(output, "extensible_kv", None)
        report = None
        if orders is not None:
            before = set(self.worker.held)
            report = self.worker.apply(orders)
            released = before - self.worker.held
            for batch in self.in_flight:
                touched = {b for b in batch.blocks if b // PER_UNIT in released}
                assert not touched, f"units given back under a batch in flight: {touched}"
        held = self.worker.held
        assert all(b // PER_UNIT in held for b in blocks), "a batch runs outside the held units"
        sampling = [
            request_id
            for request_id in output.num_scheduled_tokens
            if scheduler.requests[request_id].num_computed_tokens
            >= scheduler.requests[request_id].num_prompt_tokens
        ]
        self.in_flight.appendleft(Batch(output, blocks, sampling, report))

    @rule()
    @precondition(lambda self: self.in_flight)
    def finish_a_batch(self) -> None:
        batch = self.in_flight.pop()
        request_ids = list(batch.output.num_scheduled_tokens)
        sampled = [
            [hash((request_id, "token")) % VOCAB] if request_id in batch.sampling else []
            for request_id in request_ids
        ]
        output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )
        output.extensible_kv = batch.report
        self.scheduler.update_from_output(batch.output, output)

    @rule(data=st.data())
    @precondition(lambda self: self.scheduler is not None and self.scheduler.requests)
    def abort(self, data: st.DataObject) -> None:
        self.abort_request(data.draw(st.sampled_from(sorted(self.scheduler.requests))))

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    @invariant()
    def no_block_is_handed_out_twice(self) -> None:
        if self.scheduler is None:
            return
        holders: dict[int, int] = {}
        manager = self.scheduler.kv_cache_manager
        for request_id in self.scheduler.requests:
            for block_id in manager.get_block_ids(request_id)[0]:
                holders[block_id] = holders.get(block_id, 0) + 1
        pool = manager.block_pool
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), block

    @invariant()
    def the_worker_holds_every_unit_the_scheduler_counts(self) -> None:
        if self.scheduler is None:
            return
        committed = self.scheduler._elastic.committed
        assert {u for u, flag in enumerate(committed) if flag} <= self.worker.held

    @invariant()
    def blocks_in_use_lie_in_committed_units(self) -> None:
        if self.scheduler is None:
            return
        plan = self.scheduler._elastic
        manager = self.scheduler.kv_cache_manager
        for request_id in self.scheduler.requests:
            for block_id in manager.get_block_ids(request_id)[0]:
                assert plan.committed[block_id // PER_UNIT], block_id


def machine(model: str, *, async_scheduling: bool) -> ElasticUnderABatchQueue:
    """The state machine, started, for a scripted example."""
    ElasticUnderABatchQueue.model = model
    state = ElasticUnderABatchQueue()
    state.start(async_scheduling=async_scheduling, cache_units=0, budget=12)
    return state


def check(state: ElasticUnderABatchQueue) -> None:
    state.no_block_is_handed_out_twice()
    state.the_worker_holds_every_unit_the_scheduler_counts()
    state.blocks_in_use_lie_in_committed_units()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_unit_aborted_under_a_running_batch_stays_until_the_batch_ends(
    model: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request spanning units 0 and 1 is aborted while its decode batch
    runs; the next schedule (the engine idle) gives back no unit that batch
    uses, and once it ends and the idle engine's linger is over, unit 1 goes."""
    state = machine(model, async_scheduling=async_scheduling)
    state.arrive(prefix=None, length=200, max_tokens=8)
    while not state.scheduler.running or state.scheduler.running[0].num_output_tokens == 0:
        state.schedule()
        state.finish_a_batch()
    state.schedule()  # a decode batch, in flight
    state.abort_request("r0")
    state.schedule()  # checks that nothing the batch in flight uses goes back
    check(state)
    assert 1 in state.worker.held
    state.finish_a_batch()
    state.finish_a_batch()
    assert not state.scheduler.has_requests(), "idle, nobody wanting: it keeps the unit a while"
    monkeypatch.setattr(scheduler_module, "LINGER_S", 0.0)  # the linger is over
    assert state.scheduler.has_requests(), "the idle engine steps once more to give it back"
    state.schedule()
    assert 1 not in state.worker.held


def test_orders_sent_before_the_report_keep_the_units_asked_for(model: str) -> None:
    """Async scheduling: a second batch is scheduled before the first's
    report on the units it asked for, with orders of its own (a short
    request started in the first batch changed the blocks in use); they
    must not give back the units asked for."""
    state = machine(model, async_scheduling=True)
    state.arrive(prefix=None, length=20, max_tokens=8)  # fits in unit 0
    state.arrive(prefix=None, length=200, max_tokens=8)  # needs more units
    state.schedule()
    orders = state.in_flight[0].output.extensible_kv
    asked = set(units_of(orders.wanted))
    assert asked, "the first batch asks for units"
    state.schedule()
    assert state.in_flight[0].output.extensible_kv is not None, "the second batch has orders"
    state.finish_a_batch()
    check(state)
    assert asked <= state.worker.held


def test_a_late_answer_does_not_commit_a_unit_given_back_since(model: str) -> None:
    """Async scheduling: units asked for twice (two batches in flight), the
    first answer commits them, the next plan gives back the ones the load
    no longer needs, then the second answer comes: those stay given back."""
    state = machine(model, async_scheduling=True)
    state.arrive(prefix=None, length=30, max_tokens=1)
    state.schedule()
    state.schedule()
    state.finish_a_batch()
    state.abort_request("r0")
    state.schedule()  # idle: units the load no longer needs go back
    state.finish_a_batch()
    check(state)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_refused_engine_asks_at_once_for_what_its_requests_need_to_finish(
    model: str, async_scheduling: bool
) -> None:
    """Three requests of 100 prompt tokens and 200 new ones (19 blocks each
    at their end) under a budget of three units: the first orders ask for
    what the prompts need soon, and are refused in part. Once another
    process made room, the next orders ask, in one want, for every block
    the requests need to finish (57 blocks and the null block: 8 units),
    not for the next step's blocks."""
    state = machine(model, async_scheduling=async_scheduling)
    state.worker.budget_units = 3
    for _ in range(3):
        state.arrive(prefix=None, length=100, max_tokens=200)
    state.schedule()
    first = state.in_flight[0].output.extensible_kv
    assert len(units_of(first.wanted)) > 2, "asked for more than the budget grants"
    assert len(units_of(first.wanted)) < 7, "asked only for what the prompts need soon"
    state.finish_a_batch()
    time.sleep(REFUSED_RETRY_S)
    state.worker.budget_units = 12  # another process gave way
    state.schedule()
    check(state)
    assert len(state.worker.held) >= 8
    while state.in_flight:
        state.finish_a_batch()  # the report: the units join the free blocks
    finished = blocks_to_finish(state.scheduler.waiting, state.scheduler.running, BLOCK_SIZE, 512)
    assert finished <= state.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_what_requests_need_to_finish_stops_at_the_models_length() -> None:
    """A request asking for more tokens than the model's length holds at
    most ``max_model_len`` tokens: 512 tokens, 32 blocks, not 69."""
    request = Request("r", list(range(100)), SamplingParams(max_tokens=1000), None)
    assert blocks_to_finish([request], [], BLOCK_SIZE, 512) == 32
    assert blocks_to_finish([request], [], BLOCK_SIZE, 4096) == -(-1100 // BLOCK_SIZE)
    assert blocks_soon([request], [], BLOCK_SIZE) == -(-102 // BLOCK_SIZE)


class _Pending(AsyncModelRunnerOutput):
    """An output still being computed, as vLLM's GPU runner returns one."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get_output(self) -> ModelRunnerOutput:
        return self.output


def test_the_report_rides_on_an_output_still_being_computed() -> None:
    """Under async scheduling vLLM's GPU runner returns an
    AsyncModelRunnerOutput; the report must be on what it gives when done."""
    tensor = ExtensibleTensor(8 << 20, "cpu", chunk_bytes=2 << 20)
    cache = KVCacheBuffers([(tensor, 1 << 20)], 8)
    steps = ElasticSteps(ElasticBlocks(cache, 8))
    steps.report = ElasticReport(3, 1)
    empty = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    pending = steps.with_report(_Pending(empty))
    assert isinstance(pending, AsyncModelRunnerOutput)
    assert pending.get_output().extensible_kv == ElasticReport(3, 1)
    assert not hasattr(empty, "extensible_kv"), "vLLM's own output is left alone"
    assert steps.with_report(_Pending(empty)).get_output() is empty, "one report, once"
    cache.free()


def test_elastic_scheduling_under_a_batch_queue(model: str) -> None:
    ElasticUnderABatchQueue.model = model
    run_state_machine_as_test(
        ElasticUnderABatchQueue, settings=settings(max_examples=100, stateful_step_count=50)
    )


def test_a_gpu_workers_pool_keeps_one_steps_units_and_the_host_has_none() -> None:
    """The handles an elastic worker may keep idle while its engine runs:
    one step's blocks in every segment, rounded out to whole granules
    (and one for the ends); on the host, no pool (creating costs nothing
    there but the mapping)."""
    page = SPEC.page_size_bytes  # one layer-outermost segment, 256 KiB a block
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=NUM_BLOCKS * page,
                layers=["layer.0"],
                layer_stride=NUM_BLOCKS * page,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)],
    )
    granule = 2 << 20
    # 96 tokens a step: 6 blocks of 256 KiB, 1.5 MiB: a granule, and one more.
    assert pool_bytes(config, 96, granule) == 2 * granule
    assert pool_bytes(config, 16 * 64, granule) == (8 + 1) * granule
    assert elastic_driver(torch.device("cpu"), config, 96) is None


def test_the_elastic_option_knows_our_scheduler_by_its_mark() -> None:
    """``growth: "elastic"`` takes our scheduler by name or as a class, and
    a subclass of it either way, by the mark it carries (the options never
    import the scheduler); any other scheduler is refused in one line."""

    class Ours(ExtensibleKVScheduler):  # type: ignore[misc]
        pass

    def config(chosen: object, resolved: type) -> Any:
        scheduler = SimpleNamespace(scheduler_cls=chosen, get_scheduler_cls=lambda: resolved)
        return SimpleNamespace(scheduler_config=scheduler)

    assert getattr(ExtensibleKVScheduler, SCHEDULER_MARK) is True
    for chosen, resolved in [
        (SCHEDULER, ExtensibleKVScheduler),
        (ExtensibleKVScheduler, ExtensibleKVScheduler),
        (ExtensibleKVAsyncScheduler, ExtensibleKVAsyncScheduler),
        (Ours, Ours),
        ("somewhere.Ours", Ours),
    ]:
        check_scheduler(config(chosen, resolved))
    for chosen, resolved in [
        (None, Scheduler),
        (Scheduler, Scheduler),
        ("vllm.v1.core.sched.scheduler.Scheduler", Scheduler),
    ]:
        with pytest.raises(ValueError, match="'elastic' needs scheduler_cls=") as refused:
            check_scheduler(config(chosen, resolved))
        assert "\n" not in str(refused.value)
