"""A STAND-IN EXECUTOR at vLLM 0.32's model boundary, and engine runs over it
(for tests/test_vllm_batch_queue.py).

vLLM's CPU build forces async scheduling off, and a real pipeline-parallel
engine fails at its first step on this build, so vLLM's batch queue (two
batches in flight) cannot run here with a real model. These runs use
**vLLM's real** ``EngineCore`` stepped through its ``step_with_batch_queue``,
with the real scheduler (stock ``AsyncScheduler``/``Scheduler``, or ours),
config, block pool, prefix cache, preemption, aborts and output handling.
**The one thing not real is below the executor boundary**: the workers,
their model runners and the GPU are stood in for.

- :class:`StandInExecutor` *is* vLLM's ``UniProcExecutor`` (the executor of
  a one-GPU engine: the worker runs on the engine's thread, an async output
  is awaited through vLLM's own ``AsyncOutputFuture``), with only
  ``_init_executor`` replaced to make a stand-in worker its driver worker.
  :class:`StandInPipelineExecutor` is shaped as vLLM's ``MultiprocExecutor``
  with pipeline parallelism: one worker per stage serving its calls in order
  on a thread of its own (a worker process), every call broadcast to all
  stages and answered by the last one, an async output resolved in the
  worker as ``WorkerProc`` resolves it.
- A :class:`StandInWorker` does on the host what our worker
  (``ExtensibleKVWorker``) does: the real
  :class:`~extensible_kv.integrations.vllm.worker.elastic.ElasticSteps` applies the
  scheduler's orders to a real KV cache on the host backend (units really
  committed and unmapped) before the step, and its report goes on the step's
  output through ``ElasticSteps.with_report``. It keeps the block tables as
  vLLM's runner does and launches the step's kernels; it answers as vLLM's
  GPU runners do: ``EMPTY_MODEL_RUNNER_OUTPUT`` for an empty step; for a
  step with tokens ``None`` from ``execute_model`` and the output from
  ``sample_tokens``, an ``AsyncModelRunnerOutput`` with async scheduling or
  the V2 runner (which always returns one), a ``ModelRunnerOutput`` after
  the step is done otherwise.
- A :class:`Device` per stage is the GPU: one FIFO of kernels on a thread of
  its own (a CUDA stream). It is **the slowest GPU vLLM's loop allows**: a
  batch's kernels start only when the host waits for that batch's output
  (or a later one's). Everything the host does while a GPU could still be
  running a batch (the next ``schedule()``, the worker applying the next
  orders, aborts, ``update_from_output`` of the batch before) happens before
  the batch touches memory. A faster GPU only narrows that window: a hazard
  a GPU can hit, these runs hit every time (with the one-GPU executor,
  whose worker runs on the engine's thread, deterministically).
- The model is a tiny paged attention: the token ``t`` at position ``p``
  writes its "KV", :func:`kv_value`, into its slot (the block from the
  request's block table, the offset in the block) of every layer's page in
  the real cache memory, and the next token is a function of every slot of
  the context read back through the block table (:func:`reference_tokens`
  computes the same from the token ids alone). A block released, zeroed or
  reused under a batch gives other tokens, not only a fault. Before touching
  a block the device checks that the worker holds it (``ElasticBlocks.holds``)
  and records a fault instead of reading unmapped memory (SIGSEGV on the
  host); it checks every slot it reads against the tokens that wrote it; and
  when orders release a unit, the worker records every batch still in
  flight that uses a block of it.

Not modelled: real weights and kernels, CUDA graphs, ranks in processes of
their own (one process; vLLM's process groups have one rank), and the
device-wide ``synchronize`` our GPU drivers make before every unmap: there a
release under a running batch waits for the batch (a stall, the overlap
lost) instead of faulting. The stand-in's device takes no part in it, so
the scheduler's own promise (nothing given back under a batch in flight)
is what is checked; ``releases_while_busy`` counts the releases that on a
GPU would have waited for a batch in flight, used or not.

``python tests/stand_in_executor.py '{"model": DIR}'`` runs every scenario
of :data:`MODES`, stock then ours, and the canary (:func:`main`); the last
line printed is ``RESULT`` and the JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

#: Seconds any one wait (the host's, a device's, a worker's) may take.
WAIT_S = 30.0
#: A prime the next-token function reduces by, before the vocabulary.
MIX = 1_000_003


# -- the model ------------------------------------------------------------------------


def kv_value(tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """The "KV" the tokens ``tokens`` at ``positions`` write in ``layer``:
    int32, never 0 (a zeroed slot reads differently)."""
    mixed = tokens.long() * 40503 + positions.long() * 2654435761 + (layer + 1) * 97
    return ((mixed % (1 << 31)) | 1).to(torch.int32)


def weighted_sum(values: torch.Tensor, positions: torch.Tensor) -> int:
    """What attention makes of the slots ``values`` read at ``positions``."""
    return int((values.long() * (positions.long() + 1)).sum().item())


def next_token(total: int, vocab: int) -> int:
    """The token after a context whose weighted KV sum over layers is ``total``."""
    return (total % MIX) % vocab


def reference_tokens(prompt: list[int], count: int, num_layers: int, vocab: int) -> list[int]:
    """The first ``count`` tokens the stand-in's model makes after ``prompt``,
    from the token ids alone (no cache, no engine)."""
    tokens = list(prompt)
    positions = torch.arange(len(tokens))
    ids = torch.tensor(tokens)
    total = sum(
        weighted_sum(kv_value(ids, positions, layer), positions) for layer in range(num_layers)
    )
    out: list[int] = []
    for _ in range(count):
        token = next_token(total, vocab)
        out.append(token)
        at = torch.tensor([len(tokens)])
        total += sum(
            weighted_sum(kv_value(torch.tensor([token]), at, layer), at)
            for layer in range(num_layers)
        )
        tokens.append(token)
    return out


# -- the device ------------------------------------------------------------------------


class Clock:
    """Which batches the devices may run: up to the latest one the host waited for."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.allowed = 0

    def allow(self, seq: int) -> None:
        with self.cond:
            if seq > self.allowed:
                self.allowed = seq
                self.cond.notify_all()


