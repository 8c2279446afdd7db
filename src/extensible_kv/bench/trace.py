"""The trace replay of the ``several`` case: three vLLM servers on one
device under one limit, each serving a stream of the Azure LLM inference
trace 2023 (``data/azure_llm_2023``: the conversation service, the code
service, and the conversation service 26 minutes later), arrivals and
lengths as recorded, against static splits of the limit.

Three kinds, each a run of its own with the same requests:

- ``even``: three stock servers with a third of the limit each;
- ``best``: three stock servers with **the best static split in
  hindsight**: every candidate split (:func:`candidates`) is replayed on the
  same trace, and the one with the highest SLO attainment (then the lowest
  p99 time to first token) is kept and replayed again beside the others;
- ``ours``: three servers on our worker and scheduler with ``growth:
  "elastic"`` under the limit, each with a floor of one unit (unit 0) and
  no prefix cache kept idle (the trace shares no prefix).

Scaling, the same for every request: time is stretched
:data:`TIME_SCALE` times (a 12 s window is replayed in 60 s) and token
counts divided by :data:`TOKEN_SCALE` (at least one token each; a prompt
is cut so that it and its output fit :data:`MAX_MODEL_LEN`), so that three
servers on a tiny model keep up on two CPU cores and the streams' memory,
not the cores, is what the limit shares. The trace has no content: each
prompt is its own token sequence, and no prefix is shared.

Each kind reports, per engine and over all requests: time to first token
p50 and p99, the share of requests whose first token came within
:data:`SLO_S` (SLO attainment), output tokens per second over the replay,
the requests completed, and the share of the machine's CPU the servers
used over the replay (vLLM's CPU worker busy-waits a second after every
step: near 1, the cores held the requests back, not the memory); ours
also the memory each engine claimed over time, from the budget's ledger.
"""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

from extensible_kv.bench.child import UNIT_BYTES, case_main, child_figures, prompt, tiny_model
from extensible_kv.bench.measure import MiB
from extensible_kv.bench.ratios import spread
from extensible_kv.bench.serving import (
    Server,
    Timeline,
    device_name,
    elastic_options,
    flags,
    percentile,
    servers,
)

#: Each engine's stream: its name, the slice it replays and the start of
#: the slice's window (UTC; the data's README says how they were chosen).
STREAMS = {
    "conv": ("conv.csv", "2023-11-16 18:40:19"),
    "code": ("code.csv", "2023-11-16 18:48:12"),
    "conv-later": ("conv_later.csv", "2023-11-16 19:06:15"),
}
#: How many times longer the replay takes than the trace's window.
TIME_SCALE = 5.0
#: What every token count is divided by.
TOKEN_SCALE = 8
#: The servers' model length (tokens): a prompt and its output fit it.
MAX_MODEL_LEN = 1024
#: The device limit every kind shares out.
LIMIT_BYTES = 48 * MiB
#: The grid static splits are drawn on: a share is a whole number of steps.
STEP_BYTES = 4 * MiB
#: Each of our engines' floor and prefix cache: unit 0 and one more unit.
FLOOR_BYTES = UNIT_BYTES
CACHE_BYTES = 0
#: The time-to-first-token objective of the SLO attainment (seconds).
SLO_S = 1.0
KINDS = ("even", "best", "ours")


@dataclass(frozen=True)
class Arrival:
    """One request of a stream, scaled: seconds after the replay starts,
    prompt tokens and output tokens."""

    at_s: float
    prompt_tokens: int
    new_tokens: int


