"""Timing for the benchmarks: device-synchronized, repeated, summarized."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Stats:
    """Seconds over repeats."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        return cls(min(samples), statistics.median(samples), max(samples))


def ratio(baseline: Stats, ours: Stats) -> float:
    """How many times faster ours is, by medians (above 1: ours is faster)."""
    return baseline.median / ours.median


def warm_up(device: torch.device, size: int) -> None:
    """Touch ``size`` bytes once so that neither side of a comparison pays
    first-touch costs (on a VM, a fault per page in the hypervisor)."""
    torch.ones(size, dtype=torch.uint8, device=device)
    sync(device)


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
