"""Stock vLLM and vLLM on extensible-kv, side by side in one run, on one tiny model.

    nox -s vllm -- --bench            # or, where vLLM is installed:
    python benchmarks/bench_vllm.py --rounds 3 --out bench-results/vllm.json
    python benchmarks/bench_vllm.py --only elastic --out bench-results/elastic.json
    python benchmarks/bench_vllm.py --only several --out bench-results/several.json
    python benchmarks/bench_vllm.py --only give_way --out bench-results/give-way.json
    python benchmarks/bench_vllm.py --only restart --out bench-results/restart.json

The ``vllm`` suite of ``extensible-kv bench`` (``extensible_kv.bench.engine``),
on its own: stock vLLM, ours with static growth and ours with memory that
follows the load, each round in processes of their own; decode with one
engine of each kind alive at once, 60 short passes per round alternated
(``extensible_kv.bench.decode``); the goals, each met, not met or
undecided; then the ``elastic``
case (a bursty day on stock, static and elastic growth; with ``--out``, its
plot beside the JSON as ``elastic-memory.png``); then the ``several`` case
(two OpenAI servers taking turns at bursts under one limit, against a
static split of it; ``several-memory.png``; and three servers replaying
slices of the Azure LLM inference trace 2023 against the even and the best
static split, ``several-trace.png``); then the ``give_way`` case (how soon
an idle engine gives its memory to another's want, run as a server, an
``LLM`` program and a program on two tensor-parallel ranks); then the
``restart`` case (time to
first token of prefix-sharing requests right after a restart that keeps
the prefix cache, against stock vLLM cold and warm; vLLM's offloading
connector is tried and its refusal reported). ``--only CASE`` runs that
case alone, ``--skip CASE`` leaves it out. The table gives
median [min-max] over the rounds and ours over stock as ratios paired by
round (decode: by pass), median [interval]; the JSON
holds every run and each kind's resident-memory timeline, which
``extensible-kv bench`` plots. On CPU stock vLLM's sleep does nothing (it
logs "not supported"), so its memory stays where it was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from extensible_kv.bench import child, elastic, engine, give_way, restart, several, trace
from extensible_kv.bench.measure import MiB

#: The cases --only and --skip name.
CASES = ["elastic", "several", "give_way", "restart"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="engines of each kind (default 3)")
    parser.add_argument("--kv-mib", type=int, default=512, help="KV cache size (default 512)")
    parser.add_argument("--out", type=Path, help="write the results and the table as JSON here")
    parser.add_argument(
        "--only",
        choices=CASES,
        help="run this case alone (default: the whole suite)",
    )
    parser.add_argument(
        "--skip",
        choices=CASES,
        action="append",
        default=[],
        help="leave this case out (repeat for more)",
    )
    args = parser.parse_args()
    if args.only is not None:
        why = child.unavailable()
        if why is not None:
            raise SystemExit(why)
        case = {
            "elastic": elastic,
            "several": several,
            "give_way": give_way,
            "restart": restart,
        }[args.only]
        alone = case.case(args.rounds, lambda step: print(step, flush=True))
        text = f"{args.only} case\n\n" + case.markdown(alone)
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({args.only: alone, "table": text}, indent=2))
            if args.only == "elastic":
                elastic.plot(alone, args.out.with_name("elastic-memory.png"))
            if args.only == "several":
                several.plot(alone, args.out.with_name("several-memory.png"))
                trace.plot(alone["trace"], args.out.with_name("several-trace.png"))
        return
    results = engine.suite(
        args.rounds, args.kv_mib * MiB, lambda step: print(step, flush=True), args.skip
    )
    if "skipped" in results:
        raise SystemExit(results["skipped"])
    text = engine.markdown(results)
    for name, case in (
        ("elastic", elastic),
        ("several", several),
        ("give_way", give_way),
        ("restart", restart),
    ):
        if name in results:
            text += f"\n\n{name} case\n\n" + case.markdown(results[name])
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**results, "table": text}, indent=2))
        for name, case in (("elastic", elastic), ("several", several)):
            if name in results:
                case.plot(results[name], args.out.with_name(f"{name}-memory.png"))
        if "several" in results:
            trace.plot(results["several"]["trace"], args.out.with_name("several-trace.png"))


if __name__ == "__main__":
    main()
