"""The keeper process: ``python -m extensible_kv.kept.keeper FD``, started
by :func:`~extensible_kv.kept.hand.start_keeper` with one end of a socket
pair as descriptor ``FD``.

It first leaves the process tree it was started in (a fork whose parent
exits at once): an engine's shutdown may kill its whole tree, vLLM's does,
and the pages must outlive it. Then it receives the pages (one descriptor
per chunk), imports them into handles of its own through the device's
backend (a handle keeps the memory alive on every driver; a bare
descriptor need not), claims them in the device's budget, publishes its
record and serves its socket until a taker with the same fingerprint
adopts the pages, someone drops them, another process on the device wants
memory the budget refused it, the process that was to name them exits
before it did and left no file of names, or ``keep_s`` seconds pass. Then it
releases the handles and gives the claim back. Killed, it leaves nothing:
its descriptors and handles go with it, and the budget forgets a dead
process's claim.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from extensible_kv.budget import Ledger
from extensible_kv.budget.liveness import this_process
from extensible_kv.budget.publish import publisher, register_cache
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.driver import Driver
from extensible_kv.driver.select import backend
from extensible_kv.kept.record import KeptCache, kept_dir
from extensible_kv.kept.wire import receive_message, send_message
from extensible_kv.share import SharedLayout, receive_layout, send_layout

__all__ = ["main"]

#: Seconds a taker has to say it mapped the pages before the keeper keeps them again.
TAKE_S = 60.0
#: Seconds between two looks at the device's wants.
LOOK_EVERY_S = 0.25


@dataclass
class _Held:
    """One tensor's pages: its layout and one handle per chunk, in order."""

    layout: SharedLayout
    handles: list[int]


