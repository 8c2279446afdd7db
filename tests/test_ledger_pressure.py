"""Wants, floors and caps in a device's ledger, across real processes.

A Hypothesis state machine drives three child processes, each claiming and
giving back on one ledger, while the test sets the limit and each child's
floor and cap, against a model of the rules (docs/budget.md, "Several
engines on one device"):

- a claim fits when it keeps its process within its cap, and every claim
  plus every other process's unmet floor within the limit;
- a refused claim posts a want of at least its size, which later claims pay
  down;
- :meth:`Ledger.pressure` is what other processes want beyond the room;
- a floor or limit that would not fit is refused and changes nothing;
- the most a process could ever hold (:meth:`LedgerView.most_for`) is the
  limit less the other processes' floors, within its cap.

Example tests pin a version 1 ledger moved up in place (by processes
opening it together too), the refusal's words, the wait a met want records,
and a want's lapse.
"""

from __future__ import annotations

import itertools
import os
import queue
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from extensible_kv import ExtensibleTensor
from extensible_kv.budget import STALLED_S, Holder, Ledger, StaleRevisionError, snapshot
from extensible_kv.budget.ledger import WANT_TTL_S
from extensible_kv.budget.ledger_file import FILE_BYTES, HEADER_BYTES, SLOTS, V1_FILE_BYTES
from extensible_kv.budget.liveness import this_process
from extensible_kv.budget.stall import StallWatch
from extensible_kv.budget.state_dir import prepare
from extensible_kv.cli import main
from extensible_kv.devices import BudgetDriver, waiting_for_budget, without_wants
from extensible_kv.driver import BudgetExceededError, backend

MiB = 1 << 20
#: Seconds a child may take to answer.
PATIENCE_S = 60
CHILD = """
    import sys
    from extensible_kv.budget import Ledger, StateDirError, state_dir
    from extensible_kv.driver import BudgetExceededError

    ledger = None
    for line in sys.stdin:
        verb, *args = line.split()
        try:
            if verb == "open":
                ledger = Ledger(state_dir(), args[0])
                answer = "ok"
            elif verb == "claim":
                ledger.claim(int(args[0]))
                answer = "ok"
            elif verb == "give":
                ledger.give_back(int(args[0]))
                answer = "ok"
            elif verb == "bounds":
                cap = None if args[1] == "none" else int(args[1])
                answer = f"ok {ledger.set_floor_and_cap(int(args[0]), cap).revision}"
            elif verb == "pressure":
                answer = f"ok {ledger.pressure()}"
            elif verb == "open-close":
                Ledger(state_dir(), args[0]).close()
                answer = "ok"
        except BudgetExceededError as exc:
            answer = "refused " + " ".join(str(exc).split())
        except ValueError as exc:
            answer = "invalid " + " ".join(str(exc).split())
        except StateDirError as exc:
            answer = "failed " + " ".join(str(exc).split())
        print(answer, flush=True)
"""


class Child:
    """A process with its own slot in the ledgers it opens, told what to do
    line by line."""

    def __init__(self, state: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(state)},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, line: str) -> str:
        self.tell(line)
        return self.answer()

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def answer(self) -> str:
        try:
            return self.lines.get(timeout=PATIENCE_S)
        except queue.Empty:
            raise AssertionError(f"the child said nothing for {PATIENCE_S} s") from None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(PATIENCE_S)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def children(state: Path) -> Iterator[list[Child]]:
    made = [Child(state) for _ in range(3)]
    yield made
    for child in made:
        child.stop()


_devices = itertools.count()
sizes = st.integers(1, 12).map(lambda mib: mib * MiB)


