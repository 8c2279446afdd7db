"""The benchmark suites. Each returns plain data (for JSON) whose figures are
ratios to a baseline measured in the same run, repeats interleaved."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from extensible_kv.bench.measure import MiB, Stats, free_bytes, ratio, sync, timed
from extensible_kv.devices import get_driver
from extensible_kv.driver import (
    Backend,
    Driver,
    HostDriver,
    PoolingDriver,
    StatisticsDriver,
)
from extensible_kv.kv import (
    AttentionSpec,
    BlockMajorBackend,
    KVCacheBuffers,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSplitBackend,
    MambaSpec,
    allocate_kv_cache,
)
from extensible_kv.tensor import ExtensibleTensor

Row = dict[str, Any]


def _stats_row(**named: Stats) -> Row:
    return {name: vars(stats) for name, stats in named.items()}


# 1. commit + zero vs torch.zeros ---------------------------------------------


def commit_vs_zeros(device: torch.device, sizes: list[int], repeats: int) -> list[Row]:
    rows = []
    for size in sizes:
        ours, zeros = [], []
        for _ in range(repeats):
            ours.append(_commit_once(device, size))
            zeros.append(_zeros_once(device, size))
        a, b = Stats.of(ours), Stats.of(zeros)
        rows.append({"bytes": size, **_stats_row(ours=a, torch_zeros=b), "ratio": ratio(b, a)})
    return rows


def _commit_once(device: torch.device, size: int) -> float:
    et = ExtensibleTensor(size, device)
    seconds = timed(functools.partial(et.resize_per_segment_, size, zero_new=True), device)
    et.free()
    return seconds


def _zeros_once(device: torch.device, size: int) -> float:
    held: list[torch.Tensor] = []

    def allocate() -> None:
        held.append(torch.zeros(size, dtype=torch.uint8, device=device))

    seconds = timed(allocate, device)
    held.clear()
    return seconds


def sizes_to_try(device: torch.device, largest: int) -> list[int]:
    """64 MiB, then x4, up to the largest that fits (an eighth of free memory)."""
    cap = min(largest, free_bytes(device) // 8)
    sizes = [64 * MiB]
    while sizes[-1] * 4 <= cap:
        sizes.append(sizes[-1] * 4)
    return sizes


# 2. growth in place vs reallocate-and-copy (vs cuda.core) ------------------------


def _grow_ours(device: torch.device, total: int, steps: int) -> list[float]:
    et = ExtensibleTensor(total, device)
    step = total // steps
    costs = [timed(functools.partial(et.resize_, k * step), device) for k in range(1, steps + 1)]
    et.free()
    return costs


def _grow_by_copy(device: torch.device, total: int, steps: int) -> list[float]:
    step = total // steps
    held = [torch.empty(0, dtype=torch.uint8, device=device)]
    costs = []
    for k in range(1, steps + 1):

        def regrow(k: int = k) -> None:
            bigger = torch.empty(k * step, dtype=torch.uint8, device=device)
            bigger[: held[0].numel()].copy_(held[0])
            held[0] = bigger

        costs.append(timed(regrow, device))
    held.clear()
    return costs


def _grow_cuda_core(device: torch.device, total: int, steps: int) -> list[float]:
    """cuda.core's VirtualMemoryResource.modify_allocation: grows in place
    when the next addresses are free, else reserves again and remaps."""
    from cuda.core import Device, VirtualMemoryResource

    cuda_device = Device(device.index or 0)
    cuda_device.set_current()
    resource = VirtualMemoryResource(cuda_device.device_id)
    step = total // steps
    held = [resource.allocate(step)]
    costs = []
    for k in range(2, steps + 1):

        def grow(k: int = k) -> None:
            held[0] = resource.modify_allocation(held[0], k * step)

        costs.append(timed(grow, device))
    held[0].close()
    return [costs[0], *costs]


_EXPANDABLE_GROWTH = """
import json, sys, time, torch
device, total, steps = torch.device(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
step, held, costs = total // steps, [], []
def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)
for _ in range(steps):
    sync()
    start = time.perf_counter()
    held.append(torch.empty(step, dtype=torch.uint8, device=device))
    sync()
    costs.append(time.perf_counter() - start)