class Device:
    """One stage's GPU (see the module): kernels in order on a thread of
    their own, batch ``seq``'s once the clock allows it. ``memory`` is held
    while a kernel runs; the worker holds it to change what is mapped, so a
    kernel never meets memory going away under it (a fault is recorded
    instead of a SIGSEGV)."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.clock = clock
        self.cond = clock.cond
        self.memory = threading.Lock()
        #: Batches launched and not finished, in order (the first may be running).
        self.queue: list[tuple[int, Callable[[], None]]] = []
        self.done = 0
        self.failure: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, seq: int, kernel: Callable[[], None]) -> None:
        with self.cond:
            self.queue.append((seq, kernel))
            self.cond.notify_all()

    def in_flight(self) -> list[int]:
        """The batches launched and not finished."""
        with self.cond:
            return [seq for seq, _ in self.queue]

    def wait(self, seq: int, *, open_gate: bool) -> None:
        """Until batch ``seq``'s kernels are done (at most :data:`WAIT_S`);
        ``open_gate``: the host is the one waiting, so the batch may run."""
        if open_gate:
            self.clock.allow(seq)
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while self.done < seq and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stand-in device: batch {seq} not done after {WAIT_S} s")
                self.cond.wait(left)
            if self.failure is not None:
                raise RuntimeError(f"stand-in device failed: {self.failure!r}")

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._stop and not (
                    self.queue and self.queue[0][0] <= self.clock.allowed
                ):
                    self.cond.wait(0.1)
                if self._stop:
                    return
                seq, kernel = self.queue[0]
            with self.memory:
                try:
                    kernel()
                except BaseException as error:  # every wait on this device fails
                    with self.cond:
                        self.failure = error
                        self.cond.notify_all()
                    return
                with self.cond:
                    self.queue.pop(0)
                    self.done = max(self.done, seq)
                    self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join(WAIT_S)


# -- the worker ------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's work on one stage, as its worker planned it on the host."""

    seq: int
    finished: list[str]
    #: Token lists a request starts over from (new, or resumed with its tokens).
    resets: dict[str, list[int]]
    #: Tokens the scheduler sends for positions (pipeline parallelism).
    inputs: dict[str, tuple[int, list[int]]]
    #: Tokens a request has once every batch before this one sampled.
    lengths: dict[str, int]
    #: (request, first position computed, positions computed, blocks of the context)
    requests: list[tuple[str, int, int, tuple[int, ...]]]
    zero_blocks: list[int]
    blocks: set[int] = field(default_factory=set)


class Shared:
    """What one engine's stages share: the clock, the states handed down the
    pipeline, the outputs, and the record of what went wrong."""

    def __init__(self, stages: int) -> None:
        self.clock = Clock()
        self.stages = stages
        self.lock = threading.Lock()
        self.hidden: dict[tuple[int, int], dict[str, Any]] = {}
        self.outputs: dict[int, tuple[list[str], list[list[int]]]] = {}
        #: Orders that released a unit a batch in flight uses (found at the release).
        self.released_under_batch: list[str] = []
        #: A kernel that met memory not held, or read KV its tokens did not write.
        self.device_faults: list[str] = []
        #: Failures of stages whose answer nobody waits for.
        self.errors: list[str] = []
        #: Per launch: batches in flight on that stage before it.
        self.in_flight_at_launch: list[int] = []

    def record(self, where: list[str], text: str) -> None:
        with self.lock:
            if len(where) < 100:
                where.append(text)

    def hand_down(self, seq: int, stage: int, hidden: dict[str, Any]) -> None:
        with self.clock.cond:
            self.hidden[seq, stage] = hidden
            self.clock.cond.notify_all()

    def take_hidden(self, seq: int, stage: int) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        with self.clock.cond:
            while (seq, stage) not in self.hidden:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stand-in: stage {stage} of batch {seq} never came")
                self.clock.cond.wait(left)
            return self.hidden.pop((seq, stage))


def _async_output_class() -> type:
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class StandInAsyncOutput(AsyncModelRunnerOutput):  # type: ignore[misc]
        """STAND-IN for the GPU runner's async output: the step's
        ``ModelRunnerOutput`` once the device has run it."""

        def __init__(self, worker: StandInWorker, seq: int) -> None:
            self.worker, self.seq = worker, seq

        def get_output(self) -> Any:
            return self.worker.output_of(self.seq)

    return StandInAsyncOutput


