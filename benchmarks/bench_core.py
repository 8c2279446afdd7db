"""Core benchmark: committing and growing in place vs what torch does today.

    python benchmarks/bench_core.py                  # best device
    python benchmarks/bench_core.py --device cpu --json bench-results/core-cpu.json

Every figure is a ratio to a baseline measured in the same run, repeats
interleaved (A, B, A, B, ...) so that machine noise hits both sides:

1. commit + zero N bytes (``resize_per_segment_(N, zero_new=True)`` on a
   fresh buffer) vs ``torch.zeros(N)``;
2. growing to the target size in k equal steps, in place, vs reallocating
   and copying at every step (``torch.empty`` + ``copy_``), and the cost of
   the one step that crosses half the target size;
3. the same growth with a different step size, to show that a step costs
   what it adds (step size), not what the buffer already holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from extensible_kv import ExtensibleTensor

MiB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def commit_once(device: torch.device, size: int) -> float:
    et = ExtensibleTensor(size, device)
    seconds = timed(lambda: et.resize_per_segment_(size, zero_new=True), device)
    et.free()
    return seconds


def zeros_once(device: torch.device, size: int) -> float:
    holder: list[torch.Tensor] = []
    seconds = timed(
        lambda: holder.append(torch.zeros(size, dtype=torch.uint8, device=device)), device
    )
    holder.clear()
    return seconds


def commit_vs_zeros(device: torch.device, size: int, repeats: int) -> dict[str, object]:
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeats):
        ours.append(commit_once(device, size))
        theirs.append(zeros_once(device, size))
    return {"bytes": size, "ours_s": summary(ours), "torch_zeros_s": summary(theirs)}


def grow_in_place(device: torch.device, total: int, steps: int) -> list[float]:
    et = ExtensibleTensor(total, device)
    step = total // steps
    costs = [timed(lambda k=k: et.resize_(k * step), device) for k in range(1, steps + 1)]
    et.free()
    return costs


def grow_by_copy(device: torch.device, total: int, steps: int) -> list[float]:
    step = total // steps
    current = torch.empty(0, dtype=torch.uint8, device=device)
    costs = []
    for k in range(1, steps + 1):

        def regrow(k: int = k) -> None:
            nonlocal current
            bigger = torch.empty(k * step, dtype=torch.uint8, device=device)
            bigger[: current.numel()].copy_(current)
            current = bigger

        costs.append(timed(regrow, device))
    del current
    return costs


def growth(device: torch.device, total: int, steps: int, repeats: int) -> dict[str, object]:
    """Whole-growth time, and the cost of the steps reaching 1/4, 1/2 and all of ``total``."""
    marks = {"quarter": steps // 4, "half": steps // 2, "full": steps}
    ours_total, copy_total = [], []
    ours_steps: dict[str, list[float]] = {name: [] for name in marks}
    copy_steps: dict[str, list[float]] = {name: [] for name in marks}
    for _ in range(repeats):
        ours = grow_in_place(device, total, steps)
        theirs = grow_by_copy(device, total, steps)
        ours_total.append(sum(ours))
        copy_total.append(sum(theirs))
        for name, k in marks.items():
            ours_steps[name].append(ours[k - 1])
            copy_steps[name].append(theirs[k - 1])
    return {
        "total_bytes": total,
        "steps": steps,
        "ours_total_s": summary(ours_total),
        "copy_total_s": summary(copy_total),
        "ours_step_s": {name: summary(v) for name, v in ours_steps.items()},
        "copy_step_s": {name: summary(v) for name, v in copy_steps.items()},
    }


def warm_up(device: torch.device, size: int) -> None:
    """Touch ``size`` bytes once so neither side pays first-touch costs.

    On a virtual machine the first use of guest memory costs the hypervisor
    a fault per page, several times the kernel's own cost; whichever side of
    a comparison touched memory first would be charged for it.
    """
    torch.ones(size, dtype=torch.uint8, device=device)


def ratio(baseline: dict[str, float], ours: dict[str, float]) -> float:
    return baseline["median"] / ours["median"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: best available)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=1024, help="growth target (default 1 GiB)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    device = ExtensibleTensor(1, args.device).device  # resolves the default
    results: dict[str, object] = {"device": str(device), "torch": torch.__version__}

    total = args.total_mib * MiB
    warm_up(device, total + 512 * MiB)
    print(f"device {device}, torch {torch.__version__}, {args.repeats} repeats, medians")
    print("\n1. commit + zero N bytes vs torch.zeros(N)")
    commits = []
    for mib in (64, 256, 512):
        row = commit_vs_zeros(device, mib * MiB, args.repeats)
        commits.append(row)
        ours, theirs = row["ours_s"], row["torch_zeros_s"]
        assert isinstance(ours, dict)
        assert isinstance(theirs, dict)
        print(
            f"   {mib:>4} MiB: ours {ours['median'] * 1e3:7.1f} ms, torch.zeros "
            f"{theirs['median'] * 1e3:7.1f} ms -> {ratio(theirs, ours):5.2f}x"
        )
    results["commit_vs_zeros"] = commits

    print(f"\n2. grow to {args.total_mib} MiB vs reallocate-and-copy at every step")
    grows = []
    for steps in (64, 16):
        row = growth(device, total, steps, args.repeats)
        grows.append(row)
        o_t, c_t = row["ours_total_s"], row["copy_total_s"]
        o_s, c_s = row["ours_step_s"], row["copy_step_s"]
        assert isinstance(o_t, dict)
        assert isinstance(c_t, dict)
        assert isinstance(o_s, dict)
        assert isinstance(c_s, dict)
        step_mib = args.total_mib // steps
        print(
            f"   {steps:>3} steps of {step_mib:>3} MiB: whole growth ours "
            f"{o_t['median'] * 1e3:7.1f} ms, copy {c_t['median'] * 1e3:8.1f} ms "
            f"-> {ratio(c_t, o_t):6.1f}x"
        )
        for name, fraction in (("quarter", 4), ("half", 2), ("full", 1)):
            print(
                f"      step reaching {args.total_mib // fraction:>5} MiB: ours "
                f"{o_s[name]['median'] * 1e3:6.2f} ms, copy {c_s[name]['median'] * 1e3:7.1f} ms "
                f"-> {ratio(c_s[name], o_s[name]):6.1f}x"
            )
    results["growth"] = grows

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
