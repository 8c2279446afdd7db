"""Shared fixtures: every test module takes its backend from here.

Backends: ``cpu`` (the host backend) always; ``cuda-sim`` and ``hip-sim``,
the real CUDA and HIP backends over the LABELLED driver simulator in
``tests/gpusim`` (CPU views; not GPU verification); and ``cuda`` when this
machine has a GPU whose virtual memory backend is usable.

``device`` is the torch device a test makes tensors on (``"cpu"`` for the
simulators, whose memory is host memory) and ``driver`` the backend's
driver; tests pass both. ``real_device`` is for tests that need a real
device (the demo, examples, sizing), and skips the simulators.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# Every process of the suite, children included, publishes into a directory of
# its own, so no run sees another's budget (tests of the budget make their own).
os.environ.setdefault("EXTENSIBLE_KV_STATE_DIR", tempfile.mkdtemp(prefix="extensible-kv-tests-"))

from extensible_kv import StatisticsDriver, get_driver, unavailable_reason
from extensible_kv.driver import Driver
from gpusim import SimMachine, sim_driver

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

GPU = unavailable_reason("cuda") is None
REAL_DEVICES = ["cpu"] + (["cuda"] if GPU else [])
SIMULATORS = [
    kind
    for kind, module in (("cuda-sim", "cuda.bindings"), ("hip-sim", "hip"))
    if importlib.util.find_spec(module.split(".")[0]) is not None
]
BACKENDS = ["cpu", *SIMULATORS] + (["cuda"] if GPU else [])


@pytest.fixture(params=BACKENDS)
def vmm_backend(request: pytest.FixtureRequest) -> str:
    """A backend to run the test on: a real device or a simulated GPU."""
    return str(request.param)


@pytest.fixture
def sim(vmm_backend: str) -> SimMachine | None:
    """The simulated GPUs behind a simulator backend (fresh per test), else None."""
    return SimMachine() if vmm_backend.endswith("-sim") else None


@pytest.fixture
def driver(vmm_backend: str, sim: SimMachine | None) -> Driver:
    """The backend's driver: the shared one of a real device, or a simulated one."""
    if sim is None:
        return get_driver(vmm_backend)
    return sim_driver(vmm_backend, sim)[0]


@pytest.fixture
def device(vmm_backend: str) -> str:
    """The torch device tensors of the backend live on."""
    return "cpu" if vmm_backend.endswith("-sim") else vmm_backend


@pytest.fixture(params=REAL_DEVICES)
def real_device(request: pytest.FixtureRequest) -> str:
    """A real device whose virtual memory backend works on this machine."""
    return str(request.param)


@pytest.fixture
def stats(driver: Driver, sim: SimMachine | None) -> Iterator[StatisticsDriver]:
    """The backend's driver, counted; the test must leave nothing alive."""
    counted = StatisticsDriver(driver)
    yield counted
    live = counted.live
    assert (live.handles, live.reservations, live.mappings) == (0, 0, 0), live
    if sim is not None:
        assert sim.empty(), "the simulated driver still holds memory"
        assert sim.sticky is None, "a simulated kernel touched an illegal address"


@pytest.fixture
def granularity(driver: Driver) -> int:
    return driver.granularity(0, False)


@pytest.fixture(params=SIMULATORS)
def simulated(request: pytest.FixtureRequest) -> tuple[Driver, SimMachine]:
    """A simulated GPU backend (CPU views) and its machine, for tests of
    work in flight, which only the simulator can hold back."""
    machine = SimMachine()
    return sim_driver(str(request.param), machine)[0], machine
