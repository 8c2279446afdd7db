"""vLLM's scheduler and ours (``growth: "elastic"``) side by side, with no model.

    python benchmarks/bench_scheduler.py --out bench-results/scheduler.json
    python benchmarks/bench_scheduler.py --quick          # seconds, small sizes

The ``scheduler`` suite of ``extensible-kv bench``
(``extensible_kv.bench.scheduler``), on its own; run it with the Python of
an environment that has vLLM (``nox -s vllm`` makes one in ``.nox/vllm``).
Both schedulers are built as vLLM's engine core builds them, over a
Llama-3-8B-like KV cache (60 and 120 GiB layer-outermost, and 60 GiB
block-outermost: 30,720 units of one block), and driven by vLLM's loop with
async scheduling off and on, the workers' part played by answering every
step at once. Four traces: steady decode, a burst then idle, prefix-heavy
under a ``cache_bytes`` bound, steady load with turnover. Printed: per step,
``schedule()`` + ``update_from_output()`` in ms, median [min-max] and p99 for
each side, ours / stock with the goals (median at most 1.05x, p99 at most
1.2x, the falling step under 1 ms at the most units), the step where the
load falls, a cProfile of ours on its worst trace, and the driver calls of
a 1 GiB burst of elastic units (which needs no vLLM).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from extensible_kv.bench import BenchPlan, scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--load", type=int, help="requests of the steady traces (default 256)")
    parser.add_argument("--steps", type=int, help="measured steps per trace (default 200)")
    parser.add_argument(
        "--kv-gib",
        type=int,
        nargs="+",
        help="layer-outermost KV caches, GiB; the first also block-outermost (default 60 120)",
    )
    parser.add_argument("--out", type=Path, help="write the results and the tables as JSON here")
    args = parser.parse_args()
    plan = BenchPlan.for_device(torch.device("cpu"), args.quick).scheduler_plan()
    kv_gib = None if args.kv_gib is None else tuple(args.kv_gib)
    changes = {"load": args.load, "steps": args.steps, "kv_gib": kv_gib}
    plan = scheduler.SchedulerPlan(
        **(vars(plan) | {key: value for key, value in changes.items() if value is not None})
    )
    results = scheduler.suite(plan, progress=lambda step: print(step, flush=True))
    text = scheduler.markdown(results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        date = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        args.out.write_text(json.dumps({**results, "date": date, "table": text}, indent=2))


if __name__ == "__main__":
    main()
