"""``extensible-kv bench --quick`` runs every suite and writes its report."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from extensible_kv.budget import Ledger, state_dir
from extensible_kv.cli import main
from extensible_kv.driver import backend

SUITES = (
    "commit_vs_zeros",
    "growth",
    "sleep_wake",
    "large_wake",
    "release_beside_work",
    "pooled_regrowth",
    "view_access",
    "bookkeeping",
    "overhead",
    "budget",
    "vllm",
)  # written out: a suite dropped from the bench fails here


def test_quick_bench_writes_every_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = Ledger(state_dir(), backend("cpu").device_uuid(0))
    limit_before = ledger.limit()
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    limit_after = ledger.limit()
    ledger.close()
    assert limit_after == limit_before, "the budget suite keeps to state directories of its own"
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(SUITES) <= set(results)
    for row in results["commit_vs_zeros"]:
        assert row["ratio"] > 0
        assert row["ours"]["min"] <= row["ours"]["median"] <= row["ours"]["max"]
    assert results["growth"]["reallocate_and_copy"]["ratio_to_ours"] > 0
    assert results["growth"]["gpu_peers"] == "GPU only"
    assert results["pooled_regrowth"]["ratio"] > 0
    assert results["sleep_wake"]["reserved_ahead_fraction_of_roof"] > 0
    wake = results["large_wake"]
    assert wake["bytes"] > 0
    assert wake["cold_vs_floor"] > 0
    assert wake["reserved_ahead_vs_floor"] > 0
    assert results["release_beside_work"] == {"skipped": "GPU only"}
    if importlib.util.find_spec("vllm") is None:  # nox -s tests: the suite says why not
        assert results["vllm"] == {"skipped": "vLLM is not installed (nox -s vllm installs it)"}
    assert results["bookkeeping"]["driver_calls_per_commit"] == pytest.approx(4, abs=0.1)
    for rows in results["overhead"].values():
        for row in rows.values():
            assert 0 <= row["overhead"] < 8 << 20, "at most a granule per segment"
    _check_budget_rows(results["budget"])
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "commit + zero" in out
    assert "physical overhead" in out
    assert "pooled handles vs new" in out
    assert "reserved ahead while asleep" in out
    assert "vs the memset floor" in out
    assert out.count("not measured on this machine (no GPU)") == 4, "the GPU-only goals"
    assert "7. the shared budget, on the host" in out
    assert "the budget's cost on a 2 MiB host commit" in out
    assert "10. vLLM, stock and on extensible-kv" in out


def _positive_stats(stats: dict[str, float]) -> None:
    assert 0 < stats["min"] <= stats["median"] <= stats["max"]


def _check_budget_rows(budget: dict[str, Any]) -> None:
    """The budget suite's rows: every field, positive times, boolean goals
    (whether they are met depends on the machine)."""
    commit, claim, switch = budget["commit"], budget["claim"], budget["switch"]
    assert commit["bytes"] == claim["bytes"] == 2 << 20
    for key in ("raw_us", "no_limit_us", "limit_us"):
        _positive_stats(commit[key])
    for key in ("no_limit", "limit"):
        assert commit[f"{key}_vs_raw"] > 0
        assert commit[f"{key}_vs_raw"] == pytest.approx(1 + commit[f"{key}_overhead_pct"] / 100)
        assert isinstance(commit[f"{key}_added_us"], float)
        _positive_stats(claim[f"{key}_us"])
    assert isinstance(commit["overhead_goal_met"], bool)
    assert isinstance(claim["claim_goal_met"], bool)
    assert (commit["overhead_goal_pct"], claim["claim_goal_us"]) == (5, 50)
    assert switch["limit_bytes"] == 3 * switch["cache_bytes"] // 2
    assert switch["engines_started"] == 2, "A and one B at --quick's 2 repeats"
    assert switch["switches"] == 4
    for key in ("release_s", "recommit_s", "switch_s", "start_s", "start_commit_s"):
        _positive_stats(switch[key])
    assert switch["switch_s"]["min"] >= switch["recommit_s"]["min"]
    assert switch["start_s"]["min"] > switch["start_commit_s"]["min"]
    assert switch["start_vs_switch"] > 0


def test_the_expandable_segments_peer_runs_in_a_process_of_its_own() -> None:
    """The subprocess plumbing of the GPU-only peer, run on the host (where
    the allocator setting does nothing): one positive time per step."""
    import torch

    from extensible_kv.bench.suites import _grow_expandable_segments

    costs = _grow_expandable_segments(torch.device("cpu"), 8 << 20, 4)
    assert len(costs) == 4
    assert all(cost > 0 for cost in costs)


def test_the_budget_suite_kills_its_engines_when_a_step_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine that fails a call (here, one it does not have) ends the
    suite with an error naming it, and no engine process outlives it."""
    from extensible_kv.bench import budget

    made: list[budget._Engine] = []

    class Recorded(budget._Engine):
        def __init__(self, env: dict[str, str], layer_bytes: int) -> None:
            super().__init__(env, layer_bytes)
            made.append(self)

    def failing(source: budget._Engine, target: budget._Engine) -> tuple[float, float]:
        return source.call("no_such_call"), target.call("recommit")

    monkeypatch.setattr(budget, "_Engine", Recorded)
    monkeypatch.setattr(budget, "_switch", failing)
    with pytest.raises(RuntimeError, match="answered nothing instead of 'done'"):
        budget.switching(8 << 20, 2)
    assert len(made) == 2
    assert all(engine.process.poll() is not None for engine in made)


