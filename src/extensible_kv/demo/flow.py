"""The runner flow of docs/design.md section 6, end to end, on a tiny model.

1. Reserve the KV cache at an upper bound and commit one block.
2. Warm up through ``ensure_blocks`` (and, on a GPU, capture the decode
   step in a CUDA graph over the cache's views).
3. Measure what warm-up really used and size the cache; with several
   tensor-parallel ranks, agree on the smallest count; commit that.
4. Generate.
5. Sleep (release all KV memory) and wake (commit it again, zeroed).
6. Generate again, through the same views and the same graph.

The tokens of steps 4 and 6 are checked against the same model run on
ordinary ``torch.zeros`` KV memory. Each phase is recorded in a timeline of
reserved, committed and physical bytes.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from extensible_kv.demo.model import (
    ModelConfig,
    StepFn,
    TinyDecoder,
    eager_step,
    generate,
    graphed_step,
)
from extensible_kv.kv import (
    KVCache,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSizing,
    KVSplitBackend,
    WarmupMeter,
    allocate_kv_cache,
    commit_final_size,
)
from extensible_kv.kv.sizing import DEFAULT_MEMORY_UTILIZATION


class Progress(Protocol):
    """Where the flow reports progress (the CLI draws bars)."""

    def start(self, phase: str, total: int) -> None: ...

    def advance(self) -> None: ...


class _Silent:
    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self) -> None:
        pass


@dataclass(frozen=True)
class FlowSettings:
    """Sizes of one run. ``capacity_blocks`` is the reservation's upper bound."""

    model: ModelConfig = field(default_factory=ModelConfig)
    batch: int = 4
    prompt_tokens: int = 24
    new_tokens: int = 40
    warmup_tokens: int = 32
    capacity_blocks: int = 8192
    kv_budget_bytes: int | None = None
    #: Used when ``kv_budget_bytes`` is None; None: size from free memory.
    memory_utilization: float | None = DEFAULT_MEMORY_UTILIZATION
    cuda_graph: bool | None = None

    @property
    def blocks_per_sequence(self) -> int:
        span = max(self.prompt_tokens + self.new_tokens, self.warmup_tokens)
        return math.ceil(span / self.model.block_size)


@dataclass(frozen=True)
class Phase:
    """One point of the memory timeline, bytes after the phase ended."""

    name: str
    seconds: float
    reserved_bytes: int
    committed_bytes: int
    physical_bytes: int
    device_used_bytes: int


@dataclass
class FlowReport:
    device: str
    cuda_graph: bool
    sizing: KVSizing
    #: Blocks committed: the sizing's count, or the ranks' minimum.
    num_blocks: int
    timeline: list[Phase]
    tokens: list[list[int]]
    tokens_after_wake: list[list[int]]
    reference: list[list[int]]

    @property
    def ok(self) -> bool:
        """Both generations match the model on ordinary KV memory."""
        return self.tokens == self.reference and self.tokens_after_wake == self.reference


