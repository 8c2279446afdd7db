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

# (examples, steps per stateful run) per profile. "gpu-check" is for the
# prepared GPU check, which runs every test twice inside lent device time.
PROFILES = {"default": (100, 30), "thorough": (300, 50), "gpu-check": (20, 20)}
for name, (examples, steps) in PROFILES.items():
    settings.register_profile(
        name,
        max_examples=examples,
        stateful_step_count=steps,
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