class PressureMachine(RuleBasedStateMachine):
    """Three processes on a fresh ledger per run, against the rules' model."""

    def __init__(self, state: Path, children: list[Child]) -> None:
        super().__init__()
        self.children = children
        self.device = f"host-pressure-{next(_devices)}"
        self.ledger = Ledger(state, self.device)
        for child in children:
            assert child.ask(f"open {self.device}") == "ok"
        n = len(children)
        self.limit: int | None = None
        self.claims, self.floors, self.caps = [0] * n, [0] * n, [0] * n
        #: Per process: the bytes wanted, and when the want was last posted.
        self.wants: list[tuple[int, float]] = [(0, 0.0)] * n

    def teardown(self) -> None:
        self.ledger.close()

    # -- the model ----------------------------------------------------------------

    def _want(self, p: int) -> int:
        wanted, at = self.wants[p]
        return wanted if time.monotonic() - at < WANT_TTL_S else 0

    def _fits(self, p: int, size: int) -> bool:
        if self.caps[p] and self.claims[p] + size > self.caps[p]:
            return False
        if self.limit is None:
            return True
        unmet = [max(0, f - c) for f, c in zip(self.floors, self.claims, strict=True)]
        kept = sum(each for q, each in enumerate(unmet) if q != p)
        return sum(self.claims) + size + kept <= self.limit

    def _pressure(self, p: int) -> int:
        if self.limit is None:
            return 0
        asked, kept = 0, 0
        for q in range(len(self.children)):
            unmet = max(0, self.floors[q] - self.claims[q])
            want = self._want(q)
            if q == p or not want:
                kept += unmet
                continue
            if self.caps[q]:
                want = min(want, max(0, self.caps[q] - self.claims[q]))
            asked += want
        return max(0, asked - max(0, self.limit - sum(self.claims) - kept))

    # -- rules ----------------------------------------------------------------------

    @rule(p=st.integers(0, 2), size=sizes)
    def claim(self, p: int, size: int) -> None:
        fits = self._fits(p, size)
        before = time.monotonic()
        answer = self.children[p].ask(f"claim {size}")
        assert answer.startswith("ok" if fits else "refused"), (answer, fits)
        if fits:
            self.claims[p] += size
            self.wants[p] = (max(0, self._want(p) - size), self.wants[p][1])
        else:
            self.wants[p] = (max(self._want(p), size), before)
            rule_broken = "cap" if "past its cap" in answer else "limit"
            assert (rule_broken == "cap") == bool(
                self.caps[p] and self.claims[p] + size > self.caps[p]
            ), answer

    @rule(p=st.integers(0, 2), data=st.data())
    def give_back(self, p: int, data: st.DataObject) -> None:
        if not self.claims[p]:
            return
        size = data.draw(st.integers(1, self.claims[p]))
        assert self.children[p].ask(f"give {size}") == "ok"
        self.claims[p] -= size

    @rule(
        p=st.integers(0, 2),
        floor=st.integers(0, 24).map(lambda mib: mib * MiB),
        cap=st.none() | st.integers(1, 40).map(lambda mib: mib * MiB),
    )
    def bounds(self, p: int, floor: int, cap: int | None) -> None:
        others = sum(f for q, f in enumerate(self.floors) if q != p)
        valid = (cap is None or floor <= cap) and (
            self.limit is None or others + floor <= self.limit
        )
        answer = self.children[p].ask(f"bounds {floor} {'none' if cap is None else cap}")
        assert answer.startswith("ok" if valid else "invalid"), (answer, valid)
        if valid:
            self.floors[p], self.caps[p] = floor, cap or 0

    @rule(limit=st.none() | st.integers(8, 64).map(lambda mib: mib * MiB))
    def set_limit(self, limit: int | None) -> None:
        valid = limit is None or limit >= sum(self.floors)
        if valid:
            self.ledger.set_limit(limit)
            self.limit = limit
        else:
            with pytest.raises(ValueError, match="below the floors"):
                self.ledger.set_limit(limit)

    @rule(p=st.integers(0, 2))
    def pressure(self, p: int) -> None:
        started = time.monotonic()
        expected = self._pressure(p)
        answer = self.children[p].ask("pressure")
        # A want may lapse while the child answers: compare only when none
        # is near its end.
        if all(
            not wanted or started - at < WANT_TTL_S / 2 or started - at > WANT_TTL_S * 1.5
            for wanted, at in self.wants
        ):
            assert answer == f"ok {expected}"

    def _most(self, p: int) -> int | None:
        cap = self.caps[p] or None
        if self.limit is None:
            return cap
        room = max(0, self.limit - sum(f for q, f in enumerate(self.floors) if q != p))
        return room if cap is None else min(room, cap)

    @invariant()
    def the_most_a_process_could_hold_is_the_limit_less_the_others_floors(self) -> None:
        view = self.ledger.read()
        for p, child in enumerate(self.children):
            assert view.most_for({child.pid}) == self._most(p)

    @invariant()
    def the_ledger_holds_what_the_model_does(self) -> None:
        holders = {key.pid: held for key, held in self.ledger.read().holders.items()}
        for p, child in enumerate(self.children):
            held = holders.get(child.pid)
            if held is None:
                assert self.claims[p] == 0
                assert self.floors[p] == 0
                continue
            assert held.claimed_bytes == self.claims[p]
            assert held.floor_bytes == self.floors[p]
            assert held.cap_bytes == (self.caps[p] or None)


