"""The budget across real processes on the host backend: racing processes
stay under the limit together, a killed holder's claim comes back, waits
see another process's release, the no-limit path takes no lock, and
``extensible-kv top`` shows every process."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import queue
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from extensible_kv import (
    BudgetDriver,
    BudgetExceededError,
    ExtensibleTensor,
    KVCacheBuffers,
    waiting_for_budget,
)
from extensible_kv.budget import Ledger, Limit, snapshot
from extensible_kv.cli import main
from extensible_kv.driver import DriverAdaptor, backend

MiB = 1 << 20
UUID = backend("cpu").device_uuid(0)
#: Seconds a child may take to reach a point it reports.
PATIENCE_S = 60


class Child:
    """A Python child sharing the test's state directory, told what to do
    line by line on stdin, answering line by line on stdout."""

    def __init__(self, state: Path, code: str) -> None:
        env = os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(state)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        # Lines are read on a thread: a select on the pipe would miss a line
        # that an earlier readline already took into the file's buffer.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def expect(self, word: str) -> str:
        """The child's next line, which must start with ``word``."""
        try:
            line = self.lines.get(timeout=PATIENCE_S).strip()
        except queue.Empty:
            raise AssertionError(f"the child said nothing for {PATIENCE_S} s") from None
        assert line.startswith(word), f"expected {word!r} from the child, got {line!r}"
        return line[len(word) :].strip()

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(PATIENCE_S)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        if child.process.poll() is None:
            child.kill()


def _ledger(state: Path) -> Ledger:
    return Ledger(state, UUID)


HOLDER = """
    import sys
    from extensible_kv import ExtensibleTensor
    tensor = ExtensibleTensor(256 << 20, "cpu", chunk_bytes=2 << 20)
    for line in sys.stdin:
        verb, *arg = line.split()
        if verb == "commit":
            tensor.resize_per_segment_(int(arg[0]) << 20)
        elif verb == "shrink":
            tensor.shrink_per_segment_(int(arg[0]) << 20)
        elif verb == "free":
            tensor.free()
        print("done", tensor.physical_bytes, flush=True)
"""


def test_racing_processes_never_claim_more_than_the_limit_together(state: Path) -> None:
    limit = 24 * MiB
    _ledger(state).set_limit(limit)
    racer = """
        import json, random, sys
        from extensible_kv import BudgetExceededError, ExtensibleTensor, get_driver
        rng = random.Random(int(sys.argv[1]))
        tensor = ExtensibleTensor(64 << 20, "cpu", chunk_bytes=2 << 20)
        ledger = get_driver("cpu").ledger(0)
        granted = refused = mismatched = 0
        print("ready", flush=True)
        sys.stdin.readline()  # all start together
        for _ in range(300):
            target = rng.randrange(0, 17) << 20
            try:
                if target >= tensor.num_bytes:
                    tensor.resize_per_segment_(target)
                else:
                    tensor.shrink_per_segment_(target)
                granted += 1
            except BudgetExceededError:
                refused += 1
            mismatched += ledger.held != tensor.physical_bytes
        tensor.free()
        print(json.dumps([granted, refused, mismatched, ledger.held]), flush=True)
    """
    env = os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(state)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(racer), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed in range(4)
    ]
    for racer_process in racers:
        assert racer_process.stdout is not None
        assert racer_process.stdout.readline().strip() == "ready"
    for racer_process in racers:
        assert racer_process.stdin is not None
        racer_process.stdin.write("go\n")
        racer_process.stdin.flush()
    ledger = _ledger(state)
    highest = 0
    while any(r.poll() is None for r in racers):
        highest = max(highest, ledger.read().claimed_bytes)  # read under the ledger's lock
        time.sleep(0.001)
    outputs = [r.communicate(timeout=PATIENCE_S) for r in racers]
    assert [r.returncode for r in racers] == [0] * 4, [err[-2000:] for _, err in outputs]
    results = [json.loads(out) for out, _ in outputs]
    assert highest <= limit, results
    assert sum(refused for _, refused, _, _ in results) > 0, f"no contention: {results}"
    assert all(granted > 0 for granted, _, _, _ in results), results
    assert [(mismatched, held) for _, _, mismatched, held in results] == [(0, 0)] * 4
    assert ledger.read().claimed_bytes == 0


