"""``extensible-kv bench``: every figure a ratio to a baseline measured in the
same run, with min/median/max over repeats; a table on the terminal, JSON
and PNG plots in an output folder."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from extensible_kv.bench import budget, engine, scheduler, suites
from extensible_kv.bench.measure import MiB, warm_up

#: The suites, in the order they run.
SUITES = (
    "commit_vs_zeros",
    "growth",
    "sleep_wake",
    "large_wake",
    "release_beside_work",
    "pooled_regrowth",
    "view_access",
    "bookkeeping",
    "overhead",
    "budget",
    "vllm",
    "scheduler",
)


@dataclass(frozen=True)
class BenchPlan:
    """Sizes of one run (bytes unless said)."""

    repeats: int = 3
    largest_commit: int = 1024 * MiB
    growth_total: int = 512 * MiB
    growth_steps: int = 32
    sleep_layers: int = 8
    sleep_layer_bytes: int = 32 * MiB
    wake_bytes: int = 1024 * MiB
    regrow_bytes: int = 256 * MiB
    view_bytes: int = 256 * MiB
    bookkeeping_granules: int = 100_000
    bookkeeping_real_granules: int = 20_000
    overhead_blocks: tuple[int, ...] = (1, 10, 100, 1000)
    vllm_rounds: int = 3
    vllm_kv_bytes: int = 512 * MiB
    #: The budget suite, on the host whatever the device: samples of each
    #: figure, each the mean of ``budget_cycles`` commits or ``budget_pairs``
    #: claims in a row; each engine's KV cache when engines switch (engines
    #: started: ``repeats``, at least 2).
    budget_samples: int = 15
    budget_cycles: int = 200
    budget_pairs: int = 10_000
    budget_cache_bytes: int = 256 * MiB
    #: The scheduler suite (no model; vLLM's scheduler and ours, on the host
    #: whatever the device): requests of its steady traces, measured steps
    #: per trace, new tokens per request (mean), layer-outermost KV caches
    #: in GiB (the first also block-outermost); and on the device, the
    #: driver calls of a burst of ``scheduler_burst_units`` one-block units
    #: over ``scheduler_burst_segments`` segments.
    scheduler_load: int = 256
    scheduler_steps: int = 200
    scheduler_tokens: int = 32
    scheduler_kv_gib: tuple[int, ...] = (60, 120)
    scheduler_burst_units: int = 512
    scheduler_burst_segments: int = 64

    def scheduler_plan(self) -> scheduler.SchedulerPlan:
        """The scheduler suite's sizes."""
        return scheduler.SchedulerPlan(
            load=self.scheduler_load,
            steps=self.scheduler_steps,
            tokens=self.scheduler_tokens,
            kv_gib=self.scheduler_kv_gib,
            burst_units=self.scheduler_burst_units,
            burst_segments=self.scheduler_burst_segments,
            repeats=self.repeats,
        )

    @classmethod
    def for_device(cls, device: torch.device, quick: bool) -> BenchPlan:
        if quick:
            return cls(
                repeats=2,
                largest_commit=64 * MiB,
                growth_total=64 * MiB,
                growth_steps=8,
                sleep_layers=2,
                sleep_layer_bytes=4 * MiB,
                wake_bytes=32 * MiB,
                regrow_bytes=16 * MiB,
                view_bytes=16 * MiB,
                bookkeeping_granules=1000,
                bookkeeping_real_granules=200,
                overhead_blocks=(1, 10, 100),
                vllm_rounds=1,
                vllm_kv_bytes=64 * MiB,
                budget_samples=3,
                budget_cycles=50,
                budget_pairs=1000,
                budget_cache_bytes=32 * MiB,
                scheduler_load=8,
                scheduler_steps=8,
                scheduler_tokens=4,
                scheduler_kv_gib=(1, 2),
                scheduler_burst_units=256,
                scheduler_burst_segments=4,
            )
        if device.type == "cuda":
            return cls(
                repeats=5,
                largest_commit=16 << 30,
                growth_total=4 << 30,
                growth_steps=64,
                sleep_layers=32,
                sleep_layer_bytes=64 * MiB,
                wake_bytes=64 << 30,
                regrow_bytes=4 << 30,
                view_bytes=1 << 30,
            )
        return cls()


def run(
    device: torch.device,
    plan: BenchPlan,
    progress: Callable[[str], None] = lambda _: None,
    checkpoint: Callable[[dict[str, Any]], object] = lambda _: None,
) -> dict[str, Any]:
    """Every suite on ``device``; returns the results as plain data.

    ``progress`` gets each suite's name as it starts, ``checkpoint`` the
    results so far as each ends (so that a run cut short keeps them).
    """
    warm_up(device, 2 * max(plan.largest_commit, plan.growth_total) // 2)
    results: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "plan": vars(plan) | {"overhead_blocks": list(plan.overhead_blocks)},
    }
    steps: dict[str, Callable[[], Any]] = {
        "commit_vs_zeros": lambda: suites.commit_vs_zeros(
            device, suites.sizes_to_try(device, plan.largest_commit), plan.repeats
        ),
        "growth": lambda: suites.growth(device, plan.growth_total, plan.growth_steps, plan.repeats),
        "sleep_wake": lambda: suites.sleep_wake(
            device, plan.sleep_layers, plan.sleep_layer_bytes, plan.repeats
        ),
        "large_wake": lambda: suites.large_wake(device, plan.wake_bytes, plan.repeats),
        "release_beside_work": lambda: suites.release_beside_work(
            device, plan.sleep_layers, plan.sleep_layer_bytes, plan.repeats
        ),
        "pooled_regrowth": lambda: suites.pooled_regrowth(device, plan.regrow_bytes, plan.repeats),
        "view_access": lambda: suites.view_access(device, plan.view_bytes, plan.repeats),
        "bookkeeping": lambda: suites.bookkeeping(
            plan.bookkeeping_granules, plan.bookkeeping_real_granules
        ),
        "overhead": lambda: suites.overhead(device, list(plan.overhead_blocks)),
        "budget": lambda: budget.budget(
            plan.budget_cycles,
            plan.budget_pairs,
            plan.budget_samples,
            plan.budget_cache_bytes,
            plan.repeats,
        ),
        "vllm": lambda: engine.suite(plan.vllm_rounds, plan.vllm_kv_bytes),
        "scheduler": lambda: scheduler.suite(plan.scheduler_plan(), str(device)),
    }
    for name in SUITES:
        progress(name)
        results[name] = steps[name]()
        checkpoint(results)
    return results


def save(results: dict[str, Any], out: Path) -> list[Path]:
    """Write ``results.json`` and the plots into ``out``; returns the files."""
    from extensible_kv.bench.report import plot

    return [save_json(results, out), *plot(results, out)]


def save_json(results: dict[str, Any], out: Path) -> Path:
    """Write ``results.json`` into ``out`` (made if missing); returns it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2))
    return path
