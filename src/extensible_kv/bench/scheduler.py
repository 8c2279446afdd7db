"""The ``scheduler`` suite: vLLM's scheduler and ours (``growth: "elastic"``)
side by side, with no model and no GPU.

Both are built as vLLM's engine core builds them: a ``VllmConfig`` (its
``ModelConfig`` from a tiny local model), the KV cache layout resolved by
vLLM's ``resolve_kv_cache_layout``, a ``KVCacheConfig`` from vLLM's own
``get_kv_cache_configs`` and ``generate_scheduler_kv_cache_config`` for a
Llama-3-8B-like KV spec (:data:`LAYERS` layers, :data:`KV_HEADS` KV heads of
:data:`HEAD_SIZE`, fp16, blocks of :data:`BLOCK_TOKENS` tokens: 2 MiB a block
over all layers), and the class ``SchedulerConfig.get_scheduler_cls()``
names. Stock is vLLM's ``Scheduler`` (``AsyncScheduler`` with async
scheduling on); ours is ``extensible_kv.integrations.vllm.ExtensibleKVScheduler``
with ``additional_config={"extensible_kv": {"growth": "elastic", ...}}``.

Each side is driven as vLLM's engine core loop drives it (``step``, or
``step_with_batch_queue`` with vLLM's ``max_concurrent_batches`` batches in
flight): a side steps only while its ``has_requests()`` says so. The workers
are played by answering every batch at once: a ``ModelRunnerOutput`` giving
each scheduled request one token (none to a prefill chunk that does not end
its prompt, as vLLM's runner discards those), and ours's orders answered
granting every wanted unit (an ``ElasticReport``, as ``ElasticSteps`` does).

Timed per batch: ``schedule()`` plus ``update_from_output()``, in seconds.
The two sides run in one process, in lockstep, the first to step alternating
every tick, so that a slow spell of the machine weighs on both. Traces
(:func:`traces`): steady decode, a burst then idle (the load falling),
prefix-heavy requests under a ``cache_bytes`` bound that forces eviction,
and steady load with turnover. At each scale (:func:`scales`): layer-
outermost caches (LBHNC; a unit is 32 blocks) of each size, and a block-
outermost one (BLHNC) where a unit is one block. Reported per trace, scale
and mode: each side's median, p99 and max per step, ours / stock, and
whether the goals hold (median at most :data:`MEDIAN_GOAL`, p99 at most
:data:`P99_GOAL`: ``met`` or ``not met``, ``not comparable`` where ours
scheduled fewer tokens than stock); the step where a burst's load falls,
for both (ours's under :data:`FALLING_GOAL_S` at the most units); and a
cProfile of ours on its worst trace at the most units.

Also, with no vLLM: the driver calls of a burst of elastic units
(:func:`driver_calls`), ``ElasticBlocks.apply`` committing the units at once
and giving them back, counted by ``StatisticsDriver`` over the bench's
device's backend: on a machine without a GPU the host backend, whose 2 MiB
granules are a CUDA device's (the CUDA simulator is the test suite's, not
the library's).
"""

from __future__ import annotations

import cProfile
import hashlib
import itertools
import logging
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from extensible_kv.bench.child import markdown_table, quiet_vllm_cpu, unavailable
from extensible_kv.bench.measure import timed

MiB = 1 << 20
GiB = 1 << 30
#: The KV spec: a Llama-3-8B-like model, fp16 (2 bytes).
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, DTYPE_BYTES = 32, 8, 128, 16, 2
#: Bytes of one block in one layer's K or V.
HALF_PAGE_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES
OURS = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
#: The engine's limits, as a GPU user of vLLM's ``LLM`` runs it.
MAX_NUM_SEQS = 512
MAX_NUM_BATCHED_TOKENS = 8192
#: The tiny model's context (its ``max_position_embeddings``).
MAX_MODEL_LEN = 1024
#: Every new token a worker returns.
TOKEN = 7
#: The goals: ours / stock per step, at most; ours's falling step, seconds,
#: at the scale of one-block units.
MEDIAN_GOAL, P99_GOAL, FALLING_GOAL_S = 1.05, 1.2, 1e-3
#: Ours's scheduled tokens, as a share of stock's, below which its step
#: times are not compared with stock's (it did less work).
COMPARABLE_TOKENS = 0.95
#: Modes: async scheduling off (vLLM's CPU build, pipeline parallelism
#: aside) and on (vLLM's default on a GPU).
MODES = ("off", "on")
#: Prefixes every other request of the prefix-heavy trace shares.
HOT_PREFIXES = 8
#: Functions listed in the profile.
PROFILE_TOP = 15
#: Ticks a burst may take before the suite gives up (a side that never
#: finishes its requests).
MAX_BURST_TICKS = 10_000

#: A new request: its prompt's tokens and its ``max_tokens``.
Prompt = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class Scale:
    """One KV cache: its bytes and vLLM's layout name (``LBHNC``
    layer-outermost, ``BLHNC`` block-outermost)."""

    name: str
    kv_bytes: int
    layout: str


