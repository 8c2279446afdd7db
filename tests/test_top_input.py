"""``extensible-kv top`` whose input is not a terminal, in a real process:
at the end of its input (``< /dev/null``, a service, a script) or with no
input at all it shows the table once and ends; from an open pipe it keeps
refreshing until the pipe ends or brings a ``q``."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extensible_kv.budget import Ledger
from extensible_kv.driver import backend

MiB = 1 << 20
UUID = backend("cpu").device_uuid(0)
#: Seconds top may take to show its table or to end (it imports torch).
PATIENCE_S = 60
#: What every refresh of the live view shows.
HEADER = b"q quits"
TOP = [sys.executable, "-m", "extensible_kv.cli", "top"]


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state directory where this process claims 2 MiB: top has a table to show."""
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("TERM", "xterm")  # a pty's view refreshes in place
    monkeypatch.setenv("COLUMNS", "200")  # and is wide enough for every column
    ledger = Ledger(tmp_path, UUID)
    ledger.claim(2 * MiB)
    yield tmp_path
    ledger.give_back(2 * MiB)
    ledger.close()


def _stopped(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(PATIENCE_S)


def _ended(process: subprocess.Popen[bytes], why: str) -> int:
    """``process``'s exit code once it ends; it is killed (and the test
    fails, saying ``why`` it should have ended) if it runs on."""
    try:
        return process.wait(PATIENCE_S)
    except subprocess.TimeoutExpired:
        _stopped(process)
        raise AssertionError(f"top ran on for {PATIENCE_S} s after {why}") from None


def _shows_this_process(output: bytes) -> None:
    text = output.decode(errors="replace")
    assert str(os.getpid()) in text, text
    assert "claimed 2.00 MiB" in text, text


@pytest.mark.parametrize("redirect", ["< /dev/null", "<&-"], ids=["dev-null", "closed"])
def test_top_at_the_end_of_its_input_shows_the_table_once_and_ends(
    state: Path, redirect: str
) -> None:
    command = 'exec "$@" ' + redirect
    process = subprocess.Popen(
        ["sh", "-c", command, "sh", *TOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        stdout, stderr = process.communicate(timeout=PATIENCE_S)
    except subprocess.TimeoutExpired:
        _stopped(process)
        raise AssertionError(f"top {redirect} ran on for {PATIENCE_S} s") from None
    assert process.returncode == 0, stderr.decode()
    assert stdout.count(HEADER) == 1
    _shows_this_process(stdout)


def _read_until(fd: int, count: int) -> bytes:
    """What the terminal ``fd`` shows until HEADER has shown ``count`` times."""
    seen = b""
    while seen.count(HEADER) < count:
        ready, _, _ = select.select([fd], [], [], PATIENCE_S)
        assert ready, f"top showed {seen.count(HEADER)} of {count} refreshes in {PATIENCE_S} s"
        try:
            seen += os.read(fd, 1 << 16)
        except OSError:  # EIO: no process has the terminal open any more
            raise AssertionError(f"top ended after {seen.count(HEADER)} refreshes") from None
    return seen


def _read_to_end(fd: int, why: str) -> None:
    """Read the terminal ``fd`` until the process writing to it ends (a
    full terminal would block it), for PATIENCE_S seconds at most; it
    should have ended, says ``why``."""
    deadline = time.monotonic() + PATIENCE_S
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        try:
            if ready and not os.read(fd, 1 << 16):
                return
        except OSError:  # EIO: no process has the terminal open any more
            return
    raise AssertionError(f"top ran on for {PATIENCE_S} s after {why}")


def test_top_reading_a_pipe_refreshes_until_the_pipe_ends(state: Path) -> None:
    terminal, screen = pty.openpty()
    process = subprocess.Popen(TOP, stdin=subprocess.PIPE, stdout=screen)
    os.close(screen)
    try:
        _shows_this_process(_read_until(terminal, 3))
        assert process.poll() is None
        assert process.stdin is not None
        process.stdin.close()
        _read_to_end(terminal, "its input pipe closed")
        assert _ended(process, "its input pipe closed") == 0
    finally:
        _stopped(process)
        os.close(terminal)


def test_top_reading_a_pipe_ends_at_a_q(state: Path) -> None:
    process = subprocess.Popen(TOP, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert process.stdin is not None
        process.stdin.write(b"q\n")
        process.stdin.flush()  # the pipe stays open: only the q ends top
        assert _ended(process, "a q on its input") == 0
        assert process.stdout is not None
        _shows_this_process(process.stdout.read())
    finally:
        _stopped(process)
