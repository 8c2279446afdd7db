"""The per-device budget within one process: claims follow every operation,
a refused commit changes nothing, limits are revisioned, and bad input or a
corrupt state directory gives a clean error. The processes' side is in
test_budget_processes.py."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from extensible_kv import (
    BudgetDriver,
    BudgetExceededError,
    ExtensibleTensor,
    KVCacheBuffers,
    OutOfMemoryError,
    PoolingDriver,
    waiting_for_budget,
)
from extensible_kv.budget import (
    Ledger,
    Limit,
    StaleRevisionError,
    StateDirError,
    format_bytes,
    parse_size,
    snapshot,
)
from extensible_kv.budget.publish import publisher
from extensible_kv.cli import main
from extensible_kv.devices import get_driver
from extensible_kv.driver import Driver, DriverAdaptor, backend

MiB = 1 << 20
GRANULE = 2 * MiB
BLOCK = 256 * 1024  # 8 blocks per granule


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def budget(state: Path) -> BudgetDriver:
    return BudgetDriver(backend("cpu"), state_dir=state)


def _cache(driver: object, blocks: int = 64) -> KVCacheBuffers:
    """Two K/V-split layers of ``blocks`` blocks of BLOCK bytes per segment."""
    tensors = [
        ExtensibleTensor(blocks * BLOCK * 2, "cpu", num_segments=2, driver=driver)  # type: ignore[arg-type]
        for _ in range(2)
    ]
    return KVCacheBuffers([(t, BLOCK) for t in tensors], blocks)


def test_claims_follow_commit_trim_sleep_wake_and_free(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    cache = _cache(budget)
    for step in (
        lambda: cache.commit(20),
        lambda: cache.trim(9),
        lambda: cache.release_physical(),
        lambda: cache.recommit(),
        lambda: cache.commit(33),
        lambda: cache.release_physical(preserve=True),
        lambda: cache.recommit(),
    ):
        step()
        assert ledger.held == cache.physical_bytes
    # The preserving sleep's host backup is a cpu tensor on the shared driver,
    # not this one: only the cache's own memory is claimed here.
    assert cache.physical_bytes == 4 * 5 * GRANULE  # 33 blocks: 5 granules per segment
    cache.free()
    assert ledger.held == 0


def test_memory_a_pool_keeps_stays_claimed(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    pool = PoolingDriver(budget)
    tensor = ExtensibleTensor(64 * MiB, "cpu", driver=pool, chunk_bytes=GRANULE)
    tensor.resize_(16 * MiB)
    tensor.shrink_per_segment_(4 * MiB)
    assert pool.idle_bytes == 12 * MiB
    assert ledger.held == tensor.physical_bytes + pool.idle_bytes == 16 * MiB
    tensor.resize_(10 * MiB)  # taken from the pool: nothing more claimed
    assert ledger.held == 16 * MiB
    tensor.release_physical()  # a full release drains the pool
    assert pool.idle_bytes == 0
    assert ledger.held == 0
    tensor.free()


def test_a_refused_commit_leaves_the_cache_as_it_was(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(8)  # one granule per segment: 8 MiB in all
    views = [t.segment(s) for t, _ in cache.buffers for s in range(2)]
    for index, view in enumerate(views):
        view[: 8 * BLOCK].fill_(index + 1)
    ledger.set_limit(12 * MiB)
    before = (cache.num_blocks_committed, cache.physical_bytes, ledger.held, cache.base_ptrs)
    with pytest.raises(BudgetExceededError) as refused:
        cache.commit(24)  # would need 24 MiB
    assert before == (
        cache.num_blocks_committed,
        cache.physical_bytes,
        ledger.held,
        cache.base_ptrs,
    )
    for index, view in enumerate(views):
        assert bool((view[: 8 * BLOCK] == index + 1).all())
    error = refused.value
    assert isinstance(error, OutOfMemoryError)
    assert isinstance(error, torch.OutOfMemoryError)
    assert error.limit_bytes == 12 * MiB
    # The commit claims its whole 16 MiB at once, before any driver call.
    assert error.asked_bytes == 16 * MiB
    assert [(pid, claimed) for pid, claimed, _ in error.holders] == [(os.getpid(), 8 * MiB)]
    assert "12.0 MiB" in str(error)
    assert f"pid {os.getpid()}" in str(error)
    copy = pickle.loads(pickle.dumps(error))  # engines send errors between processes
    assert (type(copy), copy.holders, str(copy)) == (BudgetExceededError, error.holders, str(error))
    ledger.set_limit(None)
    cache.commit(24)
    assert ledger.held == cache.physical_bytes == 24 * MiB
    cache.free()


def test_a_limit_below_the_claims_refuses_only_new_claims(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    tensor = ExtensibleTensor(64 * MiB, "cpu", driver=budget, chunk_bytes=GRANULE)
    tensor.resize_(8 * MiB)
    ledger.set_limit(4 * MiB)
    with pytest.raises(BudgetExceededError):
        tensor.resize_(10 * MiB)
    tensor.shrink_per_segment_(2 * MiB)
    tensor.resize_(4 * MiB)
    assert ledger.held == 4 * MiB
    tensor.free()


def test_waiting_for_budget_waits_until_the_timeout(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    ledger.set_limit(2 * MiB)
    tensor = ExtensibleTensor(64 * MiB, "cpu", driver=budget)
    started = time.monotonic()
    with waiting_for_budget(0.2), pytest.raises(BudgetExceededError):
        tensor.resize_(4 * MiB)
    # The wait's deadline is on this clock, from after `started`: an earlier
    # refusal is one that did not wait.
    assert time.monotonic() >= started + 0.2, "refused before the timeout"
    assert ledger.held == 0
    tensor.resize_(2 * MiB)  # the refused wait left nothing open: what fits is claimed
    assert ledger.held == 2 * MiB
    with pytest.raises(ValueError, match="non-negative"):
        waiting_for_budget(-1).__enter__()
    tensor.free()


def test_a_nested_block_claims_only_what_the_outer_one_lacks(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    ledger.set_limit(8 * MiB)
    with budget.holding(0, 2 * MiB):
        with budget.holding(0, 8 * MiB):  # fits only as the 6 MiB the outer lacks
            assert ledger.held == 8 * MiB
            budget.release(budget.create(8 * MiB, 0, False))  # drawn on the account
            assert ledger.held == 8 * MiB
        with budget.holding(0, 4 * MiB):  # the outer holds 8 MiB already
            assert ledger.held == 8 * MiB
        assert ledger.held == 8 * MiB  # until the outermost block ends
    assert ledger.held == 0


def test_a_nested_blocks_credit_ends_with_the_block(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    ledger.set_limit(8 * MiB)
    full = budget.create(8 * MiB, 0, False)
    with budget.holding(0, 0):
        with budget.holding(0, 0, credit=2 * MiB):
            pass
        with pytest.raises(BudgetExceededError):
            budget.create(2 * MiB, 0, False)
    assert ledger.held == 8 * MiB
    budget.release(full)


@pytest.mark.parametrize(
    ("size", "credit", "error", "message"),
    [
        (-2 * MiB, 0, ValueError, r"size must be between 0 and .* got -2097152"),
        (2.0 * MiB, 0, TypeError, "size must be an int, got float"),
        (True, 0, TypeError, "size must be an int, got bool"),
        (0, -1, ValueError, r"credit must be between 0 and .* got -1"),
        (0, True, TypeError, "credit must be an int, got bool"),
        (0, float("nan"), TypeError, "credit must be an int, got float"),
        (0, 2.0 * MiB, TypeError, "credit must be an int, got float"),
        (0, "2MiB", TypeError, "credit must be an int, got str"),
    ],
)
@pytest.mark.parametrize("limit", [None, 8 * MiB])
def test_a_hold_must_be_whole_bytes(
    budget: BudgetDriver,
    limit: int | None,
    size: object,
    credit: object,
    error: type[Exception],
    message: str,
) -> None:
    ledger = budget.ledger(0)
    ledger.set_limit(limit)
    held = budget.create(4 * MiB, 0, False)
    with pytest.raises(error, match=message), budget.holding(0, size, credit=credit):  # type: ignore[arg-type]
        pass
    assert (ledger.held, ledger.read().claimed_bytes) == (4 * MiB, 4 * MiB)
    with pytest.raises(BudgetExceededError) if limit else contextlib.nullcontext():
        budget.release(budget.create(6 * MiB, 0, False))  # no account left open
    budget.release(held)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        ("5", TypeError, "timeout_s must be a number of seconds .*got str"),
        (True, TypeError, "timeout_s must be a number of seconds .*got bool"),
        (None, TypeError, "timeout_s must be a number of seconds .*got NoneType"),
        (float("nan"), ValueError, "timeout_s must be a non-negative number .*got nan"),
        (-0.5, ValueError, "timeout_s must be a non-negative number .*got -0.5"),
    ],
)
def test_a_wait_must_be_seconds(timeout: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message), waiting_for_budget(timeout):  # type: ignore[arg-type]
        pass


def test_an_infinite_wait_is_taken(budget: BudgetDriver) -> None:
    tensor = ExtensibleTensor(4 * MiB, "cpu", driver=budget)
    with waiting_for_budget(float("inf")):
        tensor.resize_(2 * MiB)  # fits: no wait
    assert budget.ledger(0).held == 2 * MiB
    tensor.free()


def test_stale_revisions_are_refused(state: Path) -> None:
    ledger = Ledger(state, "host-test")
    first = ledger.limit()
    assert (first.bytes, first.revision) == (None, 0)
    second = ledger.set_limit(64 * MiB, expect_revision=0)
    assert (second.bytes, second.revision) == (64 * MiB, 1)
    with pytest.raises(StaleRevisionError, match="revision 1, not 0"):
        ledger.set_limit(8 * MiB, expect_revision=0)
    assert ledger.limit() == second
    assert ledger.set_limit(None).revision == 2
    ledger.close()


@pytest.mark.parametrize(
    ("revision", "error", "message"),
    [
        (True, TypeError, "expect_revision must be an int, got bool"),
        ("1", TypeError, "expect_revision must be an int, got str"),
        (1.0, TypeError, "expect_revision must be an int, got float"),
        (-1, ValueError, "expect_revision must be at least 0, got -1"),
    ],
)
def test_a_revision_must_be_an_int(
    state: Path, revision: object, error: type[Exception], message: str
) -> None:
    from extensible_kv.limits import set_device_limit

    with pytest.raises(error, match=message):
        set_device_limit("cpu", "1GiB", expect_revision=revision)  # type: ignore[arg-type]
    assert list(state.glob("devices/*.ledger")) == []
    ledger = Ledger(state, "host-test")
    ledger.set_limit(64 * MiB)  # revision 1
    with pytest.raises(error, match=message):
        ledger.set_limit(8 * MiB, expect_revision=revision)  # type: ignore[arg-type]
    assert ledger.limit() == Limit(64 * MiB, 1)
    ledger.close()


@pytest.mark.parametrize(
    ("text", "total", "expected"),
    [
        ("64MiB", None, 64 * MiB),
        ("8GiB", None, 8 << 30),
        ("1.5 GB", None, 1_500_000_000),
        ("4096", None, 4096),
        ("50%", 10 * MiB, 5 * MiB),
        ("12.5 %", 800, 100),
        ("3kib", None, 3072),
    ],
)
def test_sizes_are_read_as_written(text: str, total: int | None, expected: int) -> None:
    assert parse_size(text, total) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("12XB", "cannot read the size"),
        ("-3MiB", "cannot read the size"),
        ("0", "at least 1 byte"),
        ("0%", "above 0 and at most 100"),
        ("101%", "above 0 and at most 100"),
        ("", "cannot read the size"),
    ],
)
def test_bad_sizes_say_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text, 1 << 30)


def test_a_limit_must_be_positive(state: Path) -> None:
    ledger = Ledger(state, "host-test")
    with pytest.raises(ValueError, match="at least 1 byte"):
        ledger.set_limit(0)
    assert ledger.limit().revision == 0
    ledger.close()


def test_limits_by_device_name(state: Path) -> None:
    from extensible_kv.limits import all_limits, device_limit, set_device_limit

    assert device_limit("cpu").bytes is None
    written = set_device_limit("cpu", "25%")
    assert written.bytes == (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4
    assert device_limit(torch.device("cpu")) == written
    assert set_device_limit("cpu", 64 * MiB, expect_revision=1).revision == 2
    with pytest.raises(TypeError, match="limit must be an int"):
        set_device_limit("cpu", True)
    with pytest.raises(ValueError, match="device type 'tpu' is not supported"):
        set_device_limit("tpu", "1GiB")
    with pytest.raises(ValueError, match="'GPU-bad name' is not a device UUID"):
        device_limit("GPU-bad name")
    assert set_device_limit("cpu", "off").bytes is None
    assert list(all_limits().values()) == [device_limit("cpu")]


@pytest.mark.parametrize(
    ("text", "total", "expected"),
    [
        ("2.01MB", None, 2_010_000),
        ("8.2TB", None, 8_200_000_000_000),
        ("0.001KB", None, 1),
        ("1.000KB", None, 1000),
        ("50%", (1 << 60) + 2, (1 << 59) + 1),
        ("0.1%", 10**19 - 1, 10**16 - 1),
        ("33.3%", 1000, 333),  # a share is rounded down to a whole byte
        ("0.0001%", 100, 1),  # and is at least one
    ],
)
def test_decimal_sizes_are_exact(text: str, total: int | None, expected: int) -> None:
    assert parse_size(text, total) == expected


@pytest.mark.parametrize("text", ["1.5B", "0.0001KB", "1.0005 KB", "0.5"])
def test_a_size_of_a_fraction_of_a_byte_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{text!r} is not a whole number of bytes")):
        parse_size(text)


def test_a_size_past_what_a_ledger_holds_is_refused(state: Path) -> None:
    from extensible_kv.limits import set_device_limit

    most = (1 << 63) - 1  # a ledger stores a limit as an int64
    assert parse_size(str(most)) == most
    for text in (str(most + 1), "99999999999TiB"):
        with pytest.raises(ValueError, match=rf"'{text}' .*at most {most} bytes"):
            parse_size(text)
    with pytest.raises(ValueError, match=rf"limit must be at most {most} bytes.*got {1 << 70}"):
        set_device_limit("cpu", 1 << 70)
    assert list(state.glob("devices/*.ledger")) == []
    ledger = Ledger(state, "host-test")
    ledger.set_limit(64 * MiB)
    with pytest.raises(ValueError, match=rf"limit_bytes must be at most {most}.*{most + 1}"):
        ledger.set_limit(most + 1)
    assert ledger.limit() == Limit(64 * MiB, 1)
    assert ledger.set_limit(most) == Limit(most, 2)
    ledger.close()


def test_bytes_print_in_binary_units() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536 * MiB, 5 << 40)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 GiB",
        "5.00 TiB",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["limit", "cpu", "12XB"], "argument SIZE: cannot read the size '12XB'"),
        (["limit", "cpu", "150%"], "argument SIZE: a percentage must be above 0"),
        (["limit", "cpu", "99999999999TiB"], "argument SIZE: the size '99999999999TiB'"),
        (["limit", "gpu0", "1GiB"], "argument DEVICE: cannot read device 'gpu0'"),
        (["limit", "GPU-bad name", "1GiB"], "DEVICE: device name 'GPU-bad name' is not a"),
        (["limit", "host-/x", "off"], "DEVICE: device name 'host-/x' is not a device UUID"),
        (["limit", "cpu"], "give a SIZE"),
        (["limit", "cpu", "1GiB", "--revision", "x"], "argument --revision"),
    ],
)
def test_the_limit_command_refuses_bad_input_in_one_line(
    state: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: extensible-kv limit")
    assert message in err.splitlines()[-1]
    assert list(state.glob("devices/*.ledger")) == []


def test_the_limit_command_sets_shows_and_checks_revisions(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["limit", "cpu", "64MiB"]) == 0
    assert "limit 64.0 MiB, revision 1" in capsys.readouterr().out
    assert main(["limit", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["type"], row["limit_bytes"], row["revision"]) == ("cpu", 64 * MiB, 1)
    with pytest.raises(SystemExit) as exited:
        main(["limit", "cpu", "off", "--revision", "0"])
    assert exited.value.code == 1
    assert "revision 1, not 0" in capsys.readouterr().err
    assert main(["limit", "cpu", "off", "--revision", "1"]) == 0
    assert "no limit, revision 2" in capsys.readouterr().out


def test_the_limit_command_prints_what_it_set_as_json(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uuid = get_driver("cpu").device_uuid(0)
    assert main(["limit", "cpu", "8MiB", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written == {
        "device": uuid,
        "type": "cpu",
        "limit_bytes": 8 * MiB,
        "revision": 1,
        "claimed_bytes": 0,
    }
    assert main(["limit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [written]  # a row of the listing
    assert main(["limit", "cpu", "off", "--json", "--revision", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == written | {"limit_bytes": None, "revision": 2}


def _one_line_failure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI run with ``argv`` exits with status 1 and one line on stderr: that line."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    return err


def test_a_corrupt_ledger_gives_a_clean_error(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Ledger(state, "host-test").close()
    path = state / "devices" / "host-test.ledger"
    path.write_bytes(b"not a ledger" + bytes(100))
    with pytest.raises(StateDirError, match="is not an extensible-kv ledger"):
        Ledger(state, "host-test")
    for argv in (["top", "--once", "--json"], ["limit"]):
        err = _one_line_failure(argv, capsys)
        assert "Traceback" not in err
        assert str(path) in err
        assert "not an extensible-kv ledger" in err


@pytest.mark.parametrize("target", ["nowhere", "real"])
def test_a_symbolic_link_where_a_ledger_goes_gives_a_clean_error(
    state: Path, budget: BudgetDriver, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    uuid = get_driver("cpu").device_uuid(0)
    path = state / "devices" / f"{uuid}.ledger"
    snapshot(state)  # makes the folders
    if target == "real":  # even one to a real ledger: the state is this directory's own
        Ledger(state, "host-elsewhere").close()
        path.symlink_to(state / "devices" / "host-elsewhere.ledger")
        message = "is a symbolic link to "
    else:
        path.symlink_to(state / "nowhere")
        message = "is a symbolic link that points nowhere"
    with pytest.raises(StateDirError, match=message):
        Ledger(state, uuid)
    tensor = ExtensibleTensor(4 * MiB, "cpu", driver=budget)
    with pytest.raises(StateDirError, match=message):
        tensor.resize_(2 * MiB)
    assert tensor.physical_bytes == 0
    tensor.free()
    for argv in (["limit", "cpu", "1GiB"], ["limit"]):
        err = _one_line_failure(argv, capsys)
        assert err.startswith(f"extensible-kv limit: error: {path} is not an extensible-kv ledger")
        assert message in err
    assert path.is_symlink()  # left for the user to remove


@pytest.mark.parametrize(
    ("where", "content", "message"),
    [
        ("devices/notes.txt", "hello", "is not a device ledger"),
        ("procs/notes.txt", "hello", "is not a process's file"),
        ("procs/1-00000000000000aa.json", "{", "cannot be read as JSON"),
    ],
)
def test_a_foreign_file_in_the_state_directory_gives_a_clean_error(
    state: Path, where: str, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot(state)  # makes the folders
    (state / where).write_text(content)
    if where.endswith(".json"):  # a record of a live process: its lock is held
        budget = BudgetDriver(backend("cpu"), state_dir=state)
        tensor = ExtensibleTensor(4 * MiB, "cpu", driver=budget)
        tensor.resize_(2 * MiB)
        own = next((state / "procs").glob(f"{os.getpid()}-*.lock"))
        (state / where).rename(own.with_suffix(".json"))
    with pytest.raises(SystemExit) as exited:
        main(["top", "--once", "--json"])
    assert exited.value.code == 1
    assert message in capsys.readouterr().err


def test_a_state_directory_that_is_a_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path / "file"))
    with pytest.raises(SystemExit):
        main(["top", "--once"])
    assert "cannot use the state directory" in capsys.readouterr().err


def test_top_shows_this_processs_caches(
    budget: BudgetDriver, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = _cache(budget)
    cache.commit(16)
    cache.release_physical()
    lone = ExtensibleTensor(8 * MiB, "cpu", driver=budget)
    lone.resize_(2 * MiB)
    publisher(state).write()
    assert main(["top", "--once", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema_version"] == 1
    (device,) = document["devices"]
    assert (device["type"], device["limit_bytes"], device["claimed_bytes"]) == (
        "cpu",
        None,
        2 * MiB,
    )
    (process,) = device["processes"]
    assert (process["pid"], process["claimed_bytes"]) == (os.getpid(), 2 * MiB)
    kinds = {c["kind"]: c for c in process["caches"]}
    assert kinds["KVCacheBuffers"]["asleep"] is True
    assert kinds["KVCacheBuffers"]["physical_bytes"] == 0
    assert kinds["KVCacheBuffers"]["reserved_bytes"] == cache.reserved_bytes
    assert kinds["ExtensibleTensor"]["physical_bytes"] == 2 * MiB
    assert len(process["caches"]) == 2  # the cache's tensors are shown as the cache
    assert main(["top", "--once"]) == 0
    table = capsys.readouterr().out
    assert "KVCacheBuffers" in table
    assert str(os.getpid()) in table
    cache.free()
    lone.free()


def _fill(cache: KVCacheBuffers, num_blocks: int) -> list[torch.Tensor]:
    """Each segment's first ``num_blocks`` blocks, filled with its own number."""
    views = [t.segment(s)[: num_blocks * BLOCK] for t, _ in cache.buffers for s in range(2)]
    for index, view in enumerate(views):
        view.fill_(index + 1)
    return views


