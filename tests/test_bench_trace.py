"""The trace replay's data and arithmetic (``extensible_kv/bench/trace.py``),
with no engine: the vendored slices of the Azure LLM inference trace load
as recorded and scaled as the module says, the static splits searched
share out the limit, and a run beats another by SLO attainment, then p99.
The replay itself runs in ``tests/test_vllm_trace.py``."""

from __future__ import annotations

import csv
from datetime import datetime
from importlib.resources import files
from typing import Any

import pytest

from extensible_kv.bench import trace
from extensible_kv.bench.child import BYTES_PER_BLOCK


def rows(stream: str) -> list[dict[str, str]]:
    name, _ = trace.STREAMS[stream]
    text = (files("extensible_kv.bench") / "data" / "azure_llm_2023" / name).read_text()
    return list(csv.DictReader(text.splitlines()))


def test_the_slices_ship_with_their_licence_and_attribution() -> None:
    folder = files("extensible_kv.bench") / "data" / "azure_llm_2023"
    assert "Attribution 4.0 International" in (folder / "LICENSE").read_text()
    readme = (folder / "README.md").read_text()
    assert "Splitwise" in readme
    assert "790921015d50dd6aae7f7e47f39ba0e235ad6b08" in readme


@pytest.mark.parametrize(("stream", "count"), [("conv", 61), ("code", 65), ("conv-later", 54)])
def test_each_stream_is_its_slice_scaled(stream: str, count: int) -> None:
    recorded, arrivals = rows(stream), trace.load(stream)
    assert len(arrivals) == len(recorded) == count
    window_s = 12 * trace.TIME_SCALE
    assert all(0 <= a.at_s < window_s for a in arrivals)
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    for row, arrival in zip(recorded, arrivals, strict=True):
        assert arrival.prompt_tokens + arrival.new_tokens < trace.MAX_MODEL_LEN
        assert arrival.new_tokens == max(1, round(int(row["GeneratedTokens"]) / trace.TOKEN_SCALE))
        scaled = max(1, round(int(row["ContextTokens"]) / trace.TOKEN_SCALE))
        if scaled + arrival.new_tokens < trace.MAX_MODEL_LEN:
            assert arrival.prompt_tokens == scaled  # not cut
    # Time is stretched alike for every request: gaps scale with the trace's.
    stamps = [datetime.fromisoformat(row["TIMESTAMP"][:26]) for row in recorded]
    recorded_s = (stamps[-1] - stamps[0]).total_seconds()
    assert arrivals[-1].at_s - arrivals[0].at_s == pytest.approx(recorded_s * trace.TIME_SCALE)


def test_the_static_splits_share_out_the_limit_on_the_grid() -> None:
    splits = trace.candidates()
    even = (trace.LIMIT_BYTES // 3,) * 3
    assert splits[0] == even
    assert len(set(splits)) == len(splits) > 3
    one_request = trace.MAX_MODEL_LEN // 32 * BYTES_PER_BLOCK  # a stock server needs more
    for split in splits:
        assert sum(split) == trace.LIMIT_BYTES
        assert all(share % trace.STEP_BYTES == 0 and share > one_request for share in split)
        assert trace.split_of(trace.split_kind(split)) == split


def run(slo: float, p99: float) -> dict[str, Any]:
    return {"engines": {"all": {"slo": slo, "ttft_p99_s": p99}}}


def test_a_run_beats_another_by_slo_attainment_then_by_p99() -> None:
    assert trace.better(run(0.9, 5.0), run(0.8, 1.0))
    assert not trace.better(run(0.8, 1.0), run(0.9, 5.0))
    assert trace.better(run(0.9, 1.0), run(0.9, 2.0))
    assert not trace.better(run(0.9, 2.0), run(0.9, 2.0))


def answer(ttft_s: float | None, tokens: int = 4, wanted: int = 4) -> dict[str, Any]:
    return {"ttft_s": ttft_s, "tokens": tokens, "wanted": wanted}


def test_a_runs_figures_per_engine_and_over_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace.os, "cpu_count", lambda: 2)
    results = {
        "conv": [answer(0.2), answer(0.4)],
        "code": [answer(3.0, tokens=1), answer(None, tokens=0)],
        "conv-later": [answer(0.9)],
    }
    run = trace.figures(results, 10.0, {"conv": 6.0, "code": 10.0, "conv-later": 0.0})
    conv, code, every = (run["engines"][name] for name in ("conv", "code", "all"))
    assert conv["slo"] == 1.0
    assert conv["completed"] == 2
    assert code["slo"] == 0.0
    assert code["completed"] == 0
    assert every["slo"] == 3 / 5
    assert every["sent"] == 5
    assert every["tokens_per_s"] == (4 + 4 + 1 + 0 + 4) / 10.0
    # CPU seconds over what two cores had in the 10 s span.
    assert conv["cpu_share"] == 0.3
    assert code["cpu_share"] == 0.5
    assert every["cpu_share"] == 0.8
