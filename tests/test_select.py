"""Choosing a backend for a device, and saying why none can serve it."""

from __future__ import annotations

import re

import pytest
import torch

import extensible_kv
from extensible_kv.devices import BudgetDriver, get_driver
from extensible_kv.driver import (
    BackendUnavailableError,
    DeviceSpec,
    HostDriver,
    backend,
    parse_device,
    unavailable_reason,
)


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", DeviceSpec("cpu", 0)),
        ("cpu:0", DeviceSpec("cpu", 0)),
        (torch.device("cpu"), DeviceSpec("cpu", 0)),
        ("cuda", DeviceSpec("cuda", None)),
        ("cuda:3", DeviceSpec("cuda", 3)),
        (torch.device("cuda", 1), DeviceSpec("cuda", 1)),
        (2, DeviceSpec("cuda", 2)),
    ],
)
def test_devices_are_read_as_torch_reads_them(device: object, expected: DeviceSpec) -> None:
    assert parse_device(device) == expected


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("meta", "'meta' is not supported"),
        (torch.device("meta"), "'meta' is not supported"),
        ("mps:0", "'mps' is not supported"),
        ("cuda:x", "cannot read device"),
        ("cpu:1", "one device"),
        (-1, "non-negative"),
        (True, "torch.device, str or int"),
        (1.5, "torch.device, str or int"),
    ],
)
def test_unreadable_devices_are_refused(device: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_device(device)


def test_cpu_gets_the_shared_host_driver() -> None:
    driver = get_driver("cpu")
    assert isinstance(driver, BudgetDriver)
    assert isinstance(driver.inner, HostDriver)
    assert driver is get_driver(torch.device("cpu"))
    assert backend("cpu") is driver.inner
    assert unavailable_reason("cpu") is None


def test_unavailable_reason_never_raises() -> None:
    for device in ("meta", object(), "cuda:99", 7):
        reason = unavailable_reason(device)
        assert reason is None or isinstance(reason, str)
    assert "not supported" in str(unavailable_reason("meta"))


@pytest.mark.skipif(unavailable_reason("cuda") is None, reason="a GPU backend is usable here")
def test_without_a_gpu_backend_cuda_says_why() -> None:
    reason = unavailable_reason("cuda")
    assert reason
    assert extensible_kv.vmm_unavailable_reason() == reason
    with pytest.raises(BackendUnavailableError, match=re.escape(reason)):
        get_driver("cuda")


def test_cuda_without_an_ordinal_probes_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As vLLM's probe: a worker whose current device is 3 asks about 3.

    Mocked at the driver boundary (no GPU here): torch reports a current
    device and the probe records the ordinal it is asked for.
    """
    from extensible_kv.driver import select

    probed: list[tuple[str, int | None]] = []
    monkeypatch.setattr(select, "_usable", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(select, "_probe", lambda kind, index: probed.append((kind, index)))
    assert unavailable_reason("cuda") is None
    assert unavailable_reason("cuda:1") is None
    assert extensible_kv.vmm_unavailable_reason() is None
    assert probed == [("cuda", 3), ("cuda", 1)], "a passed probe is cached per ordinal"
