"""The ``scheduler`` suite of ``extensible-kv bench`` (vLLM's scheduler and
ours side by side, no model) through ``benchmarks/bench_scheduler.py
--quick``: every mode, scale and trace, well-formed figures, its tables.
In ``nox -s vllm`` (it needs vLLM); the suite's note where vLLM is missing,
with its driver calls, runs in the main suite. Figures are checked for
shape, never for speed: the speeds are the bench's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from extensible_kv.bench import scheduler
from extensible_kv.bench.report import scheduler_tables

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_scheduler.py"


def _ordered(spread: dict[str, float]) -> None:
    assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert spread["median"] <= spread.get("p99", spread["max"]) <= spread["max"]


def _check_driver_calls(calls: dict[str, Any], units: int, segments: int) -> None:
    assert (calls["units"], calls["segments"]) == (units, segments)
    assert calls["bytes"] == units * segments * scheduler.HALF_PAGE_BYTES
    commit, release = calls["commit"], calls["release"]
    assert set(commit["calls"]) == set(release["calls"]) == set(scheduler.COUNTED)
    assert commit["calls"]["create"] > 0
    assert commit["calls"]["map"] > 0
    assert release["calls"]["unmap"] > 0
    assert release["calls"]["release"] > 0
    pooled_commit, pooled_release = calls["commit_pooled"], calls["release_pooled"]
    # Handles kept idle serve the next commit: it creates none, and the
    # release that keeps them idle releases none (a statement of behaviour,
    # not of speed).
    assert pooled_commit["calls"]["create"] == 0
    assert pooled_commit["calls"]["map"] == commit["calls"]["map"]
    assert pooled_release["calls"]["release"] == 0
    assert pooled_release["calls"]["unmap"] == release["calls"]["unmap"]
    for figures in (commit, release, pooled_commit, pooled_release):
        assert figures["total_calls"] == sum(figures["calls"].values())
        _ordered(figures["seconds"])


def test_without_vllm_the_suite_says_why_and_still_counts_a_bursts_driver_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler, "unavailable", lambda: "vLLM is not installed")
    plan = scheduler.SchedulerPlan(burst_units=256, burst_segments=4, repeats=2)
    results = scheduler.suite(plan)
    assert results["skipped"] == "vLLM is not installed"
    _check_driver_calls(results["driver_calls"], 256, 4)
    tables = scheduler_tables(results)
    assert [table.row_count for table in tables] == [1, 4]
    assert "scheduler: skipped (vLLM is not installed)" in scheduler.markdown(results)


def test_the_quick_suite_runs_every_mode_scale_and_trace(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "scheduler.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    saved = json.loads(out.read_text())
    names = [scale["name"] for scale in saved["scales"]]
    traces = ("decode", "burst", "prefix", "turnover")
    assert [(r["mode"], r["scale"], r["trace"]) for r in saved["runs"]] == [
        (mode, name, trace) for mode in scheduler.MODES for name in names for trace in traces
    ]
    for run in saved["runs"]:
        _check_run(run)
    _check_scales(saved["scales"])
    _check_profile(saved["profile"])
    assert set(saved["falling_goal"]) == {"scale", "goal_s", *scheduler.MODES}
    assert "extensible_kv.integrations.vllm.scheduler.scheduler" in saved["ours_sources"]
    _check_driver_calls(saved["driver_calls"], 256, 4)
    assert "| async scheduling | scale | trace |" in result.stdout
    tables = scheduler_tables(saved)
    assert tables[0].row_count == len(saved["runs"])
    assert [table.row_count for table in tables[1:]] == [
        len(names) * len(scheduler.MODES) + len(scheduler.MODES),  # each burst run, each goal
        len(saved["profile"]["top"]),
        len(saved["profile"]["ours"]),
        4,  # commit and release, new handles and pooled ones
    ]


def _check_run(run: dict[str, Any]) -> None:
    """Both sides stepped and timed, the ratios of their medians, a verdict
    per goal, the burst's falling steps, and vLLM's classes per mode."""
    for side in ("stock", "ours"):
        figures = run[side]
        assert figures["steps"] > 0
        assert figures["tokens"] > 0
        _ordered(figures["seconds"])
        falls = 1 if run["trace"] == "burst" else 0  # --quick: one burst
        assert len(figures["falling_s"]) == len(figures["falling_asked"]) == falls
    for key in ("median", "p99"):
        ratio = run["ours"]["seconds"][key] / run["stock"]["seconds"][key]
        assert run["ratio"][key] == pytest.approx(ratio)
        assert run["goals"][key] in ("met", "not met", "not comparable")
    stock = "AsyncScheduler" if run["mode"] == "on" else "Scheduler"
    assert run["classes"]["stock"] == stock
    assert run["classes"]["ours"].startswith("ExtensibleKV")


def _check_scales(scales: list[dict[str, Any]]) -> None:
    """Layer-outermost units of several blocks; block-outermost, one block each."""
    *layer_outermost, block_outermost = scales
    assert [s["layout"] for s in scales] == ["LBHNC", "LBHNC", "BLHNC"]
    assert all(s["blocks_per_unit"] > 1 for s in layer_outermost)
    assert block_outermost["blocks_per_unit"] == 1
    assert block_outermost["units"] == block_outermost["num_blocks"]
    for scale in scales:
        assert scale["num_blocks"] == scale["kv_bytes"] // (2 << 20)  # 2 MiB a block


def _check_profile(profile: dict[str, Any]) -> None:
    assert profile["total_s"] > 0
    assert profile["top"]
    assert profile["ours"]
    assert all(row["function"].startswith("extensible_kv/") for row in profile["ours"])
    for row in profile["top"]:
        assert 0 <= row["own_s"] <= row["cumulative_s"] + 1e-9