@dataclass(frozen=True)
class Trace:
    """Requests arriving at ticks (``arrivals``), ``warm`` ticks unmeasured,
    then ``ticks`` measured; ``bursts`` > 0: that many bursts instead, each
    run until every request of both sides is done, then ``idle`` ticks."""

    name: str
    label: str
    arrivals: dict[int, list[Prompt]]
    warm: int = 0
    ticks: int = 0
    cache_bytes: int | None = None
    bursts: int = 0
    idle: int = 0


@dataclass(frozen=True)
class SchedulerPlan:
    """Sizes of the suite: ``load`` requests of the steady traces,
    ``steps`` measured steps per trace, ``tokens`` new tokens per request
    (mean), the layer-outermost caches' sizes in GiB (the first also
    block-outermost), and the driver-call burst: ``burst_units`` units of
    one block over ``burst_segments`` segments."""

    load: int = 256
    steps: int = 200
    tokens: int = 32
    kv_gib: tuple[int, ...] = (60, 120)
    burst_units: int = 512
    burst_segments: int = 64
    repeats: int = 3


def scales(kv_gib: tuple[int, ...]) -> list[Scale]:
    """Layer-outermost caches of each size, and block-outermost (units of
    one block) at the first."""
    out = [Scale(f"{gib} GiB", gib * GiB, "LBHNC") for gib in kv_gib]
    out.append(Scale(f"{kv_gib[0]} GiB, block-outermost", kv_gib[0] * GiB, "BLHNC"))
    return out


# -- traces ------------------------------------------------------------------


