"""Elastic memory under vLLM's own batch-queue loop: vLLM 0.32's
real ``EngineCore`` and its ``step_with_batch_queue`` driving a scheduler
with two batches in flight, tokens equal to stock vLLM's under the same loop.

**The executor is a STAND-IN at the model boundary** (tests/stand_in_executor.py):
the one thing not real. vLLM's CPU build forces async scheduling off, and a
real pipeline-parallel engine fails at its first step on this build, so a
GPU's loop cannot run here with a real model. Everything above the executor
is vLLM's own: the config made from engine args (a tiny local Llama), the
engine core, its batch queue and busy-loop stepping, the scheduler (stock
``AsyncScheduler``/``Scheduler``, or ours chosen with ``scheduler_cls``),
block pool, prefix cache, preemption, aborts and output handling.

Why this is faithful to a GPU's loop:

- The config says what a GPU's says: async scheduling on (vLLM's default
  there, custom scheduler or not; only the CPU platform turns it off) and,
  for the GPU default, the V2 model runner; vLLM itself then computes
  ``max_concurrent_batches`` 2 and the engine core picks
  ``step_with_batch_queue``, both checked here. Pipeline parallelism of 2
  with the V1 runner is configured as on a GPU, and vLLM itself turns
  async scheduling off for it: a plain ``Scheduler`` under a batch queue.
- The one-GPU executor *is* vLLM's ``UniProcExecutor`` (only the worker it
  makes is stood in), so outputs travel as on a GPU: ``None`` from
  ``execute_model``, an ``AsyncModelRunnerOutput`` from ``sample_tokens``
  awaited through vLLM's ``AsyncOutputFuture``. The pipeline executor has
  ``MultiprocExecutor``'s shape: a worker per stage serving its calls in
  order, the last stage answering.
- The worker side is our own code: ``ElasticSteps.before_step`` commits and
  unmaps real host memory before the step, and its report rides on the
  output through ``ElasticSteps.with_report``, as ``ExtensibleKVWorker`` does.
- The device is the slowest a GPU may be: a batch's kernels run only once
  the host waits for its output, so the next ``schedule()``, the next orders
  and aborts all happen while it is still "running". The model is a paged
  attention over the real cache memory, so a block released, zeroed or
  reused under a batch changes tokens; the device also checks every block
  is held and every slot it reads holds what its tokens wrote, and the
  worker records any release of a unit a batch in flight uses. The canary
  run shows these checks catch a unit given back under a batch in flight.

Not modelled (see the stand-in's module): real weights and kernels, ranks in
processes of their own, and our GPU drivers' device-wide synchronize before
an unmap, which on a GPU turns a release under a running batch into a stall
rather than a fault; the scheduler's promise itself is what is checked.

The load (``stand_in_executor.load``): a burst of 24 requests on shared
prefixes asking for 2.6 times the 160-block pool (preemption, prefix hits),
three aborted part way; once idle, 8 arriving one by one; once idle, 6 all
aborted after 12 tokens (the units they filled empty while their batch is
in flight). Memory is read after each wave, the engine idle.

Runs every scenario in one process of its own (about 20 s), in ``nox -s
vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from extensible_kv.demo.tiny_models import save_tiny_model
from stand_in_executor import CACHE_BYTES, MODES, NUM_BLOCKS, load, reference_tokens

ENGINE = Path(__file__).resolve().parent / "stand_in_executor.py"
#: Seconds the engines' process may take (it takes about 20).
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario's stock and elastic runs, and the canary's."""
    model = save_tiny_model("llama", tmp_path_factory.mktemp("wide") / "llama", num_kv_heads=16)
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps({"model": str(model)})],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return report


def expected_tokens(report: dict[str, Any]) -> dict[str, list[int]]:
    """Every request's tokens from the stand-in's model alone: all it asked
    for, or as many as it had when aborted."""
    return {
        spec.name: reference_tokens(
            spec.prompt,
            spec.abort_after or spec.max_tokens,
            report["num_layers"],
            report["vocab"],
        )
        for spec in load()
    }


