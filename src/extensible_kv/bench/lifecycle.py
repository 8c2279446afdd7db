"""One engine's life, in a process of its own: the ``vllm`` suite's run of
each kind of engine (:data:`~extensible_kv.bench.child.KINDS`), each round.

An engine measures:

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

Or, with ``start``, only its start (:func:`start_child`).
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from extensible_kv.bench.child import KINDS, WORKER, make_engine, print_figures, quiet_vllm_cpu
from extensible_kv.bench.measure import MiB

#: Seconds an engine stays asleep before it wakes (and the baseline's copy
#: stays out): a sleep is for a while, and on a VM memory freed a second ago
#: is cheaper to take again than memory the host has since taken back.
ASLEEP_S = 2.0
#: Prefix-keeping sleeps an engine of ours runs, each paired with its
#: baseline (:func:`copy_out_and_back`); their figures and the median.
KEEP_CYCLES = 3
KEEP_KEYS = ("keep_sleep_s", "keep_wake_s", "copy_s")
#: Seconds between two samples of the resident memory.
SAMPLE_S = 0.02


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
    if worker == WORKER:
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
    """``python -m extensible_kv.bench.lifecycle MODEL KIND KV_BYTES [start]``:
    one engine's figures (:func:`child`; with ``start``, :func:`start_child`)."""
    model, kind, kv_bytes, *what = sys.argv[1:]
    run = start_child if what == ["start"] else child
    print_figures(run(model, kind, int(kv_bytes)))


if __name__ == "__main__":
    main()