def test_claims_floors_caps_and_wants_follow_the_rules(state: Path, children: list[Child]) -> None:
    run_state_machine_as_test(
        lambda: PressureMachine(state, children),
        settings=settings(max_examples=40, stateful_step_count=25, deadline=None),
    )


def _write_version_1(state: Path, device: str, length: int = V1_FILE_BYTES) -> None:
    """A version 1 ledger of ``device``, ``length`` bytes long (zeros past
    its arrays): a limit of 64 MiB at revision 3, and this process claiming
    5 MiB in its first slot."""
    prepare(state)
    me = this_process(state)
    v1 = bytearray(length)
    struct.pack_into("<8sIIqqq", v1, 0, b"EKVBUDG1", 1, SLOTS, 64 * MiB, 3, 1)
    struct.pack_into("<q", v1, HEADER_BYTES, me.pid)
    struct.pack_into("<q", v1, HEADER_BYTES + 8 * SLOTS, me.token)
    struct.pack_into("<q", v1, HEADER_BYTES + 16 * SLOTS, 5 * MiB)
    (state / "devices" / f"{device}.ledger").write_bytes(bytes(v1))


def _assert_moved_up(state: Path, device: str) -> None:
    """The ledger of ``device`` is version 2, holding what _write_version_1 wrote."""
    ledger = Ledger(state, device)
    try:
        assert ledger.path.stat().st_size == FILE_BYTES
        view = ledger.read()
        assert (view.limit.bytes, view.limit.revision) == (64 * MiB, 3)
        (held,) = view.holders.values()
        assert (held.claimed_bytes, held.wanted_bytes, held.floor_bytes) == (5 * MiB, 0, 0)
        assert held.cap_bytes is None
    finally:
        ledger.close()


@pytest.mark.parametrize(
    "length",
    [V1_FILE_BYTES, FILE_BYTES],
    ids=["version-1", "a-move-its-process-died-in"],
)
def test_a_version_1_ledger_is_moved_up_in_place_keeping_its_claims(
    state: Path, length: int
) -> None:
    _write_version_1(state, "host-old", length)
    _assert_moved_up(state, "host-old")


#: Rounds of concurrent first opens: before the move was locked, one of
#: three processes read it half done first after 2 to 2,013 rounds (12 runs).
OPEN_ROUNDS = 4000


def test_processes_opening_a_version_1_ledger_together_all_see_it_moved_up(
    state: Path, children: list[Child]
) -> None:
    for round_ in range(OPEN_ROUNDS):
        device = f"host-old-{round_}"
        _write_version_1(state, device)
        for child in children:
            child.tell(f"open-close {device}")
        answers = [child.answer() for child in children]
        assert answers == ["ok"] * len(children), f"round {round_}: {answers}"
        _assert_moved_up(state, device)


