"""The endpoint plug-in's ``/extensible_kv/metrics`` gauges over a real
snapshot, with no engine: a figure the snapshot has as null is left out
(docs/vllm.md), a cache's ``asleep`` is 0 or 1. vLLM is imported only
because the plug-in's module is vLLM's (``nox -s vllm`` runs this file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extensible_kv import BudgetDriver, ExtensibleTensor, KVCacheBuffers
from extensible_kv.budget import snapshot
from extensible_kv.budget.publish import publisher
from extensible_kv.driver import backend

pytest.importorskip("vllm")
from extensible_kv.integrations.vllm.endpoints import metrics_text

MiB = 1 << 20
BLOCK = 256 * 1024  # 8 blocks per 2 MiB granule


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


def _gauge(text: str, name: str, **labels: object) -> list[float]:
    """The values of gauge ``name`` with ``labels`` in Prometheus' ``text``."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            found.append(float(line.rsplit(" ", 1)[1]))
    return found


def _metrics(where: Path) -> tuple[dict[str, object], str]:
    """This process's caches' ``asleep`` by kind in the snapshot of ``where``,
    and the snapshot's gauges."""
    publisher(where).write()
    taken = snapshot(where)
    (device,) = taken["devices"]
    (process,) = (p for p in device["processes"] if p["pid"] == os.getpid())
    return {c["kind"]: c["asleep"] for c in process["caches"]}, metrics_text(taken).decode()


def test_a_null_asleep_is_left_out_and_a_cache_asleep_is_0_or_1(state: Path) -> None:
    budget = BudgetDriver(backend("cpu"), state_dir=state)
    tensor = ExtensibleTensor(16 * BLOCK * 2, "cpu", num_segments=2, driver=budget)
    cache = KVCacheBuffers([(tensor, BLOCK)], 16)
    cache.commit(8)
    lone = ExtensibleTensor(8 * MiB, "cpu", driver=budget)  # no cache owns it: asleep is null
    lone.resize_(2 * MiB)
    pid = os.getpid()
    try:
        asleep, text = _metrics(state)
        assert asleep == {"KVCacheBuffers": False, "ExtensibleTensor": None}
        assert _gauge(text, "extensible_kv_cache_asleep", pid=pid, kind="KVCacheBuffers") == [0]
        assert _gauge(text, "extensible_kv_cache_asleep", pid=pid, kind="ExtensibleTensor") == []
        lone_bytes = _gauge(text, "extensible_kv_cache_physical_bytes", kind="ExtensibleTensor")
        assert lone_bytes == [2 * MiB]  # the tensor is there, only its null is left out
        cache.release_physical()
        asleep, text = _metrics(state)
        assert asleep["KVCacheBuffers"] is True
        assert _gauge(text, "extensible_kv_cache_asleep", pid=pid, kind="KVCacheBuffers") == [1]
    finally:
        cache.free()
        lone.free()
