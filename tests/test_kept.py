"""KV pages that outlive their process (``extensible_kv.kept``): a keeper
process holds what a tensor left it, counted in the budget under its own
pid, until a tensor with the same fingerprint adopts the very pages (no
copy), someone drops them, or its time runs out; killed, it leaves nothing.
Real keeper processes on the host backend's memfd pages."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from extensible_kv import BudgetDriver, ExtensibleTensor, StatisticsDriver
from extensible_kv.budget import Ledger, snapshot
from extensible_kv.cli import main
from extensible_kv.driver import Driver, backend
from extensible_kv.kept import KeptCache, adopt, drop, kept_caches, leave, name, start_keeper
from extensible_kv.kv import KVCacheBuffers
from extensible_kv.kv.growth.elastic import ElasticBlocks, ElasticOrders
from test_growth import fill, reads
from test_kv_buffers import CAPACITY, make_cache

MiB = 1 << 20
GRANULE = 2 * MiB
FINGERPRINT = {"model": "tiny", "block_size": 16}
BLOCKS = [[1, "a1"], [2, "b2"]]


@pytest.fixture
def budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BudgetDriver]:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    yield BudgetDriver(backend("cpu"), state_dir=tmp_path)
    for record in kept_caches():
        drop(record.keeper_pid)


def tensor(budget: Driver, size: int = 16 * MiB, segments: int = 2) -> ExtensibleTensor:
    return ExtensibleTensor(
        size, "cpu", num_segments=segments, shareable=True, chunk_bytes=GRANULE, driver=budget
    )


def pattern(nbytes: int) -> torch.Tensor:
    return torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) ^ 0x5A


def claims(budget: BudgetDriver) -> dict[int, int]:
    ledger = budget.ledger(0)
    return {key.pid: value for key, value in ledger.read().claims.items() if value}


def shown_by_top(pid: int) -> dict[str, Any]:
    """Process ``pid`` as ``extensible-kv top`` shows it, once it has published."""
    deadline = time.monotonic() + 10
    while True:
        (device,) = snapshot(Path(os.environ["EXTENSIBLE_KV_STATE_DIR"]))["devices"]
        shown = [p for p in device["processes"] if p["pid"] == pid]
        if (shown and shown[0]["caches"]) or time.monotonic() > deadline:
            (found,) = shown
            return found
        time.sleep(0.05)


def left_behind(budget: BudgetDriver, keep_s: float = 60) -> KeptCache:
    """A tensor of 8 MiB (4 MiB in each segment) with :func:`pattern`,
    left to a keeper and freed."""
    source = tensor(budget)
    source.resize_per_segment_(4 * MiB)
    for segment in range(2):
        source.segment(segment).copy_(pattern(8 * MiB)[segment * 4 * MiB : (segment + 1) * 4 * MiB])
    record = leave([source], FINGERPRINT, BLOCKS, keep_s)
    source.free()
    return record


def test_pages_outlive_their_tensor_and_are_adopted_in_place_counted_once(
    budget: BudgetDriver,
) -> None:
    record = left_behind(budget)
    assert (record.nbytes, record.blocks, record.fingerprint) == (8 * MiB, BLOCKS, FINGERPRINT)
    assert claims(budget) == {record.keeper_pid: 8 * MiB}  # the keeper's, under its pid
    shown = shown_by_top(record.keeper_pid)
    assert "extensible_kv.kept.keeper" in shown["command"]
    (pages,) = shown["caches"]
    assert (pages["kind"], pages["physical_bytes"], pages["blocks"]) == ("kept pages", 8 * MiB, 2)
    (listed,) = kept_caches()
    assert listed == record
    stats = StatisticsDriver(budget)
    target = tensor(stats)
    adopted = adopt([target], FINGERPRINT)
    assert adopted is not None
    assert (adopted.blocks, adopted.nbytes) == (BLOCKS, 8 * MiB)
    calls = stats.calls
    assert (calls["create"].calls, calls["import_handle"].calls) == (0, 4)  # no copy
    assert target.buffer.physical_bytes == 8 * MiB
    for segment in range(2):
        start = segment * target.segment_capacity_bytes
        got = target.full_view()[start : start + 4 * MiB]
        assert torch.equal(got, pattern(8 * MiB)[segment * 4 * MiB : (segment + 1) * 4 * MiB])
    deadline = time.monotonic() + 10
    while kept_caches() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kept_caches() == []
    assert claims(budget) == {os.getpid(): 8 * MiB}  # the adopter's now, once
    target.free()
    assert claims(budget) == {}


def test_another_fingerprint_or_shape_adopts_nothing_and_the_keeper_keeps_the_pages(
    budget: BudgetDriver,
) -> None:
    record = left_behind(budget)
    target = tensor(budget)
    assert adopt([target], {**FINGERPRINT, "block_size": 32}) is None
    other = tensor(budget, size=32 * MiB)
    with pytest.raises(ValueError, match="cannot go into one of"):
        adopt([other], FINGERPRINT)
    assert (target.buffer.physical_bytes, other.buffer.physical_bytes) == (0, 0)
    assert kept_caches() == [record]
    assert claims(budget) == {record.keeper_pid: 8 * MiB}
    assert adopt([target], FINGERPRINT) is not None  # still there for the right one
    target.free()
    other.free()


def test_pages_go_back_when_their_time_runs_out_or_when_dropped(budget: BudgetDriver) -> None:
    timed = left_behind(budget, keep_s=1)
    deadline = time.monotonic() + 20
    while kept_caches() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept_caches() == []
    assert timed.keeper_pid not in claims(budget)
    dropped = left_behind(budget)
    assert drop(dropped.keeper_pid)
    assert kept_caches() == []
    assert claims(budget) == {}
    assert not drop(dropped.keeper_pid)  # gone: nothing to drop


def test_a_killed_keeper_leaves_nothing_held(budget: BudgetDriver, tmp_path: Path) -> None:
    record = left_behind(budget)
    os.kill(record.keeper_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while kept_caches() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept_caches() == []
    ledger = Ledger(tmp_path, budget.device_uuid(0))
    try:
        ledger.claim(0)  # a claim forgets the dead when it must; make it look
        assert record.keeper_pid not in {
            p["pid"] for d in snapshot(tmp_path)["devices"] for p in d["processes"]
        }
    finally:
        ledger.close()
    assert adopt([tensor(budget)], FINGERPRINT) is None


def test_kept_pages_go_back_once_another_process_wants_the_memory(
    budget: BudgetDriver,
) -> None:
    """Under a limit the pages fill, a claim another process waits on posts
    a want; the keeper gives its pages back, and the claim goes through."""
    record = left_behind(budget)
    ledger = budget.ledger(0)
    ledger.set_limit(record.nbytes + 4 * MiB)
    ledger.claim(8 * MiB, timeout_s=20)  # waits for the keeper
    assert kept_caches() == []
    assert claims(budget) == {os.getpid(): 8 * MiB}
    ledger.give_back(8 * MiB)


def test_a_program_that_left_pages_ends_for_whoever_reads_its_output(
    budget: BudgetDriver,
) -> None:
    """The keeper outlives its starter but holds none of its output: a
    parent reading the program's stdout and stderr to their end (a shell's
    ``| tee``, ``subprocess.run``) sees them end with the program."""
    script = (
        "from extensible_kv import ExtensibleTensor\n"
        "from extensible_kv.kept import leave\n"
        "t = ExtensibleTensor(16 << 20, 'cpu', num_segments=2, shareable=True,"
        " chunk_bytes=2 << 20)\n"
        "t.resize_per_segment_(4 << 20)\n"
        "print(leave([t], {'model': 'x'}, [[1, 'a']], 120).keeper_pid)\n"
    )
    ended = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 0, ended.stderr
    (record,) = kept_caches()  # the pages outlive the program
    assert record.keeper_pid == int(ended.stdout)


def test_the_cli_lists_the_kept_pages_and_drops_them(
    budget: BudgetDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    record = left_behind(budget)
    assert main(["kept", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["keeper_pid"], listed["nbytes"], listed["fingerprint"]) == (
        record.keeper_pid,
        8 * MiB,
        FINGERPRINT,
    )
    assert main(["kept"]) == 0
    assert str(record.keeper_pid) in capsys.readouterr().out
    assert main(["kept", "--drop", str(record.keeper_pid)]) == 0
    assert kept_caches() == []
    with pytest.raises(SystemExit) as exited:
        main(["kept", "--drop", str(record.keeper_pid)])
    assert exited.value.code == 1
    assert f"no keeper with pid {record.keeper_pid} holds pages" in capsys.readouterr().err


def test_bad_input_is_refused_before_any_keeper_starts(budget: BudgetDriver) -> None:
    plain = ExtensibleTensor(4 * MiB, "cpu", chunk_bytes=GRANULE, driver=budget)
    plain.resize_(2 * MiB)
    shared = tensor(budget)
    shared.resize_per_segment_(2 * MiB)
    with pytest.raises(ValueError, match="shareable=True"):
        leave([plain], FINGERPRINT, BLOCKS, 60)
    with pytest.raises(ValueError, match="keep_s must be a positive, finite number"):
        leave([shared], FINGERPRINT, BLOCKS, 0)
    with pytest.raises(ValueError, match="must be JSON"):
        leave([shared], {"model": object()}, BLOCKS, 60)
    assert kept_caches() == []
    plain.free()
    shared.free()


def test_pages_left_unnamed_are_adopted_only_once_named_by_their_owner(
    budget: BudgetDriver,
) -> None:
    """An engine's worker leaves the pages as it stops; its scheduler, which
    knows what they hold, names them after: until then nobody adopts them."""
    source = tensor(budget)
    source.resize_per_segment_(2 * MiB)
    record = leave([source], FINGERPRINT, None, 60, owner={"engine": "e1", "rank": 0})
    source.free()
    (listed,) = kept_caches()
    assert (listed.blocks, listed.owner) == (None, {"engine": "e1", "rank": 0})
    target = tensor(budget)
    assert adopt([target], FINGERPRINT) is None
    assert target.buffer.physical_bytes == 0
    assert name(listed, BLOCKS)
    assert not name(listed, [[9, "z"]])  # named once
    (named,) = kept_caches()
    assert named.blocks == BLOCKS
    adopted = adopt([target], FINGERPRINT)
    assert adopted is not None
    assert adopted.blocks == BLOCKS
    assert not name(record, BLOCKS)  # the keeper has gone
    target.free()


def until_true(done: Any, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_pages_left_unnamed_go_back_once_the_process_to_name_them_exits_first(
    budget: BudgetDriver,
) -> None:
    """The engine whose scheduler names the pages killed before it did (a
    server's second signal as it stops): nobody else can name them, so
    they go back at once, not after ``keep_s``. Named, they outlive it."""
    source = tensor(budget)
    source.resize_per_segment_(2 * MiB)
    namer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leave([source], FINGERPRINT, None, 600, namer_pid=namer.pid)
        (unnamed,) = kept_caches()
        namer.kill()
        namer.wait(10)
        until_true(lambda: not kept_caches(), "unnamed pages outlived their namer")
        until_true(lambda: unnamed.keeper_pid not in claims(budget), "unnamed pages claimed")
        namer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        leave([source], FINGERPRINT, None, 600, namer_pid=namer.pid)
        (listed,) = kept_caches()
        assert name(listed, BLOCKS)
        namer.kill()
        namer.wait(10)
        time.sleep(0.5)  # the keeper looks every 0.25 s
        assert [record.blocks for record in kept_caches()] == [BLOCKS]
        drop(listed.keeper_pid)
        # A namer gone already: the keeper gives the pages back at its first
        # look, maybe before the leaver finds its record ("gone already").
        with contextlib.suppress(RuntimeError):
            leave([source], FINGERPRINT, None, 600, namer_pid=namer.pid)
        until_true(lambda: not kept_caches(), "pages left to a namer gone already stayed")
    finally:
        namer.kill()
        namer.wait(10)
        source.free()


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_a_keeper_started_ahead_takes_pages_at_once_or_exits_with_none(
    budget: BudgetDriver,
) -> None:
    """An engine starts its keeper before it must stop: the pages go over a
    socket already open. One that stops without leaving anything lets its
    keeper go, and nothing is held."""
    idle = start_keeper()
    assert not gone(idle.pid)
    idle.close()
    deadline = time.monotonic() + 20
    while not gone(idle.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(idle.pid)
    assert (kept_caches(), claims(budget)) == ([], {})
    spare = start_keeper()
    source = tensor(budget)
    source.resize_per_segment_(2 * MiB)
    record = spare.leave([source], FINGERPRINT, BLOCKS, 60)
    source.free()
    assert record.keeper_pid == spare.pid
    assert claims(budget) == {spare.pid: 4 * MiB}
    with pytest.raises(RuntimeError, match="did not take the pages"):
        spare.leave([tensor(budget)], FINGERPRINT, BLOCKS, 60)  # pages are taken once


def shareable_cache(driver: Driver) -> KVCacheBuffers:
    """test_kv_buffers' cache, shareable, one chunk per granule (for elastic units)."""
    return make_cache("cpu", driver, GRANULE, shareable=True)


def test_an_elastic_cache_adopts_the_units_another_left_with_their_blocks(
    budget: BudgetDriver,
) -> None:
    """An engine's elastic cache leaves its held units; the next one's
    adopts them before start(): held as they were, same bytes, and the
    same orders map nothing more."""
    old = shareable_cache(budget)
    elastic = ElasticBlocks(old, CAPACITY)
    elastic.start()
    held = ((0, 1), (3, 4), (10, 12))
    elastic.apply(ElasticOrders(1, 4, held=held))
    fill(old, 13, 3)
    fill(old, 41, 5)
    leave([t for t, _ in old.tensors], FINGERPRINT, BLOCKS, 60)
    old.free()
    stats = StatisticsDriver(budget)
    new = shareable_cache(stats)
    again = ElasticBlocks(new, CAPACITY)
    with pytest.raises(ValueError, match="are not mapped"):
        again.adopted(held, 4)
    assert again.held_units == ()
    assert adopt([t for t, _ in new.tensors], FINGERPRINT) is not None
    with pytest.raises(ValueError, match="within the 64 blocks"):
        again.adopted(((0, 1), (16, 17)), 4)
    again.adopted(held, 4)
    again.start()
    assert again.held_units == held
    assert (reads(new, 13), reads(new, 41)) == ({3}, {5})
    stats.reset_calls()
    again.apply(ElasticOrders(1, 4, held=held))
    assert stats.calls["create"].calls == 0
    with pytest.raises(ValueError, match="before start"):
        again.adopted(held, 4)
    new.free()
