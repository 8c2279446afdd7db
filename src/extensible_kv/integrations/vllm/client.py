"""A worker whose engine lost its client shuts down, memory and claims with it.

vLLM 0.32's engine core watches nothing of the process that made it (the
client: the process of an ``LLM``, or the OpenAI server): no death pipe, no
``PR_SET_PDEATHSIG``, no ZMQ heartbeat (its input socket polls without a
timeout). Killed (SIGKILL, a test's timeout, the OOM killer), the client
leaves the engine core and its workers running as orphans, holding their
memory, stock's as ours; ours would also keep their claims on the device's
budget, since their processes live. Nothing can reach such an engine again,
so each of our workers watches the client and, once it is gone, sends its
own process SIGTERM: vLLM's own shutdown then runs (a worker process's
handler, or the engine core's where the worker lives in it), and the engine
core shuts down when a worker process dies.

The watch waits on a pidfd (Linux 5.3 and later): no polling, and no
confusion with a later process given the same pid.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

logger = logging.getLogger(__name__)

#: Seconds vLLM's shutdown may take after the SIGTERM before the process
#: exits at once.
SHUTDOWN_S = 30.0


def client_pid(title_prefix: str) -> int | None:
    """The pid of the process that made this worker's engine: the nearest
    ancestor that is not one of vLLM's own processes (vLLM titles those
    ``<title_prefix>::EngineCore``, ``::Worker_TP0``, ``::APIServer_0``...).
    None where this process is not one of vLLM's (the worker runs in the
    client, or in a process Ray or another launcher owns)."""
    marker = f"{title_prefix}::"
    pid = os.getpid()
    while process_title(pid).startswith(marker):
        pid = _parent(pid)
    return None if pid == os.getpid() or pid <= 1 else pid


def process_title(pid: int) -> str:
    """A process's title (its command line, which vLLM's setproctitle rewrites)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        # The command name, in parentheses, may hold spaces: fields follow the last ")".
        return int(stat.read().rpartition(")")[2].split()[1])


def watch_client(pid: int) -> None:
    """Start a daemon thread that shuts this process down once ``pid`` is
    gone; shut down at once where ``pid`` is gone already (the client may die
    between :func:`client_pid` and this call). Nothing where the kernel has
    no pidfd."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        _shut_down(pid)
        return
    except (AttributeError, OSError) as exc:
        logger.warning("extensible-kv cannot watch the engine's client (pid %d): %s", pid, exc)
        return
    watch = threading.Thread(
        target=_wait_and_shut_down, args=(pid, pidfd), name="extensible-kv-client", daemon=True
    )
    watch.start()


def _wait_and_shut_down(pid: int, pidfd: int) -> None:
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    poll.poll()  # readable once the process has exited
    os.close(pidfd)
    _shut_down(pid)


def _shut_down(pid: int) -> None:
    """Send this process SIGTERM, so vLLM's own shutdown runs, and exit
    :data:`SHUTDOWN_S` seconds later if that shutdown has not ended it."""
    logger.warning(
        "the process that made this vLLM engine (pid %d) is gone; nothing can reach the "
        "engine any more, so it shuts down and its KV memory goes back",
        pid,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(SHUTDOWN_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