print(json.dumps(costs))
"""


def _grow_expandable_segments(device: torch.device, total: int, steps: int) -> list[float]:
    """PyTorch's expandable segments, in a process of their own (the
    allocator reads its configuration once): a list of tensors growing by
    one step each time, which maps more memory into the segment."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE_GROWTH, str(device), str(total), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    costs: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return costs


def growth(device: torch.device, total: int, steps: int, repeats: int) -> Row:
    contenders: dict[str, Callable[[torch.device, int, int], list[float]]] = {
        "ours": _grow_ours,
        "reallocate_and_copy": _grow_by_copy,
    }
    skipped: str | None = "GPU only"
    if device.type == "cuda":
        skipped = None
        try:
            _grow_cuda_core(device, 4 * steps * MiB, steps)
            contenders["cuda_core_modify_allocation"] = _grow_cuda_core
        except Exception as exc:
            skipped = f"cuda.core not usable here: {type(exc).__name__}: {exc}"
        try:
            _grow_expandable_segments(device, 4 * steps * MiB, steps)
            contenders["torch_expandable_segments"] = _grow_expandable_segments
        except Exception as exc:
            skipped = (skipped + "; " if skipped else "") + (
                f"expandable segments not measured: {type(exc).__name__}: {exc}"
            )
    marks = {"quarter": steps // 4, "half": steps // 2, "full": steps}
    totals: dict[str, list[float]] = {name: [] for name in contenders}
    per_step: dict[str, dict[str, list[float]]] = {
        name: {m: [] for m in marks} for name in contenders
    }
    for _ in range(repeats):
        for name, grow in contenders.items():
            costs = grow(device, total, steps)
            totals[name].append(sum(costs))
            for mark, k in marks.items():
                per_step[name][mark].append(costs[k - 1])
    ours = Stats.of(totals["ours"])
    row: Row = {"total_bytes": total, "steps": steps, "gpu_peers": skipped or "measured"}
    for name in contenders:
        whole = Stats.of(totals[name])
        row[name] = {
            "whole_growth": vars(whole),
            "steps": {mark: vars(Stats.of(v)) for mark, v in per_step[name].items()},
            "ratio_to_ours": ratio(whole, ours),
        }
    return row


# 3. sleep and wake -------------------------------------------------------------


#: Bytes of a block in each of the bench caches' two segments (K and V).
BLOCK_BYTES = 256 * 1024


def _kv_cache(
    device: torch.device, layers: int, layer_bytes: int, driver: Driver | None = None
) -> KVCacheBuffers:
    blocks = layer_bytes // (2 * BLOCK_BYTES)
    buffers = [
        (
            ExtensibleTensor(2 * blocks * BLOCK_BYTES, device, num_segments=2, driver=driver),
            BLOCK_BYTES,
        )
        for _ in range(layers)
    ]
    cache = KVCacheBuffers(buffers, blocks)
    cache.commit(blocks)
    return cache


def _per_allocation_sleep(device: torch.device, layers: int, layer_bytes: int) -> float:
    """What per-allocation sleep allocators do: one allocation per tensor,
    each copied to host synchronously and freed, then allocated again and
    copied back on wake."""
    tensors = [torch.ones(layer_bytes, dtype=torch.uint8, device=device) for _ in range(layers)]

    def sleep_and_wake() -> None:
        backups = []
        for i in range(layers):
            backups.append(tensors[i].to("cpu", copy=True))
            tensors[i] = torch.empty(0, dtype=torch.uint8, device=device)
        sync(device)
        for i in range(layers):
            tensors[i] = backups[i].to(device, copy=True)

    return timed(sleep_and_wake, device)


def _sleep_reserved_ahead(device: torch.device, layers: int, layer_bytes: int) -> float:
    """Seconds of a preserving sleep and a wake whose memory was created
    while asleep (``create_ahead``, as while an engine reloads weights):
    the two calls on the engine's path, the reserve not counted."""
    total = layers * layer_bytes
    driver = PoolingDriver(get_driver(device), cap_bytes=total)
    cache = _kv_cache(device, layers, layer_bytes, driver)
    cache.release_physical(preserve=True)  # the first host copy, outside the timing
    cache.recommit(keep_host_memory=True)
    asleep = timed(lambda: cache.release_physical(preserve=True), device)
    cache.create_ahead(cache.num_blocks_capacity).result()
    awake = timed(lambda: cache.recommit(keep_host_memory=True), device)
    cache.free()
    driver.drain()
    return asleep + awake


def sleep_wake(device: torch.device, layers: int, layer_bytes: int, repeats: int) -> Row:
    discard, preserve, roof, per_alloc, ahead = [], [], [], [], []
    total = layers * layer_bytes
    for _ in range(repeats):
        cache = _kv_cache(device, layers, layer_bytes)

        def sleep_discarding(cache: KVCacheBuffers = cache) -> None:
            cache.release_physical()
            cache.recommit()

        def sleep_preserving(cache: KVCacheBuffers = cache) -> None:
            cache.release_physical(preserve=True)
            cache.recommit(keep_host_memory=True)

        discard.append(timed(sleep_discarding, device))
        sleep_preserving()  # the first host copy is made outside the timing
        preserve.append(timed(sleep_preserving, device))
        cache.free()
        ahead.append(_sleep_reserved_ahead(device, layers, layer_bytes))
        source = torch.ones(total, dtype=torch.uint8, device=device)
        host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")

        def copy_out_and_back(source: torch.Tensor = source, host: torch.Tensor = host) -> None:
            host.copy_(source)
            source.copy_(host)

        roof.append(timed(copy_out_and_back, device))
        del source, host, copy_out_and_back
        per_alloc.append(_per_allocation_sleep(device, layers, layer_bytes))
    d, p, r, a = Stats.of(discard), Stats.of(preserve), Stats.of(roof), Stats.of(per_alloc)
    h = Stats.of(ahead)
    return {
        "layers": layers,
        "bytes": total,
        **_stats_row(
            release_recommit=d,
            preserving=p,
            preserving_reserved_ahead=h,
            plain_copy_roof=r,
            per_allocation_sleep=a,
        ),
        "preserving_fraction_of_roof": ratio(r, p),
        "reserved_ahead_fraction_of_roof": ratio(r, h),
        "preserving_vs_per_allocation": ratio(a, p),
        "preserving_GBps": 2 * total / p.median / 1e9,
        "roof_GBps": 2 * total / r.median / 1e9,
    }


# 3a. a release beside other work ------------------------------------------------


def _release_beside(device: torch.device, layers: int, layer_bytes: int, streams: bool) -> float:
    """Seconds a release takes while another stream runs about half a
    second of work; the cache waits for the whole device or for its own
    (the current) stream."""
    cache = _kv_cache(device, layers, layer_bytes)
    if streams:
        cache.wait_for_streams([torch.cuda.current_stream(device)])
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 30)  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    cache.release_physical()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize(device)
    cache.free()
    return seconds


