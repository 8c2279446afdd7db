"""integrations/vllm/scheduler/pressure.py with no vLLM engine, on a real ledger:
what another process wants, in the engine's blocks, and the engine's floor,
which the giving back never goes below."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extensible_kv.budget import STALLED_S, Ledger
from extensible_kv.budget.ledger import WANT_TTL_S
from extensible_kv.driver import backend
from extensible_kv.integrations.vllm.scheduler import pressure as pressure_module
from extensible_kv.integrations.vllm.scheduler.pressure import STALL_EVERY_S, Pressure
from extensible_kv.limits import set_device_limit, set_floor_and_cap

MiB = 1 << 20
#: Bytes of one of the engine's blocks on its one rank.
BLOCK = MiB
UUID = backend("cpu").device_uuid(0)
#: Seconds a child may take to post its want (it imports torch).
PATIENCE_S = 60
#: A process waiting to claim 8 MiB: its want stays posted while it waits.
WANTING = """
import sys
from pathlib import Path
from extensible_kv.budget import Ledger
Ledger(Path(sys.argv[1]), sys.argv[2]).claim(8 << 20, timeout_s=float(sys.argv[3]))
"""


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def wanting(state: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Another process on the device, waiting for 8 MiB."""
    code = textwrap.dedent(WANTING)
    child = subprocess.Popen([sys.executable, "-c", code, str(state), UUID, str(PATIENCE_S)])
    yield child
    if child.poll() is None:
        child.kill()
    child.wait(PATIENCE_S)


def _first_want(pressure: Pressure) -> int:
    """The blocks others want, once their want shows."""
    deadline = time.monotonic() + PATIENCE_S
    while not pressure.blocks_wanted():
        assert time.monotonic() < deadline, f"no want showed in {PATIENCE_S} s"
        time.sleep(0.05)
    return pressure.blocks_wanted()


def _give_way(ledger: Ledger, pressure: Pressure) -> None:
    """What the scheduler does for others' wants, with no vLLM: give back a
    block at a time while others want more, never below the floor."""
    while pressure.blocks_wanted() and ledger.held - BLOCK >= pressure.floor_blocks * BLOCK:
        ledger.give_back(BLOCK)
        pressure.spent()


def test_giving_way_to_anothers_want_stops_at_the_floor(
    state: Path, wanting: subprocess.Popen[bytes]
) -> None:
    set_device_limit("cpu", 8 * MiB)
    ledger = Ledger(state, UUID)
    ledger.claim(8 * MiB)
    set_floor_and_cap("cpu", os.getpid(), floor=4 * MiB)
    pressure = Pressure(BLOCK)
    pressure.learn(((UUID, str(state), os.getpid()),))
    try:
        assert _first_want(pressure) == 8  # the limit is all this engine's
        assert pressure.floor_blocks == 4
        _give_way(ledger, pressure)
        assert ledger.held == 4 * MiB
        assert pressure.blocks_wanted() == 4  # still wanted: the floor keeps it
        assert wanting.poll() is None  # still waiting, refused
    finally:
        ledger.give_back(ledger.held)
        ledger.close()
        pressure.close()


def test_a_want_is_remembered_for_a_while_after_it_is_gone(
    state: Path, wanting: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pressure_module, "WANTED_LATELY_S", 2.0)
    set_device_limit("cpu", 8 * MiB)
    ledger = Ledger(state, UUID)
    ledger.claim(8 * MiB)
    pressure = Pressure(BLOCK)
    pressure.learn(((UUID, str(state), os.getpid()),))
    try:
        assert not pressure.wanted_lately()
        _first_want(pressure)
        assert pressure.wanted_lately()
        wanting.kill()
        wanting.wait(PATIENCE_S)
        time.sleep(WANT_TTL_S + 0.1)
        assert pressure.blocks_wanted() == 0  # the want lapsed with its process
        assert pressure.wanted_lately()  # and is still remembered
        time.sleep(2.0)
        assert pressure.blocks_wanted() == 0
        assert not pressure.wanted_lately()
    finally:
        ledger.give_back(ledger.held)
        ledger.close()
        pressure.close()


def test_a_stalled_want_of_the_engine_is_told_once_naming_the_holder(
    state: Path, wanting: subprocess.Popen[bytes]
) -> None:
    set_device_limit("cpu", 8 * MiB)
    ledger = Ledger(state, UUID)
    ledger.claim(6 * MiB)
    # The waiting child plays this engine's rank: its want is the engine's.
    pressure = Pressure(BLOCK)
    pressure.learn(((UUID, str(state), wanting.pid),))
    try:
        deadline = time.monotonic() + PATIENCE_S
        while not (told := pressure.stalled()):
            assert time.monotonic() < deadline, f"no stall was told in {PATIENCE_S} s"
            time.sleep(0.1)
        (line,) = told
        waited = re.search(rf"pid {wanting.pid} has waited (\d+) s for 8\.00 MiB more", line)
        assert waited, line
        assert int(waited[1]) >= STALLED_S
        assert f"pid {os.getpid()} (" in line
        assert "holds 6.00 MiB, floor none, cap none" in line
        time.sleep(STALL_EVERY_S * 1.5)
        assert pressure.stalled() == []  # the same want: told once
        assert wanting.poll() is None
    finally:
        ledger.give_back(ledger.held)
        ledger.close()
        pressure.close()