def _intact(views: list[torch.Tensor]) -> bool:
    return all(bool((view == index + 1).all()) for index, view in enumerate(views))


def test_a_refused_wake_to_more_blocks_leaves_the_cache_asleep_with_its_copy(
    budget: BudgetDriver,
) -> None:
    # Item 4: the restore and the growth past it are claimed together.
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(8)
    views = _fill(cache, 8)
    cache.release_physical(preserve=True)
    # On the host the copy is host memory too, claimed (8 MiB) while asleep:
    # the restore (8 MiB more) fits, 24 blocks (24 MiB more) do not.
    ledger.set_limit(20 * MiB)
    with pytest.raises(BudgetExceededError):
        cache.recommit(num_blocks=24)
    assert cache.asleep
    assert (cache.physical_bytes, ledger.held, cache.num_blocks_committed) == (0, 0, 0)
    assert cache.host_backup_bytes > 0
    ledger.set_limit(None)
    cache.recommit(num_blocks=24)
    assert (cache.num_blocks_committed, cache.physical_bytes) == (24, 24 * MiB)
    assert _intact(views)
    cache.free()


def test_a_refused_commit_while_asleep_with_a_copy_leaves_it_asleep(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(8)
    views = _fill(cache, 8)
    cache.release_physical(preserve=True)
    ledger.set_limit(20 * MiB)  # as above: the restore fits, 24 blocks do not
    with pytest.raises(BudgetExceededError):
        cache.commit(24)
    assert cache.asleep
    assert cache.physical_bytes == ledger.held == 0
    ledger.set_limit(None)
    cache.commit(24)
    assert cache.physical_bytes == 24 * MiB
    assert _intact(views)
    cache.free()


@pytest.mark.parametrize("limit", [24 * MiB, 6 * MiB], ids=["full", "lowered-below-the-claims"])
def test_a_trim_is_never_refused_by_the_budget(budget: BudgetDriver, limit: int) -> None:
    # Item 5: each segment is one 3-granule chunk; trimming to 9 blocks copies
    # two granules of it, which replace the chunk: that is not new memory.
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(24)
    assert all(len(t.buffer.chunks) == 2 for t, _ in cache.buffers)
    views = _fill(cache, 9)
    ledger.set_limit(limit)
    cache.trim(9)
    assert cache.num_blocks_committed == 9
    assert cache.physical_bytes == ledger.held == 4 * 2 * GRANULE
    assert _intact(views)
    assert ledger.read().claimed_bytes == ledger.held
    if limit < ledger.held:  # still over a lowered limit: trimming further works too
        cache.trim(0)
        assert cache.physical_bytes == ledger.held == 0
    cache.free()


class _ReusingHandles(DriverAdaptor):
    """Test adaptor below the budget, at the driver boundary: it hands out the
    lowest free handle value, as a driver may reuse a released handle's value
    (CUDA may; the host backend never does), and runs ``after_release``
    between a release and its return."""

    def __init__(self, inner: Driver) -> None:
        super().__init__(inner)
        self._names: dict[int, int] = {}
        self.after_release: Callable[[], None] | None = None

    def create(self, size: int, device: int, shareable: bool) -> int:
        handle = self.inner.create(size, device, shareable)
        value = min(set(range(1, len(self._names) + 2)) - set(self._names))
        self._names[value] = handle
        return value

    def release(self, handle: int) -> None:
        self.inner.release(self._names.pop(handle))
        hook, self.after_release = self.after_release, None
        if hook is not None:
            hook()


def test_a_handle_value_given_out_again_at_once_keeps_each_claim(state: Path) -> None:
    # Another thread's create that lands between a release and its return,
    # and gets the released value, keeps its own claim.
    reusing = _ReusingHandles(backend("cpu"))
    budget = BudgetDriver(reusing, state_dir=state)
    ledger = budget.ledger(0)
    first = budget.create(GRANULE, 0, False)
    made: list[int] = []

    def create_beside() -> None:
        thread = threading.Thread(target=lambda: made.append(budget.create(2 * GRANULE, 0, False)))
        thread.start()
        thread.join(30)

    reusing.after_release = create_beside
    budget.release(first)
    assert made == [first]  # the same value, for another allocation
    assert ledger.held == 2 * GRANULE
    budget.release(made[0])
    assert ledger.held == 0


def test_a_wake_of_an_awake_cache_claims_nothing(budget: BudgetDriver) -> None:
    ledger = budget.ledger(0)
    cache = _cache(budget)
    cache.commit(8)
    ledger.set_limit(8 * MiB)  # full
    cache.recommit(num_blocks=24)  # awake: nothing to do, so nothing to refuse
    assert (cache.num_blocks_committed, cache.physical_bytes, ledger.held) == (8, 8 * MiB, 8 * MiB)
    cache.free()
