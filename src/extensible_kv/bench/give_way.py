"""The give-way part of the ``several`` case: how soon an idle engine gives
its memory to another engine's want, in each way people run an engine.

Two engines on one device under the ``several`` case's limit (96 MiB), both
ours with ``growth: "elastic"`` and its floors (8 MiB), on its tiny Llama:

- **A**, an OpenAI server, bursts and wants memory;
- **B**, with a prefix cache of 40 MiB kept idle (``cache_bytes``), is run
  in one of :data:`WAYS`: an OpenAI server started without the endpoint
  plug-in opt-in (``server``); an ``LLM`` in a Python program, vLLM's
  default engine-core process, idle between ``generate`` calls
  (``program``); the same on two tensor-parallel ranks (``program-tp2``).

Each of :data:`TURNS` turns: B serves a burst that fills its prefix cache,
idles :data:`IDLE_S` seconds (past its linger), then A bursts; A's burst
needs more than the limit less what B holds idle, so A wants memory, and B
must give it while idle. Figures per run: A's wants, and for each the
seconds from the want to the room being there (the ledger read every
50 ms: :func:`~extensible_kv.bench.serving.want_episodes`); what B held
idle before A's burst, and the least it held during it.

An engine stepped in its program's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is not a way here: it has no loop
of its own to wake, and gives way only while ``generate`` runs (its log
says so at start).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from extensible_kv.bench import several
from extensible_kv.bench.child import (
    case_main,
    child_figures,
    markdown_table,
    quiet_vllm_cpu,
    tiny_model,
)
from extensible_kv.bench.measure import MiB
from extensible_kv.bench.ratios import spread
from extensible_kv.bench.serving import (
    SAMPLE_S,
    Server,
    Timeline,
    device_name,
    elastic_options,
    engine_args,
    flags,
    servers,
)

#: How B is run: name -> tensor-parallel ranks of its ``LLM`` (None: a server).
WAYS: dict[str, int | None] = {"server": None, "program": 1, "program-tp2": 2}
#: B fills its prefix cache, then A bursts; this many times a run.
TURNS = 2
#: Seconds B idles after its burst before A bursts: past its linger.
IDLE_S = 3.0
#: B's prefix cache, kept idle until another engine wants the memory.
CACHE_BYTES = several.CACHE_OF["giving"]
#: The time from a want to the room being there that the issue asks for.
GOAL_S = 1.0


class ProgramFamily:
    """This program's own processes (its ``LLM``'s engine core and workers),
    less the servers it started, as :class:`Timeline` asks of an engine."""

    def __init__(self, servers: Iterable[Server]) -> None:
        self._servers = list(servers)
        self.pids: set[int] = set()
        self.learn_pids()

    def learn_pids(self) -> None:
        import psutil

        theirs = {pid for server in self._servers for pid in server.pids}
        with contextlib.suppress(psutil.Error):
            me = psutil.Process()
            self.pids = {me.pid, *(p.pid for p in me.children(recursive=True))} - theirs


def program(model: str, ranks: int) -> Any:
    """B as an ``LLM`` in this program, with the servers' settings."""
    from vllm import LLM

    # The floor and the cache are each rank's: the ranks together hold the engine's.
    options = elastic_options(CACHE_BYTES // ranks, several.FLOOR_BYTES // ranks)
    return LLM(model, tensor_parallel_size=ranks, **engine_args(several.LIMIT_BYTES, options))


def child(model: str, way: str) -> dict[str, Any]:
    """A and B (run ``way``) through :data:`TURNS` turns, from this process,
    in a budget state directory of its own."""
    quiet_vllm_cpu()
    state = Path(tempfile.mkdtemp(prefix="extensible-kv-give-way-"))
    os.environ["EXTENSIBLE_KV_STATE_DIR"] = str(state)
    try:
        return _run(model, way, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _run(model: str, way: str, state: Path) -> dict[str, Any]:
    from extensible_kv.limits import named_device, set_device_limit

    set_device_limit(device_name(), several.LIMIT_BYTES)
    env = {"EXTENSIBLE_KV_STATE_DIR": str(state)}
    ranks = WAYS[way]
    each = {
        "A": flags(several.LIMIT_BYTES, elastic_options(0, several.FLOOR_BYTES)),
        "B": flags(several.LIMIT_BYTES, elastic_options(CACHE_BYTES, several.FLOOR_BYTES)),
    }
    with servers(model, ["A"] if ranks else ["A", "B"], each, env) as engines:
        llm = None if ranks is None else program(model, ranks)
        holders: dict[str, Any] = dict(engines)
        if llm is not None:
            holders["B"] = ProgramFamily(engines.values())
        uuid = named_device(device_name()).uuid
        timeline = Timeline(state, uuid, holders, several.LIMIT_BYTES, several.FLOOR_BYTES)
        try:
            turns = [_turn(turn, engines, llm, timeline) for turn in range(TURNS)]
        finally:
            trace = timeline.close()
    return figures(turns) | {"timeline": trace}


def _turn(turn: int, engines: dict[str, Server], llm: Any, timeline: Timeline) -> dict[str, Any]:
    """B fills its prefix cache and idles, then A bursts: what the ledger saw."""
    prompts = several.burst_prompts(2 * turn)
    if llm is None:
        engines["B"].burst(prompts, several.NEW_TOKENS)
    else:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=several.NEW_TOKENS, ignore_eos=True, temperature=0)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    time.sleep(IDLE_S)
    since = timeline.now()
    b_idle = timeline.sample()["B"]
    timeline.mark(f"A bursts ({turn + 1})")
    results = engines["A"].burst(several.burst_prompts(2 * turn + 1), several.NEW_TOKENS)
    time.sleep(2 * SAMPLE_S)  # the burst's last samples
    seen = timeline.since(since)
    return {
        "b_idle_mib": b_idle / MiB,
        "b_least_mib": seen["B"]["least_mib"],
        "rooms_s": [w["room_s"] for w in seen["A"]["wants"]],
        "completed": sum(r["tokens"] == several.NEW_TOKENS for r in results),
        "errors": [r["error"] for r in results if "error" in r][:3],
    }


def figures(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figures (:data:`FIGURES`) from its turns."""
    rooms = [r for t in turns for r in t["rooms_s"]]
    came = [r for r in rooms if r is not None]
    return {
        "wants": len(rooms),
        "room_s": max(came) if came else None,
        "room_median_s": statistics.median(came) if came else None,
        "unmet": len(rooms) - len(came),
        "b_idle_mib": statistics.median(t["b_idle_mib"] for t in turns),
        "b_least_mib": statistics.median(t["b_least_mib"] for t in turns),
        "completed": sum(t["completed"] for t in turns),
        "errors": [e for t in turns for e in t["errors"]][:5],
    }


if __name__ == "__main__":
    case_main(child)


# -- the case -----------------------------------------------------------------------

#: (key, label, unit) of each figure a way reports.
FIGURES = (
    ("wants", "A's wants (refused claims, one episode each)", "wants"),
    ("room_s", "a want to the room being there, longest", "s"),
    ("room_median_s", "a want to the room being there, median", "s"),
    ("unmet", "wants the room never came to (within the want and 1 s)", "wants"),
    ("b_idle_mib", "B idle, before A's burst", "MiB"),
    ("b_least_mib", "B during A's burst, least (given way)", "MiB"),
    ("completed", f"A's requests completed, of {TURNS * several.REQUESTS}", "requests"),
)


def case(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every way, ``rounds`` times, in turn: min/median/max per figure."""
    model = tiny_model()
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for round_ in range(rounds):
        for way in WAYS:
            progress(f"give way, round {round_ + 1}/{rounds}: B as {way}")
            runs[way].append(child_figures(__name__, model, way))
    return summary(runs)


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    stats = {
        way: {key: spread([run[key] for run in way_runs]) for key, _, _ in FIGURES}
        for way, way_runs in runs.items()
    }
    errors = [e for way_runs in runs.values() for run in way_runs for e in run["errors"]][:5]
    return {"stats": stats, "goal": goal(stats), "errors": errors}


def goal(stats: dict[str, Any]) -> dict[str, Any]:
    """Issue 50's goal: every idle engine gives way within 1 s, each way."""
    worst = {way: s["room_s"]["max"] if s["room_s"] else None for way, s in stats.items()}
    unmet = {way: int(s["unmet"]["max"]) if s["unmet"] else 0 for way, s in stats.items()}
    met = all(not unmet[w] and _within(worst[w]) for w in stats)
    measured = ", ".join(
        f"{way} {'-' if worst[way] is None else f'{worst[way]:.2f} s'}"
        + (f" ({unmet[way]} unmet)" if unmet[way] else "")
        for way in stats
    )
    name = f"an idle engine gives way within {GOAL_S:g} s"
    return {"goal": name, "measured": measured, "met": met}


def _within(seconds: float | None) -> bool:
    return seconds is not None and seconds <= GOAL_S


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The table, header first: median [min-max] per way, then the goal."""
    ways = list(results["stats"])
    out = [["figure", *(f"B as {way}" for way in ways)]]
    for key, label, unit in FIGURES:
        cells = [f"{label} ({unit})"]
        for way in ways:
            s = results["stats"][way][key]
            cells.append("-" if s is None else f"{s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}]")
        out.append(cells)
    found = results["goal"]
    verdict = "met" if found["met"] else "NOT met"
    out.append([f"goal: {found['goal']}", found["measured"], verdict, *[""] * (len(ways) - 2)])
    return out


def markdown(results: dict[str, Any]) -> str:
    return markdown_table(rows(results))
