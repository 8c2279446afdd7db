"""The trace replay of the ``several`` case (``extensible_kv/bench/trace.py``)
with real servers, on the first requests of each stream: three stock
servers on a static split, and three of ours under the limit, each serving
its stream at the recorded (stretched) times; every request completes and
the figures and our memory timeline come back. Runs in ``nox -s vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from extensible_kv.bench import trace
from extensible_kv.bench.child import tiny_model

#: The first requests of each stream: the code stream's start 18 s in.
REQUESTS = 3


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The run sets its own state directory; this puts the test's back after.
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("kind", ["ours", trace.split_kind(trace.candidates()[1])])
def test_three_servers_replay_their_streams(state: Path, kind: str) -> None:
    run = trace.child(tiny_model(), kind, REQUESTS)
    assert run["errors"] == []
    sent = {name: len(stream) for name, stream in trace.streams(REQUESTS).items()}
    for name, count in sent.items():
        figures = run["engines"][name]
        assert figures["sent"] == figures["completed"] == count
        assert figures["ttft_p50_s"] is not None
    assert run["engines"]["all"]["completed"] == sum(sent.values())
    assert 0 < run["engines"]["all"]["cpu_share"] < 2  # the servers' processes were read
    assert run["span_s"] >= max(a.at_s for s in trace.streams(REQUESTS).values() for a in s)
    if kind == "ours":
        timeline = run["timeline"]
        assert timeline["engines"] == list(trace.STREAMS)
        claimed = [sum(p[1 : 1 + len(sent)]) for p in timeline["points"]]
        assert 0 < max(claimed) * (1 << 20) <= trace.LIMIT_BYTES
    else:
        assert run["timeline"] is None