def test_a_cap_refuses_with_its_own_words_and_a_met_want_records_its_wait(
    state: Path, children: list[Child]
) -> None:
    first, second, _ = children
    ledger = Ledger(state, "host-words")
    try:
        for child in (first, second):
            assert child.ask("open host-words") == "ok"
        assert first.ask(f"bounds 0 {8 * MiB}").startswith("ok")
        answer = first.ask(f"claim {9 * MiB}")
        assert "past its cap of 8.00 MiB" in answer
        assert "--cap" in answer
        assert first.ask("bounds 0 none").startswith("ok")
        ledger.set_limit(16 * MiB)
        assert second.ask(f"bounds {6 * MiB} none").startswith("ok")
        answer = first.ask(f"claim {12 * MiB}")
        assert answer.startswith("refused")
        assert "6.00 MiB more is kept for others' floors" in answer
        assert first.ask(f"claim {8 * MiB}") == "ok"  # 8 + 6 kept <= 16
        assert second.ask(f"claim {10 * MiB}").startswith("refused")  # posts a want
        # The room for the want: 16 - 8 claimed (its own floor's 6 in it).
        assert first.ask("pressure") == f"ok {10 * MiB - 8 * MiB}"
        assert first.ask(f"give {8 * MiB}") == "ok"
        assert second.ask(f"claim {10 * MiB}") == "ok"
        held = {key.pid: value for key, value in ledger.read().holders.items()}
        waited = held[second.pid].waited_s
        assert held[second.pid].wanted_bytes == 0
        assert waited is not None
        assert 0 < waited < PATIENCE_S
    finally:
        ledger.close()


def test_floors_and_caps_are_revisioned_with_the_limit(state: Path) -> None:
    ledger = Ledger(state, "host-revisions")
    try:
        revision = ledger.set_limit(32 * MiB).revision
        written = ledger.set_floor_and_cap(4 * MiB, None)
        assert written.revision == revision + 1
        with pytest.raises(StaleRevisionError, match=f"revision {revision + 1}, not {revision}"):
            ledger.set_floor_and_cap(8 * MiB, None, expect_revision=revision)
        with pytest.raises(ValueError, match="above the cap"):
            ledger.set_floor_and_cap(8 * MiB, 4 * MiB)
        with pytest.raises(ValueError, match="holds no slot"):
            ledger.set_floor_and_cap(0, None, pid=1)
        (held,) = ledger.read().holders.values()
        assert (held.floor_bytes, held.cap_bytes) == (4 * MiB, None)
        with pytest.raises(BudgetExceededError):
            ledger.claim(40 * MiB)
    finally:
        ledger.close()


def _refused_and_read(ledger: Ledger, size: int) -> tuple[Holder, int]:
    """Refuse a claim of ``size`` bytes, then read this process's entry and
    the pressure, trying again until the reads end within the want's
    lifetime (a busy machine can stall the test past it)."""
    for _ in range(20):
        asked = time.monotonic()  # before the claim posts its want
        with pytest.raises(BudgetExceededError):
            ledger.claim(size)
        (held,) = ledger.read().holders.values()
        pressure = ledger.pressure(mine=())
        if time.monotonic() < asked + WANT_TTL_S:
            return held, pressure
    raise AssertionError(f"no read came within {WANT_TTL_S} s of the refusal in 20 tries")


def test_a_refused_claims_want_lapses_after_its_lifetime(state: Path) -> None:
    ledger = Ledger(state, "host-lapse")
    try:
        ledger.set_limit(8 * MiB)
        held, pressure = _refused_and_read(ledger, 12 * MiB)
        assert (held.wanted_bytes, pressure) == (12 * MiB, 4 * MiB)
        lapsed = time.monotonic() + WANT_TTL_S  # after the last ask posted it
        while time.monotonic() < lapsed:
            time.sleep(WANT_TTL_S / 10)
        (held,) = ledger.read().holders.values()
        assert (held.wanted_bytes, ledger.pressure(mine=())) == (0, 0)
    finally:
        ledger.close()