def test_a_bench_cut_short_keeps_the_suites_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extensible_kv.bench import suites

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(suites, "large_wake", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"commit_vs_zeros", "growth", "sleep_wake"} <= set(results)
    assert "large_wake" not in results


def _several_run(kind: str, bursts: int = 4) -> dict[str, Any]:
    """One run of the ``several`` case's ``kind``, made up: what its child
    would report, through the same :func:`figures`."""
    from extensible_kv.bench import several

    ours = kind != "split"
    # [seconds, claimed MiB of A, of B, wanted MiB of A, of B] every 50 ms:
    # B idles at 28 MiB, A's burst is refused at 52 and B gives a unit back.
    points = [[0.05 * i, 4.0, 28.0, 0.0, 0.0] for i in range(1, 5)]
    points += [[0.25, 52.0, 28.0, 2.0, 0.0], [0.30, 52.0, 28.0, 2.0, 0.0]]
    points += [[0.35, 52.0, 24.0, 2.0, 0.0], [0.40, 56.0, 24.0, 0.0, 0.0]]
    trace = {
        "engines": ["A", "B"],
        "limit_bytes": 80 << 20,
        "floor_bytes": 8 << 20,
        "points": points,
        "met": [],
        "marks": [[0.1, "A bursts"]],
    }
    runs = []
    for index in range(bursts):
        results = [
            {"ttft_s": (1 if ours else 3) * (i + 1) / 16, "tokens": 32, "cached_tokens": 64}
            for i in range(16)
        ]
        burst: dict[str, Any] = {"engine": "AB"[index % 2], "seconds": 1.0, "results": results}
        if ours:
            burst |= {"peak_mib": 56.0, "other_most_mib": 28.0, "other_least_mib": 24.0}
            burst |= {"wants": [], "ledger_waited_s": [0.12]}
        runs.append(burst)
    idle = {"A": 8 << 20, "B": 8 << 20} if ours else None
    return several.figures(runs, idle, trace if ours else None, 30.0)


def test_the_several_case_times_wants_from_the_ledgers_samples() -> None:
    from extensible_kv.bench import serving, several

    (want,) = serving.want_episodes(_several_run("shared")["timeline"])
    assert want["engine"] == "A"
    assert want["wanted_mib"] == 2.0
    # Shown at 0.25 s (so begun after 0.20 s); B's unit back at 0.35 s made
    # the room: 80 - 52 - 24 = 4 MiB covers the 2 MiB wanted.
    assert want["room_s"] == pytest.approx(0.15)
    assert serving.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert serving.percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert several.needed_bytes(16) == 16 * 18 * (256 << 10)  # 568 tokens: 18 blocks each


