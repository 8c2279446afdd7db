"""The ``vllm`` suite: stock vLLM and vLLM on extensible-kv, side by side in one run.

Each round starts one engine of each kind, in turn, each in a process of its
own (so that none inherits another's memory), on one tiny model: stock
vLLM, ours with static growth, and ours with memory that follows the load
(``growth: "on_demand"``); each measures its start, sleep, wake, restart,
prefix-keeping sleep and resident memory (:mod:`extensible_kv.bench.lifecycle`).

Figures are min, median and max over the rounds. Ratios are ours over stock
**paired by round** (the kinds of a round run back to back, so a slow spell
of the machine weighs on both sides of a ratio). The start also counts
:func:`start_sets_for` further sets of starts per round, each kind once per set,
every order of the kinds in turn (:func:`order_of`), and pairs by set. Decode is measured apart,
with an engine of each kind alive at once and short passes alternated
(:mod:`extensible_kv.bench.decode`). :func:`goals` says which of the
project's goals the figures settle (:mod:`extensible_kv.bench.ratios`).
Then the ``elastic`` case (:mod:`extensible_kv.bench.elastic`): a bursty
day on stock, static and elastic growth; the ``several`` case
(:mod:`extensible_kv.bench.several`): two servers taking turns at bursts
under one limit, against a static split of it; the ``give_way`` case
(:mod:`extensible_kv.bench.give_way`): how soon an idle engine gives way,
in each way it is run; and the ``restart`` case
(:mod:`extensible_kv.bench.restart`): the first requests after a restart
that keeps the prefix cache, against stock started cold and stock warm.
Runs only where vLLM is installed.

This module alone runs the cases; what they share is in
:mod:`extensible_kv.bench.child`.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from extensible_kv.bench import decode, elastic, give_way, lifecycle, restart, several
from extensible_kv.bench.child import KINDS, child_figures, markdown_table, unavailable
from extensible_kv.bench.ratios import decided, paired_ratios, ratio_figures, spread

#: (key, label, unit) of each figure an engine reports.
FIGURES = (
    ("start_s", "engine start", "s"),
    ("decode_tok_s", "decode", "tok/s"),
    ("sleep_s", "sleep(level=1)", "s"),
    ("wake_s", "wake_up()", "s"),
    ("restart_s", "restart: drop the engine, new LLM", "s"),
    ("shutdown_s", "of which dropping the engine", "s"),
    ("keep_sleep_s", "sleep keeping the prefix cache", "s"),
    ("keep_wake_s", "wake with the prefix cache", "s"),
    ("copy_s", "copying the KV bytes out and back", "s"),
    ("rss_before", "resident before sleep", "MiB"),
    ("rss_asleep", "resident asleep", "MiB"),
    ("rss_awake", "resident after wake", "MiB"),
)
#: The figure the decode case measures, not each kind's run.
DECODE = "decode_tok_s"


def start_sets_for(rounds: int) -> int:
    """Further starts per round, each kind once per set, in a fresh process
    that only starts an engine: a start's spread on a noisy machine is wider
    than the few percent its goal asks about, so its ratio pairs more starts
    than rounds (3 rounds: 13 sets each, 42 pairs with the rounds' own,
    which the median's interval needs to decide 1.05 where a start's pairs
    spread by +-10%; 1 round, a smoke run: 5 sets). Each set takes the
    next of the kinds' orders (:func:`order_of`)."""
    return 4 * max(rounds, 1) + 1


_ORDERS = tuple(itertools.permutations(KINDS))


def order_of(index: int) -> tuple[str, ...]:
    """The kinds' order for the ``index``-th set of starts: every order in
    turn, so that each kind starts first, between and last, and right after
    each other kind, equally often. A start on this VM runs faster right
    after another (an A/B of 14 pairs, alternated: the second of a pair
    took 4% less, whichever kind it was), so a fixed place would tilt a
    kind's ratio by that much."""
    return _ORDERS[index % len(_ORDERS)]


