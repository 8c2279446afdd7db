"""The vLLM worker's watch on its engine's client
(``extensible_kv.integrations.vllm.client``), with real processes titled as
vLLM titles its own: a client, under it an engine core, under that a
worker. Needs no vLLM; tests/test_vllm_server.py checks the same with a
real server."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from extensible_kv.integrations.vllm.client import client_pid

WORKER = (
    "import os, time\n"
    "from extensible_kv.integrations.vllm.client import client_pid, watch_client\n"
    "client = client_pid('VLLM')\n"
    "print(os.getpid(), client, flush=True)\n"
    "watch_client(client)\n"
    "time.sleep(120)\n"
)
#: Starts a Python process titled ``sys.argv[1]`` that runs ``sys.argv[2]``
#: with the rest as its arguments.
START = (
    "import os, subprocess, sys, time\n"
    "python = os.readlink('/proc/self/exe')  # sys.executable is lost with the title\n"
    "subprocess.Popen([sys.argv[1], '-c', *sys.argv[2:]], executable=python)\n"
    "time.sleep(120)\n"
)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie its parent has yet to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_process_that_is_not_vllms_has_no_client_to_watch() -> None:
    assert client_pid("VLLM") is None


def test_a_worker_finds_its_client_above_the_engine_core_and_goes_when_it_goes() -> None:
    # client -> VLLM::EngineCore -> VLLM::Worker_TP0, as vLLM's processes stand.
    client = subprocess.Popen(
        [sys.executable, "-c", START, "VLLM::EngineCore", START, "VLLM::Worker_TP0", WORKER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A Python started under another name finds no virtual environment:
        # give the titled ones this process's import path.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    try:
        assert client.stdout is not None
        assert select.select([client.stdout], [], [], 60)[0], "the worker did not start in 60 s"
        worker_pid, found = map(int, client.stdout.readline().split())
        assert found == client.pid
        assert Path(f"/proc/{worker_pid}/cmdline").read_text().startswith("VLLM::Worker_TP0")
        assert running(worker_pid)
        client.kill()
        client.wait(timeout=30)
        # The watch sends the worker SIGTERM (here its default action ends it).
        deadline = time.monotonic() + 30
        while running(worker_pid):
            assert time.monotonic() < deadline, "the worker outlived its client by 30 s"
            time.sleep(0.1)
    finally:
        os.killpg(client.pid, signal.SIGKILL)
        client.wait(timeout=30)


def test_a_worker_whose_client_is_gone_before_the_watch_starts_goes_at_once() -> None:
    # The client may die between the worker finding it and the watch starting.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from extensible_kv.integrations.vllm.client import watch_client\n"
            "watch_client(int(sys.argv[1]))\n"
            "time.sleep(120)\n",
            str(gone.pid),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.wait(timeout=30) == -signal.SIGTERM
        assert worker.stderr is not None
        assert f"(pid {gone.pid}) is gone" in worker.stderr.read()
    finally:
        worker.kill()
        worker.wait(timeout=30)
