"""When the worker may release a KV cache a vLLM connector registered:
vLLM 0.32's real connectors (refused), and 0.33's connector API (allowed
where the connector supports sleep mode). Runs in ``nox -s vllm``.

vLLM 0.33 has no CPU build, so its API is stood in for by subclasses of
0.32's ExampleConnector that add what 0.33's ``KVConnectorBase_V1`` adds
(``unregister_kv_caches``, ``restore_kv_caches``, ``supports_sleep_mode``),
as read from 0.33.0's sources: a labelled stand-in at a boundary this
machine cannot reach.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)

from extensible_kv.integrations.vllm.worker.connectors import release_refusal

CONFIG = object()  # what supports_sleep_mode reads; these stand-ins ignore it


class SleepCapable033(ExampleConnector):  # stand-in: vLLM 0.33's API
    def unregister_kv_caches(self) -> None: ...

    def restore_kv_caches(self) -> None: ...

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True


class SleepIncapable033(SleepCapable033):  # stand-in: e.g. 0.33's NIXL push connector
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False


def test_vllm_032s_connectors_refuse_a_release() -> None:
    reason = release_refusal(ExampleConnector, CONFIG)
    assert reason is not None
    assert "would not register it again" in reason
    assert "ExampleConnector" in reason


def test_a_connector_with_vllm_033s_sleep_support_allows_it() -> None:
    assert release_refusal(SleepCapable033, CONFIG) is None


def test_a_033_connector_without_sleep_support_refuses_by_name() -> None:
    reason = release_refusal(SleepIncapable033, CONFIG)
    assert reason == (
        "SleepIncapable033 does not support sleep mode (its supports_sleep_mode says so)"
    )