def test_a_holder_killed_in_the_middle_of_a_commit_gives_its_claim_back(
    state: Path, children: list[Child]
) -> None:
    ledger = _ledger(state)
    ledger.set_limit(64 * MiB)
    child = Child(
        state,
        """
        import sys, time
        from extensible_kv import BudgetDriver, ExtensibleTensor
        from extensible_kv.driver import DriverAdaptor, backend

        class StallOnThirdCreate(DriverAdaptor):
            # Test adaptor under the budget: the third create never returns,
            # so the test can kill the process between a claim and its memory.
            made = 0
            def create(self, size, device, shareable):
                self.made += 1
                if self.made == 3:
                    print("stalled", flush=True)
                    time.sleep(600)
                return self.inner.create(size, device, shareable)

        driver = BudgetDriver(StallOnThirdCreate(backend("cpu")))
        tensor = ExtensibleTensor(64 << 20, "cpu", driver=driver, chunk_bytes=8 << 20)
        tensor.resize_(16 << 20)
        print("holding", tensor.physical_bytes, flush=True)
        tensor.resize_(40 << 20)
        """,
    )
    children.append(child)
    assert child.expect("holding") == str(16 * MiB)
    child.expect("stalled")
    claims = {p.pid: claimed for p, claimed in ledger.read().claims.items()}
    # 16 MiB mapped, and the growth's 24 MiB claimed at once, of which 8 MiB is being made.
    assert claims == {child.pid: 40 * MiB}
    ledger.set_limit(48 * MiB)
    mine = ExtensibleTensor(64 * MiB, "cpu", driver=BudgetDriver(backend("cpu"), state_dir=state))
    with pytest.raises(BudgetExceededError, match=f"pid {child.pid}"):
        mine.resize_(32 * MiB)
    os.kill(child.pid, signal.SIGKILL)
    child.process.wait(PATIENCE_S)
    mine.resize_(32 * MiB)  # the dead child's 40 MiB came back
    assert {p.pid for p in ledger.read().claims} == {os.getpid()}
    assert not list((state / "procs").glob(f"{child.pid}-*"))
    mine.free()


def test_a_parent_killed_while_its_forked_child_lives_gives_its_claim_back(
    state: Path, children: list[Child]
) -> None:
    child = Child(
        state,
        """
        import os, sys, time
        from extensible_kv import ExtensibleTensor
        tensor = ExtensibleTensor(64 << 20, "cpu")
        tensor.resize_(8 << 20)
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(600)  # holds every descriptor the parent had at the fork
            os._exit(0)
        print("forked", grandchild, flush=True)
        time.sleep(600)
        """,
    )
    children.append(child)
    grandchild = int(child.expect("forked"))
    try:
        ledger = _ledger(state)
        assert {p.pid: c for p, c in ledger.read().claims.items()} == {child.pid: 8 * MiB}
        os.kill(child.pid, signal.SIGKILL)
        child.process.wait(PATIENCE_S)
        assert ledger.read().claims == {}
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_a_wake_waits_for_another_processs_sleep(state: Path, children: list[Child]) -> None:
    child = Child(state, HOLDER)
    children.append(child)
    child.tell("commit 16")
    assert child.expect("done") == str(16 * MiB)
    ledger = _ledger(state)
    ledger.set_limit(24 * MiB)
    mine = ExtensibleTensor(64 * MiB, "cpu", driver=BudgetDriver(backend("cpu"), state_dir=state))
    with pytest.raises(BudgetExceededError) as refused:
        mine.resize_(16 * MiB)
    assert [pid for pid, _, _ in refused.value.holders] == [child.pid]
    assert refused.value.holders[0][2].startswith(f"{sys.executable} -c")

    def wake() -> None:
        with waiting_for_budget(PATIENCE_S):  # per thread
            mine.resize_(16 * MiB)

    waiting = threading.Thread(target=wake)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive()
    # A waiting commit holds nothing: its whole 16 MiB is claimed at once.
    claims = {p.pid: c for p, c in ledger.read().claims.items()}
    assert claims == {child.pid: 16 * MiB, os.getpid(): 0}
    child.tell("free")
    waiting.join(PATIENCE_S)
    assert not waiting.is_alive()
    assert child.expect("done") == "0"
    assert mine.physical_bytes == 16 * MiB
    mine.free()


