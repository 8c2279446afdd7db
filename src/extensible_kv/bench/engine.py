"""The ``vllm`` suite: stock vLLM and vLLM on extensible-kv, side by side in one run.

Each round starts one engine of each kind, in turn, each in a process of its
own (so that none inherits another's memory), on one tiny model: stock
vLLM, ours with static growth, and ours with memory that follows the load
(``growth: "on_demand"``). Each measures its start (``LLM(...)``), decode
tokens per second (the median of :data:`DECODE_PASSES` passes of 8
sequences of :data:`DECODE_TOKENS` new tokens), ``llm.sleep(level=1)``
and ``llm.wake_up()``, a restart (the engine dropped and a new ``LLM`` made:
what vLLM's sleep mode is sold against), for ours the sleep that keeps the
prefix cache (``sleep(level=0)`` and ``sleep_kv_cache(preserve=True)``,
then ``wake_kv_cache`` and ``wake_up(tags=["scheduling"])``; stock has no
such call), and its resident memory sampled every 20 ms over the whole
run. Figures are min, median and max over the rounds. Ratios are ours over
stock **paired by round** (the kinds of a round run back to back, so a slow
spell of the machine weighs on both sides of a ratio): the median of the
rounds' ratios, with their min and max (:func:`decided` says whether that
spread decides a goal). Then the ``elastic`` case (:mod:`extensible_kv.bench.elastic`):
a bursty day on stock, static and elastic growth; and the ``several`` case
(:mod:`extensible_kv.bench.several`): two servers taking turns at bursts
under one limit, against a static split of it. Runs only where vLLM is
installed.
"""

from __future__ import annotations

import gc
import importlib.util
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
    ("rss_before", "resident before sleep", "MiB"),
    ("rss_asleep", "resident asleep", "MiB"),
    ("rss_awake", "resident after wake", "MiB"),
)
SAMPLE_S = 0.02
#: Decode passes an engine runs, and new tokens per sequence in each: a pass
#: of about a second on a 2-core VM; the median pass is the figure.
DECODE_PASSES = 3
DECODE_TOKENS = 256