def loop_problems(report: dict[str, Any], mode: dict[str, Any]) -> list[str]:
    """What differs from vLLM's GPU loop in ``report``'s engine."""
    if "step_fn" not in report:
        return ["vLLM's engine core was not made"]
    problems = []
    if report["step_fn"] != "step_with_batch_queue":
        problems.append(f"the engine core stepped with {report['step_fn']}, not its batch queue")
    if report["batch_queue_size"] != 2 or report["max_concurrent_batches"] != 2:
        problems.append(
            f"batch queue of {report['batch_queue_size']} "
            f"(max_concurrent_batches {report['max_concurrent_batches']}), not 2"
        )
    if report["async_scheduling"] != mode["async"] or report["v2_runner"] != mode["v2"]:
        problems.append(
            f"async scheduling {report['async_scheduling']} and V2 runner "
            f"{report['v2_runner']}, not {mode['async']} and {mode['v2']}"
        )
    if report["is_async_scheduler"] != mode["async"]:
        want = "an AsyncScheduler" if mode["async"] else "a plain Scheduler"
        problems.append(
            f"the scheduler is {report['scheduler_class']} "
            f"({' < '.join(report['scheduler_bases'])}), not {want}"
        )
    # Async scheduling overlaps nearly every batch with the one before; a
    # plain Scheduler under a batch queue only batches of other requests.
    overlapped = report["in_flight_at_launch"].get("1", 0)
    launches = sum(report["in_flight_at_launch"].values())
    if overlapped < launches // (2 if mode["async"] else 10):
        problems.append(
            f"only {overlapped} of {launches} batches were launched with one in flight: "
            f"the loop did not overlap"
        )
    return problems


@pytest.mark.parametrize("name", list(MODES))
def test_stock_vllm_under_the_batch_queue(runs: dict[str, Any], name: str) -> None:
    """Stock vLLM (no extensible-kv) through the same loop and stand-in: the
    loop is a GPU's (two batches in flight), the load preempts, hits the
    prefix cache and aborts, and every token is the model's: the stand-in
    itself is right."""
    report, mode = runs[name]["stock"], MODES[name]
    assert not report["errors"], report.get("traceback")
    problems = loop_problems(report, mode)
    assert report["scheduler_class"] == ("AsyncScheduler" if mode["async"] else "Scheduler")
    assert not problems, "\n".join(problems)
    assert report["preempted"], "the load never preempted"
    assert report["prefix_hits"], "no request hit the prefix cache"
    assert len(report["aborted"]) == 9
    assert report["tokens"] == expected_tokens(report)
    assert report["device_faults"] == []
    assert report["worker_errors"] == []
    assert report["threads_left"] == []


@pytest.mark.parametrize("name", list(MODES))
def test_elastic_under_the_batch_queue(runs: dict[str, Any], name: str) -> None:
    """Our scheduler and worker (``growth: "elastic"``) through the same loop:
    vLLM's scheduler kind kept (``AsyncScheduler`` where async scheduling is
    on), tokens equal stock's per request, no unit given back while a batch
    in flight uses it, every report reaching the scheduler, and memory up
    with the load and back once it falls."""
    report, stock, mode = runs[name]["elastic"], runs[name]["stock"], MODES[name]
    problems = [f"failed: {error}" for error in report["errors"]]
    problems += loop_problems(report, mode)
    answered = report.get("orders_applied", [0])[-1]
    if not answered:
        problems.append("no orders reached the workers: the scheduler did not run elastic")
    differ = sorted(n for n in stock["tokens"] if report["tokens"][n] != stock["tokens"][n])
    if differ:
        problems.append(f"tokens differ from stock vLLM's for {differ}")
    problems += [f"released under a batch: {v}" for v in report.get("released_under_batch", [])]
    problems += [f"device: {v}" for v in report.get("device_faults", [])[:10]]
    problems += [f"worker: {v}" for v in report.get("worker_errors", [])]
    if report["reports_received"] != answered:
        problems.append(
            f"the scheduler received {report['reports_received']} reports on the "
            f"{answered} orders the workers applied and answered"
        )
    per = report.get("blocks_per_unit", [None])[0]
    if per:
        # Idle: unit 0 and the units cache_bytes lets the prefix cache keep.
        cache_units = -(-(CACHE_BYTES // report["bytes_per_block"]) // per)
        floor = per * (1 + cache_units)
        if max(report["max_blocks_held"]) <= floor:
            problems.append(f"memory never grew past {max(report['max_blocks_held'])} blocks")
        for wave, held in report["held_after_wave"].items():
            if max(held) > floor:
                problems.append(
                    f"after wave {wave}, idle, the workers hold {held} blocks of "
                    f"{NUM_BLOCKS}, past unit 0 and the prefix cache's {floor}"
                )
    if report["threads_left"]:
        problems.append(f"threads left running: {report['threads_left']}")
    assert not problems, "\n".join(problems)


def test_canary_a_unit_given_back_under_a_batch_in_flight(runs: dict[str, Any]) -> None:
    """The stand-in catches what the elastic test asserts never happens: a
    worker giving back, once, a unit a batch in flight uses (behind the
    scheduler's back) leaves that batch on unmapped memory, recorded, and
    other tokens than stock's."""
    canary, stock = runs["canary"], runs["async"]["stock"]
    assert canary["sabotaged"] is not None, "the canary found no batch in flight"
    unit, batch = canary["sabotaged"]
    assert any(f"batch {batch} ran on" in fault for fault in canary["device_faults"])
    assert any(canary["tokens"][n] != stock["tokens"][n] for n in stock["tokens"]), (
        f"unit {unit} gone under batch {batch} changed no token"
    )
