"""Shared fixtures: every test module takes its device from here.

The host backend ("cpu") always runs; "cuda" joins when this machine has a
GPU whose virtual memory backend is usable, so the same tests run there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from extensible_kv import StatisticsDriver, get_driver, unavailable_reason
from extensible_kv.driver import Driver

settings.register_profile(
    "default",
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# The prepared GPU check runs every test twice (host and GPU) inside a few
# minutes of lent device time.
settings.register_profile(
    "gpu-check",
    max_examples=20,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

DEVICES = ["cpu"] + (["cuda"] if unavailable_reason("cuda") is None else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """A device whose virtual memory backend works on this machine."""
    return str(request.param)


@pytest.fixture
def stats(device: str) -> Iterator[StatisticsDriver]:
    """The device's driver, counted; the test must leave nothing alive."""
    driver = StatisticsDriver(get_driver(device))
    yield driver
    live = driver.live
    assert (live.handles, live.reservations, live.mappings) == (0, 0, 0), live


@pytest.fixture
def granularity(device: str) -> int:
    driver: Driver = get_driver(device)
    return driver.granularity(0, False)
