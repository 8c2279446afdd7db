"""``extensible-kv bench --quick`` runs every suite and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from extensible_kv.cli import main

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
    "vllm",
)  # written out: a suite dropped from the bench fails here


def test_quick_bench_writes_every_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
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
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "commit + zero" in out
    assert "physical overhead" in out
    assert "pooled handles vs new" in out
    assert "reserved ahead while asleep" in out
    assert "vs the memset floor" in out
    assert out.count("not measured on this machine (no GPU)") == 4, "the GPU-only goals"
    assert "10. vLLM, stock and on extensible-kv" in out


def test_the_expandable_segments_peer_runs_in_a_process_of_its_own() -> None:
    """The subprocess plumbing of the GPU-only peer, run on the host (where
    the allocator setting does nothing): one positive time per step."""
    import torch

    from extensible_kv.bench.suites import _grow_expandable_segments

    costs = _grow_expandable_segments(torch.device("cpu"), 8 << 20, 4)
    assert len(costs) == 4
    assert all(cost > 0 for cost in costs)


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
