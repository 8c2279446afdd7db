"""The give-way case (``extensible_kv/bench/give_way.py``) with real
engines: B as an ``LLM`` in this test's process, idle between ``generate``
calls, gives A's wants the room, down to its floor, and A's every request
completes. (How soon is the benchmark's to say, not an assertion's.) Runs in
``nox -s vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from extensible_kv.bench import give_way, several
from extensible_kv.bench.child import child_figures, tiny_model


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The run sets its own state directory; this puts the test's back after.
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


def test_an_idle_program_gives_a_server_room_for_its_bursts(state: Path) -> None:
    run = child_figures(give_way.__name__, tiny_model(), "program")
    assert run["errors"] == []
    assert run["completed"] == give_way.TURNS * several.REQUESTS
    assert run["wants"] >= give_way.TURNS  # A's bursts needed B's memory
    assert run["b_least_mib"] < run["b_idle_mib"]  # B gave way
    assert run["b_least_mib"] * (1 << 20) >= several.FLOOR_BYTES  # down to its floor, no lower