def release_beside_work(device: torch.device, layers: int, layer_bytes: int, repeats: int) -> Row:
    """A release while other work runs on the device: the device-wide wait
    against the stream-ordered one (``wait_for_streams``)."""
    if device.type != "cuda":
        return {"skipped": "GPU only"}
    whole, ordered = [], []
    for _ in range(repeats):
        whole.append(_release_beside(device, layers, layer_bytes, streams=False))
        ordered.append(_release_beside(device, layers, layer_bytes, streams=True))
    a, b = Stats.of(whole), Stats.of(ordered)
    return {
        "bytes": layers * layer_bytes,
        **_stats_row(device_wide=a, streams=b),
        "ratio": ratio(a, b),
    }


# 3b. regrowth through a handle pool ---------------------------------------------


def _regrow_once(device: torch.device, total: int, pooled: bool) -> float:
    """Seconds to grow a tensor back to ``total`` bytes (zeroed) after
    trimming it to nothing, with its handles pooled or given back."""
    driver = get_driver(device.type)
    granule = driver.granularity(0, False)
    pool = PoolingDriver(driver, cap_bytes=total) if pooled else None
    et = ExtensibleTensor(total, device, driver=pool or driver, chunk_bytes=granule)
    et.resize_per_segment_(total, zero_new=True)
    et.shrink_per_segment_(0)
    seconds = timed(functools.partial(et.resize_per_segment_, total, zero_new=True), device)
    et.free()
    if pool is not None:
        pool.drain()
    return seconds