def test_without_a_limit_a_commit_takes_no_lock_and_with_one_it_does(
    state: Path, children: list[Child]
) -> None:
    ledger = _ledger(state)
    locker = Child(
        state,
        f"""
        import fcntl, os, sys
        fd = os.open({str(ledger.path)!r}, os.O_RDWR)
        for line in sys.stdin:
            fcntl.flock(fd, fcntl.LOCK_EX if line.strip() == "lock" else fcntl.LOCK_UN)
            print("done", flush=True)
        """,
    )
    children.append(locker)
    mine = ExtensibleTensor(64 * MiB, "cpu", driver=BudgetDriver(backend("cpu"), state_dir=state))
    mine.resize_(2 * MiB)  # takes this process's slot, which locks once

    def grow(to: int) -> threading.Thread:
        thread = threading.Thread(target=mine.resize_, args=(to,))
        thread.start()
        thread.join(5)
        return thread

    locker.tell("lock")
    locker.expect("done")
    assert not grow(8 * MiB).is_alive()  # no limit: done while another process holds the lock
    locker.tell("unlock")
    locker.expect("done")
    ledger.set_limit(64 * MiB)
    locker.tell("lock")
    locker.expect("done")
    blocked = grow(16 * MiB)
    assert blocked.is_alive()  # a claim under a limit waits for the ledger's lock
    locker.tell("unlock")
    blocked.join(PATIENCE_S)
    assert not blocked.is_alive()
    assert mine.physical_bytes == 16 * MiB
    mine.free()


