"""Each process's caches, published for ``extensible-kv top``.

A process that claims memory writes ``procs/<pid>-<token>.json`` in the state
directory: its command line and one entry per live cache (reserved,
committed and physical bytes, asleep). A background thread samples the
figures soon after a claim changes (:meth:`Publisher.touch`) and at least
every :data:`RESAMPLE_S`, and writes them when they differ from what it last
wrote, under a temporary name renamed into place: a reader sees the old file
or the new one, and a commit never waits for a write nor blocks another
process. Caches register themselves (:func:`register_cache`); a forked child
starts with none registered, and publishes the caches it makes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extensible_kv.budget.liveness import command_line, this_process
from extensible_kv.driver.protocol import Driver

logger = logging.getLogger(__name__)

#: Version of the per-process file's layout.
PROCESS_SCHEMA = 1
#: Seconds at least between two samples of one process's figures: a burst of
#: commits costs one write, not one each.
MIN_INTERVAL_S = 0.2
#: Seconds at most between two samples of the figures.
RESAMPLE_S = 0.5

#: A cache's figures from the cache: ``{"kind", "device", "device_uuid",
#: "state_dir", "reserved_bytes", "committed_bytes", "physical_bytes",
#: "asleep"}``, or None to be left out (a tensor that is part of a cache, a
#: cache being freed, one that has claimed nothing yet). ``state_dir`` is
#: its budget's: only the publisher of that directory shows it.
Figures = Callable[[Any], "dict[str, Any] | None"]

#: Every registered cache, weakly, with its figures function. No lock: a
#: buffer's finalizer may run on any thread at any allocation, so nothing
#: here may wait for a lock that thread could hold; dict operations are
#: atomic under the GIL, and dead entries are dropped as the figures are read.
_caches: dict[int, tuple[weakref.ref[Any], Figures]] = {}
_ids = itertools.count()


def register_cache(owner: object, figures: Figures) -> None:
    """Publish ``figures(owner)`` while ``owner`` lives (kept weakly)."""
    _caches[next(_ids)] = (weakref.ref(owner), figures)
    touch_all()


def cache_figures(
    driver: Driver, ordinal: int, device: str, kind: str, **figures: object
) -> dict[str, Any] | None:
    """What ``extensible-kv top`` shows of a cache whose memory ``driver``
    creates on device ``ordinal`` (``device`` as torch names it): ``kind``,
    the device and where it claims from, then ``figures``; None while the
    driver stack has no budget or has claimed nothing yet (calls no driver)."""
    accounting = driver.accounting(ordinal)
    if accounting is None:
        return None
    device_uuid, where = accounting
    return {
        "kind": kind,
        "device": device,
        "device_uuid": device_uuid,
        "state_dir": where,
        **figures,
    }


def all_figures(state_dir: Path) -> list[dict[str, Any]]:
    """The figures of every live cache of this process that claims from a
    budget in ``state_dir``."""
    found = []
    for key, (ref, figures) in _caches.copy().items():
        owner = ref()
        if owner is None:
            _caches.pop(key, None)
            continue
        try:
            entry = figures(owner)
        except Exception:  # a cache being freed on another thread: left out this time
            continue
        if entry is not None and entry.pop("state_dir") == str(state_dir):
            found.append(entry)
    return found


class Publisher:
    """Writes this process's file in one state directory, in the background."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._stale = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._command: str | None = None

    def touch(self) -> None:
        """Mark the figures changed; the thread writes them soon. Costs an
        attribute read when they are marked already (every commit calls it)."""
        if not self._stale.is_set():
            self._stale.set()
            if self._thread is None:
                self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="extensible-kv-publish", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        written: dict[str, Any] | None = None
        while True:
            # A touch comes as a claim is made, before the commit that made it
            # has finished its books; so the figures are also sampled again
            # every RESAMPLE_S, and written whenever they differ.
            self._stale.wait(RESAMPLE_S)
            self._stale.clear()
            time.sleep(MIN_INTERVAL_S)
            record = self.record()
            if record == written:
                continue
            try:
                self.write(record)
            except OSError as exc:
                logger.warning("cannot publish this process's caches: %s", exc)
            written = record

    def record(self) -> dict[str, Any]:
        """What this process publishes now."""
        me = this_process(self.state_dir)
        if self._command is None:  # the process's command line does not change
            self._command = command_line(me.pid)
        return {
            "schema_version": PROCESS_SCHEMA,
            "pid": me.pid,
            "command": self._command,
            "caches": all_figures(self.state_dir),
        }

    def write(self, record: dict[str, Any] | None = None) -> Path:
        """Write ``record`` (by default the figures now) as this process's file; its path."""
        record = self.record() if record is None else record
        me = this_process(self.state_dir)
        path = self.state_dir / "procs" / f"{me.stem}.json"
        temporary = path.with_name(f".{path.name}.tmp")
        with self._write_lock:
            temporary.write_text(json.dumps(record | {"updated": time.time()}))
            os.replace(temporary, path)
        return path


_publishers_lock = threading.Lock()
_publishers: dict[Path, Publisher] = {}


def publisher(state_dir: Path) -> Publisher:
    """This process's publisher into ``state_dir``."""
    with _publishers_lock:
        found = _publishers.get(state_dir)
        if found is None:
            found = _publishers[state_dir] = Publisher(state_dir)
        return found


def touch_all() -> None:
    with _publishers_lock:
        every = list(_publishers.values())
    for each in every:
        each.touch()


def _after_fork_in_child() -> None:
    """A child publishes only what it makes: the parent's caches claim in the
    parent's name (the child's budget forgets their handles), and the
    parent's publishers are threads the child does not have."""
    global _publishers_lock
    _publishers_lock = threading.Lock()
    _publishers.clear()
    _caches.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
