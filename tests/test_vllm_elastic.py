"""Elastic KV memory in a released vLLM (0.32, CPU build): our worker and
scheduler (``growth: "elastic"``) against stock vLLM on the same traces.

Every engine runs in a process of its own (``tests/vllm_elastic.py``) with a
tiny random Llama whose 16 KV heads make a block (32 tokens) 128 KiB per
layer, so a 2 MiB unit holds 16 blocks. Every request's greedy tokens must
equal stock vLLM's (prefix caching on); memory must follow the load down
as well as up. Runs in ``nox -s vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_report import report_of
from extensible_kv.bench.child import prompt
from extensible_kv.demo.tiny_models import save_tiny_model
from extensible_kv.integrations.vllm.scheduler.scheduler import LINGER_S
from vllm_program import Program

ENGINE = Path(__file__).resolve().parent / "vllm_elastic.py"
MiB = 1 << 20
#: A unit: 16 blocks of 128 KiB in each of the model's 2 layers.
UNIT_BYTES = 2 * 2 * MiB
CACHE_BYTES = 16 * MiB
#: Free blocks the scheduler keeps ahead while a request runs: a step's
#: token budget (the engine's 512 tokens: 16 blocks), a unit.
AHEAD_BYTES = UNIT_BYTES


def run(settings: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    return report_of(ENGINE, settings, env)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("wide") / "llama", num_kv_heads=16))


_stock: dict[str, dict[str, Any]] = {}


def stock(model: str, trace: str, **settings: Any) -> dict[str, Any]:
    """Stock vLLM's run of a trace, made once per module."""
    key = json.dumps([trace, settings], sort_keys=True)
    if key not in _stock:
        _stock[key] = run({"model": model, "worker": "stock", "trace": trace, **settings})
    return _stock[key]


def physical(samples: list[list[Any]], label: str) -> int:
    """The most physical bytes any rank held at the sample ``label``."""
    return max(next(s for s in samples if s[0] == label)[2])


@pytest.mark.parametrize("multiprocessing", [False, True])
def test_a_bursty_day_comes_back_down_with_stock_tokens(model: str, multiprocessing: bool) -> None:
    reference = stock(model, "bursty", watch_modules=True)
    report = run(
        {
            "model": model,
            "worker": "ours",
            "trace": "bursty",
            "cache_bytes": CACHE_BYTES,
            "multiprocessing": multiprocessing,
            "watch_modules": not multiprocessing,
        }
    )
    assert report["tokens"] == reference["tokens"]
    samples = report["samples"]
    peak = report["state"][0]["high_water_blocks"] * 2 * 128 * 1024
    idle = physical(samples, "round 13 (0 requests)")
    # Idle: unit 0 and the prefix cache's bound, nothing more.
    assert idle <= UNIT_BYTES + CACHE_BYTES < peak
    assert sum(report["cached"].values()) > 0  # the prefix cache still serves
    if not multiprocessing:
        # No vLLM function, class or method replaced, beyond what vLLM's
        # CPU build replaces itself in a stock run.
        assert set(report["replaced"]) <= set(reference["replaced"])


def test_an_rl_loop_holds_the_same_memory_every_cycle(model: str) -> None:
    reference = stock(model, "rl")
    report = run({"model": model, "worker": "ours", "trace": "rl"})
    assert report["tokens"] == reference["tokens"]
    assert len(reference["tokens"]) == 15 * 8
    samples = report["samples"]
    generated = {physical(samples, f"cycle {c} generated") for c in range(15)}
    woken = {physical(samples, f"cycle {c} woken") for c in range(15)}
    assert len(generated) == 1, generated  # no ratchet
    assert woken == {UNIT_BYTES}  # a wake commits unit 0 only


def test_memory_below_a_long_request_started_at_the_peak_comes_back(model: str) -> None:
    reference = stock(model, "long")
    report = run({"model": model, "worker": "ours", "trace": "long", "cache_bytes": 0})
    assert report["tokens"] == reference["tokens"]
    samples = report["samples"]
    # The long request holds the highest ids; the units below it go back
    # but for the blocks kept ahead.
    long_runs = physical(samples, "long runs")
    assert long_runs <= 2 * UNIT_BYTES + AHEAD_BYTES < physical(samples, "burst done")
    # In-process, no step follows the last one: the long request's unit
    # and the blocks ahead go back with the next request (docs/vllm.md).
    assert physical(samples, "idle") <= long_runs


def test_a_burst_past_the_budget_waits_for_memory_and_never_passes_it(
    model: str, tmp_path: Path
) -> None:
    reference = stock(model, "limit")
    env = {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    limit = subprocess.run(
        [str(Path(sys.executable).parent / "extensible-kv"), "limit", "cpu", "24MiB"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert limit.returncode == 0, limit.stderr
    report = run({"model": model, "worker": "ours", "trace": "limit"}, env=env)
    assert report["tokens"] == reference["tokens"]
    (state,) = report["state"]
    bytes_per_block = 2 * 128 * 1024
    assert state["high_water_blocks"] * bytes_per_block <= 24 * MiB
    assert all(max(s[2]) <= 24 * MiB for s in report["samples"])
    # Without the limit the burst holds more at once.
    free = run({"model": model, "worker": "ours", "trace": "limit"})
    assert free["state"][0]["high_water_blocks"] * bytes_per_block > 24 * MiB


def test_requests_one_at_a_time_find_the_blocks_ahead_until_the_linger_ends(
    model: str, tmp_path: Path
) -> None:
    """vLLM runs an empty step after a request finishes; the blocks kept
    ahead stay through it, so the next request, come before
    :data:`LINGER_S` is over, is scheduled at once on memory already
    committed (no unit committed, no step waited for it); they go back
    once the linger is over, the engine's own loop stepping for that."""
    env = {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    prompts = [prompt(300 + i, 200, shared=160) for i in range(4)]
    stock_program = Program({"model": model, "multiprocessing": True, "stock": True}, env)
    try:
        tokens = [stock_program.generate([p], 8)[0] for p in prompts]
    finally:
        stock_program.stop()
    config = {"extensible_kv": {"growth": "elastic", "cache_bytes": CACHE_BYTES}}
    ours = Program({"model": model, "multiprocessing": True, "additional_config": config}, env)
    try:
        held, served = [], []
        for p in prompts:
            served.append(ours.generate([p], 8)[0])
            held.append(ours.ask({"op": "state"})["state"]["physical_bytes"])
        # After every request, the blocks ahead still held; then given back.
        deadline, falls_to = time.monotonic() + LINGER_S + 10, min(held) - AHEAD_BYTES
        while (now := ours.ask({"op": "state"})["state"]["physical_bytes"]) > falls_to:
            assert time.monotonic() < deadline, f"held {held} after the requests, {now} now"
            time.sleep(0.2)
    finally:
        ours.stop()
    assert served == tokens