def _unique(seed: int, length: int) -> tuple[int, ...]:
    """``length`` tokens that share no first block with any other seed's
    (below 250,000) or with a :func:`_prefix`."""
    head = (seed % 500 + 1, seed // 500 % 500 + 1)
    return head + tuple((31 * seed + 7 * j) % 509 + 1 for j in range(length - 2))


def _prefix(index: int, length: int) -> tuple[int, ...]:
    """A shared prefix of ``length`` tokens, the ``index``-th."""
    head = (510, index % 500 + 1, index // 500 + 1)
    return head + tuple((17 * index + 5 * j) % 509 + 1 for j in range(length - 3))


def _prefill_ticks(tokens: int) -> int:
    """Steps a prefill of ``tokens`` prompt tokens takes at most."""
    return -(-tokens // MAX_NUM_BATCHED_TOKENS)


def traces(plan: SchedulerPlan) -> list[Trace]:
    """The four traces at ``plan``'s load (``L``), steps (``S``) and tokens (``N``)."""
    return [_decode(plan), _burst(plan), _prefix_heavy(plan), _turnover(plan)]


def _decode(plan: SchedulerPlan) -> Trace:
    """``L`` requests of 256-271 prompt tokens, measured once every one
    decodes: ``S`` steps of one token each."""
    load = plan.load
    warm = _prefill_ticks(load * 272) + 4
    new = warm + plan.steps + 8
    prompts = [(_unique(i, 256 + i % 16), new) for i in range(load)]
    return Trace("decode", f"steady decode of {load}", {0: prompts}, warm, plan.steps)


def _burst(plan: SchedulerPlan) -> Trace:
    """``2L`` requests of 256-271 prompt tokens and ``N`` new ones at once,
    run to their end, then 8 idle ticks; ``max(1, S // 64)`` times."""
    size, bursts = 2 * plan.load, max(1, plan.steps // 64)
    arrivals = {
        b: [(_unique(b * size + i, 256 + i % 16), plan.tokens) for i in range(size)]
        for b in range(bursts)
    }
    return Trace("burst", f"a burst of {size}, then idle", arrivals, bursts=bursts, idle=8)


def _prefix_heavy(plan: SchedulerPlan) -> Trace:
    """``L / 32`` requests a tick, each a 256-token prefix and 64 tokens of
    its own, ``N`` new tokens. Every other request's prefix is one of
    :data:`HOT_PREFIXES` (hits on both sides), the rest one of ``2L`` cold
    ones, each used again after ``2 x 2L / (L / 32)`` ticks (128). Ours's
    ``cache_bytes`` is ``L x 8 MiB`` (2 GiB at 256), well below the cold
    prefixes' blocks, so its bound evicts every step and ours computes the
    cold prefixes again, where stock's pool keeps them."""
    per_tick, cold = max(1, plan.load // 32), 2 * plan.load
    warm = 2 * plan.tokens + 2 * cold // per_tick
    arrivals: dict[int, list[Prompt]] = {}
    for tick in range(warm + plan.steps):
        batch = range(tick * per_tick, (tick + 1) * per_tick)
        arrivals[tick] = [(_shared(j, cold) + _unique(j, 64), plan.tokens) for j in batch]
    label = f"prefix-heavy ({HOT_PREFIXES} hot, {cold} cold), cache_bytes {plan.load * 8} MiB"
    return Trace("prefix", label, arrivals, warm, plan.steps, cache_bytes=plan.load * 8 * MiB)


def _shared(request: int, cold: int) -> tuple[int, ...]:
    """The ``request``-th request's 256-token prefix: a hot one for even
    requests, else one of ``cold``."""
    if request % 2 == 0:
        return _prefix(request // 2 % HOT_PREFIXES, 256)
    return _prefix(HOT_PREFIXES + request // 2 % cold, 256)


def _turnover(plan: SchedulerPlan) -> Trace:
    """``L / 32`` requests a tick, 128-511 prompt tokens, 1 to ``2N`` new
    tokens (mean ``N``): about ``L`` running, some finishing every step."""
    per_tick = max(1, plan.load // 32)
    warm = 2 * plan.tokens + 8
    arrivals: dict[int, list[Prompt]] = {}
    for tick in range(warm + plan.steps):
        batch = range(tick * per_tick, (tick + 1) * per_tick)
        arrivals[tick] = [
            (_unique(j, 128 + 29 * j % 384), 1 + 13 * j % (2 * plan.tokens)) for j in batch
        ]
    label = f"steady load with turnover ({per_tick} in and out a step)"
    return Trace("turnover", label, arrivals, warm, plan.steps)


# -- building both schedulers as vLLM's engine core does ---------------------


def _vllm_config(model: str, ours: bool, async_on: bool, cache_bytes: int | None) -> Any:
    """A ``VllmConfig`` for stock or ours. vLLM's CPU platform turns async
    scheduling off in it; ``async_on`` turns it back on, as a GPU has it."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    elastic: dict[str, Any] = {"growth": "elastic"}
    if cache_bytes is not None:
        elastic["cache_bytes"] = cache_bytes
    config = VllmConfig(
        model_config=ModelConfig(
            model=model, dtype="float16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            scheduler_cls=OURS if ours else None,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        additional_config={"extensible_kv": elastic} if ours else {},
    )
    config.scheduler_config.async_scheduling = async_on
    return config


def _kv_cache_config(config: Any, scale: Scale) -> Any:
    """The scheduler's ``KVCacheConfig`` at ``scale``, from vLLM's own
    functions, as ``EngineCore._initialize_kv_caches`` makes it."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    register_all_kvcache_specs(config)
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}
    resolve_kv_cache_layout(config, [[scale.layout]], specs.values())
    per_worker = get_kv_cache_configs(config, [specs], [scale.kv_bytes])
    for worker in per_worker:
        worker.kv_cache_layout = config.cache_config.kv_cache_layout
    kv_cache_config = generate_scheduler_kv_cache_config(per_worker)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return kv_cache_config


def _scheduler(config: Any, kv_cache_config: Any, block_sizes: tuple[int, int]) -> Any:
    """The class ``get_scheduler_cls()`` names, made with the engine core's
    arguments (``block_sizes``: vLLM's scheduler and hash block sizes)."""
    from vllm.v1.structured_output import StructuredOutputManager

    return config.scheduler_config.get_scheduler_cls()(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        include_finished_set=False,
        log_stats=False,
        block_size=block_sizes[0],
        hash_block_size=block_sizes[1],
    )


def _block_hasher(config: Any, hash_block_size: int) -> Any:
    """The engine core's request block hasher (prefix caching is on)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


# -- one side: a scheduler driven as the engine core drives it ---------------


@dataclass
class _Batch:
    """One batch: ``seconds`` of its ``schedule()`` and
    ``update_from_output()``, its scheduled ``tokens``, whether it was
    ``measured``, ``falling`` (the first after a burst ended), and
    ``asked`` (whether ``has_requests()`` asked for it; a falling step it did
    not ask for is timed only to compare)."""

    seconds: float
    tokens: int
    measured: bool
    falling: bool = False
    asked: bool = True


@dataclass
class _Side:
    """One scheduler under vLLM's engine-core loop with ``depth`` batches in
    flight (``max_concurrent_batches``); ``profiler`` records its calls."""

    scheduler: Any
    hasher: Any
    depth: int
    profiler: cProfile.Profile | None = None
    batches: list[_Batch] = field(default_factory=list)
    queue: deque[tuple[Any, Any, float, bool, bool]] = field(default_factory=deque)
    ids: Iterator[int] = field(default_factory=itertools.count)
    #: A burst runs: when its last request finishes, the next batch falls.
    in_burst: bool = False
    #: The burst's last request finished; the next batch is the falling step.
    awaiting_fall: bool = False

    def add(self, prompts: list[Prompt]) -> None:
        """New requests, as the engine core's ``add_request`` adds them."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        for tokens, new in prompts:
            params = SamplingParams(max_tokens=new, ignore_eos=True, detokenize=False)
            self.scheduler.add_request(
                Request(
                    request_id=str(next(self.ids)),
                    prompt_token_ids=list(tokens),
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=self.hasher,
                )
            )

    def busy(self) -> bool:
        """Whether a burst runs, its falling step is to come, or batches
        are in flight."""
        return bool(self.in_burst or self.awaiting_fall or self.queue)

    def tick(self, measured: bool) -> None:
        """One pass of ``step_with_batch_queue`` (with depth 1, of ``step``)."""
        scheduler = self.scheduler
        if scheduler.has_requests():
            executed = self._schedule(measured)
            if len(self.queue) < self.depth and (executed or scheduler.has_requests()):
                return
        elif not self.queue:
            if self.awaiting_fall:
                self._forced_fall(measured)
            return
        self._update()

    def _timed(self, call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``call(*args)`` and its seconds (profiled when profiling)."""
        if self.profiler is not None:
            self.profiler.enable()
        start = time.perf_counter()
        value = call(*args)
        seconds = time.perf_counter() - start
        if self.profiler is not None:
            self.profiler.disable()
        return value, seconds

    def _schedule(self, measured: bool) -> bool:
        """Schedule a batch into the queue; whether it has tokens."""
        output, seconds = self._timed(self.scheduler.schedule)
        falling, self.awaiting_fall = self.awaiting_fall, False
        self.queue.appendleft((output, self._worker(output), seconds, measured, falling))
        return bool(output.total_num_scheduled_tokens)

    def _update(self) -> None:
        output, result, seconds, measured, falling = self.queue.pop()
        _, more = self._timed(self.scheduler.update_from_output, output, result)
        tokens = int(output.total_num_scheduled_tokens)
        self.batches.append(_Batch(seconds + more, tokens, measured, falling))
        if self.in_burst and not self.scheduler.get_num_unfinished_requests():
            self.in_burst, self.awaiting_fall = False, True

    def _forced_fall(self, measured: bool) -> None:
        """The falling step of a side that did not ask for it (stock: no
        request, so its engine would not step), timed to compare."""
        self.awaiting_fall = False
        output, seconds = self._timed(self.scheduler.schedule)
        _, more = self._timed(self.scheduler.update_from_output, output, self._worker(output))
        self.batches.append(_Batch(seconds + more, 0, measured, falling=True, asked=False))

    def _worker(self, output: Any) -> Any:
        """What the workers return for ``output``: one token per request
        whose prompt is done (vLLM's runner discards a prefill chunk's),
        and ours's orders answered, every wanted unit granted."""
        from vllm.v1.outputs import ModelRunnerOutput

        from extensible_kv.kv.growth.elastic import ElasticReport, units_of

        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[] if requests[r].is_prefill_chunk else [TOKEN] for r in ids],
        )
        orders = getattr(output, "extensible_kv", None)
        if orders is not None:
            result.extensible_kv = ElasticReport(orders.seq, len(units_of(orders.wanted)))
        return result


# -- running a trace on both sides -------------------------------------------


@dataclass(frozen=True)
class _Pairing:
    """Where both sides are built: the model folder, the scale, the mode."""

    model: str
    scale: Scale
    async_on: bool


def _side(pairing: _Pairing, ours: bool, trace: Trace) -> _Side:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = _vllm_config(pairing.model, ours, pairing.async_on, trace.cache_bytes)
    kv_cache_config = _kv_cache_config(config, pairing.scale)
    block_sizes = resolve_kv_cache_block_sizes(kv_cache_config, config)
    scheduler = _scheduler(config, kv_cache_config, block_sizes)
    hasher = _block_hasher(config, block_sizes[1])
    return _Side(scheduler, hasher, config.max_concurrent_batches)


def _lockstep(sides: list[_Side], tick: int, measured: bool) -> None:
    """One tick of every side, the first to step alternating by tick."""
    order = sides if tick % 2 == 0 else sides[::-1]
    for side in order:
        side.tick(measured)


def _run(trace: Trace, sides: list[_Side]) -> None:
    """``trace`` on ``sides`` (stock, ours), in lockstep."""
    if trace.bursts:
        _run_bursts(trace, sides)
        return
    for tick in range(trace.warm + trace.ticks):
        for side in sides:
            side.add(trace.arrivals.get(tick, []))
        _lockstep(sides, tick, measured=tick >= trace.warm)


def _run_bursts(trace: Trace, sides: list[_Side]) -> None:
    """Each burst to the end of both sides' requests and their falling
    steps, then ``trace.idle`` ticks; every tick measured."""
    tick = 0
    for burst in range(trace.bursts):
        for side in sides:
            side.add(trace.arrivals[burst])
            side.in_burst = True
        start = tick
        while any(side.busy() for side in sides):
            if tick - start > MAX_BURST_TICKS:
                raise RuntimeError(f"a burst ran past {MAX_BURST_TICKS} ticks")
            _lockstep(sides, tick, measured=True)
            tick += 1
        for _ in range(trace.idle):
            _lockstep(sides, tick, measured=True)
            tick += 1


def _spread(seconds: list[float]) -> dict[str, float]:
    """min, median, p99 and max of per-step ``seconds``."""
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p99": p99,
        "max": ordered[-1],
    }


def _figures(side: _Side) -> dict[str, Any]:
    """A side's measured steps (those its ``has_requests()`` asked for):
    the spread, count and tokens of those that scheduled tokens (the work
    both sides do), the count and slowest of the empty ones (ours steps
    while idle to give memory back, a bounded part each step), and its
    falling steps."""
    steps = [b for b in side.batches if b.measured and b.asked]
    busy = [b for b in steps if b.tokens] or steps
    empty = [b.seconds for b in steps if not b.tokens]
    falls = [b for b in side.batches if b.falling]
    return {
        "steps": len(busy),
        "tokens": sum(b.tokens for b in busy),
        "seconds": _spread([b.seconds for b in busy]),
        "empty_steps": len(empty),
        "empty_max_s": max(empty, default=0.0),
        "falling_s": [b.seconds for b in falls],
        "falling_asked": [b.asked for b in falls],
    }


def _class_name(scheduler: Any) -> str:
    """The scheduler's class and the vLLM class under it."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    base = "AsyncScheduler" if isinstance(scheduler, AsyncScheduler) else "Scheduler"
    name = type(scheduler).__name__
    return name if name == base else f"{name} (on vLLM's {base})"


def run_trace(
    pairing: _Pairing, trace: Trace, profiler: cProfile.Profile | None = None
) -> dict[str, Any]:
    """``trace`` on stock and ours at ``pairing``: each side's figures, the
    ratios ours / stock and the goals; ``profiler`` records ours's calls."""
    stock, ours = _side(pairing, False, trace), _side(pairing, True, trace)
    ours.profiler = profiler
    _run(trace, [stock, ours])
    mine, theirs = _figures(ours), _figures(stock)
    ratio = {key: mine["seconds"][key] / theirs["seconds"][key] for key in ("median", "p99")}
    return {
        "mode": "on" if pairing.async_on else "off",
        "scale": pairing.scale.name,
        "trace": trace.name,
        "label": trace.label,
        "classes": {"stock": _class_name(stock.scheduler), "ours": _class_name(ours.scheduler)},
        "stock": theirs,
        "ours": mine,
        "ratio": ratio,
        "goals": {
            "median": _verdict(ratio["median"], MEDIAN_GOAL, mine, theirs),
            "p99": _verdict(ratio["p99"], P99_GOAL, mine, theirs),
        },
    }


def _verdict(ratio: float, goal: float, mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """``met`` when ``ratio`` (ours / stock) is at most ``goal``, else ``not
    met``; ``not comparable`` where ours scheduled under
    :data:`COMPARABLE_TOKENS` of stock's tokens (cheaper steps for less
    work: a ``Scheduler`` under a batch queue schedules a decode only every
    other batch)."""
    if mine["tokens"] < COMPARABLE_TOKENS * theirs["tokens"]:
        return "not comparable"
    return "met" if ratio <= goal else "not met"


def _scale_figures(model: str, scale: Scale) -> dict[str, Any]:
    """The scale's blocks and units as vLLM's config and our scheduler see them."""
    from extensible_kv.integrations.vllm.scheduler.scheduler import blocks_per_unit

    config = _vllm_config(model, True, False, None)
    kv_cache_config = _kv_cache_config(config, scale)
    per_unit = blocks_per_unit(kv_cache_config)
    blocks = int(kv_cache_config.num_blocks)
    return {
        "name": scale.name,
        "kv_bytes": scale.kv_bytes,
        "layout": scale.layout,
        "num_blocks": blocks,
        "blocks_per_unit": per_unit,
        "units": -(-blocks // per_unit),
    }


@contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM's warnings and our scheduler's notes off while the suite runs."""
    loggers = [logging.getLogger(n) for n in ("vllm", "extensible_kv.integrations")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def suite(
    plan: SchedulerPlan, device: str = "cpu", progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Every trace at every scale, async scheduling off and on, stock and
    ours side by side (on the host); the profile of ours on its worst trace
    at the most units; the driver calls of a burst on ``device``. Without
    vLLM: ``skipped`` says why, and only the driver calls run."""
    progress("scheduler: driver calls of a burst")
    calls = driver_calls(plan.burst_units, plan.burst_segments, plan.repeats, device)
    why = unavailable()
    if why is not None:
        return {"skipped": why, "driver_calls": calls}
    from extensible_kv.demo.tiny_models import save_tiny_model

    quiet_vllm_cpu()
    model = str(save_tiny_model("llama", Path(tempfile.gettempdir()) / "extensible-kv-tiny-llama"))
    with _quiet_vllm():
        sizes = [_scale_figures(model, scale) for scale in scales(plan.kv_gib)]
        runs = []
        for mode, scale, trace in itertools.product(MODES, scales(plan.kv_gib), traces(plan)):
            progress(f"scheduler: async {mode}, {scale.name}, {trace.name}")
            runs.append(run_trace(_Pairing(model, scale, mode == "on"), trace))
        progress("scheduler: profile")
        profile = profile_worst(model, plan, runs, sizes)
    return {
        "load": plan.load,
        "steps": plan.steps,
        "tokens": plan.tokens,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "scales": sizes,
        "runs": runs,
        "falling_goal": falling_goal(runs, sizes),
        "profile": profile,
        "ours_sources": ours_sources(),
        "driver_calls": calls,
    }


def ours_sources() -> dict[str, str]:
    """Which code ours ran: each vLLM integration module loaded, by name,
    with the first 12 hex digits of its source's SHA-256 (the scheduler
    changes; a result names the version it measured)."""
    out = {}
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith("extensible_kv.integrations.vllm") and path:
            out[name] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    return out


def falling_goal(runs: list[dict[str, Any]], sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours's falling steps at the scale with the most units (each mode),
    against :data:`FALLING_GOAL_S`: met when the slowest is under it."""
    most = max(sizes, key=lambda s: s["units"])["name"]
    out: dict[str, Any] = {"scale": most, "goal_s": FALLING_GOAL_S}
    for run in runs:
        if run["scale"] == most and run["trace"] == "burst":
            falls = run["ours"]["falling_s"]
            out[run["mode"]] = {
                "max_s": max(falls),
                "verdict": "met" if max(falls) < FALLING_GOAL_S else "not met",
            }
    return out


# -- where ours's time goes ----------------------------------------------------


def profile_worst(
    model: str, plan: SchedulerPlan, runs: list[dict[str, Any]], sizes: list[dict[str, Any]]
) -> dict[str, Any]:
    """cProfile of ours (async scheduling off) on the trace with its worst
    median ratio at the scale with the most units, run again: the top
    functions by own time, and ours's seconds in all."""
    most = max(sizes, key=lambda s: s["units"])["name"]
    candidates = [r for r in runs if r["scale"] == most and r["mode"] == "off"]
    worst = max(candidates, key=lambda r: r["ratio"]["median"])["trace"]
    trace = next(t for t in traces(plan) if t.name == worst)
    scale = next(s for s in scales(plan.kv_gib) if s.name == most)
    profiler = cProfile.Profile()
    run_trace(_Pairing(model, scale, False), trace, profiler)
    return {"scale": most, "trace": worst, **top_functions(profiler, PROFILE_TOP)}


def top_functions(profiler: cProfile.Profile, count: int) -> dict[str, Any]:
    """Where the profile's time went: the ``count`` functions with the most
    own time (``top``), and the ``count`` of extensible-kv's with the most
    cumulative time (``ours``, what each of our calls costs with what it
    calls): each with where it is (file:line, the path from its package),
    calls, own and cumulative seconds; and the profile's total seconds."""
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{_short(path)}:{line}({name})",
            "calls": calls,
            "own_s": own,
            "cumulative_s": cumulative,
        }
        for (path, line, name), (_, calls, own, cumulative, _) in entries.items()
    ]
    by_own = sorted(rows, key=lambda row: -row["own_s"])
    mine = [row for row in rows if row["function"].startswith("extensible_kv/")]
    by_cumulative = sorted(mine, key=lambda row: -row["cumulative_s"])
    total = stats.total_tt  # type: ignore[attr-defined]
    return {"total_s": total, "top": by_own[:count], "ours": by_cumulative[:count]}


def _short(path: str) -> str:
    """A source path from its package on (``vllm/...``, ``extensible_kv/...``)."""
    for root in ("extensible_kv/", "vllm/"):
        if root in path:
            return root + path.rsplit(root, 1)[1]
    return path


# -- driver calls of a burst of elastic units --------------------------------


def driver_calls(units: int, segments: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """``ElasticBlocks.apply`` committing ``units`` one-block units at once
    (each block :data:`HALF_PAGE_BYTES` in each of ``segments`` segments:
    a layer's K or V) and giving them back, ``repeats`` times, on
    ``device``'s backend under a ``StatisticsDriver``: the calls of each
    (from the first repeat) and seconds, min/median/max; then the same
    under a ``PoolingDriver`` with orders that keep memory idle (as while
    an engine runs), the handles of the units given back serving the next
    commit."""
    from extensible_kv.driver import PoolingDriver, StatisticsDriver, backend

    inner = backend(device)
    stats = StatisticsDriver(inner)
    granule = stats.granularity(0, False)
    on = torch.device(device)
    figures: dict[str, Any] = {}
    cache, burst = _burst_cache(stats, units, segments, device, keep_idle=False)
    try:
        figures["commit"] = _counted(stats, on, burst.commit, repeats, burst.give_back)
        figures["release"] = _counted(
            stats, on, burst.give_back, repeats, burst.commit, before=True
        )
    finally:
        cache.free()
    # Per segment, the granules the burst spans and one for its ends.
    per_segment = -(-units * HALF_PAGE_BYTES // granule) + 1
    pool = PoolingDriver(stats, cap_bytes=per_segment * granule * segments)
    cache, burst = _burst_cache(pool, units, segments, device, keep_idle=True)
    try:
        burst.commit()
        burst.give_back()  # the pool holds the burst's handles now
        figures["commit_pooled"] = _counted(stats, on, burst.commit, repeats, burst.give_back)
        figures["release_pooled"] = _counted(
            stats, on, burst.give_back, repeats, burst.commit, before=True
        )
    finally:
        cache.free()
        pool.drain()
    return {
        "units": units,
        "segments": segments,
        "bytes": units * HALF_PAGE_BYTES * segments,
        "granule_bytes": granule,
        "driver": f"StatisticsDriver({inner!r}), {granule // MiB} MiB granules",
        **figures,
    }


def _burst_cache(
    driver: Any, units: int, segments: int, device: str, *, keep_idle: bool
) -> tuple[Any, _Burst]:
    """An elastic cache of ``units`` one-block units over ``segments``
    segments on ``driver``, and its burst."""
    from extensible_kv.kv import KVCacheBuffers
    from extensible_kv.kv.growth.elastic import ElasticBlocks
    from extensible_kv.tensor import ExtensibleTensor

    granule = driver.granularity(0, False)
    capacity = units + granule // HALF_PAGE_BYTES
    tensor = ExtensibleTensor(
        capacity * HALF_PAGE_BYTES * segments,
        device,
        num_segments=segments,
        driver=driver,
        chunk_bytes=granule,
    )
    cache = KVCacheBuffers([(tensor, HALF_PAGE_BYTES)], capacity)
    return cache, _Burst(ElasticBlocks(cache, capacity), units, keep_idle)


class _Burst:
    """Units ``[1, units]`` of ``blocks`` (one block each) committed at once
    and given back, as a worker applies the scheduler's orders (which keep
    memory idle or not)."""

    def __init__(self, blocks: Any, units: int, keep_idle: bool) -> None:
        self.blocks = blocks
        self.units = units
        self.keep_idle = keep_idle
        self.seq = itertools.count(1)
        blocks.start()

    def commit(self) -> None:
        from extensible_kv.kv.growth.elastic import ElasticOrders

        wanted = ((1, self.units + 1),)
        self.blocks.apply(
            ElasticOrders(
                next(self.seq), 1, held=((0, 1),), wanted=wanted, keep_idle=self.keep_idle
            )
        )

    def give_back(self) -> None:
        from extensible_kv.kv.growth.elastic import ElasticOrders

        self.blocks.apply(
            ElasticOrders(next(self.seq), 1, held=((0, 1),), keep_idle=self.keep_idle)
        )


#: The calls a commit and a release make, counted.
COUNTED = ("create", "map", "set_access", "unmap", "release")


def _counted(
    stats: Any,
    device: torch.device,
    call: Callable[[], object],
    repeats: int,
    undo: Callable[[], object],
    *,
    before: bool = False,
) -> dict[str, Any]:
    """``call`` ``repeats`` times, ``undo`` after each (with ``before``,
    before each): the driver calls of the first, seconds of each
    (``device``'s queued work included)."""
    counts: dict[str, int] = {}
    seconds = []
    for repeat in range(repeats):
        if before:
            undo()
        stats.reset_calls()
        seconds.append(timed(call, device))
        if repeat == 0:
            counts = {name: stats.calls[name].calls for name in COUNTED}
        if not before:
            undo()
    return {
        "calls": counts,
        "total_calls": sum(counts.values()),
        "seconds": {"min": min(seconds), "median": statistics.median(seconds), "max": max(seconds)},
    }


# -- tables --------------------------------------------------------------------


def _ms(seconds: float) -> str:
    """``seconds`` in ms, 3 significant digits (whole ms from 1 s on)."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def _units(results: dict[str, Any], scale: str) -> str:
    """``scale`` with its units and blocks per unit."""
    size = next(s for s in results["scales"] if s["name"] == scale)
    return f"{scale} ({size['units']:,} units of {size['blocks_per_unit']})"


def rows(results: dict[str, Any]) -> list[list[str]]:
    """Per mode, scale and trace, header first: each side's time of a step
    that scheduled tokens in ms, median [min-max] and p99, the ratios ours /
    stock and the goals' verdicts, the tokens ours scheduled over stock's
    (the same work), and the empty steps each took (slowest in ms)."""
    out = [
        [
            "async scheduling",
            "scale",
            "trace",
            "stock ms: median [min-max]",
            "stock p99",
            "ours ms: median [min-max]",
            "ours p99",
            f"ours / stock: median (goal <= {MEDIAN_GOAL})",
            f"p99 (goal <= {P99_GOAL})",
            "tokens ours / stock",
            "empty steps ours / stock (slowest ms)",
        ]
    ]
    for run in results["runs"]:
        cells = [run["mode"], _units(results, run["scale"]), run["label"]]
        for side in ("stock", "ours"):
            s = run[side]["seconds"]
            cells += [f"{_ms(s['median'])} [{_ms(s['min'])}-{_ms(s['max'])}]", _ms(s["p99"])]
        ratio, goals = run["ratio"], run["goals"]
        cells += [
            f"{ratio['median']:.3f}x ({goals['median']})",
            f"{ratio['p99']:.3f}x ({goals['p99']})",
            f"{run['ours']['tokens'] / max(run['stock']['tokens'], 1):.3f}",
            f"{run['ours']['empty_steps']} ({_ms(run['ours']['empty_max_s'])}) / "
            f"{run['stock']['empty_steps']} ({_ms(run['stock']['empty_max_s'])})",
        ]
        out.append(cells)
    return out


def falling_rows(results: dict[str, Any]) -> list[list[str]]:
    """The burst's falling steps (the first after its last request
    finished), ms, each burst's, per mode and scale; stock's marked where its
    ``has_requests()`` did not ask for the step (timed only to compare)."""
    out = [["async scheduling", "scale", "stock ms", "ours ms"]]
    for run in results["runs"]:
        if run["trace"] != "burst":
            continue
        cells = [run["mode"], _units(results, run["scale"])]
        for side in ("stock", "ours"):
            figures = run[side]
            times = ", ".join(_ms(s) for s in figures["falling_s"])
            asked = "" if all(figures["falling_asked"]) else " (not asked for)"
            cells.append(times + asked)
        out.append(cells)
    goal = results["falling_goal"]
    for mode in MODES:
        if mode in goal:
            verdict = goal[mode]
            out.append(
                [
                    mode,
                    f"goal: ours under {_ms(goal['goal_s'])} ms at {goal['scale']}",
                    "",
                    f"slowest {_ms(verdict['max_s'])} ({verdict['verdict']})",
                ]
            )
    return out


def profile_rows(results: dict[str, Any], key: str = "top") -> list[list[str]]:
    """The profile's functions under ``key`` (``top``: most own time;
    ``ours``: extensible-kv's, most cumulative time), header first: calls,
    own and cumulative seconds, and their shares of the profiled total."""
    profile = results["profile"]
    total = profile["total_s"]
    out = [["function", "calls", "own s", "cumulative s", "own share", "cumulative share"]]
    for row in profile[key]:
        out.append(
            [
                row["function"],
                str(row["calls"]),
                f"{row['own_s']:.3f}",
                f"{row['cumulative_s']:.3f}",
                f"{row['own_s'] / total:.1%}",
                f"{row['cumulative_s'] / total:.1%}",
            ]
        )
    return out


def driver_rows(calls: dict[str, Any]) -> list[list[str]]:
    """The burst's driver calls, header first: each counted call, the total
    and the time (ms, median [min-max])."""
    out = [["what", *COUNTED, "all", "ms: median [min-max]"]]
    labels = {
        "commit": "commit",
        "release": "release",
        "commit_pooled": "commit, handles from the pool (an engine running)",
        "release_pooled": "release, handles kept idle (an engine running)",
    }
    for what, label in labels.items():
        if what not in calls:
            continue
        figures = calls[what]
        s = figures["seconds"]
        out.append(
            [
                label,
                *(str(figures["calls"][name]) for name in COUNTED),
                str(figures["total_calls"]),
                f"{_ms(s['median'])} [{_ms(s['min'])}-{_ms(s['max'])}]",
            ]
        )
    return out


def driver_title(calls: dict[str, Any]) -> str:
    """What the driver-call rows measured."""
    return (
        f"ElasticBlocks.apply: {calls['units']} one-block units "
        f"({calls['bytes'] / GiB:.3g} GiB over {calls['segments']} segments) "
        f"committed at once and given back; {calls['driver']}"
    )


def markdown(results: dict[str, Any]) -> str:
    """Every table of the suite as Markdown, each under its title."""
    parts = []
    if "skipped" in results:
        parts.append(f"scheduler: skipped ({results['skipped']})")
    else:
        profile = results["profile"]
        parts += [
            markdown_table(rows(results)),
            "The falling step\n\n" + markdown_table(falling_rows(results)),
            f"Ours profiled on {profile['trace']} at {profile['scale']} (async scheduling "
            f"off): {profile['total_s']:.2f} s in ours's schedule() and update_from_output(); "
            "the functions with the most own time\n\n" + markdown_table(profile_rows(results)),
            "extensible-kv's functions with the most cumulative time\n\n"
            + markdown_table(profile_rows(results, "ours")),
        ]
    calls = results["driver_calls"]
    parts.append(driver_title(calls) + "\n\n" + markdown_table(driver_rows(calls)))
    return "\n\n".join(parts)
