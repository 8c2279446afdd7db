"""``extensible-kv top`` shows the flow of memory (claimed, in use, cached,
wanted, and each process's floor and cap), and ``extensible-kv limit``
sets one process's floor and cap: in this process and in a real child,
through the snapshot, the live view's table, the command line and the
Prometheus gauges."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from extensible_kv import BudgetDriver, BudgetExceededError, ExtensibleTensor, KVCacheBuffers
from extensible_kv.budget import SCHEMA_VERSION, Ledger, snapshot
from extensible_kv.budget.publish import publisher
from extensible_kv.cli import main
from extensible_kv.driver import backend
from extensible_kv.limits import KEEP, set_floor_and_cap

MiB = 1 << 20
BLOCK = 256 * 1024  # 8 blocks per 2 MiB granule
UUID = backend("cpu").device_uuid(0)
#: Seconds a child may take to reach a point it reports (it imports torch).
PATIENCE_S = 60
DOCS = Path(__file__).resolve().parent.parent / "docs" / "budget.md"


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def budget(state: Path) -> BudgetDriver:
    return BudgetDriver(backend("cpu"), state_dir=state)


def _cache(driver: object, blocks: int = 64) -> KVCacheBuffers:
    """One K/V-split layer of ``blocks`` blocks of BLOCK bytes per segment."""
    tensor = ExtensibleTensor(blocks * BLOCK * 2, "cpu", num_segments=2, driver=driver)  # type: ignore[arg-type]
    return KVCacheBuffers([(tensor, BLOCK)], blocks)


def _process(state: Path, pid: int) -> dict[str, Any] | None:
    """Process ``pid`` in the snapshot's one device (None: not there)."""
    for device in snapshot(state)["devices"]:
        for process in device["processes"]:
            if process["pid"] == pid:
                return dict(process)
    return None


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def _refused_want(ledger: Ledger, size: int) -> None:
    """A claim of ``size`` bytes that does not fit: it posts a want."""
    with pytest.raises(BudgetExceededError):
        ledger.claim(size)


T = TypeVar("T")


def _wanting(ledger: Ledger, size: int, look: Callable[[], T], seen: Callable[[T], bool]) -> T:
    """``look()`` right after a refused claim of ``size`` bytes posted a
    want, until ``seen`` says the want shows (a want lapses half a second
    after its ask: a look slowed past that by a busy machine is tried again)."""
    for _ in range(10):
        _refused_want(ledger, size)
        found = look()
        if seen(found):
            return found
    raise AssertionError(f"a want of {size} bytes never showed")


# -- the snapshot, in this process -------------------------------------------------


def test_the_snapshot_shows_this_processs_flow(budget: BudgetDriver, state: Path) -> None:
    ledger = budget.ledger(0)
    first, second = _cache(budget), _cache(budget)
    first.commit(16)  # 4 MiB per segment: 8 MiB
    second.commit(8)  # 4 MiB
    lone = ExtensibleTensor(8 * MiB, "cpu", driver=budget)
    lone.resize_(2 * MiB)  # reports no blocks in use
    first.block_use = (10, 3)  # as an elastic engine's scheduler counts them
    second.block_use = (2, 5)
    publisher(state).write()
    me = _process(state, os.getpid())
    assert me is not None
    per_block = first.bytes_per_block
    assert per_block == 2 * BLOCK
    assert me["claimed_bytes"] == 14 * MiB == ledger.held
    assert (me["in_use_bytes"], me["cached_bytes"]) == (12 * per_block, 8 * per_block)
    reported = {c["committed_bytes"]: c for c in me["caches"] if c["kind"] == "KVCacheBuffers"}
    assert reported[8 * MiB]["in_use_bytes"] == 10 * per_block
    assert reported[4 * MiB]["cached_bytes"] == 5 * per_block
    (tensor,) = [c for c in me["caches"] if c["kind"] == "ExtensibleTensor"]
    assert "in_use_bytes" not in tensor  # only caches that count them say so
    assert (me["wanted_bytes"], me["floor_bytes"], me["cap_bytes"], me["waited_s"]) == (
        0,
        0,
        None,
        None,
    )

    ledger.set_floor_and_cap(16 * MiB, 20 * MiB)
    asked = 10 * MiB  # 14 + 10 passes the cap of 20
    me = _wanting(
        ledger,
        asked,
        lambda: _process(state, os.getpid()) or {},
        lambda found: found["wanted_bytes"] > 0,
    )
    assert me["wanted_bytes"] == asked
    assert (me["floor_bytes"], me["cap_bytes"]) == (16 * MiB, 20 * MiB)
    assert me["waited_s"] is None
    ledger.set_floor_and_cap(16 * MiB, None)
    ledger.claim(asked)  # fits now: pays the want off
    me = _process(state, os.getpid())
    assert me is not None
    assert (me["wanted_bytes"], me["cap_bytes"], me["claimed_bytes"]) == (0, None, 24 * MiB)
    assert isinstance(me["waited_s"], float)
    assert 0 < me["waited_s"] < PATIENCE_S
    ledger.give_back(asked)
    for each in (first, second):
        each.free()
    lone.free()