def test_a_claim_refused_without_wants_asks_no_one(state: Path) -> None:
    budget = BudgetDriver(backend("cpu"), state_dir=state)
    ledger = budget.ledger(0)
    ledger.set_limit(2 * MiB)
    tensor = ExtensibleTensor(64 * MiB, "cpu", driver=budget)
    try:
        with without_wants(), pytest.raises(BudgetExceededError):
            tensor.resize_(4 * MiB)
        assert ledger.pressure(mine=()) == 0  # nobody was asked
        with pytest.raises(BudgetExceededError):
            tensor.resize_(4 * MiB)
        assert ledger.pressure(mine=()) == 2 * MiB  # the want beyond the 2 MiB of room
    finally:
        tensor.free()


def test_a_wait_past_the_stall_tells_once_who_holds_the_memory(
    state: Path, children: list[Child], caplog: pytest.LogCaptureFixture
) -> None:
    holder, idle, _ = children
    budget = BudgetDriver(backend("cpu"), state_dir=state)
    device = backend("cpu").device_uuid(0)
    budget.ledger(0).set_limit(8 * MiB)
    for child in (holder, idle):
        assert child.ask(f"open {device}") == "ok"
    assert holder.ask(f"bounds {2 * MiB} none").startswith("ok")
    assert holder.ask(f"claim {6 * MiB}") == "ok"
    tensor = ExtensibleTensor(64 * MiB, "cpu", driver=budget)
    try:
        with waiting_for_budget(STALLED_S + 2.0), pytest.raises(BudgetExceededError):
            tensor.resize_(4 * MiB)
    finally:
        tensor.free()
    told = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(told) == 1, told
    (line,) = told
    assert f"pid {os.getpid()} has waited" in line
    assert f"for 4.00 MiB more on device {device} (limit 8.00 MiB)" in line
    assert f"pid {holder.pid} ({sys.executable} -c" in line
    assert "holds 6.00 MiB, floor 2.00 MiB, cap none, cached unknown" in line
    assert f"pid {idle.pid}" not in line  # it holds nothing
    assert f"pid {os.getpid()} (" not in line  # the waiter is not its own holder


def _ask_until_stalled(ledger: Ledger, size: int) -> None:
    """Ask for ``size`` bytes again and again, each refused, until the want
    has stood :data:`STALLED_S` seconds (asked within its lifetime each time)."""
    until = time.monotonic() + STALLED_S + 0.2
    while time.monotonic() < until:
        with pytest.raises(BudgetExceededError):
            ledger.claim(size)
        time.sleep(WANT_TTL_S / 5)


def test_a_stalled_want_is_marked_in_top_and_told_once_per_want(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger(state, "host-stall")
    watch = StallWatch()
    me = {os.getpid()}
    try:
        ledger.set_limit(8 * MiB)
        with pytest.raises(BudgetExceededError):
            ledger.claim(12 * MiB)
        (held,) = ledger.read().holders.values()
        assert held.wanting_s is not None
        assert not held.stalled
        assert watch.check(ledger, me) is None  # wanting, not stalled yet
        _ask_until_stalled(ledger, 12 * MiB)
        (process,) = snapshot(state)["devices"][0]["processes"]
        assert process["wanting_s"] >= STALLED_S
        assert main(["top", "--once"]) == 0
        shown = capsys.readouterr().out
        assert "wanted 12.0 MiB (stalled)" in shown
        assert re.search(r"12\.0 MiB, stalled \d+ s", shown)
        told = watch.check(ledger, me)
        assert told is not None
        assert "for 12.0 MiB more on device host-stall" in told
        assert "held by: no other process" in told
        assert watch.check(ledger, me) is None  # the same want: told once
        time.sleep(WANT_TTL_S * 1.2)  # the want lapses
        assert watch.check(ledger, me) is None
        assert ledger.read().holders[this_process(state)].wanting_s is None
        _ask_until_stalled(ledger, 12 * MiB)
        assert watch.check(ledger, me) is not None  # a new want: told again
    finally:
        ledger.close()