def unavailable() -> str | None:
    """Why the suite cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (nox -s vllm installs it)"
    from extensible_kv.integrations.vllm_support import check_vllm_version, installed_vllm

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


def _engine(model: str, worker: str, options: dict[str, str] | None, kv_bytes: int) -> Any:
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
    llm, start_s = _timed(lambda: _engine(model, worker, options, kv_bytes))
    sampler.mark("started")
    prompts = [
        TokensPrompt(prompt_token_ids=[(5 * i + j) % 500 + 1 for j in range(8)]) for i in range(8)
    ]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(
        temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True, detokenize=False
    )
    passes = []
    for _ in range(DECODE_PASSES):
        outputs, decode_s = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
        passes.append(sum(len(o.outputs[0].token_ids) for o in outputs) / decode_s)
    sampler.mark("decoded")
    figures: dict[str, Any] = {
        "start_s": start_s,
        "decode_tok_s": statistics.median(passes),
        "decode_passes_tok_s": passes,
        "rss_before": _resident_bytes() / MiB,
    }
    figures["sleep_s"] = _timed(lambda: llm.sleep(level=1))[1]
    sampler.mark("asleep")
    figures["rss_asleep"] = _resident_bytes() / MiB
    figures["wake_s"] = _timed(llm.wake_up)[1]
    sampler.mark("awake")
    figures["rss_awake"] = _resident_bytes() / MiB

    def shut_down() -> None:
        nonlocal llm
        del llm
        gc.collect()

    figures["shutdown_s"] = _timed(shut_down)[1]
    llm, figures["new_engine_s"] = _timed(lambda: _engine(model, worker, options, kv_bytes))
    figures["restart_s"] = figures["shutdown_s"] + figures["new_engine_s"]
    sampler.mark("restarted")
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    figures["keep_sleep_s"] = figures["keep_wake_s"] = None
    if worker == OURS:
        llm.sleep(level=0)
        rpc = llm.collective_rpc
        _, figures["keep_sleep_s"] = _timed(
            lambda: rpc("sleep_kv_cache", kwargs={"preserve": True})
        )
        sampler.mark("kept")
        _, figures["keep_wake_s"] = _timed(lambda: rpc("wake_kv_cache"))
        llm.wake_up(tags=["scheduling"])
        sampler.mark("rewoken")
    figures["timeline"] = sampler.stop()
    return figures


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
    for round_ in range(rounds):
        for kind in KINDS:
            progress(f"round {round_ + 1}/{rounds}: {kind}")
            runs[kind].append(
                child_figures("extensible_kv.bench.engine", model, kind, str(kv_bytes))
            )
    stats = {
        kind: {key: spread([run[key] for run in kind_runs]) for key, _, _ in FIGURES}
        for kind, kind_runs in runs.items()
    }
    paired = {
        kind: {key: paired_ratios(kind_runs, runs["stock"], key) for key, _, _ in FIGURES}
        for kind, kind_runs in runs.items()
        if kind != "stock"
    }
    ratios = {
        kind: {key: None if s is None else s["median"] for key, s in figures.items()}
        for kind, figures in paired.items()
    }
    stock = stats["stock"]
    from extensible_kv.bench import elastic, several

    cases = {"elastic": elastic.case, "several": several.case}
    return {
        "kv_bytes": kv_bytes,
        "rounds": rounds,
        **{name: run(rounds, progress) for name, run in cases.items() if name not in skip},
        "stats": stats,
        "ratios": ratios,
        "ratio_spreads": paired,
        "stock_sleep_frees": _median(stock["rss_asleep"]) < 0.99 * _median(stock["rss_before"]),
        "timelines": {kind: kind_runs[-1].pop("timeline") for kind, kind_runs in runs.items()},
        "runs": {
            kind: [_without_timeline(run) for run in kind_runs] for kind, kind_runs in runs.items()
        },
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    """min, median and max; None for a figure this kind does not have."""
    if any(value is None for value in values):
        return None
    numbers = [float(value) for value in values if value is not None]
    return {"min": min(numbers), "median": statistics.median(numbers), "max": max(numbers)}


def _median(spread: dict[str, float] | None) -> float:
    assert spread is not None, "a figure every kind reports"
    return spread["median"]


def paired_ratios(
    ours: list[dict[str, Any]], stock: list[dict[str, Any]], key: str
) -> dict[str, float] | None:
    """Figure ``key``'s ratio, ours over stock, round by round: min, median
    and max; None where a side lacks the figure."""
    pairs = [(o[key], s[key]) for o, s in zip(ours, stock, strict=True)]
    if any(o is None or not s for o, s in pairs):
        return None
    return spread([o / s for o, s in pairs])


def decided(ratios: dict[str, float], goal: float) -> str:
    """Whether the rounds' ratios (:func:`paired_ratios`) decide ``ratio >=
    goal``: ``"met"`` when every round's is at least ``goal``, ``"not met"``
    when none is, ``"undecided"`` when the spread straddles it."""
    if ratios["min"] >= goal:
        return "met"
    if ratios["max"] < goal:
        return "not met"
    return "undecided"


def _without_timeline(run: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run.items() if key != "timeline"}


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The suite's table, header first: median [min-max] per kind, and
    ours / stock paired by round, median [min-max] (none for a sleep stock
    did not do)."""
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


def _ratio_cell(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f} [{spread['min']:.2f}-{spread['max']:.2f}]"


def markdown(results: dict[str, Any]) -> str:
    """:func:`rows` as a Markdown table."""
    return markdown_table(rows(results))


def markdown_table(table: list[list[str]]) -> str:
    """Rows of cells, the first the header, as a Markdown table."""
    head, *body = table
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def main() -> None:
    model, kind, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print("FIGURES " + json.dumps(child(model, kind, kv_bytes)), flush=True)


if __name__ == "__main__":
    main()