def load(stream: str) -> list[Arrival]:
    """``stream``'s requests (:data:`STREAMS`), scaled, in order of arrival,
    their times from the start of the slice's window."""
    name, window = STREAMS[stream]
    text = (files("extensible_kv.bench") / "data" / "azure_llm_2023" / name).read_text()
    start = datetime.fromisoformat(window)
    out = []
    for row in csv.DictReader(text.splitlines()):
        when = datetime.fromisoformat(row["TIMESTAMP"][:26])
        new = max(1, round(int(row["GeneratedTokens"]) / TOKEN_SCALE))
        new = min(new, MAX_MODEL_LEN // 2)
        prompt_tokens = max(1, round(int(row["ContextTokens"]) / TOKEN_SCALE))
        prompt_tokens = min(prompt_tokens, MAX_MODEL_LEN - new - 1)
        at = (when - start).total_seconds() * TIME_SCALE
        out.append(Arrival(at, prompt_tokens, new))
    return out


def streams(requests: int | None = None) -> dict[str, list[Arrival]]:
    """Every stream, or its first ``requests`` requests."""
    return {name: load(name)[:requests] for name in STREAMS}


# -- static splits ------------------------------------------------------------------


def candidates(
    limit_bytes: int = LIMIT_BYTES, step_bytes: int = STEP_BYTES
) -> list[tuple[int, ...]]:
    """The static splits searched for the best in hindsight, in bytes per
    engine: the even split, each engine given half the limit (the others a
    quarter), and each given a quarter (the others the rest, halved), on
    the grid of ``step_bytes``. (A stock server on the CPU build does not
    start with KV memory for just one request of :data:`MAX_MODEL_LEN`
    tokens, 8 MiB here: no share is that small.)"""
    steps, count = limit_bytes // step_bytes, len(STREAMS)
    shapes = [(steps // count,) * count]
    for big in (steps // 2, steps // 4):
        rest = steps - big
        for engine in range(count):
            shape = [rest // (count - 1)] * count
            shape[engine] = big
            shape[(engine + 1) % count] += rest % (count - 1)
            shapes.append(tuple(shape))
    unique = list(dict.fromkeys(shapes))
    return [tuple(s * step_bytes for s in shape) for shape in unique]


def split_kind(split: Sequence[int]) -> str:
    """A static split as a kind's name: ``split:A,B,C`` in MiB."""
    return "split:" + ",".join(str(share // MiB) for share in split)


def split_of(kind: str) -> tuple[int, ...]:
    return tuple(int(mib) * MiB for mib in kind.removeprefix("split:").split(","))


# -- one run ------------------------------------------------------------------------


def replay(
    engines: dict[str, Server], arrivals: dict[str, list[Arrival]]
) -> dict[str, list[dict[str, Any]]]:
    """Every stream's requests sent to its engine at their times (each on a
    thread of its own); their results (:meth:`Server.stream`) with the
    second each was sent."""
    count = sum(len(a) for a in arrivals.values())
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arrivals}
    lock = threading.Lock()
    start = time.perf_counter()

    def send(name: str, index: int, arrival: Arrival) -> None:
        tokens = prompt(1000 * list(arrivals).index(name) + index, arrival.prompt_tokens)
        result = engines[name].stream(tokens, arrival.new_tokens)
        result |= {"at_s": arrival.at_s, "wanted": arrival.new_tokens}
        with lock:
            results[name].append(result)

    order = sorted(
        ((a.at_s, name, i, a) for name, stream in arrivals.items() for i, a in enumerate(stream)),
        key=lambda entry: entry[0],
    )
    pool = ThreadPoolExecutor(max(1, count))
    try:
        for at, name, index, arrival in order:
            time.sleep(max(0.0, at - (time.perf_counter() - start)))
            pool.submit(send, name, index, arrival)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


def child(model: str, kind: str, requests: int | None = None) -> dict[str, Any]:
    """Three servers of ``kind`` (``ours``, or ``split:A,B,C``) replaying the
    streams, from this process, in a budget state directory of its own."""
    state = Path(tempfile.mkdtemp(prefix="extensible-kv-trace-"))
    os.environ["EXTENSIBLE_KV_STATE_DIR"] = str(state)
    try:
        return _run(model, kind, state, streams(requests))
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _run(model: str, kind: str, state: Path, arrivals: dict[str, list[Arrival]]) -> dict[str, Any]:
    from extensible_kv.limits import named_device, set_device_limit

    env = {"EXTENSIBLE_KV_STATE_DIR": str(state)}
    names = list(arrivals)
    if kind == "ours":
        set_device_limit(device_name(), LIMIT_BYTES)
        options = elastic_options(CACHE_BYTES, FLOOR_BYTES)
        each = {name: flags(LIMIT_BYTES, options, max_model_len=MAX_MODEL_LEN) for name in names}
    else:
        shares = dict(zip(names, split_of(kind), strict=True))
        each = {name: flags(shares[name], max_model_len=MAX_MODEL_LEN) for name in names}
    with servers(model, names, each, env) as engines:
        timeline = None
        if kind == "ours":
            uuid = named_device(device_name()).uuid
            timeline = Timeline(state, uuid, engines, LIMIT_BYTES, FLOOR_BYTES)
        try:
            if timeline:
                timeline.mark("replay starts")
            cpu = {name: engine.cpu_s() for name, engine in engines.items()}
            started = time.perf_counter()
            results = replay(engines, arrivals)
            span = time.perf_counter() - started
            cpu = {name: engine.cpu_s() - cpu[name] for name, engine in engines.items()}
        finally:
            trace = timeline.close() if timeline else None
    return figures(results, span, cpu) | {"timeline": trace}


def figures(
    results: dict[str, list[dict[str, Any]]], span_s: float, cpu_s: dict[str, float]
) -> dict[str, Any]:
    """A run's figures, per engine and over every request (``all``);
    ``cpu_s``: the CPU seconds each engine's processes used over the replay.
    ``cpu_share`` is that over what the machine's cores had in the span:
    near 1, the cores, not the memory, held the requests back."""
    every = [r for engine in results.values() for r in engine]
    cores = os.cpu_count() or 1
    out = {
        name: _figures(engine, span_s) | {"cpu_share": cpu_s[name] / (span_s * cores)}
        for name, engine in results.items()
    }
    out["all"] = _figures(every, span_s) | {"cpu_share": sum(cpu_s.values()) / (span_s * cores)}
    errors = [r["error"] for r in every if "error" in r][:5]
    return {"engines": out, "span_s": span_s, "errors": errors}


def _figures(results: list[dict[str, Any]], span_s: float) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "slo": sum(t <= SLO_S for t in ttfts) / len(results) if results else None,
        "tokens_per_s": sum(r["tokens"] for r in results) / span_s,
        "completed": sum(r["tokens"] == r["wanted"] for r in results),
        "sent": len(results),
    }


# -- the case -----------------------------------------------------------------------


def better(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether run ``a`` beats run ``b``: more requests within the SLO, then
    a lower p99 time to first token over every request."""
    ours, theirs = a["engines"]["all"], b["engines"]["all"]
    if ours["slo"] != theirs["slo"]:
        return bool(ours["slo"] > theirs["slo"])
    return bool((ours["ttft_p99_s"] or float("inf")) < (theirs["ttft_p99_s"] or float("inf")))


def search(
    model: str, progress: Callable[[str], None], splits: Sequence[Sequence[int]]
) -> tuple[str, list[dict[str, Any]]]:
    """Each split of ``splits`` replayed once; the best one's kind, and every run."""
    runs = []
    for split in splits:
        kind = split_kind(split)
        progress(f"trace, the best split in hindsight: {kind}")
        runs.append(child_figures(__name__, model, kind) | {"kind": kind})
    best = runs[0]
    for run in runs[1:]:
        if better(run, best):
            best = run
    return best["kind"], runs


def case(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The search, then every kind ``rounds`` times in turn."""
    model = tiny_model()
    splits = candidates()
    best, searched = search(model, progress, splits)
    names = {"even": split_kind(splits[0]), "best": best, "ours": "ours"}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for round_ in range(rounds):
        for kind in KINDS:
            progress(f"trace, round {round_ + 1}/{rounds}: {kind} ({names[kind]})")
            runs[kind].append(child_figures(__name__, model, names[kind]))
    return summary(runs, names, searched)


def summary(
    runs: dict[str, list[dict[str, Any]]], names: dict[str, str], searched: list[dict[str, Any]]
) -> dict[str, Any]:
    """The case's results: per kind and engine, min/median/max over rounds."""
    engines = [*STREAMS, "all"]
    stats = {
        kind: {
            engine: {
                key: spread([run["engines"][engine][key] for run in kind_runs])
                for key, _, _ in FIGURES
            }
            for engine in engines
        }
        for kind, kind_runs in runs.items()
    }
    return {
        "limit_bytes": LIMIT_BYTES,
        "slo_s": SLO_S,
        "time_scale": TIME_SCALE,
        "token_scale": TOKEN_SCALE,
        "kinds": names,
        "stats": stats,
        "searched": [{"kind": run["kind"], **run["engines"]["all"]} for run in searched],
        "timeline": runs["ours"][-1]["timeline"],
        "errors": [e for done in runs.values() for run in done for e in run["errors"]][:5],
    }


if __name__ == "__main__":
    case_main(child)


# -- the report ---------------------------------------------------------------------

#: (key, label, unit) of each figure, per engine.
FIGURES = (
    ("ttft_p50_s", "time to first token, p50", "s"),
    ("ttft_p99_s", "time to first token, p99", "s"),
    ("slo", f"first token within {SLO_S:g} s (SLO attainment)", "share"),
    ("tokens_per_s", "output tokens per second", "tokens/s"),
    ("completed", "requests completed", "requests"),
    ("cpu_share", "CPU the servers used, of the machine's", "share"),
)


def ratio(results: dict[str, Any], kind: str, engine: str = "all") -> float | None:
    """``kind``'s p99 time to first token over ours (above 1: ours is lower)."""
    theirs = results["stats"][kind][engine]["ttft_p99_s"]
    ours = results["stats"]["ours"][engine]["ttft_p99_s"]
    if theirs is None or ours is None or not ours["median"]:
        return None
    return float(theirs["median"] / ours["median"])


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 50's goals on the trace, each with what the run measured."""
    even, best = ratio(results, "even"), ratio(results, "best")
    slo = {kind: results["stats"][kind]["all"]["slo"] for kind in KINDS}
    ours_slo = None if slo["ours"] is None else slo["ours"]["median"]
    best_slo = None if slo["best"] is None else slo["best"]["median"]
    return [
        {
            "goal": "p99 time to first token at least 2x lower than the even split",
            "measured": "-" if even is None else f"{even:.2f}x",
            "met": even is not None and even >= 2.0,
        },
        {
            "goal": "p99 time to first token no worse than the best static split",
            "measured": "-" if best is None else f"{best:.2f}x",
            "met": best is not None and best >= 1.0,
        },
        {
            "goal": "SLO attainment at least the best static split's",
            "measured": "-"
            if ours_slo is None or best_slo is None
            else f"{ours_slo:.1%} against {best_slo:.1%}",
            "met": ours_slo is not None and best_slo is not None and ours_slo >= best_slo,
        },
    ]


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The case's table, header first: median [min-max] per kind and engine,
    then the ratios and the goals."""
    kinds = results["kinds"]
    out = [["engine: figure", *(f"{kind} ({kinds[kind]})" for kind in KINDS)]]
    for engine in [*STREAMS, "all"]:
        for key, label, unit in FIGURES:
            cells = [f"{engine}: {label} ({unit})"]
            for kind in KINDS:
                s = results["stats"][kind][engine][key]
                cells.append(
                    "-" if s is None else f"{s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}]"
                )
            out.append(cells)
    pad = [""] * (len(KINDS) - 1)
    for kind in ("even", "best"):
        found = ratio(results, kind)
        out.append([f"p99, {kind} / ours", "-" if found is None else f"{found:.2f}", *pad])
    for goal in goals(results):
        verdict = "met" if goal["met"] else "NOT met"
        out.append([f"goal: {goal['goal']}", goal["measured"], verdict, *pad[1:]])
    return out


def plot(results: dict[str, Any], path: Path) -> Path:
    """The streams' arrivals, and our engines' KV memory over the replay
    (the last round), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from extensible_kv.bench.serving import draw

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), height_ratios=[1, 2])
    arrivals = streams()
    span = max(a.at_s for stream in arrivals.values() for a in stream)
    edges = [i * 2.0 for i in range(int(span // 2) + 2)]
    for name, stream in arrivals.items():
        top.hist([a.at_s for a in stream], bins=edges, histtype="step", label=name)
    top.set_ylabel("requests per 2 s")
    top.set_title(
        f"the Azure LLM inference trace 2023, three slices, time x{TIME_SCALE:g}, "
        f"tokens / {TOKEN_SCALE}",
        fontsize=10,
    )
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    draw(
        bottom,
        results["timeline"],
        f"ours: three vLLM servers under one {results['limit_bytes'] // MiB} MiB limit, "
        f"floors {FLOOR_BYTES // MiB} MiB",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