def test_the_several_case_reports_its_goals_table_and_plot(tmp_path: Path) -> None:
    from extensible_kv.bench import several
    from extensible_kv.bench.report import several_table

    runs = {kind: [_several_run(kind), _several_run(kind)] for kind in several.KINDS}
    results = several.summary(2, runs)
    assert results["stats"]["split"]["wants"] is None
    assert results["stats"]["shared"]["ttft_p99_s"]["median"] == 1.0
    assert results["ratios"]["time to first token p99, split / shared"] == pytest.approx(3.0)
    idle, want, ttft = results["goals"]
    assert idle["met"]
    assert idle["measured"] == "1.00x (shared)"
    assert want["met"]
    assert want["measured"] == "room there in 0.15 s at most"
    assert ttft["met"]
    table = several.markdown(results)
    assert "| time to first token, p99 (s) | 3 [3-3] | 1 [1-1] | 1 [1-1] |" in table
    assert several_table(results).row_count == len(several.FIGURES) + 4 + 3
    pytest.importorskip("matplotlib")
    assert several.plot(results, tmp_path / "several.png").stat().st_size > 10_000


def test_the_vllm_suite_pairs_its_ratios_by_round() -> None:
    from extensible_kv.bench.ratios import decided, paired_ratios

    stock = [{"start_s": 10.0}, {"start_s": 20.0}, {"start_s": 12.5}]
    # The machine slowed in round 2 for both: the paired ratios stay close.
    ours = [{"start_s": 9.9}, {"start_s": 20.4}, {"start_s": 12.5}]
    ratios = paired_ratios(ours, stock, "start_s")
    assert ratios is not None
    assert ratios == pytest.approx(
        {"min": 0.99, "median": 1.0, "max": 1.02, "low": 0.99, "high": 1.02}
    )
    assert decided(ratios, 0.98) == "met"
    assert decided(ratios, 1.0) == "undecided"
    assert decided(ratios, 1.05) == "not met"
    assert decided(ratios, 1.05, at_most=True) == "met"
    assert decided(ratios, 1.0, at_most=True) == "undecided"
    assert decided(ratios, 0.98, at_most=True) == "not met"
    assert paired_ratios(ours, [{"start_s": None}] * 3, "start_s") is None
    assert paired_ratios([{"copy_s": None}] * 3, [{"copy_s": 1.0}] * 3, "copy_s") is None


def test_the_vllm_suites_starts_give_every_kind_every_place_equally() -> None:
    from collections import Counter

    from extensible_kv.bench.child import KINDS
    from extensible_kv.bench.engine import order_of

    orders = [order_of(i) for i in range(12)]
    assert all(sorted(order) == sorted(KINDS) for order in orders)
    assert len(set(orders[:6])) == 6
    assert orders[6:] == orders[:6]
    places = Counter((kind, order.index(kind)) for order in orders[:6] for kind in order)
    follows = Counter(pair for order in orders[:6] for pair in itertools.pairwise(order))
    assert set(places.values()) == {2}
    assert len(places) == len(KINDS) ** 2
    assert set(follows.values()) == {2}
    assert len(follows) == len(KINDS) * (len(KINDS) - 1)


def test_the_median_interval_narrows_with_more_pairs() -> None:
    from extensible_kv.bench.ratios import median_interval, ratio_figures

    # Eleven values: order statistics 2 and 10 hold the median with 98.8%,
    # 3 and 9 with only 93.5%.
    assert median_interval([float(v) for v in range(1, 12)]) == (2.0, 10.0)
    # Five: no pair of order statistics reaches 95%, so min and max.
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    # A thousand ratios spread 0.5-1.5 around 1: the interval is narrow.
    ratios = [0.5 + i / 999 for i in range(1000)]
    low, high = median_interval(ratios)
    assert 0.96 < low < 1.0 < high < 1.04
    figures = ratio_figures(ratios, [1.0] * 1000)
    assert figures is not None
    assert (figures["low"], figures["high"]) == (low, high)
    assert figures["min"] == 0.5
    assert figures["max"] == 1.5
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_the_page_policy_benchmark_compares_every_way() -> None:
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_pages.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--mib", "8", "--repeats", "1", "--asleep", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    head, _, *rows = result.stdout.splitlines()
    assert head == (
        "| 8 MiB, populated (s) | host backend (pieces on threads) | one call"
        " | one call, forced huge pages | torch.zeros |"
    )
    assert [row.split(" | ")[0] for row in rows] == [
        "| first commit",
        "| again at once",
        "| again after the sleep (0 s)",
    ]
    assert all(float(cell.split()[0]) > 0 for row in rows for cell in row.split(" | ")[1:])