class Keeper:
    def __init__(
        self,
        driver: Driver,
        record: KeptCache,
        held: list[_Held],
        namer: int | None = None,
        names_path: str | None = None,
    ) -> None:
        self.driver = driver
        self.record = record
        self.held = held
        self.ledger = Ledger(state_dir(), record.device_uuid)
        #: A pidfd of the process that is to name the pages (None: none
        #: named, or they are named): readable once it has exited.
        self.namer = namer
        #: Where the namer may have written the names before it exited.
        self.names_path = names_path

    @classmethod
    def receive(cls, sock: socket.socket) -> Keeper:
        """Take the pages the leaver sends on ``sock``, claim them, publish."""
        header = receive_message(sock)
        held: list[_Held] = []
        driver: Driver | None = None
        for _ in range(int(header["tensors"])):
            layout, fds = receive_layout(sock)
            driver = driver or backend(layout.device)
            try:
                held.append(_Held(layout, [driver.import_handle(fd) for fd in fds]))
            finally:
                for fd in fds:
                    os.close(fd)
        if driver is None:
            raise ValueError("no tensor's pages were sent")
        me = this_process(state_dir())
        record = KeptCache(
            keeper_pid=me.pid,
            keeper_token=me.token,
            fingerprint=header["fingerprint"],
            blocks=header["blocks"],
            owner=header["owner"],
            nbytes=sum(size for h in held for _, size in h.layout.chunks),
            device_uuid=held[0].layout.device_uuid,
            until=time.time() + float(header["keep_s"]),
        )
        namer = _watch(header.get("namer_pid"), record)
        keeper = cls(driver, record, held, namer, header.get("names_path"))
        # The memory exists already: counted now, and by the leaver too
        # until it frees its cache (never under, at most twice for that while).
        keeper.ledger.claim_unchecked(record.nbytes)
        register_cache(keeper, Keeper.figures)
        publisher(state_dir()).touch()
        return keeper

    def figures(self) -> dict[str, Any] | None:
        """What ``extensible-kv top`` shows of the pages under this process."""
        if not self.held:
            return None
        layout = self.held[0].layout
        return {
            "kind": "kept pages",
            "device": layout.device if layout.device == "cpu" else f"cuda:{layout.device_index}",
            "device_uuid": self.record.device_uuid,
            "state_dir": str(state_dir()),
            "reserved_bytes": 0,
            "committed_bytes": self.record.nbytes,
            "physical_bytes": self.record.nbytes,
            "asleep": False,
            "blocks": len(self.record.blocks or ()),
            "cached_bytes": self.record.nbytes,
        }

    def serve(self, listener: socket.socket) -> None:
        """Answer takers and droppers until the pages go."""
        while (left := self.record.until - time.time()) > 0:
            watched = [listener.fileno()] + ([] if self.namer is None else [self.namer])
            ready, _, _ = select.select(watched, [], [], min(left, LOOK_EVERY_S))
            if self.namer is not None and self.namer in ready and not self._name_from_file():
                print(
                    "extensible-kv keeper: the process that was to name the pages exited "
                    "first and left no names; they are given back",
                    file=sys.stderr,
                )
                return
            if not ready:
                if self._wanted():
                    return
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TAKE_S)
                try:
                    if self._answer(conn):
                        return
                except (OSError, ValueError, KeyError):
                    continue  # a taker that failed: keep the pages

    def _wanted(self) -> bool:
        """Whether another process wants memory on the device: kept pages
        are a cache nobody serves from yet, the first memory to go (an
        engine of another model started under the same limit, say)."""
        holders = self.ledger.read().holders
        return any(held.wanted_bytes for p, held in holders.items() if p.pid != os.getpid())

    def _answer(self, conn: socket.socket) -> bool:
        """One request; True once the pages are gone (taken or dropped)."""
        asked = receive_message(conn)
        if asked.get("op") == "drop":
            self.give_back()
            return True
        if asked.get("op") == "name":
            named = self.record.blocks is None
            if named:
                self._named(list(asked["blocks"]))
            send_message(conn, {"named": named})
            return False
        if self.record.blocks is None:
            send_message(conn, {"adopt": False, "reason": "not named yet"})
            return False
        if asked.get("fingerprint") != self.record.fingerprint:
            send_message(conn, {"adopt": False, "reason": "another fingerprint"})
            return False
        send_message(conn, {"adopt": True, "blocks": self.record.blocks, "tensors": len(self.held)})
        for held in self.held:
            fds = [self.driver.export_handle(h) for h in held.handles]
            try:
                send_layout(conn, held.layout, fds)
            finally:
                for fd in fds:
                    os.close(fd)
        if receive_message(conn).get("op") != "taken":
            return False
        self.give_back()
        return True

    def _name_from_file(self) -> bool:
        """Name the pages from the names their namer left (True), if it did."""
        try:
            with open(self.names_path or "") as left:
                blocks = json.load(left)
        except (OSError, ValueError):
            return False
        self._named(list(blocks))
        return True

    def _named(self, blocks: list[list[Any]]) -> None:
        self.record = dataclasses.replace(self.record, blocks=blocks)
        self.record.write()
        publisher(state_dir()).touch()
        self._forget_namer()

    def _forget_namer(self) -> None:
        if self.namer is not None:
            os.close(self.namer)
            self.namer = None

    def give_back(self) -> None:
        """Release every handle and the claim; unpublish."""
        self._forget_namer()
        for held in self.held:
            for handle in held.handles:
                self.driver.release(handle)
        self.held = []
        self.ledger.give_back(self.ledger.held)
        self.record.remove()
        publisher(state_dir()).write()


def _watch(namer_pid: int | None, record: KeptCache) -> int | None:
    """A pidfd of ``namer_pid`` while ``record`` is unnamed (None: nothing
    to watch). One of a process gone already is a pipe's read end that is
    readable at once: the pages go at the first look."""
    if namer_pid is None or record.blocks is not None:
        return None
    try:
        return os.pidfd_open(int(namer_pid))
    except ProcessLookupError:
        read, write = os.pipe()
        os.close(write)
        return read


def main(argv: list[str]) -> None:
    fd = int(argv[0])
    if os.fork():
        os._exit(0)  # the starter waits for this; the keeper goes on, in no tree of theirs
    with socket.socket(fileno=fd) as leaver:
        send_message(leaver, {"ready": os.getpid()})
        try:
            # Idle until the pages come: a process that started a keeper
            # ahead and stopped without leaving anything closes the socket.
            keeper = Keeper.receive(leaver)
        except ConnectionError:
            return
        path = kept_dir() / f"{keeper.record.keeper_pid}.sock"
        path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))
            listener.listen()
            keeper.record.write()
            send_message(leaver, {"keeper_pid": keeper.record.keeper_pid})
            leaver.close()
            try:
                keeper.serve(listener)
            finally:
                if keeper.held:
                    keeper.give_back()


if __name__ == "__main__":
    main(sys.argv[1:])
