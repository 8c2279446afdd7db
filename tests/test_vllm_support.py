"""The vLLM range the worker supports, checked before vLLM is imported."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from extensible_kv.integrations.vllm.support import (
    SUPPORTED_VLLM,
    check_vllm_version,
    installed_vllm,
)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.32.4", "0.33.0", "0.33.2rc1"])
def test_releases_in_the_range_pass(found: str) -> None:
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.31.9", "0.34.0", "1.0.0", "0.30.0+cpu", "nightly"])
def test_releases_outside_fail_with_one_line_naming_the_range(found: str) -> None:
    with pytest.raises(ImportError) as caught:
        check_vllm_version(found)
    message = str(caught.value)
    assert "\n" not in message
    assert SUPPORTED_VLLM in message
    assert found in message


@pytest.mark.parametrize(
    ("module", "name"),
    [("worker.worker", "ExtensibleKVWorker"), ("scheduler.scheduler", "ExtensibleKVScheduler")],
)
def test_importing_the_worker_without_vllm_says_what_it_needs(module: str, name: str) -> None:
    """The package imports each side only when asked for one of its names
    (as vLLM resolves ``worker_cls``: the module, then the name), so the
    modules read without vLLM import here; the worker and the scheduler say
    what they need, asked for by name or imported."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (nox -s vllm)")
    assert installed_vllm() is None
    package = importlib.import_module("extensible_kv.integrations.vllm")
    with pytest.raises(ImportError, match=f"needs vLLM {SUPPORTED_VLLM}; vLLM is not installed"):
        getattr(package, name)
    with pytest.raises(ImportError, match=f"needs vLLM {SUPPORTED_VLLM}; vLLM is not installed"):
        importlib.import_module(f"extensible_kv.integrations.vllm.{module}")
