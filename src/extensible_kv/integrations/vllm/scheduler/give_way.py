"""An idle engine gives way to another process's want, however it is run.

vLLM's engine-core loop, with no request to run, blocks on its input queue
(``EngineCoreProc._process_input_queue``), and only its client's next
message wakes it: the scheduler's :meth:`has_requests`, which is true while
another process wants memory this engine holds idle, is not asked again
until then. An ``LLM`` idle between ``generate`` calls, or a server nobody
sends a request, would hold its prefix cache against every want.

:class:`GiveWay` is a daemon thread in the engine-core process that looks at
the device budget's wants every :data:`LOOK_EVERY_S` seconds and, while
another process wants memory, puts vLLM's own wake-up sentinel
(``EngineCoreRequestType.WAKEUP``, which its shutdown uses for the same
purpose) on the loop's input queue. The loop then asks the scheduler again,
runs one step if it has memory to give, and the step's orders give it back.
Nothing is released outside a step, so no step in flight can touch memory
that goes: the thread only wakes the loop.

An engine stepped in the client's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
has no loop to wake: it steps only while ``generate`` runs, and gives way
then (:func:`engine_loop` finds no loop, and the scheduler says so in its
log).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc

logger = logging.getLogger(__name__)

#: Seconds between two looks at the wants: an idle engine answers a want
#: within this, plus one step.
LOOK_EVERY_S = 0.05
#: Seconds :meth:`GiveWay.close` waits for the thread (a look is a few loads).
JOIN_S = 5.0


def engine_loop() -> EngineCoreProc | None:
    """The engine-core loop whose scheduler is being made (call it from the
    scheduler's ``__init__``); None where the engine has no loop of its own
    (stepped in the client's process).

    vLLM gives a scheduler no handle on the loop that runs it, and offers
    no hook to wake that loop; the engine core makes its scheduler from its
    own ``__init__``, so the loop is the nearest caller that is an
    ``EngineCoreProc``. Only its input queue is used, to put vLLM's own
    wake-up sentinel on it, and its ``is_running()``, read.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


class GiveWay:
    """Wakes an idle engine-core loop while ``wanted()`` says it should step
    (see the module).

    Args:
        inbox: the loop's input queue (:func:`engine_loop`'s).
        wanted: whether the loop should step now: another process on the
            engine's devices wants memory, or the idle engine's linger is
            over and it has memory to give back; called on this thread, so
            it must only read what is safe to read beside the loop (the
            budget's ledgers, flags).
    """

    def __init__(self, inbox: queue.Queue[Any], wanted: Callable[[], bool]) -> None:
        self._inbox = inbox
        self._wanted = wanted
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="extensible-kv-give-way", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(LOOK_EVERY_S):
            try:
                # A wake already waiting in the queue is enough: never pile them up.
                if self._inbox.empty() and self._wanted():
                    self._inbox.put_nowait((EngineCoreRequestType.WAKEUP, None))
            except Exception as exc:  # the engine goes on serving; say it once
                if not warned:
                    logger.warning("extensible-kv: cannot read the budget's wants: %s", exc)
                    warned = True

    def close(self) -> None:
        """Stop looking, and wait for the thread to end (within a look), so
        that the ledgers it reads can be closed after."""
        self._stop.set()
        self._thread.join(JOIN_S)