def _top(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["top", "--once", "--json"]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def _process(document: dict[str, object], pid: int) -> dict[str, object] | None:
    for device in document["devices"]:  # type: ignore[attr-defined]
        for process in device["processes"]:
            if process["pid"] == pid:
                return dict(process)
    return None


def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


def test_top_shows_every_process_and_forgets_the_dead(
    state: Path, children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    cache_child = Child(
        state,
        """
        import sys
        from extensible_kv import ExtensibleTensor, KVCacheBuffers
        block = 256 << 10
        tensor = ExtensibleTensor(64 * block * 2, "cpu", num_segments=2)
        cache = KVCacheBuffers([(tensor, block)], 64)
        cache.commit(16)
        print("ready", cache.physical_bytes, flush=True)
        sys.stdin.readline()
        cache.release_physical()
        print("asleep", flush=True)
        sys.stdin.readline()
        """,
    )
    children.append(cache_child)
    physical = int(cache_child.expect("ready"))

    def cache_of_child() -> dict[str, object] | None:
        process = _process(_top(capsys), cache_child.pid)
        if process is None or not process["caches"]:
            return None
        (cache,) = process["caches"]  # type: ignore[misc]
        return dict(cache, claimed=process["claimed_bytes"], command=process["command"])

    _until(lambda: (cache_of_child() or {}).get("physical_bytes") == physical, "the cache")
    seen = cache_of_child()
    assert seen is not None
    assert (seen["kind"], seen["asleep"], seen["claimed"]) == ("KVCacheBuffers", False, physical)
    assert "KVCacheBuffers" in str(seen["command"])
    document = _top(capsys)
    assert document["schema_version"] == 1
    (device,) = document["devices"]  # type: ignore[misc]
    assert set(device) >= {"device", "limit_bytes", "claimed_bytes", "processes"}
    assert device["limit_bytes"] is None
    cache_child.tell("sleep")
    cache_child.expect("asleep")
    _until(lambda: (cache_of_child() or {}).get("asleep") is True, "the sleep")
    assert (cache_of_child() or {})["claimed"] == 0
    cache_child.kill()
    _until(lambda: _process(_top(capsys), cache_child.pid) is None, "the dead process go")
    assert not list((state / "procs").glob(f"{cache_child.pid}-*"))


def test_the_live_view_refreshes_and_quits_on_q(state: Path) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: top on a terminal
        os.execv(sys.executable, [sys.executable, "-m", "extensible_kv.cli", "top"])
    seen = b""
    try:
        deadline = time.monotonic() + PATIENCE_S
        while seen.count(b"q quits") < 2:  # the header, drawn at least twice
            assert time.monotonic() < deadline, f"top drew {seen!r}"
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                seen += os.read(fd, 65536)
        os.write(fd, b"q")
        deadline = time.monotonic() + PATIENCE_S
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "top did not quit on q"
            with_output, _, _ = select.select([fd], [], [], 0.1)
            if with_output:
                with contextlib.suppress(OSError):
                    os.read(fd, 65536)
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.close(fd)


#: A process with a cache of ``BLOCK``-byte blocks, two buffers of two
#: segments (as a K/V-split model of two layers), on a budget over a test
#: adaptor at the driver boundary that can stop it at a create.
PAUSABLE = """
    import sys
    from extensible_kv import (
        BudgetDriver, BudgetExceededError, ExtensibleTensor, KVCacheBuffers, waiting_for_budget,
    )
    from extensible_kv.driver import DriverAdaptor, backend

    BLOCK = 256 << 10

    class PauseAtCreate(DriverAdaptor):
        # Stops at its next create once armed (a driver slow to create),
        # says so, and goes on when told.
        armed = False

        def create(self, size, device, shareable):
            if self.armed:
                self.armed = False
                print("creating", flush=True)
                assert sys.stdin.readline().strip() == "go"
            return self.inner.create(size, device, shareable)

    pause = PauseAtCreate(backend("cpu"))
    budget = BudgetDriver(pause)
    tensors = [
        ExtensibleTensor(64 * BLOCK * 2, "cpu", num_segments=2, driver=budget) for _ in range(2)
    ]
    cache = KVCacheBuffers([(t, BLOCK) for t in tensors], 64)
    views = [t.segment(s) for t in tensors for s in range(2)]

    def intact(blocks):
        return all(bool((v[: blocks * BLOCK] == i + 1).all()) for i, v in enumerate(views))

    print("ready", flush=True)
    for line in sys.stdin:
        verb, *args = line.split()
        try:
            if verb == "commit":
                cache.commit(int(args[0]))
                for i, view in enumerate(views):
                    view[: int(args[0]) * BLOCK].fill_(i + 1)
            elif verb == "sleep":
                cache.release_physical(preserve=True)
            elif verb == "wake":
                pause.armed = True
                with waiting_for_budget(float(args[0])):
                    cache.recommit()
                print("intact", intact(cache.num_blocks_committed), flush=True)
            print("done", cache.physical_bytes, flush=True)
        except BudgetExceededError:
            print("refused", flush=True)
"""

#: A process that commits when told, waiting for the budget as told.
CLAIMER = """
    import sys
    from extensible_kv import BudgetExceededError, ExtensibleTensor, waiting_for_budget

    tensor = ExtensibleTensor(256 << 20, "cpu")
    print("ready", flush=True)
    for line in sys.stdin:
        mib, wait_s = line.split()
        try:
            with waiting_for_budget(float(wait_s)):
                tensor.resize_per_segment_(int(mib) << 20)
            print("done", tensor.physical_bytes, flush=True)
        except BudgetExceededError:
            print("refused", flush=True)
"""


class _BeforeCreate(DriverAdaptor):
    """Test adaptor below the budget, at the driver boundary: runs
    ``before_create`` once, before the next create reaches the driver."""

    before_create: Callable[[], None] | None = None

    def create(self, size: int, device: int, shareable: bool) -> int:
        hook, self.before_create = self.before_create, None
        if hook is not None:
            hook()
        return self.inner.create(size, device, shareable)


def test_a_defragment_cannot_lose_its_room_to_another_process(
    state: Path, children: list[Child]
) -> None:
    # Item 1: a defragmenting commit releases its memory before it creates
    # the new chunks; another process waiting for room must not get it then.
    block = 256 << 10
    hook = _BeforeCreate(backend("cpu"))
    budget = BudgetDriver(hook, state_dir=state)
    tensors = [
        ExtensibleTensor(64 * block * 2, "cpu", num_segments=2, driver=budget) for _ in range(2)
    ]
    cache = KVCacheBuffers([(t, block) for t in tensors], 64)
    cache.commit(8)
    cache.commit(24)  # two chunks per segment: the defragment has work to do
    addresses = cache.base_ptrs
    ledger = _ledger(state)
    ledger.set_limit(24 * MiB)  # exactly what this process holds
    claimer = Child(state, CLAIMER)
    children.append(claimer)
    claimer.expect("ready")
    answers: list[str] = []

    def another_process_claims() -> None:  # the old memory is released by now
        claimer.tell("8 1")
        answers.append(claimer.lines.get(timeout=PATIENCE_S).strip())

    hook.before_create = another_process_claims
    cache.commit(24, defragment=True)
    assert answers == ["refused"]  # the room stayed this commit's
    assert (cache.num_blocks_committed, cache.physical_bytes) == (24, 24 * MiB)
    assert all(len(t.buffer.chunks) == 2 for t in tensors)  # one per segment
    assert cache.base_ptrs == addresses
    assert ledger.read().claimed_bytes == budget.ledger(0).held == 24 * MiB
    committed = [t.segment(s)[: 24 * block] for t in tensors for s in range(2)]
    assert all(bool((view == 0).all()) for view in committed)  # defragmented: zeros
    cache.free()


def test_two_engines_waking_together_do_not_wait_on_each_other(
    state: Path, children: list[Child]
) -> None:
    # Item 3: a preserving wake commits buffer by buffer but claims its whole
    # size at once, so a wake waiting for room holds none of it.
    engines = [Child(state, PAUSABLE) for _ in range(2)]
    children.extend(engines)
    for engine in engines:
        engine.expect("ready")
        engine.tell("commit 16")  # 16 MiB: 4 segments of 4 MiB
        assert engine.expect("done") == str(16 * MiB)
        engine.tell("sleep")
        assert engine.expect("done") == "0"
    ledger = _ledger(state)
    # Asleep, each holds its 16 MiB host copy (host memory, claimed on the
    # host). One wake (16 MiB more) fits; two, or two halves and one more
    # half, do not.
    assert ledger.read().claimed_bytes == 32 * MiB
    ledger.set_limit(52 * MiB)
    first, second = engines
    first.tell(f"wake {PATIENCE_S}")
    first.expect("creating")  # stopped at its first create, its claim made
    second.tell(f"wake {PATIENCE_S}")
    with pytest.raises(queue.Empty):  # it waits for room before creating anything
        second.lines.get(timeout=1.0)
    claims = {p.pid: c for p, c in ledger.read().claims.items()}
    assert claims == {first.pid: 32 * MiB, second.pid: 16 * MiB}  # second: its copy only
    first.tell("go")
    assert first.expect("intact") == "True"
    assert first.expect("done") == str(16 * MiB)
    second.expect("creating")  # the first's copy went back: room for the second
    second.tell("go")
    assert second.expect("intact") == "True"
    assert second.expect("done") == str(16 * MiB)
    assert ledger.read().claimed_bytes == 32 * MiB <= 52 * MiB


def test_a_process_registering_while_top_reads_is_never_taken_for_dead(
    state: Path, children: list[Child]
) -> None:
    child = Child(
        state,
        """
        import fcntl, os, sys
        from extensible_kv import ExtensibleTensor

        locking = fcntl.flock

        def flock_after_a_pause(fd, operation):
            # Test-only hook: stops the child between creating its lock file
            # in procs/ and locking it, until the test says go on.
            if operation == fcntl.LOCK_EX and "/procs/" in os.readlink(f"/proc/self/fd/{fd}"):
                print("paused", flush=True)
                sys.stdin.readline()
            locking(fd, operation)

        fcntl.flock = flock_after_a_pause
        tensor = ExtensibleTensor(64 << 20, "cpu")
        tensor.resize_(8 << 20)
        print("holding", tensor.physical_bytes, flush=True)
        sys.stdin.readline()
        """,
    )
    children.append(child)
    child.expect("paused")
    # Top reads the state directory while the child is between the two
    # steps: it may show the child or not, but must not take it for dead.
    snapshot(state)
    child.tell("go on")
    assert child.expect("holding") == str(8 * MiB)
    claims = {p.pid: claimed for p, claimed in _ledger(state).read().claims.items()}
    assert claims == {child.pid: 8 * MiB}
    assert len(list((state / "procs").glob(f"{child.pid}-*.lock"))) == 1


def test_a_limit_read_between_a_writes_two_stores_waits_for_the_write(
    state: Path, children: list[Child]
) -> None:
    writer = Child(
        state,
        f"""
        import sys
        from extensible_kv.budget import Ledger, state_dir
        from extensible_kv.budget.ledger import _LIMIT

        class PausingHeader:
            # Test-only hook: the ledger's header, which stops the writer after
            # it stores a limit and before it stores the limit's revision.
            def __init__(self, header):
                self.header = header
            def __getitem__(self, index):
                return self.header[index]
            def __setitem__(self, index, value):
                self.header[index] = value
                if index == _LIMIT:
                    print("paused", flush=True)
                    sys.stdin.readline()

        ledger = Ledger(state_dir(), {UUID!r})
        ledger._header = PausingHeader(ledger._header)
        print("wrote", ledger.set_limit(8 << 20).revision, flush=True)
        sys.stdin.readline()
        """,
    )
    children.append(writer)
    ledger = _ledger(state)
    writer.expect("paused")
    seen: list[Limit] = []
    reader = threading.Thread(target=lambda: seen.append(ledger.limit()))
    reader.start()
    reader.join(0.5)  # long enough for a read that does not wait for the write
    writer.tell("go on")
    assert writer.expect("wrote") == "1"
    reader.join(PATIENCE_S)
    assert not reader.is_alive()
    assert seen == [Limit(8 * MiB, 1)]


#: Limits the writer of the next test writes.
LIMIT_WRITES = 30000


def test_a_limit_read_during_writes_is_one_a_write_made(state: Path, children: list[Child]) -> None:
    writer = Child(
        state,
        f"""
        import sys
        from extensible_kv.budget import Ledger, state_dir
        ledger = Ledger(state_dir(), {UUID!r})
        print("ready", flush=True)
        sys.stdin.readline()
        # Each write's bytes tell its revision, so a reader can check a pair.
        written = ledger.set_limit(4096)
        for _ in range({LIMIT_WRITES}):
            written = ledger.set_limit(
                (written.revision + 1) * 4096, expect_revision=written.revision
            )
        """,
    )
    children.append(writer)
    ledger = _ledger(state)
    writer.expect("ready")
    writer.tell("go")
    seen: list[Limit] = []
    deadline = time.monotonic() + PATIENCE_S
    while writer.process.poll() is None:
        assert time.monotonic() < deadline, "the writer did not finish"
        seen.extend(ledger.limit() for _ in range(1000))
    assert writer.process.returncode == 0
    made = {Limit(None, 0)} | {Limit(r * 4096, r) for r in range(1, LIMIT_WRITES + 2)}
    assert any(1 < limit.revision < LIMIT_WRITES for limit in seen), "no read during the writes"
    assert [limit for limit in seen if limit not in made] == []


def test_a_forked_child_shows_only_its_own_caches(
    state: Path, children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    parent = Child(
        state,
        """
        import os, time
        from extensible_kv import ExtensibleTensor
        tensor = ExtensibleTensor(64 << 20, "cpu")
        tensor.resize_(8 << 20)
        if os.fork() == 0:
            own = ExtensibleTensor(64 << 20, "cpu")
            own.resize_(4 << 20)
            print("made", os.getpid(), flush=True)
        time.sleep(600)
        """,
    )
    children.append(parent)
    child = int(parent.expect("made"))

    def physical_bytes() -> dict[int, list[object]]:
        """Each process's caches' physical bytes, as top shows them."""
        document = _top(capsys)
        shown = {pid: _process(document, pid) or {"caches": []} for pid in (parent.pid, child)}
        return {pid: [c["physical_bytes"] for c in p["caches"]] for pid, p in shown.items()}  # type: ignore[attr-defined]

    try:
        _until(lambda: all(physical_bytes().values()), "both processes' caches")
        assert physical_bytes() == {parent.pid: [8 * MiB], child: [4 * MiB]}
    finally:
        os.kill(child, signal.SIGKILL)