def suite(
    rounds: int,
    kv_bytes: int,
    progress: Callable[[str], None] = lambda _: None,
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """Every kind, ``rounds`` times, in turn, then the cases not in ``skip``
    (``"elastic"``, ``"several"``, ``"give_way"``, ``"restart"``); or ``{"skipped": why}``."""
    why = unavailable()
    if why is not None:
        return {"skipped": why}
    from extensible_kv.demo.tiny_models import save_tiny_model

    folder = Path(tempfile.gettempdir()) / "extensible-kv-tiny-llama"
    model = str(save_tiny_model("llama", folder))
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    starts: dict[str, list[float]] = {kind: [] for kind in KINDS}
    sets = start_sets_for(rounds)
    for round_ in range(rounds):
        first = round_ * (sets + 1)  # this round's index into the kinds' orders
        for kind in order_of(first):
            progress(f"round {round_ + 1}/{rounds}: {kind}")
            runs[kind].append(child_figures(lifecycle.__name__, model, kind, str(kv_bytes)))
            starts[kind].append(runs[kind][-1]["start_s"])
        for set_ in range(sets):
            progress(f"round {round_ + 1}/{rounds}: starts, set {set_ + 1}/{sets}")
            for kind in order_of(first + set_ + 1):
                start = child_figures(lifecycle.__name__, model, kind, str(kv_bytes), "start")
                starts[kind].append(start["start_s"])
    duel = decode.decode_case(model, list(KINDS), kv_bytes, decode.passes_for(rounds), progress)
    stats, paired = _summaries(runs, starts, duel)
    cases = {
        "elastic": elastic.case,
        "several": several.case,
        "give_way": give_way.case,
        "restart": restart.case,
    }
    return {
        "kv_bytes": kv_bytes,
        "rounds": rounds,
        **{name: run(rounds, progress) for name, run in cases.items() if name not in skip},
        "stats": stats,
        "ratios": {
            kind: {key: None if s is None else s["median"] for key, s in figures.items()}
            for kind, figures in paired.items()
        },
        "ratio_spreads": paired,
        "decode": duel,
        "starts": starts,
        "goals": goals(runs, paired),
        "stock_sleep_frees": _median(stats["stock"]["rss_asleep"])
        < 0.99 * _median(stats["stock"]["rss_before"]),
        "timelines": {kind: kind_runs[-1].pop("timeline") for kind, kind_runs in runs.items()},
        "runs": {
            kind: [_without_timeline(run) for run in kind_runs] for kind, kind_runs in runs.items()
        },
    }


def _summaries(
    runs: dict[str, list[dict[str, Any]]],
    starts: dict[str, list[float]],
    duel: dict[str, Any],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per kind, each figure's :func:`spread`; per kind of ours, each
    figure's ratio to stock's, paired by round (start: by set of starts,
    decode: by pass)."""
    keys = [key for key, _, _ in FIGURES if key not in (DECODE, "start_s")]
    stats: dict[str, dict[str, Any]] = {
        kind: {key: spread([run[key] for run in kind_runs]) for key in keys}
        for kind, kind_runs in runs.items()
    }
    paired: dict[str, dict[str, Any]] = {
        kind: {key: paired_ratios(kind_runs, runs["stock"], key) for key in keys}
        for kind, kind_runs in runs.items()
        if kind != "stock"
    }
    for kind in runs:
        stats[kind]["start_s"] = spread(starts[kind])
        stats[kind][DECODE] = spread(duel["tok_s"][kind])
        if kind in paired:
            paired[kind]["start_s"] = ratio_figures(starts[kind], starts["stock"])
            paired[kind][DECODE] = duel["ratios"][kind]
    return stats, paired


def _median(spread: dict[str, float] | None) -> float:
    assert spread is not None, "a figure every kind reports"
    return spread["median"]


def goals(
    runs: dict[str, list[dict[str, Any]]], paired: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Each goal of the suite, per kind of ours, with its ratio
    (:func:`~extensible_kv.bench.ratios.ratio_figures`) and whether the
    figures settle it (:func:`~extensible_kv.bench.ratios.decided`)."""
    out: dict[str, Any] = {}
    for kind in paired:
        start, decode_ = paired[kind]["start_s"], paired[kind][DECODE]
        restart = ratio_figures(
            [r["restart_s"] for r in runs[kind]], [r["sleep_s"] + r["wake_s"] for r in runs[kind]]
        )
        out[kind] = {
            "start at most 1.05x stock's": _goal(start, 1.05, at_most=True),
            "decode at least 0.98x stock's": _goal(decode_, 0.98),
            "sleep and wake at least 50x faster than a restart": _goal(restart, 50),
        }
    ours = runs["ours"]
    cycles = [
        (copy, sleep + wake)
        for r in ours
        for copy, sleep, wake in zip(
            r["copy_s_cycles"], r["keep_sleep_s_cycles"], r["keep_wake_s_cycles"], strict=True
        )
    ]
    copy = ratio_figures([c for c, _ in cycles], [k for _, k in cycles])
    out["ours"]["prefix-keeping sleep and wake at least 0.8x copying"] = _goal(copy, 0.8)
    return out


def _goal(ratio: dict[str, float] | None, goal: float, *, at_most: bool = False) -> dict[str, Any]:
    assert ratio is not None, "a figure both sides report"
    return {"ratio": ratio, "goal": goal, "verdict": decided(ratio, goal, at_most=at_most)}


def _without_timeline(run: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run.items() if key != "timeline"}


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The suite's table, header first: median [min-max] per kind, and
    ours / stock paired by round (decode: by pass), median [interval] (none
    for a sleep stock did not do)."""
    stats, ratios = results["stats"], results["ratio_spreads"]
    ours = [kind for kind in KINDS if kind != "stock"]
    out = [["figure", *KINDS, *(f"{kind} / stock" for kind in ours)]]
    for key, label, unit in FIGURES:
        cells = [f"{label} ({unit})"]
        for kind in KINDS:
            s = stats[kind][key]
            cells.append("no such call" if s is None else _cell(s))
        idle = key in ("sleep_s", "wake_s") and not results["stock_sleep_frees"]
        for kind in ours:
            ratio = ratios[kind][key]
            cells.append("-" if idle or ratio is None else _ratio_cell(ratio))
        out.append(cells)
    return out


def _cell(spread: dict[str, float]) -> str:
    return f"{spread['median']:.4g} [{spread['min']:.4g}-{spread['max']:.4g}]"


def _ratio_cell(ratio: dict[str, float]) -> str:
    """A ratio's median with the interval for it (min-max for a few rounds)."""
    return f"{ratio['median']:.3g} [{ratio['low']:.3g}-{ratio['high']:.3g}]"


def goal_rows(results: dict[str, Any]) -> list[list[str]]:
    """The suite's goals, header first: per kind of ours, the ratio, median
    [interval], and whether it settles the goal."""
    out = [["goal", "kind", "ratio: median [interval]", "verdict"]]
    for kind, kind_goals in results["goals"].items():
        for goal, figures in kind_goals.items():
            out.append([goal, kind, _ratio_cell(figures["ratio"]), figures["verdict"]])
    return out


def markdown(results: dict[str, Any]) -> str:
    """:func:`rows` and :func:`goal_rows` as Markdown tables."""
    return markdown_table(rows(results)) + "\n\n" + markdown_table(goal_rows(results))