class StandInWorker:
    """STAND-IN for one stage's worker, model runner and GPU (see the module).

    Args:
        vllm_config: the engine's config.
        stage: the pipeline stage; it holds an even share of the layers.
        shared: what the stages share.
        opens_gate: whether waiting for this worker's output is the host
            waiting (the executor runs the worker on the engine's thread).
    """

    #: Canary (tests only): the batch after which the worker gives back a
    #: unit a batch in flight uses, behind the scheduler's back.
    sabotage_after: int | None = None

    def __init__(self, vllm_config: Any, stage: int, shared: Shared, opens_gate: bool) -> None:
        self.vllm_config = vllm_config
        self.stage = stage
        self.shared = shared
        self.opens_gate = opens_gate
        self.last = stage == shared.stages - 1
        model = vllm_config.model_config
        self.num_layers = int(model.hf_text_config.num_hidden_layers)
        share = self.num_layers // shared.stages
        end = self.num_layers if self.last else (stage + 1) * share
        self.layers = list(range(stage * share, end))
        self.vocab = int(model.get_vocab_size())
        self.device = Device(f"stand-in-device-{stage}", shared.clock)
        self.block_size = 0
        self.num_blocks = 0
        self.views: dict[int, torch.Tensor] = {}
        self.kv: Any = None
        self.steps: Any = None  # ElasticSteps, with elastic growth
        #: Host side: each request's block table and prompt length.
        self.tables: dict[str, list[int]] = {}
        self.prompt_lens: dict[str, int] = {}
        #: Device side (stage 0's device only): each request's tokens.
        self.tokens: dict[str, list[int]] = {}
        self.pending: Batch | None = None
        self.batches: dict[int, Batch] = {}
        #: Batches with tokens so far (every stage counts the same).
        self.batch_seq = 0
        #: Requests finished since the last batch (dropped with the next one).
        self.finished: list[str] = []
        self.async_output = _async_output_class()
        #: Whether sample_tokens returns an async output: vLLM's V1 runner
        #: does with async scheduling, its V2 runner always.
        self.returns_async = bool(
            vllm_config.scheduler_config.async_scheduling or vllm_config.use_v2_model_runner
        )
        #: Scheduler outputs that carried orders (each answered by a report).
        self.orders_applied = 0
        #: Orders that unmapped memory while a batch was in flight on this stage.
        self.releases_while_busy = 0
        self.max_blocks_held = 0
        self.sabotaged: tuple[int, int] | None = None

    # -- what EngineCore asks before the first step -----------------------------------

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """What vLLM's runner reports for this stage's layers: full attention."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        model = self.vllm_config.model_config
        spec = FullAttentionSpec(
            block_size=self.vllm_config.cache_config.block_size,
            num_kv_heads=model.get_num_kv_heads(self.vllm_config.parallel_config),
            head_size=model.get_head_size(),
            dtype=model.dtype,
        )
        return {f"model.layers.{layer}.self_attn.attn": spec for layer in self.layers}

    def determine_available_memory(self) -> int:
        return int(self.vllm_config.cache_config.kv_cache_memory_bytes)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """What a GPU worker whose attention backends state no preference
        (FlashAttention's) reports: vLLM's default order."""
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts(())]

    def set_kv_cache_layout(self, name: str) -> None:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(self.vllm_config.cache_config, name)

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        """This stage's KV cache: with an ``extensible_kv`` growth option,
        ours, committed as our worker commits it (elastic: unit 0, then what
        the orders say); without, stock vLLM's: plain zeroed memory."""
        from extensible_kv import granule_size
        from extensible_kv.integrations.vllm.options import options_of
        from extensible_kv.integrations.vllm.worker import commit
        from extensible_kv.integrations.vllm.worker.elastic import ElasticSteps
        from extensible_kv.kv import allocate_kv_cache, at_capacity
        from extensible_kv.kv.growth.elastic import ElasticBlocks
        from extensible_kv.kv.layouts.strided import layer_layouts

        config = kv_cache_configs
        if isinstance(config, list):
            config = config[self.stage]
        self.num_blocks = int(config.num_blocks)
        options_of(self.vllm_config)  # checked as our worker checks them
        extra = self.vllm_config.additional_config or {}
        growth = extra.get("extensible_kv", {}).get("growth")
        if growth:
            layout = at_capacity(config, self.num_blocks)
            chunk = granule_size("cpu") if growth == "elastic" else None
            self.kv = allocate_kv_cache(layout, device="cpu", chunk_bytes=chunk)
            made = commit.commit_count(self.kv.cache, self.num_blocks, growth, defragment=False)
            if isinstance(made, ElasticBlocks):
                self.steps = ElasticSteps(made)
            backing = self.kv.backing[0]
        else:
            layout = config
            backing = torch.zeros(int(config.kv_cache_tensors[0].size), dtype=torch.int8)
        spec = config.kv_cache_groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        page = int(spec.page_size_bytes)
        words = backing.view(torch.int32)
        for name, place in layer_layouts(layout).items():
            assert place.shape[1] == page, "each layer's page must be one run of bytes"
            assert place.strides[0] % 4 == 0, "blocks must start on 4-byte words"
            assert place.offset_bytes % 4 == 0, "layers must start on 4-byte words"
            self.views[int(name.split(".")[2])] = torch.as_strided(
                words,
                (place.shape[0], self.block_size),
                (place.strides[0] // 4, page // 4 // self.block_size),
                place.offset_bytes // 4,
            )

    def compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def check_health(self) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    def shutdown(self) -> None:
        self.device.stop()
        if self.kv is not None:
            self.kv.free()
            self.kv = None

    # -- the step, on the host --------------------------------------------------------

    def held_blocks(self) -> set[int]:
        """Blocks of the units the worker holds (every block without elastic growth)."""
        from extensible_kv.kv.growth.elastic import units_of

        if self.steps is None:
            return set(range(self.num_blocks))
        blocks = self.steps.blocks
        per = blocks.blocks_per_unit
        return {
            block
            for unit in units_of(blocks.held_units)
            for block in range(unit * per, min((unit + 1) * per, self.num_blocks))
        }

    def execute_model(self, scheduler_output: Any) -> Any:
        """Our worker's ``before_step`` (elastic growth), then the step's
        kernels launched; the output as vLLM's GPU runner gives it."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if self.steps is not None:
            with self.device.memory:
                before = self.held_blocks()
                self.steps.before_step(scheduler_output, self._no_wake)
                after = self.held_blocks()
                self._check_release(before - after, scheduler_output)
                if before - after and self.device.in_flight():
                    self.releases_while_busy += 1
                self._sabotage()
            if getattr(scheduler_output, "extensible_kv", None) is not None:
                self.orders_applied += 1
            self.max_blocks_held = max(self.max_blocks_held, len(after))
        self.finished.extend(scheduler_output.finished_req_ids)
        if not scheduler_output.total_num_scheduled_tokens:
            for req_id in scheduler_output.finished_req_ids:
                self.tables.pop(req_id, None)
                self.prompt_lens.pop(req_id, None)
            return self._report(EMPTY_MODEL_RUNNER_OUTPUT)
        self.batch_seq += 1
        batch = self._plan(scheduler_output, self.batch_seq)
        with self.device.cond:
            self.shared.in_flight_at_launch.append(len(self.device.queue))
            for seq in [s for s in self.batches if s <= self.device.done]:
                del self.batches[seq]
        self.batches[batch.seq] = batch
        self.device.launch(batch.seq, lambda: self._kernels(batch))
        self.pending = batch
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        """The step's output as vLLM's GPU runner gives it (see the module);
        ``None`` on a stage before the last."""
        batch, self.pending = self.pending, None
        if batch is None or not self.last:
            return None
        output = self.async_output(self, batch.seq)
        if not self.returns_async:
            output = output.get_output()  # the synchronous runner waits for the step
        return self._report(output)

    def _report(self, output: Any) -> Any:
        """``output`` carrying the elastic report, as our worker sends it."""
        return output if self.steps is None else self.steps.with_report(output)

    @staticmethod
    def _no_wake() -> None:
        raise RuntimeError("stand-in: the KV cache never sleeps in these runs")

    def _check_release(self, released: set[int], scheduler_output: Any) -> None:
        """Record every batch in flight on this stage using a block the
        orders just gave back."""
        if not released:
            return
        orders = getattr(scheduler_output, "extensible_kv", None)
        for seq in self.device.in_flight():
            hit = sorted(released & self.batches[seq].blocks)
            if hit:
                self.shared.record(
                    self.shared.released_under_batch,
                    f"stage {self.stage}: orders {getattr(orders, 'seq', None)} gave back "
                    f"blocks {hit[:6]} (units {sorted({b // self._per() for b in hit})}) "
                    f"while batch {seq}, which uses them, was in flight",
                )

    def _per(self) -> int:
        return int(self.steps.blocks.blocks_per_unit)

    def _sabotage(self) -> None:
        """The canary: once, give back the highest unit a batch in flight uses."""
        if self.sabotage_after is None or self.sabotaged or self.batch_seq < self.sabotage_after:
            return
        for seq in self.device.in_flight():
            units = {b // self._per() for b in self.batches[seq].blocks}
            if units:
                self.steps.blocks.give_back([max(units)])
                self.sabotaged = (max(units), seq)
                return

    def _plan(self, so: Any, seq: int) -> Batch:
        """The host's block tables updated and the batch planned (what
        vLLM's runner does in ``_update_states``, as far as this model needs)."""
        finished, self.finished = self.finished, []
        for req_id in finished:
            self.tables.pop(req_id, None)
            self.prompt_lens.pop(req_id, None)
        resets: dict[str, list[int]] = {}
        inputs: dict[str, tuple[int, list[int]]] = {}
        lengths: dict[str, int] = {}
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids)
            resets[new.req_id] = list(new.prefill_token_ids or new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = list(new_blocks[0])
            elif new_blocks is not None:
                self.tables[req_id].extend(new_blocks[0])
            if req_id in cached.all_token_ids:
                resets[req_id] = list(cached.all_token_ids[req_id])
            if cached.new_token_ids:
                inputs[req_id] = (cached.num_computed_tokens[i], list(cached.new_token_ids[i]))
            lengths[req_id] = self.prompt_lens[req_id] + cached.num_output_tokens[i]
            computed[req_id] = cached.num_computed_tokens[i]
        zero = list(so.new_block_ids_to_zero or ())
        batch = Batch(seq, finished, resets, inputs, lengths, [], zero, set(zero))
        for req_id, count in so.num_scheduled_tokens.items():
            position = computed[req_id]
            context = self.tables[req_id][: -(-(position + count) // self.block_size)]
            batch.blocks.update(context)
            batch.requests.append((req_id, position, count, tuple(context)))
        return batch

    def output_of(self, seq: int) -> Any:
        """Batch ``seq``'s ``ModelRunnerOutput``, once the device ran it."""
        from vllm.v1.outputs import ModelRunnerOutput

        self.device.wait(seq, open_gate=self.opens_gate)
        with self.shared.lock:
            req_ids, sampled = self.shared.outputs.pop(seq)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    # -- the step, on the device ------------------------------------------------------

    def _holds(self, blocks: Iterable[int]) -> bool:
        return self.steps is None or bool(self.steps.blocks.holds(blocks))

    def _kernels(self, batch: Batch) -> None:
        """The batch on this stage's device: stage 0 keeps the tokens (the
        embedding's input) and hands its sums down; the last stage samples."""
        if self.stage == 0:
            for req_id in batch.finished:
                self.tokens.pop(req_id, None)
            for req_id, tokens in batch.resets.items():
                self.tokens[req_id] = tokens
            for req_id, (position, tokens) in batch.inputs.items():
                self.tokens[req_id][position : position + len(tokens)] = tokens
            for req_id, length in batch.lengths.items():
                del self.tokens[req_id][length:]  # samples the scheduler dropped
        if batch.zero_blocks:
            if self._holds(batch.zero_blocks):
                for view in self.views.values():
                    view[batch.zero_blocks] = 0
            else:
                self._fault(batch, batch.zero_blocks, "zeroing")
        if self.stage == 0:
            hidden: dict[str, Any] = {}
            for req_id, position, count, _ in batch.requests:
                tokens = self.tokens[req_id]
                if len(tokens) < position + count:
                    raise RuntimeError(
                        f"stand-in: {req_id} has {len(tokens)} tokens; batch {batch.seq} "
                        f"computes positions {position} to {position + count}"
                    )
                # The runner samples only where the batch reaches the last token.
                sample = position + count == len(tokens)
                hidden[req_id] = (tokens[: position + count], sample, 0)
        else:
            hidden = self.shared.take_hidden(batch.seq, self.stage - 1)
        for req_id, position, count, context in batch.requests:
            tokens, sample, total = hidden[req_id]
            total += self._attend(batch, req_id, tokens, position, count, context)
            hidden[req_id] = (tokens, sample, total)
        if not self.last:
            self.shared.hand_down(batch.seq, self.stage, hidden)
            return
        req_ids, sampled = [], []
        for req_id, _, _, _ in batch.requests:
            tokens, sample, total = hidden[req_id]
            req_ids.append(req_id)
            sampled.append([next_token(total, self.vocab)] if sample else [])
            if sample and self.stage == 0:
                self.tokens[req_id].append(sampled[-1][0])
        with self.shared.lock:
            self.shared.outputs[batch.seq] = (req_ids, sampled)

    def _attend(
        self,
        batch: Batch,
        req_id: str,
        tokens: list[int],
        position: int,
        count: int,
        context: tuple[int, ...],
    ) -> int:
        """Write the KV of positions ``[position, position + count)`` and read
        every slot of the context back, on this stage's layers: their sum."""
        if not self._holds(context):
            self._fault(batch, context, f"{req_id}'s context")
            return 0
        end = position + count
        positions = torch.arange(end)
        blocks = torch.tensor(context, dtype=torch.long)[positions // self.block_size]
        slots = positions % self.block_size
        ids = torch.tensor(tokens, dtype=torch.long)
        new = slice(position, end)
        total = 0
        for layer in self.layers:
            view = self.views[layer]
            view[blocks[new], slots[new]] = kv_value(ids[new], positions[new], layer)
            read = view[blocks, slots]
            wrong = (read != kv_value(ids, positions, layer)).nonzero().flatten()
            if len(wrong):
                first = int(wrong[0])
                self.shared.record(
                    self.shared.device_faults,
                    f"stage {self.stage}: batch {batch.seq} read {len(wrong)} KV slots of "
                    f"{req_id} its tokens did not write ({int((read[wrong] == 0).sum())} "
                    f"zero), the first at position {first} in block {int(blocks[first])}",
                )
            total += weighted_sum(read, positions)
        return total

    def _fault(self, batch: Batch, blocks: Iterable[int], what: str) -> None:
        missing = sorted(b for b in set(blocks) if not self._holds([b]))
        self.shared.record(
            self.shared.device_faults,
            f"stage {self.stage}: batch {batch.seq} ran on {what} with blocks {missing[:6]} "
            f"not held (an unmapped page under a kernel on a GPU)",
        )


# -- the executors ----------------------------------------------------------------------


def _init_process_groups(vllm_config: Any) -> None:
    """vLLM's process groups, of one rank (our worker's elastic steps ask
    the tensor-parallel group for its size)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    handle, store = tempfile.mkstemp(prefix="stand-in-store-")
    os.close(handle)
    os.unlink(store)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"file://{store}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)


class _GatedFuture(Future):  # type: ignore[type-arg]
    """A stage's answer; the host waiting for it lets the devices run its batch."""

    def __init__(self, clock: Clock, seq: int) -> None:
        super().__init__()
        self.clock, self.seq = clock, seq

    def result(self, timeout: float | None = None) -> Any:
        self.clock.allow(self.seq)
        return super().result(WAIT_S if timeout is None else timeout)


def executor_classes() -> tuple[type, type]:
    """:class:`StandInExecutor` and :class:`StandInPipelineExecutor`, made
    once vLLM is imported."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class StandInExecutor(UniProcExecutor):  # type: ignore[misc]
        """STAND-IN below the boundary only: vLLM's own one-device executor
        (its ``collective_rpc``, ``execute_model``, ``sample_tokens`` and
        ``AsyncOutputFuture``) with a stand-in worker as its driver worker."""

        def _init_executor(self) -> None:
            _init_process_groups(self.vllm_config)
            self.shared = Shared(1)
            self.workers = [StandInWorker(self.vllm_config, 0, self.shared, opens_gate=True)]
            self.driver_worker = self.workers[0]

    class StandInPipelineExecutor(Executor):  # type: ignore[misc]
        """STAND-IN, shaped as vLLM's ``MultiprocExecutor`` with pipeline
        parallelism (see the module)."""

        supports_pp = True

        def _init_executor(self) -> None:
            _init_process_groups(self.vllm_config)
            stages = self.parallel_config.pipeline_parallel_size
            self.shared = Shared(stages)
            self.workers = [
                StandInWorker(self.vllm_config, stage, self.shared, opens_gate=False)
                for stage in range(stages)
            ]
            self.inboxes: list[list[Any]] = [[] for _ in self.workers]
            self.cond = threading.Condition()
            self.stopping = False
            self.batch_seq = 0
            self.threads = [
                threading.Thread(
                    target=self._serve, args=(stage,), name=f"stand-in-worker-{stage}", daemon=True
                )
                for stage in range(stages)
            ]
            for thread in self.threads:
                thread.start()

        def _serve(self, stage: int) -> None:
            worker, inbox = self.workers[stage], self.inboxes[stage]
            while True:
                with self.cond:
                    while not inbox and not self.stopping:
                        self.cond.wait(0.1)
                    if self.stopping:
                        return
                    method, args, future, reply = inbox.pop(0)
                try:
                    result = getattr(worker, method)(*args)
                    if reply and isinstance(result, AsyncModelRunnerOutput):
                        result = result.get_output()  # as WorkerProc.enqueue_output
                    future.set_result(result)
                except BaseException as error:
                    if not reply:
                        self.shared.record(self.shared.errors, f"stage {stage} {method}: {error!r}")
                    future.set_exception(error)

        def collective_rpc(  # type: ignore[override]
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            non_block: bool = False,
            unique_reply_rank: int | None = None,
        ) -> Any:
            if not isinstance(method, str) or kwargs:
                raise NotImplementedError(f"stand-in: collective_rpc({method!r}, {kwargs})")
            futures = [_GatedFuture(self.shared.clock, self.batch_seq) for _ in self.workers]
            with self.cond:
                for stage, inbox in enumerate(self.inboxes):
                    reply = unique_reply_rank in (None, stage)
                    inbox.append((method, args, futures[stage], reply))
                self.cond.notify_all()
            if unique_reply_rank is not None:
                future: Future[Any] = futures[unique_reply_rank]
            else:
                future = _gather(futures, _GatedFuture(self.shared.clock, self.batch_seq))
            return future if non_block else future.result()

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            if scheduler_output.total_num_scheduled_tokens:
                self.batch_seq += 1
            return self.collective_rpc(
                "execute_model",
                args=(scheduler_output,),
                non_block=non_block,
                unique_reply_rank=len(self.workers) - 1,
            )

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            return self.collective_rpc(
                "sample_tokens",
                args=(grammar_output,),
                non_block=non_block,
                unique_reply_rank=len(self.workers) - 1,
            )

        def take_draft_token_ids(self) -> None:
            return None

        def check_health(self) -> None:
            return None

        def shutdown(self) -> None:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            for thread in self.threads:
                thread.join(WAIT_S)
            for worker in self.workers:
                worker.shutdown()

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return True

    return StandInExecutor, StandInPipelineExecutor


def _gather(futures: list[Future[Any]], into: Future[Any]) -> Future[Any]:
    """``into`` resolved with every one of ``futures``' results, or the first failure."""
    results: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(index: int, future: Future[Any]) -> None:
        with lock:
            if into.done():
                return
            error = future.exception()
            if error is not None:
                into.set_exception(error)
                return
            results[index] = future.result()
            left[0] -= 1
            if not left[0]:
                into.set_result(results)

    for index, future in enumerate(futures):
        future.add_done_callback(lambda f, i=index: done(i, f))
    return into


# -- the engine runs ----------------------------------------------------------------------

#: Scenarios. ``async``: vLLM's GPU default, async scheduling with the V2
#: model runner; ``async-v1``: the same with the V1 runner; ``pipeline``:
#: pipeline parallelism of 2 with the V1 runner, where vLLM itself turns
#: async scheduling off (a plain ``Scheduler`` under a batch queue of 2).
MODES: dict[str, dict[str, Any]] = {
    "async": {"async": True, "v2": True, "pp": 1},
    "async-v1": {"async": True, "v2": False, "pp": 1},
    "pipeline": {"async": False, "v2": False, "pp": 2},
}
NUM_BLOCKS = 160
BLOCK_SIZE = 16
#: ``cache_bytes`` of our runs.
CACHE_BYTES = 4 << 20
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
#: The canary's run: ours under async scheduling, with the worker giving back
#: a unit under a batch in flight once, after this batch.
CANARY = {"mode": "async", "sabotage_after": 40}


@dataclass
class Spec:
    """One request of the load: its prompt, the tokens it asks for, the loop
    iteration (of its wave) it arrives at, and the tokens after which it is
    aborted (None: it runs to its end)."""

    name: str
    prompt: list[int]
    max_tokens: int
    arrive: int
    wave: int
    abort_after: int | None = None


def load() -> list[Spec]:
    """Three waves, each once the engine is idle after the one before: a
    burst of 24 on 4 shared 64-token prefixes, asking for about 2.6 times
    the pool (preemption), three of them aborted part way; 8 on the same
    prefixes arriving one every 3 iterations; 6 long ones, every one
    aborted after 12 tokens (a client gone: the units they filled empty at
    once while a batch of theirs is in flight)."""
    prefixes = [[(37 * g + 11 * j) % 500 + 1 for j in range(64)] for g in range(4)]
    specs = []
    aborts = {3: 5, 8: 17, 14: 40}
    for i in range(24):
        body = [(13 * i + 7 * j) % 500 + 1 for j in range(40 + 17 * (i % 7))]
        specs.append(Spec(f"a{i}", prefixes[i % 4] + body, 60 + 23 * (i % 6), 0, 1, aborts.get(i)))
    for i in range(8):
        body = [(29 * i + 3 * j) % 500 + 1 for j in range(20 + 9 * i)]
        specs.append(Spec(f"b{i}", prefixes[i % 4] + body, 12 + 7 * i, 3 * i, 2))
    for i in range(6):
        prompt = [(41 * i + 5 * j) % 500 + 1 for j in range(90 + 11 * i)]
        specs.append(Spec(f"c{i}", prompt, 200, 0, 3, 12))
    return specs


def build_config(model: str, mode: dict[str, Any], elastic: bool, executor: type) -> Any:
    """vLLM's config as its engine args make it, with the stand-in executor,
    and what a GPU's config says where this CPU build's differs: async
    scheduling on (the CPU platform turns it off; on a GPU vLLM's default is
    on, custom scheduler or not) and the V2 model runner (the GPU default
    where Triton imports; this build's config check refuses it without
    Triton, so it is chosen after the check)."""
    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs

    ours: dict[str, Any] = {}
    if elastic:
        ours = {
            "scheduler_cls": SCHEDULER,
            "additional_config": {
                "extensible_kv": {"growth": "elastic", "cache_bytes": CACHE_BYTES}
            },
        }
    args = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 << 20,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        enable_prefix_caching=True,
        pipeline_parallel_size=mode["pp"],
        distributed_executor_backend=executor,
        seed=0,
        **ours,
    )
    envs.disable_envs_cache()  # the engine before cached them
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    config = args.create_engine_config()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if mode["v2"] else "0"
    if mode["async"]:
        config.scheduler_config.async_scheduling = True
    return config


def run_engine(
    model: str, mode: dict[str, Any], elastic: bool, sabotage_after: int | None = None
) -> dict[str, Any]:
    """The load through vLLM's ``EngineCore``, stepped as its busy loop
    (``EngineCoreProc.run_busy_loop``) steps it: ``step_fn`` and
    ``post_step`` while the scheduler has requests or batches are queued,
    requests added and aborted between steps. The report (never raises:
    a failure is in ``errors``)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    from extensible_kv.integrations.vllm.scheduler.scheduler import LINGER_S

    report: dict[str, Any] = {"errors": []}
    specs = load()
    tokens: dict[str, list[int]] = {s.name: [] for s in specs}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    held_after_wave: dict[int, list[int]] = {}
    preempted: set[str] = set()
    counts = {"steps": 0, "prefix_hits": 0, "reports_received": 0}
    engine = None
    StandInWorker.sabotage_after = sabotage_after
    try:
        single, pipeline = executor_classes()
        config = build_config(model, mode, elastic, pipeline if mode["pp"] > 1 else single)
        engine = EngineCore(config, Executor.get_class(config), log_stats=False)
        scheduler = engine.scheduler
        workers = engine.model_executor.workers
        report.update(
            scheduler_class=type(scheduler).__name__,
            scheduler_bases=[c.__name__ for c in type(scheduler).__mro__],
            is_async_scheduler=isinstance(scheduler, AsyncScheduler),
            is_scheduler=isinstance(scheduler, Scheduler),
            async_scheduling=config.scheduler_config.async_scheduling,
            max_concurrent_batches=config.max_concurrent_batches,
            batch_queue_size=engine.batch_queue_size,
            step_fn=getattr(engine.step_fn, "__name__", repr(engine.step_fn)),
            v2_runner=config.use_v2_model_runner,
            num_blocks=config.cache_config.num_gpu_blocks,
            bytes_per_block=int(scheduler.kv_cache_config.kv_cache_tensors[0].size)
            // int(scheduler.kv_cache_config.num_blocks),
        )
        # Observation only: what the scheduler is given and gives.
        update, schedule = scheduler.update_from_output, scheduler.schedule

        def watched_update(so: Any, output: Any) -> Any:
            counts["reports_received"] += getattr(output, "extensible_kv", None) is not None
            return update(so, output)

        def watched_schedule(*args: Any, **kwargs: Any) -> Any:
            so = schedule(*args, **kwargs)
            preempted.update(so.preempted_req_ids or ())
            counts["prefix_hits"] += sum(1 for n in so.scheduled_new_reqs if n.num_computed_tokens)
            return so

        scheduler.update_from_output = watched_update
        scheduler.schedule = watched_schedule

        def add(spec: Spec) -> None:
            params = SamplingParams(
                temperature=0, max_tokens=spec.max_tokens, ignore_eos=True, detokenize=False
            )
            request = EngineCoreRequest(
                spec.name, spec.prompt, None, params, None, time.time(), None, None, None
            )
            engine.add_request(*engine.preprocess_add_request(request))

        deadline = time.monotonic() + 120
        for wave in (1, 2, 3):
            todo = sorted((s for s in specs if s.wave == wave), key=lambda s: s.arrive)
            iteration = 0
            idle_until: float | None = None
            while True:
                while todo and todo[0].arrive <= iteration:
                    add(todo.pop(0))
                iteration += 1
                if not scheduler.has_requests() and not engine.batch_queue:
                    if todo:
                        continue  # idle until the next arrival, as the busy loop waits
                    # The wave is done. vLLM's loop now waits on its queue; the
                    # elastic scheduler's GiveWay wakes it once the idle engine's
                    # linger is over, and the steps then give memory back.
                    if idle_until is None:
                        idle_until = time.monotonic() + (LINGER_S + 1.0 if elastic else 0.0)
                    if time.monotonic() >= idle_until:
                        break
                    time.sleep(0.02)
                    continue
                idle_until = None
                counts["steps"] += 1
                if counts["steps"] > 5000 or time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the engine did not finish: {scheduler.get_request_counts()} requests "
                        f"running/waiting after {counts['steps']} steps"
                    )
                outputs, executed = engine.step_fn()
                engine.post_step(executed)
                for eco in (outputs or {}).values():
                    for out in eco.outputs:
                        if out.request_id in aborted:
                            raise AssertionError(f"{out.request_id} got tokens after its abort")
                        tokens[out.request_id].extend(out.new_token_ids)
                        if out.finish_reason is not None:
                            finished[out.request_id] = str(out.finish_reason)
                for spec in specs:
                    if (
                        spec.abort_after is not None
                        and spec.name not in aborted
                        and len(tokens[spec.name]) >= spec.abort_after
                    ):
                        engine.abort_requests([spec.name])
                        aborted.add(spec.name)
            # Every stage has taken every call so far (a stage before the
            # last one answers no one, so the engine does not wait for it).
            engine.model_executor.collective_rpc("check_health")
            held_after_wave[wave] = [len(w.held_blocks()) for w in workers]
    except BaseException as error:  # the test says what failed
        report["errors"].append(f"{type(error).__name__}: {error}")
        report["traceback"] = traceback.format_exc()[-4000:]
    finally:
        StandInWorker.sabotage_after = None
        if engine is not None:
            workers = engine.model_executor.workers
            shared = workers[0].shared
            report.update(
                released_under_batch=list(shared.released_under_batch),
                device_faults=list(shared.device_faults),
                worker_errors=list(shared.errors),
                in_flight_at_launch=_histogram(shared.in_flight_at_launch),
                orders_applied=[w.orders_applied for w in workers],
                releases_while_busy=[w.releases_while_busy for w in workers],
                max_blocks_held=[w.max_blocks_held for w in workers],
                blocks_per_unit=[
                    None if w.steps is None else w.steps.blocks.blocks_per_unit for w in workers
                ],
                num_layers=workers[0].num_layers,
                vocab=workers[0].vocab,
                sabotaged=workers[0].sabotaged,
            )
            try:
                engine.shutdown()
            except BaseException as error:
                report["errors"].append(f"shutdown: {type(error).__name__}: {error}")
        report.update(
            tokens=tokens,
            finished=finished,
            aborted=sorted(aborted),
            held_after_wave=held_after_wave,
            preempted=sorted(preempted),
            **counts,
            threads_left=[t.name for t in threading.enumerate() if t.name.startswith("stand-in")],
        )
    return report


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def main() -> None:
    """Every scenario of :data:`MODES`, stock then ours, and the canary;
    prints ``RESULT`` and ``{mode: {"stock": report, "elastic": report},
    "canary": report}``."""
    settings = json.loads(sys.argv[1])
    result: dict[str, Any] = {}
    for name in settings.get("modes", list(MODES)):
        mode = MODES[name]
        result[name] = {
            "stock": run_engine(settings["model"], mode, elastic=False),
            "elastic": run_engine(settings["model"], mode, elastic=True),
        }
    if settings.get("canary", True):
        canary = CANARY["mode"]
        result["canary"] = run_engine(
            settings["model"], MODES[canary], True, sabotage_after=CANARY["sabotage_after"]
        )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
