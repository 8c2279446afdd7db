"""The ``vllm`` suite: stock vLLM and vLLM on extensible-kv, side by side in one run.

Each round starts one engine of each kind, in turn, each in a process of its
own (so that none inherits another's memory), on one tiny model: stock
vLLM, ours with static growth, and ours with memory that follows the load
(``growth: "on_demand"``). Each measures:

- its start (``LLM(...)``);
- ``llm.sleep(level=1)`` and, :data:`ASLEEP_S` later, ``llm.wake_up()``;
- a restart (the engine dropped and a new ``LLM`` made: what vLLM's sleep
  mode is sold against);
- for ours, :data:`KEEP_CYCLES` times, the sleep that keeps the prefix
  cache (``sleep(level=0)`` and ``sleep_kv_cache(preserve=True)``, then
  ``wake_kv_cache`` and ``wake_up(tags=["scheduling"])``; stock has no such
  call) and, with static growth, right after each, its baseline: the same
  KV bytes copied out to new host memory and back into new memory
  (:func:`copy_out_and_back`);
- its resident memory, sampled every 20 ms over the whole run.

Figures are min, median and max over the rounds. Ratios are ours over stock
**paired by round** (the kinds of a round run back to back, so a slow spell
of the machine weighs on both sides of a ratio). The start also counts
:func:`start_sets_for` further sets of starts per round, each kind once per set,
every order of the kinds in turn (:func:`order_of`), and pairs by set. Decode is measured apart,
with an engine of each kind alive at once and short passes alternated
(:mod:`extensible_kv.bench.decode`). :func:`goals` says which of the
project's goals the figures settle (:mod:`extensible_kv.bench.ratios`).
Then the ``elastic`` case (:mod:`extensible_kv.bench.elastic`): a bursty
day on stock, static and elastic growth; and the ``several`` case
(:mod:`extensible_kv.bench.several`): two servers taking turns at bursts
under one limit, against a static split of it. Runs only where vLLM is
installed.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from extensible_kv.bench import decode
from extensible_kv.bench.ratios import decided, paired_ratios, ratio_figures, spread

MiB = 1 << 20
OURS = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
#: name -> (worker_cls, additional_config["extensible_kv"] or None)
KINDS: dict[str, tuple[str, dict[str, str] | None]] = {
    "stock": ("auto", None),
    "ours": (OURS, {}),
    "ours_on_demand": (OURS, {"growth": "on_demand"}),
}
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
#: Seconds an engine stays asleep before it wakes (and the baseline's copy
#: stays out): a sleep is for a while, and on a VM memory freed a second ago
#: is cheaper to take again than memory the host has since taken back.
ASLEEP_S = 2.0
#: Prefix-keeping sleeps an engine of ours runs, each paired with its
#: baseline (:func:`copy_out_and_back`); their figures and the median.
KEEP_CYCLES = 3
KEEP_KEYS = ("keep_sleep_s", "keep_wake_s", "copy_s")
#: The figure the decode case measures, not each kind's run.
DECODE = "decode_tok_s"
SAMPLE_S = 0.02


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


def unavailable() -> str | None:
    """Why the suite cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (nox -s vllm installs it)"
    from extensible_kv.integrations.vllm.support import check_vllm_version, installed_vllm

    try:
        check_vllm_version(installed_vllm())
    except ImportError as exc:
        return str(exc)
    return None


def _resident_bytes() -> int:
    """This process's resident memory (psutil comes with vLLM)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


class _Sampler:
    """This process's resident memory every :data:`SAMPLE_S` seconds, with
    the phases marked: ``(seconds since start, MiB)`` points."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.points: list[tuple[float, float]] = []
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.points.append((time.perf_counter() - self.start, _resident_bytes() / MiB))

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter() - self.start, label))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"points": self.points, "marks": self.marks}


def make_engine(model: str, worker: str, options: dict[str, str] | None, kv_bytes: int) -> Any:
    from vllm import LLM

    return LLM(
        model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=kv_bytes,
        worker_cls=worker,
        additional_config={"extensible_kv": options} if options is not None else {},
    )


def quiet_vllm_cpu(**more: str) -> None:
    """The environment a benchmark engine runs in (unless already set): vLLM's
    CPU build without thread binding, warm-up or usage reports, and ``more``."""
    settings = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **more,
    }
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = call()
    return value, time.perf_counter() - start