def test_a_process_with_no_cache_counting_blocks_has_null_in_use(
    budget: BudgetDriver, state: Path
) -> None:
    cache = _cache(budget)
    cache.commit(8)
    publisher(state).write()
    me = _process(state, os.getpid())
    assert me is not None
    assert (me["in_use_bytes"], me["cached_bytes"]) == (None, None)
    cache.block_use = (0, 0)  # counted, and nothing in use: 0, not null
    publisher(state).write()
    me = _process(state, os.getpid())
    assert me is not None
    assert (me["in_use_bytes"], me["cached_bytes"]) == (0, 0)
    cache.free()


def test_the_schema_version_and_every_key_are_documented(
    budget: BudgetDriver, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = _cache(budget)
    cache.commit(8)
    cache.block_use = (1, 1)
    publisher(state).write()
    assert main(["top", "--once", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema_version"] == SCHEMA_VERSION
    (device,) = document["devices"]
    (process,) = device["processes"]
    docs = DOCS.read_text()
    documented = set(re.findall(r"^\| `processes\[\]\.(\w+)`", docs, re.M))
    documented |= set(re.findall(r"^\| `processes\[\]\.\w+`, `(\w+)`", docs, re.M))
    assert set(process) - {"caches"} == documented
    assert f'"schema_version": {SCHEMA_VERSION},' in docs
    assert f"(version {SCHEMA_VERSION};" in docs
    with pytest.raises(SystemExit):
        main(["top", "--help"])
    assert f"schema_version {SCHEMA_VERSION}" in " ".join(capsys.readouterr().out.split())
    cache.free()


# -- the live view's table ------------------------------------------------------------


def _header(table: str) -> list[str]:
    """The column names of the first table ``top --once`` printed."""
    line = next(line for line in table.splitlines() if re.search(r"┃ +pid ┃", line))
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def test_top_shows_the_flow_columns_only_where_a_process_has_them(
    budget: BudgetDriver, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(16)
    publisher(state).write()
    assert main(["top", "--once"]) == 0
    plain = capsys.readouterr().out
    assert _header(plain) == [
        *("pid", "command", "cache", "reserved", "committed", "physical", "asleep"),
        *("claimed", "wanted"),
    ]
    cache.block_use = (12, 4)
    ledger.set_floor_and_cap(10 * MiB, 12 * MiB)
    publisher(state).write()

    def look() -> str:
        assert main(["top", "--once"]) == 0
        return capsys.readouterr().out

    table = _wanting(ledger, 6 * MiB, look, lambda out: "wanted 6.00 MiB" in out)  # past the cap
    assert _header(table) == [
        *("pid", "command", "cache", "reserved", "committed", "physical"),
        *("in use", "cached", "asleep", "claimed", "wanted", "floor", "cap"),
    ]
    row = next(line for line in table.splitlines() if f"│ {os.getpid()} │" in line)
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    per_block = cache.bytes_per_block
    assert cells[6:] == [
        f"{12 * per_block / MiB:.2f} MiB",  # in use: 6.00 MiB
        f"{4 * per_block / MiB:.2f} MiB",
        "no",
        "8.00 MiB",
        "6.00 MiB",
        "10.0 MiB",
        "12.0 MiB",
    ]
    assert re.search(r"claimed 8.00 MiB, no limit, wanted 6.00 MiB", table), "the title's sum"
    ledger.set_floor_and_cap(0, None)
    ledger.claim(6 * MiB)  # a want met: how long it waited shows
    assert main(["top", "--once"]) == 0
    assert "waited" in _header(capsys.readouterr().out)
    ledger.give_back(6 * MiB)
    cache.free()


# -- floors and caps from the command line, on a child ----------------------------------

CHILD = """
    import sys
    from extensible_kv import ExtensibleTensor, KVCacheBuffers, waiting_for_budget
    from extensible_kv.budget import state_dir
    from extensible_kv.budget.publish import publisher
    block = 256 << 10
    tensor = ExtensibleTensor(64 * block * 2, "cpu", num_segments=2)
    cache = KVCacheBuffers([(tensor, block)], 64)
    cache.commit(16)
    cache.block_use = (10, 4)
    publisher(state_dir()).write()
    print("ready", cache.physical_bytes, cache.bytes_per_block, flush=True)
    sys.stdin.readline()
    print("growing", flush=True)
    with waiting_for_budget(60):
        cache.commit(48)
    cache.block_use = (40, 8)
    publisher(state_dir()).write()
    print("grown", cache.physical_bytes, flush=True)
    sys.stdin.readline()
"""


class Child:
    """A Python child in the test's state directory, told to go on by a
    line on stdin, answering line by line on stdout."""

    def __init__(self, code: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def expect(self, word: str) -> list[int]:
        """The numbers on the child's next line, which must start with ``word``."""
        try:
            line = self.lines.get(timeout=PATIENCE_S).split()
        except queue.Empty:
            raise AssertionError(f"the child said nothing for {PATIENCE_S} s") from None
        assert line[:1] == [word], f"expected {word!r} from the child, got {line!r}"
        return [int(value) for value in line[1:]]

    def go_on(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(PATIENCE_S)


@pytest.fixture
def child(state: Path) -> Iterator[Child]:
    made = Child(CHILD)
    yield made
    made.stop()


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_a_childs_flow_and_its_floor_and_cap_set_from_the_command_line(
    state: Path, child: Child, capsys: pytest.CaptureFixture[str]
) -> None:
    physical, per_block = child.expect("ready")
    assert physical == 8 * MiB
    pid = str(child.pid)
    _until(lambda: (_process(state, child.pid) or {}).get("in_use_bytes") is not None, "it")
    seen = _process(state, child.pid)
    assert seen is not None
    assert (seen["claimed_bytes"], seen["in_use_bytes"], seen["cached_bytes"]) == (
        8 * MiB,
        10 * per_block,
        4 * per_block,
    )
    _cli(["limit", "cpu", "64MiB"], capsys)
    written = json.loads(
        _cli(["limit", "cpu", "--pid", pid, "--floor", "4MiB", "--cap", "12MiB", "--json"], capsys)
    )
    assert written == {
        "device": UUID,
        "type": "cpu",
        "revision": 2,
        "pid": child.pid,
        "claimed_bytes": 8 * MiB,
        "floor_bytes": 4 * MiB,
        "cap_bytes": 12 * MiB,
    }
    listing = json.loads(_cli(["limit", "--json"], capsys))
    assert listing == [
        {
            "device": UUID,
            "type": "cpu",
            "limit_bytes": 64 * MiB,
            "revision": 2,
            "claimed_bytes": 8 * MiB,
            "processes": [
                {
                    "pid": child.pid,
                    "claimed_bytes": 8 * MiB,
                    "floor_bytes": 4 * MiB,
                    "cap_bytes": 12 * MiB,
                }
            ],
        }
    ]
    table = _cli(["limit"], capsys)
    assert "floors and caps" in table
    assert re.search(rf"│ {pid} │.*│ 8.00 MiB │ 4.00 MiB │ 12.0 MiB │", table), table

    # The child grows past its cap: it waits, and wants what it asked.
    child.go_on()
    child.expect("growing")
    _until(lambda: (_process(state, child.pid) or {}).get("wanted_bytes") == 16 * MiB, "a want")
    top = _cli(["top", "--once"], capsys)
    assert "wanted 16.0 MiB" in top
    # Lifting the cap keeps the floor; the wait ends, and the want is met.
    text = _cli(["limit", "cpu", "--pid", pid, "--cap", "none"], capsys)
    assert f"pid {pid} floor 4.00 MiB, cap none, revision 3" in text
    (grown,) = child.expect("grown")
    assert grown == 24 * MiB
    seen = _process(state, child.pid)
    assert seen is not None
    assert (seen["claimed_bytes"], seen["wanted_bytes"]) == (24 * MiB, 0)
    assert (seen["floor_bytes"], seen["cap_bytes"]) == (4 * MiB, None)
    assert isinstance(seen["waited_s"], float)
    assert 0 < seen["waited_s"] < PATIENCE_S
    _until(lambda: (_process(state, child.pid) or {}).get("in_use_bytes") == 40 * per_block, "")
    # A cap given alone keeps the floor; a floor of 0 removes it, keeping the cap.
    _cli(["limit", "cpu", "--pid", pid, "--cap", "32MiB"], capsys)
    _cli(["limit", "cpu", "--pid", pid, "--floor", "0"], capsys)
    seen = _process(state, child.pid)
    assert seen is not None
    assert (seen["floor_bytes"], seen["cap_bytes"]) == (0, 32 * MiB)
    _cli(["limit", "cpu", "--pid", pid, "--cap", "none"], capsys)
    listing = json.loads(_cli(["limit", "--json"], capsys))
    assert "processes" not in listing[0]  # none has a floor or a cap now
    assert "floors and caps" not in _cli(["limit"], capsys)
    child.stop()
    _until(lambda: _process(state, child.pid) is None, "the dead child go")


def test_set_floor_and_cap_keeps_what_is_not_given(budget: BudgetDriver, state: Path) -> None:
    ledger = budget.ledger(0)
    ledger.claim(2 * MiB)
    me = os.getpid()
    written = set_floor_and_cap("cpu", me, floor="1MiB", cap=8 * MiB)
    assert (written.floor_bytes, written.cap_bytes) == (MiB, 8 * MiB)
    kept = set_floor_and_cap("cpu", me, floor="3MiB")
    assert (kept.floor_bytes, kept.cap_bytes, kept.revision) == (3 * MiB, 8 * MiB, 2)
    kept = set_floor_and_cap(UUID, me, floor=KEEP, cap="none")
    assert (kept.floor_bytes, kept.cap_bytes) == (3 * MiB, None)
    seen = _process(state, me)
    assert seen is not None
    assert (seen["floor_bytes"], seen["cap_bytes"]) == (3 * MiB, None)
    with pytest.raises(ValueError, match="a cap must be at least 1 byte"):
        set_floor_and_cap("cpu", me, cap=0)
    with pytest.raises(TypeError, match="pid must be an int"):
        set_floor_and_cap("cpu", str(me), floor=0)  # type: ignore[arg-type]
    ledger.set_floor_and_cap(0, None)
    ledger.give_back(2 * MiB)


# -- bad input ---------------------------------------------------------------------------

USAGE_ERRORS = [
    ("cpu --floor 1MiB", "--floor and --cap need --pid PID"),
    ("cpu --pid {pid}", "give --floor SIZE, --cap SIZE or both"),
    ("--pid {pid} --floor 1MiB", "give the DEVICE"),
    ("cpu 8MiB --pid {pid} --floor 1MiB", "not both"),
    ("cpu --pid {pid} --cap 0", "argument --cap: a cap must be at least 1 byte, got '0'"),
    ("cpu --pid {pid} --cap 0MiB", "give none for no cap"),
    ("cpu --pid {pid} --floor 1.5B", "argument --floor: '1.5B' is not a whole number"),
    ("cpu --pid {pid} --floor lots", "argument --floor: cannot read the size 'lots'"),
    ("cpu --pid {pid} --cap 150%", "a percentage must be above 0 and at most 100"),
    ("cpu --pid 0 --floor 1MiB", "argument --pid: must be at least 1, got 0"),
    ("cpu --pid me --floor 1MiB", "argument --pid: 'me' is not a whole number"),
    ("gpu --pid {pid} --floor 1MiB", "argument DEVICE:"),
]


@pytest.mark.parametrize(("command", "message"), USAGE_ERRORS)
def test_a_usage_mistake_is_one_argparse_line(
    state: Path, command: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["limit", *command.format(pid=os.getpid()).split()])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("extensible-kv limit: error:"), last
    assert message in last
    assert not list((state / "devices").glob("*.ledger")), "nothing is written"


def test_a_refusal_is_one_line_and_writes_nothing(
    budget: BudgetDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = budget.ledger(0)
    ledger.claim(2 * MiB)
    pid = str(os.getpid())
    _cli(["limit", "cpu", "16MiB"], capsys)
    _cli(["limit", "cpu", "--pid", pid, "--floor", "4MiB", "--cap", "8MiB"], capsys)
    before = ledger.read()
    for argv, message in (
        (["--pid", pid, "--floor", "10MiB"], "is above the cap of 8.00 MiB"),
        (["--pid", pid, "--floor", "20MiB", "--cap", "none"], "would pass the limit"),
        (["--pid", str(os.getppid()), "--floor", "1MiB"], "holds no slot"),
        (["--pid", pid, "--cap", "9MiB", "--revision", "1"], "is at revision 2, not 1"),
        (["1MiB"], "is below the floors its processes hold together"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["limit", "cpu", *argv])
        assert exited.value.code == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("extensible-kv limit: error:")
        assert message in err
        assert ledger.read() == before
    _cli(["limit", "cpu", "--pid", pid, "--floor", "0", "--cap", "none", "--revision", "2"], capsys)
    ledger.give_back(2 * MiB)


# -- the Prometheus gauges ------------------------------------------------------------------


def _gauge(text: str, name: str, **labels: object) -> list[float]:
    """The values of gauge ``name`` with ``labels`` in Prometheus' ``text``."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            found.append(float(line.rsplit(" ", 1)[1]))
    return found


def test_the_gauges_carry_the_flow(budget: BudgetDriver, state: Path) -> None:
    pytest.importorskip("prometheus_client")
    pytest.importorskip("vllm")
    from extensible_kv.integrations.vllm.endpoints import metrics_text

    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(16)
    cache.block_use = (6, 2)
    lone = ExtensibleTensor(8 * MiB, "cpu", driver=budget)
    lone.resize_(2 * MiB)
    ledger.set_floor_and_cap(12 * MiB, 16 * MiB)
    publisher(state).write()
    pid = os.getpid()
    text = _wanting(
        ledger,
        8 * MiB,
        lambda: metrics_text(snapshot(state)).decode(),
        lambda found: _gauge(found, "extensible_kv_process_wanted_bytes", pid=pid) != [0],
    )
    per_block = cache.bytes_per_block
    assert _gauge(text, "extensible_kv_process_claimed_bytes", pid=pid) == [10 * MiB]
    assert _gauge(text, "extensible_kv_process_wanted_bytes", pid=pid) == [8 * MiB]
    assert _gauge(text, "extensible_kv_process_floor_bytes", pid=pid) == [12 * MiB]
    assert _gauge(text, "extensible_kv_process_cap_bytes", pid=pid) == [16 * MiB]
    assert _gauge(text, "extensible_kv_process_waited_seconds", pid=pid) == []  # none met yet
    (wanting,) = _gauge(text, "extensible_kv_process_wanting_seconds", pid=pid)
    assert 0 <= wanting < PATIENCE_S  # the want stands
    # In use and cached: the KV cache's, not the lone tensor's (it counts no blocks).
    assert _gauge(text, "extensible_kv_cache_in_use_bytes", pid=pid) == [6 * per_block]
    cached = _gauge(text, "extensible_kv_cache_cached_bytes", pid=pid, kind="KVCacheBuffers")
    assert cached == [2 * per_block]
    assert len(_gauge(text, "extensible_kv_cache_physical_bytes", pid=pid)) == 2
    ledger.set_floor_and_cap(0, None)
    text = metrics_text(snapshot(state)).decode()
    assert _gauge(text, "extensible_kv_process_cap_bytes", pid=pid) == []
    assert _gauge(text, "extensible_kv_process_floor_bytes", pid=pid) == [0]
    ledger.claim(8 * MiB)  # the want met: no longer standing
    text = metrics_text(snapshot(state)).decode()
    assert _gauge(text, "extensible_kv_process_wanting_seconds", pid=pid) == []
    cache.free()
    lone.free()