def device_used_bytes(device: torch.device) -> int:
    """Memory in use: the GPU's used bytes, or this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def kv_cache_config(model: ModelConfig, capacity_blocks: int) -> KVCacheConfig:
    """One K/V-split tensor per layer, all layers in one attention group."""
    spec = model.attention_spec()
    names = tuple(f"layer.{i}" for i in range(model.layers))
    tensors = tuple(
        KVCacheTensor(capacity_blocks * spec.page_size_bytes, (name,)) for name in names
    )
    return KVCacheConfig(capacity_blocks, tensors, (KVCacheGroup(names, spec),))


class _Timeline:
    def __init__(self, kv: KVCache, device: torch.device) -> None:
        self.kv, self.device = kv, device
        self.phases: list[Phase] = []
        self._start = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        buffers = self.kv.cache
        self.phases.append(
            Phase(
                name,
                time.perf_counter() - self._start,
                sum(tensor.capacity_bytes for tensor, _ in buffers.tensors),
                buffers.num_blocks_committed * buffers.bytes_per_block,
                buffers.physical_bytes,
                device_used_bytes(self.device),
            )
        )
        self._start = time.perf_counter()


def run_flow(
    device: torch.device | str,
    settings: FlowSettings = FlowSettings(),
    progress: Progress | None = None,
) -> FlowReport:
    """Run the whole flow on ``device`` and report what happened."""
    device = torch.device(device)
    progress = progress or _Silent()
    model = TinyDecoder(settings.model, device)
    use_graph = device.type == "cuda" if settings.cuda_graph is None else settings.cuda_graph
    max_blocks = settings.blocks_per_sequence
    needed = max_blocks * settings.batch
    if needed > settings.capacity_blocks:
        raise ValueError(
            f"{needed} blocks are needed but the capacity is {settings.capacity_blocks}"
        )
    gen = torch.Generator().manual_seed(settings.model.seed + 1)
    prompts = torch.randint(
        settings.model.vocab, (settings.batch, settings.prompt_tokens), generator=gen
    ).tolist()

    # 1. Reserve at the upper bound; allocation commits one block.
    kv = allocate_kv_cache(
        kv_cache_config(settings.model, settings.capacity_blocks), KVSplitBackend, device
    )
    caches = [view for view in kv.views.values() if isinstance(view, torch.Tensor)]
    timeline = _Timeline(kv, device)
    timeline.mark("reserve")
    try:
        # 2. Warm up; commit blocks as warm-up reaches them.
        meter = WarmupMeter.start(kv.cache, device)
        warm_prompts = [[0] * settings.warmup_tokens for _ in range(settings.batch)]
        progress.start("warm-up", settings.warmup_tokens)
        generate(
            eager_step(model, caches),
            warm_prompts,
            1,
            block_size=settings.model.block_size,
            max_blocks=max_blocks,
            device=device,
            ensure_blocks=meter.ensure_blocks,
            on_step=progress.advance,
        )
        step: StepFn = (
            graphed_step(model, caches, settings.batch, max_blocks)
            if use_graph
            else eager_step(model, caches)
        )
        timeline.mark("warm-up")

        # 3. Measure and size, then commit the final count.
        sizing = meter.size(
            kv_budget_bytes=settings.kv_budget_bytes,
            memory_utilization=settings.memory_utilization,
        )
        num_blocks = commit_final_size(kv.cache, sizing.num_blocks)
        if num_blocks < needed:
            raise RuntimeError(
                f"{sizing.describe()}; {num_blocks} blocks are fewer than the {needed} "
                f"generation needs"
            )
        timeline.mark("final commit")

        # 4. Generate.
        tokens = _generate(step, prompts, settings, max_blocks, device, progress, "generate")
        timeline.mark("generate")

        # 5. Sleep and wake: addresses, views and the graph survive.
        kv.cache.release_physical()
        timeline.mark("sleep")
        kv.cache.recommit()
        timeline.mark("wake")

        # 6. Generate again.
        again = _generate(step, prompts, settings, max_blocks, device, progress, "generate again")
        timeline.mark("generate again")
    finally:
        kv.free()
    timeline.mark("free")

    reference_caches = [
        torch.zeros(
            (
                2,
                num_blocks,
                settings.model.block_size,
                settings.model.kv_heads,
                settings.model.head_size,
            ),
            dtype=torch.float32,
            device=device,
        )
        for _ in range(settings.model.layers)
    ]
    reference = _generate(
        eager_step(model, reference_caches),
        prompts,
        settings,
        max_blocks,
        device,
        progress,
        "reference",
    )
    return FlowReport(
        str(device), use_graph, sizing, num_blocks, timeline.phases, tokens, again, reference
    )


def _generate(
    step: StepFn,
    prompts: list[list[int]],
    settings: FlowSettings,
    max_blocks: int,
    device: torch.device,
    progress: Progress,
    phase: str,
) -> list[list[int]]:
    progress.start(phase, settings.prompt_tokens + settings.new_tokens - 1)
    return generate(
        step,
        prompts,
        settings.new_tokens,
        block_size=settings.model.block_size,
        max_blocks=max_blocks,
        device=device,
        on_step=progress.advance,
    )


def run_ranks(
    world_size: int, settings: FlowSettings, device_type: str = "cpu"
) -> list[FlowReport]:
    """Run the flow on ``world_size`` processes joined by a gloo group, as
    tensor-parallel ranks: each sizes its own cache, all commit the minimum.

    To show the agreement, rank ``r`` sizes to a budget ``r / (2 *
    world_size)`` smaller than the capacity, as if its device had less
    free. Ranks use ``cuda:r`` where ``device_type`` is cuda, else the host.
    """
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = f"file://{folder}/rendezvous"
        ranks = [
            context.Process(
                target=_rank_main,
                args=(rank, world_size, rendezvous, settings, device_type, results),
            )
            for rank in range(world_size)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        reports: dict[int, FlowReport | str] = {}
        while not results.empty():
            rank, outcome = results.get()
            reports[rank] = outcome
    failures = {rank: r for rank, r in reports.items() if isinstance(r, str)}
    if failures or len(reports) != world_size:
        raise RuntimeError(f"ranks failed: {failures or 'some ranks reported nothing'}")
    return [reports[rank] for rank in range(world_size)]  # type: ignore[misc]


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    settings: FlowSettings,
    device_type: str,
    results: Any,
) -> None:
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        probe = kv_cache_config(settings.model, settings.capacity_blocks)
        per_block = sum(t.size for t in probe.kv_cache_tensors) // settings.capacity_blocks
        share = 1 - rank / (2 * world_size)
        budget = int(settings.capacity_blocks * share) * per_block
        report = run_flow(device, replace(settings, kv_budget_bytes=budget))
        results.put((rank, report))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
