"""Grow a buffer in place, put it to sleep, wake it: the runner's memory flow.

    python examples/grow_sleep_wake.py              # best device: GPU, else host
    python examples/grow_sleep_wake.py --device cpu --mib 256

The buffer reserves its whole address range once. Growth commits physical
memory underneath it; sleep releases all of it; wake commits it again. The
base pointer never changes, so views (and CUDA graphs captured over them)
stay valid. Memory use is read from the OS (host) or the GPU driver.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from extensible_kv import ExtensibleTensor

MiB = 1 << 20


def used_bytes(device: torch.device) -> int:
    """Physical memory in use: the process's resident set, or the GPU's used bytes."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: best available)"
    )
    parser.add_argument("--mib", type=int, default=512, help="capacity in MiB (default 512)")
    parser.add_argument("--steps", type=int, default=8, help="growth steps (default 8)")
    args = parser.parse_args()

    et = ExtensibleTensor(args.mib * MiB, args.device)
    device, base = et.device, et.base_ptr
    baseline = used_bytes(device)
    print(f"reserved {et.capacity_bytes / MiB:.0f} MiB on {device} at {base:#x}")
    print(f"{'phase':<10} {'committed':>10} {'physical':>10} {'in use':>10} {'call took':>10}")

    def report(phase: str, seconds: float) -> None:
        grown = (used_bytes(device) - baseline) / MiB
        print(
            f"{phase:<10} {et.num_bytes / MiB:>7.0f} MiB {et.physical_bytes / MiB:>6.0f} MiB "
            f"{grown:>+6.0f} MiB {seconds * 1e3:>7.1f} ms"
        )

    step = et.max_num_bytes // args.steps
    for i in range(1, args.steps + 1):
        start = time.perf_counter()
        view = et.resize_(i * step)
        elapsed = time.perf_counter() - start
        view[(i - 1) * step : i * step].fill_(i)
        report(f"grow {i}", elapsed)
        assert et.base_ptr == base

    start = time.perf_counter()
    et.release_physical()
    report("sleep", time.perf_counter() - start)

    start = time.perf_counter()
    et.resize_per_segment_(et.max_num_bytes, zero_new=True)
    report("wake", time.perf_counter() - start)

    view = et.tensor
    assert et.base_ptr == base, "the base pointer moved"
    assert int(view.count_nonzero()) == 0, "woken memory must read as zero"
    view.fill_(7)
    assert bool(view.eq(7).all())
    et.free()
    print(f"ok: base pointer {base:#x} unchanged through grow, sleep and wake")


if __name__ == "__main__":
    main()