def child(model: str, kind: str, kv_bytes: int) -> dict[str, Any]:
    """One engine of ``kind``, in this process: the figures and the timeline."""
    quiet_vllm_cpu(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    worker, options = KINDS[kind]
    sampler = _Sampler()
    llm, start_s = _timed(lambda: make_engine(model, worker, options, kv_bytes))
    sampler.mark("started")
    prompts = [
        TokensPrompt(prompt_token_ids=[(5 * i + j) % 500 + 1 for j in range(8)]) for i in range(8)
    ]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    sampler.mark("generated")
    figures: dict[str, Any] = {"start_s": start_s, "rss_before": _resident_bytes() / MiB}
    figures["sleep_s"] = _timed(lambda: llm.sleep(level=1))[1]
    sampler.mark("asleep")
    figures["rss_asleep"] = _resident_bytes() / MiB
    time.sleep(ASLEEP_S)
    figures["wake_s"] = _timed(llm.wake_up)[1]
    sampler.mark("awake")
    figures["rss_awake"] = _resident_bytes() / MiB

    def shut_down() -> None:
        nonlocal llm
        del llm
        gc.collect()

    figures["shutdown_s"] = _timed(shut_down)[1]
    llm, figures["new_engine_s"] = _timed(lambda: make_engine(model, worker, options, kv_bytes))
    figures["restart_s"] = figures["shutdown_s"] + figures["new_engine_s"]
    sampler.mark("restarted")
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    figures.update(dict.fromkeys(KEEP_KEYS))
    if worker == OURS:
        cycles = [_keep_cycle(llm, sampler, with_copy=kind == "ours") for _ in range(KEEP_CYCLES)]
        for key in KEEP_KEYS:
            values = figures[f"{key}_cycles"] = [cycle[key] for cycle in cycles]
            figures[key] = None if None in values else statistics.median(values)
        figures["copy_bytes"] = cycles[0]["copy_bytes"]
    figures["timeline"] = sampler.stop()
    return figures


def _keep_cycle(llm: Any, sampler: _Sampler, *, with_copy: bool) -> dict[str, Any]:
    """One prefix-keeping sleep and wake of ours (``sleep(level=0)``,
    ``sleep_kv_cache(preserve=True)``, ``wake_kv_cache``, ``wake_up(tags=
    ["scheduling"])``), timed, then with ``with_copy`` its baseline
    (:func:`copy_out_and_back`) right after, so that the two pair up."""
    llm.sleep(level=0)
    rpc = llm.collective_rpc
    _, keep_sleep_s = _timed(lambda: rpc("sleep_kv_cache", kwargs={"preserve": True}))
    sampler.mark("kept")
    time.sleep(ASLEEP_S)
    _, keep_wake_s = _timed(lambda: rpc("wake_kv_cache"))
    llm.wake_up(tags=["scheduling"])
    sampler.mark("rewoken")
    cycle: dict[str, Any] = {"keep_sleep_s": keep_sleep_s, "keep_wake_s": keep_wake_s}
    (copied,) = rpc(copy_out_and_back) if with_copy else ({"copy_s": None, "copy_bytes": None},)
    return cycle | copied


def copy_out_and_back(worker: Any) -> dict[str, float]:
    """The prefix-keeping sleep's baseline, run in the worker (through
    ``collective_rpc``): every KV tensor copied out to new host memory, and
    back into new memory of its own size, as an engine that frees its cache
    while asleep, keeping the contents, must do without extensible-kv (new
    memory, because the old was given back). Seconds (``copy_s``) and bytes
    (``copy_bytes``). Needs the whole cache committed (static growth):
    reading uncommitted blocks faults."""
    import torch

    tensors = list({t.data_ptr(): t for t in worker.model_runner.kv_caches}.values())
    start = time.perf_counter()
    saved = [t.to("cpu", copy=True) for t in tensors]
    out_s = time.perf_counter() - start
    time.sleep(ASLEEP_S)
    start = time.perf_counter()
    back = [torch.empty_like(t).copy_(copy) for t, copy in zip(tensors, saved, strict=True)]
    elapsed = out_s + time.perf_counter() - start
    del saved, back
    return {"copy_s": elapsed, "copy_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def child_figures(module: str, *args: str) -> dict[str, Any]:
    """Run ``python -m module *args`` (one engine, in a process of its own)
    and return the figures it prints on its ``FIGURES`` line."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the engine {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith("FIGURES "))
    figures: dict[str, Any] = json.loads(line.removeprefix("FIGURES "))
    return figures


def suite(
    rounds: int,
    kv_bytes: int,
    progress: Callable[[str], None] = lambda _: None,
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """Every kind, ``rounds`` times, in turn, then the cases not in ``skip``
    (``"elastic"``, ``"several"``); or ``{"skipped": why}``."""
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
            runs[kind].append(
                child_figures("extensible_kv.bench.engine", model, kind, str(kv_bytes))
            )
            starts[kind].append(runs[kind][-1]["start_s"])
        for set_ in range(sets):
            progress(f"round {round_ + 1}/{rounds}: starts, set {set_ + 1}/{sets}")
            for kind in order_of(first + set_ + 1):
                start = child_figures(
                    "extensible_kv.bench.engine", model, kind, str(kv_bytes), "start"
                )
                starts[kind].append(start["start_s"])
    duel = decode.decode_case(model, list(KINDS), kv_bytes, decode.passes_for(rounds), progress)
    stats, paired = _summaries(runs, starts, duel)
    from extensible_kv.bench import elastic, several

    cases = {"elastic": elastic.case, "several": several.case}
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


def markdown_table(table: list[list[str]]) -> str:
    """Rows of cells, the first the header, as a Markdown table."""
    head, *body = table
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def start_child(model: str, kind: str, kv_bytes: int) -> dict[str, float]:
    """Only an engine of ``kind``'s start, in this process (``start_s``),
    timed as :func:`child` times it: vLLM imported first."""
    quiet_vllm_cpu(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # What child imports before its timer, so that neither start counts it.
    from vllm import SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    worker, options = KINDS[kind]
    return {"start_s": _timed(lambda: make_engine(model, worker, options, kv_bytes))[1]}


def main() -> None:
    """``python -m extensible_kv.bench.engine MODEL KIND KV_BYTES [start]``:
    one engine's figures (:func:`child`; with ``start``, :func:`start_child`)."""
    model, kind, kv_bytes, *what = sys.argv[1:]
    run = start_child if what == ["start"] else child
    print("FIGURES " + json.dumps(run(model, kind, int(kv_bytes))), flush=True)


if __name__ == "__main__":
    main()