def pooled_regrowth(device: torch.device, total: int, repeats: int) -> Row:
    """Grow back after a trim: handles from a warm pool against new ones
    from the driver (the same granule-sized chunks, zeroed either way)."""
    fresh, pooled = [], []
    for _ in range(repeats):
        fresh.append(_regrow_once(device, total, pooled=False))
        pooled.append(_regrow_once(device, total, pooled=True))
    a, b = Stats.of(fresh), Stats.of(pooled)
    return {
        "bytes": total,
        **_stats_row(driver=a, pool=b),
        "ratio": ratio(a, b),
        "pool_GBps": total / b.median / 1e9,
    }


# 3c. waking a large cache vs the memset floor ------------------------------------

#: Layers of the large-wake cache, as in a mid-size model.
LARGE_WAKE_LAYERS = 32


def _timed_wakes(cache: KVCacheBuffers, device: torch.device, repeats: int, ahead: bool) -> Stats:
    times = []
    for _ in range(repeats):
        cache.release_physical()
        if ahead:
            cache.create_ahead(cache.num_blocks_capacity).result()
        times.append(timed(cache.recommit, device))
    return Stats.of(times)


def large_wake(device: torch.device, total: int, repeats: int) -> Row:
    """A discarding wake of a ``total``-byte cache (at most half the free
    memory) against the memset floor, ``zero_()`` of as many bytes already
    allocated: cold (memory created by the wake) and with the memory
    reserved ahead while asleep. One of the three fits at a time, so they
    run one after another rather than interleaved."""
    unit = LARGE_WAKE_LAYERS * 2 * BLOCK_BYTES
    size = min(total, free_bytes(device) // 2) // unit * unit
    layer_bytes = size // LARGE_WAKE_LAYERS
    cache = _kv_cache(device, LARGE_WAKE_LAYERS, layer_bytes)
    cold = _timed_wakes(cache, device, repeats, ahead=False)
    cache.free()
    pool = PoolingDriver(get_driver(device), cap_bytes=size)
    cache = _kv_cache(device, LARGE_WAKE_LAYERS, layer_bytes, pool)
    ahead = _timed_wakes(cache, device, repeats, ahead=True)
    cache.free()
    pool.drain()
    filled = torch.empty(size, dtype=torch.uint8, device=device)
    floor = Stats.of([timed(filled.zero_, device) for _ in range(repeats)])
    del filled
    return {
        "bytes": size,
        **_stats_row(cold=cold, reserved_ahead=ahead, memset_floor=floor),
        "cold_vs_floor": cold.median / floor.median,
        "reserved_ahead_vs_floor": ahead.median / floor.median,
    }


# 4. view access ------------------------------------------------------------------


def view_access(device: torch.device, size: int, repeats: int) -> Row:
    et = ExtensibleTensor(2 * size, device)
    ours = et.resize_(2 * size)
    plain = torch.zeros(2 * size, dtype=torch.uint8, device=device)
    results: Row = {"bytes": size}
    kernels: dict[str, Callable[[torch.Tensor], object]] = {
        "copy": lambda t: t[:size].copy_(t[size:]),
        "fill": lambda t: t.fill_(3),
    }
    for name, kernel in kernels.items():
        a, b = [], []
        for _ in range(repeats):
            a.append(timed(functools.partial(kernel, ours), device))
            b.append(timed(functools.partial(kernel, plain), device))
        mine, theirs = Stats.of(a), Stats.of(b)
        results[name] = {**_stats_row(ours=mine, ordinary=theirs), "ratio": ratio(theirs, mine)}
    ours = plain = torch.empty(0)
    et.free()
    return results


# 5. bookkeeping ------------------------------------------------------------------


class NullDriver(Backend):
    """A driver that does nothing: isolates the library's own bookkeeping
    cost from the driver's. For benchmarks only; it backs no memory."""

    dlpack_device_type = 1
    zeroes_new_memory = True

    def __init__(self, granularity: int) -> None:
        self._granularity = granularity
        self._ids = itertools.count(1)

    def granularity(self, device: int, shareable: bool) -> int:
        return self._granularity

    def reserve(self, size: int, alignment: int) -> int:
        return 1 << 40

    def device_count(self) -> int:
        return 1

    def device_uuid(self, device: int) -> str:
        return "null"

    def create(self, size: int, device: int, shareable: bool) -> int:
        return next(self._ids)

    def free_reserved(self, ptr: int, size: int) -> None: ...
    def release(self, handle: int) -> None: ...
    def map(self, ptr: int, size: int, handle: int) -> None: ...
    def unmap(self, ptr: int, size: int) -> None: ...
    def set_access(self, ptr: int, size: int, device: int) -> None: ...
    def synchronize(self, device: int) -> None: ...
    def synchronize_streams(self, device: int, streams: Sequence[int]) -> None: ...
    def export_handle(self, handle: int) -> int:
        raise NotImplementedError("the null driver shares nothing")

    def import_handle(self, fd: int) -> int:
        raise NotImplementedError("the null driver shares nothing")

    def context(self, device: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


def bookkeeping(granules: int, real_granules: int) -> Row:
    """Cost of committing one more granule as a buffer grows granule by
    granule, with the null driver (bookkeeping alone) and with the host
    driver at 4 KiB granules (real calls), sampled at powers of ten."""
    from extensible_kv.buffer import VirtualBuffer

    def curve(driver: Any, count: int) -> tuple[dict[int, float], float]:
        stats = StatisticsDriver(driver)
        g = driver.granularity(0, False)
        buffer = VirtualBuffer(count * g, stats)
        samples: dict[int, float] = {}
        window: list[float] = []
        cpu = torch.device("cpu")
        for k in range(count):
            window.append(timed(functools.partial(buffer.commit, [(k * g, g)]), cpu))
            if k + 1 in _decades(count):
                samples[k + 1] = sorted(window)[len(window) // 2]
                window = []
        calls = sum(s.calls for s in stats.calls.values()) / count
        buffer.free()
        return samples, calls

    null, null_calls = curve(NullDriver(2 * MiB), granules)
    host, host_calls = curve(HostDriver(granularity=4096), real_granules)
    return {
        "null_driver_seconds_per_commit": null,
        "host_4KiB_seconds_per_commit": host,
        "driver_calls_per_commit": host_calls,
        "null_driver_calls_per_commit": null_calls,
    }


def _decades(count: int) -> set[int]:
    return {10**i for i in range(0, 7) if 10**i <= count} | {count}


# 6. physical overhead per layout -----------------------------------------------------


def overhead(device: torch.device, block_counts: list[int]) -> Row:
    spec = AttentionSpec(16, 8, 128, torch.float16)
    capacity = max(block_counts)
    page = spec.page_size_bytes
    mamba = MambaSpec(((4, 512), (64, 64)), (torch.float16, torch.float32), page_size_padded=page)
    layouts: dict[str, tuple[KVCacheConfig, Any]] = {
        "K/V split (2 segments)": (
            KVCacheConfig(
                capacity, (KVCacheTensor(capacity * page, ("a",)),), (KVCacheGroup(("a",), spec),)
            ),
            KVSplitBackend,
        ),
        "block-major (1 segment)": (
            KVCacheConfig(
                capacity, (KVCacheTensor(capacity * page, ("a",)),), (KVCacheGroup(("a",), spec),)
            ),
            BlockMajorBackend,
        ),
        "packed (2 layers a row)": (
            KVCacheConfig(
                capacity,
                (
                    KVCacheTensor(capacity * page, ("a",), 0, 2 * page),
                    KVCacheTensor(capacity * page, ("b",), page, 2 * page),
                ),
                (KVCacheGroup(("a", "b"), spec),),
            ),
            BlockMajorBackend,
        ),
        "hybrid attention + Mamba": (
            KVCacheConfig(
                capacity,
                (KVCacheTensor(capacity * page, ("a", "m")),),
                (KVCacheGroup(("a",), spec), KVCacheGroup(("m",), mamba)),
            ),
            [KVSplitBackend, None],
        ),
    }
    rows: Row = {}
    for name, (config, backends) in layouts.items():
        cache = allocate_kv_cache(config, backends, device)
        per_count = {}
        for blocks in block_counts:
            cache.cache.commit(blocks)
            committed = blocks * cache.cache.bytes_per_block
            physical = cache.cache.physical_bytes
            per_count[blocks] = {
                "committed": committed,
                "physical": physical,
                "overhead": physical - committed,
            }
        rows[name] = per_count
        cache.free()
    return rows
