"""Leaving a cache's pages to a keeper, and adopting them in a new cache."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extensible_kv._checks import check_seconds
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.kept.record import KeptCache, kept_caches, kept_dir
from extensible_kv.kept.wire import receive_message, send_message
from extensible_kv.share import SharedLayout, receive_layout, send_layout
from extensible_kv.tensor import ExtensibleTensor

__all__ = ["Adopted", "SpareKeeper", "adopt", "leave", "name", "start_keeper"]

#: Seconds a keeper may take to start, or to take the pages.
START_S = 60.0


class SpareKeeper:
    """A keeper process started ahead (:func:`start_keeper`), idle until
    :meth:`leave` hands it pages: a process that must stop within seconds
    (vLLM gives an engine 5) pays for the keeper's start, a Python
    interpreter and torch, before it stops. Closed, or dropped with its
    starter, it exits having held nothing."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid

    def leave(
        self,
        tensors: Sequence[ExtensibleTensor],
        fingerprint: dict[str, Any],
        blocks: list[list[Any]] | None,
        keep_s: float,
        *,
        owner: Any = None,
        namer_pid: int | None = None,
        names_path: str | None = None,
    ) -> KeptCache:
        """Hand the memory mapped in ``tensors`` (made ``shareable``) to
        this keeper, which holds it for ``keep_s`` seconds or until an
        :func:`adopt` with an equal ``fingerprint`` (JSON) takes it;
        ``blocks`` (JSON: what names the pages, ``[block id, hash]`` each)
        goes with it. With ``blocks`` None the pages are named later
        (:func:`name`, by whoever knows the names, finding the keeper by
        ``owner``, JSON): until then nobody adopts them. Where ``namer_pid``
        is the process that will name them and it exits first, the keeper
        names them from the file ``names_path`` (a JSON list as ``blocks``)
        if the namer wrote one, else gives them back at once (nobody else
        could name them). The tensors stay
        the caller's: free them after (the pages live on in the keeper).
        Returns the keeper's record; the keeper takes pages once.

        Raises ValueError, handing nothing over, if ``keep_s`` is not a
        positive, finite number of seconds, ``fingerprint``, ``blocks`` or
        ``owner`` is not JSON, or a tensor is not ``shareable``;
        RuntimeError if the keeper did not take the pages (the tensors are
        as they were).
        """
        if check_seconds("keep_s", keep_s) <= 0 or keep_s == float("inf"):
            raise ValueError(f"keep_s must be a positive, finite number of seconds, got {keep_s!r}")
        header = {
            "fingerprint": fingerprint,
            "blocks": blocks,
            "owner": owner,
            "keep_s": keep_s,
            "namer_pid": namer_pid,
            "names_path": names_path,
        }
        try:
            json.dumps(header)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the fingerprint, blocks and owner must be JSON: {exc}") from None
        exported: list[tuple[SharedLayout, list[int]]] = []
        try:
            for tensor in tensors:
                exported.append(tensor.shared_layout())
            return self._hand_over(exported, header)
        finally:
            for _, fds in exported:
                for fd in fds:
                    os.close(fd)

    def _hand_over(
        self, exported: list[tuple[SharedLayout, list[int]]], header: dict[str, Any]
    ) -> KeptCache:
        try:
            with self._sock:
                send_message(self._sock, {**header, "tensors": len(exported)})
                for layout, fds in exported:
                    send_layout(self._sock, layout, fds)
                pid = int(receive_message(self._sock)["keeper_pid"])
        except (OSError, ValueError, KeyError) as exc:
            raise RuntimeError(
                f"keeper {self.pid} did not take the pages ({exc}); its error, if any, is in "
                f"{keepers_log()}"
            ) from exc
        found = [r for r in kept_caches() if r.keeper_pid == pid]
        if not found:
            raise RuntimeError(
                f"keeper {pid} took the pages but has gone already; why is in {keepers_log()}"
            )
        return found[0]

    def close(self) -> None:
        """Let the keeper go without pages: it exits."""
        self._sock.close()


def keepers_log() -> Path:
    """The file keepers write their errors to (appended, one for all)."""
    return kept_dir() / "keepers.log"


def start_keeper() -> SpareKeeper:
    """Start a keeper process, out of this process's tree, idle until pages
    come (:meth:`SpareKeeper.leave`). Returns once it is ready to take them.
    RuntimeError if it did not start within :data:`START_S` seconds."""
    ours, theirs = socket.socketpair()
    # Not this process's stderr: the keeper outlives it, and a pipe it held
    # open would keep whoever reads this process's output (a shell's `| tee`,
    # a parent's subprocess.run) waiting until the pages go.
    with theirs, keepers_log().open("ab") as log:
        ours.settimeout(START_S)
        starter = subprocess.Popen(
            [sys.executable, "-m", "extensible_kv.kept.keeper", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "EXTENSIBLE_KV_STATE_DIR": str(state_dir())},
        )
    try:
        starter.wait(START_S)
        pid = int(receive_message(ours)["ready"])
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        starter.kill()
        ours.close()
        raise RuntimeError(f"the keeper process did not start ({exc})") from exc
    return SpareKeeper(ours, pid)


def leave(
    tensors: Sequence[ExtensibleTensor],
    fingerprint: dict[str, Any],
    blocks: list[list[Any]] | None,
    keep_s: float,
    *,
    owner: Any = None,
    namer_pid: int | None = None,
    names_path: str | None = None,
) -> KeptCache:
    """:func:`start_keeper`, then :meth:`SpareKeeper.leave` (see there)."""
    spare = start_keeper()
    try:
        return spare.leave(
            tensors,
            fingerprint,
            blocks,
            keep_s,
            owner=owner,
            namer_pid=namer_pid,
            names_path=names_path,
        )
    finally:
        spare.close()


def name(record: KeptCache, blocks: list[list[Any]]) -> bool:
    """Name the pages a keeper holds unnamed (``blocks`` as :func:`leave`
    takes them): from now on they can be adopted. False if they were named
    already, or the keeper has gone."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(START_S)
            sock.connect(str(record.socket_path))
            send_message(sock, {"op": "name", "blocks": blocks})
            return bool(receive_message(sock).get("named"))
    except (OSError, ConnectionError):
        return False


@dataclass(frozen=True)
class Adopted:
    """What :func:`adopt` mapped: the keeper's ``blocks``, the bytes, and
    the ``owner`` its leaver named."""

    blocks: list[list[Any]]
    nbytes: int
    owner: Any = None


def adopt(tensors: Sequence[ExtensibleTensor], fingerprint: dict[str, Any]) -> Adopted | None:
    """Map the pages a keeper holds under an equal ``fingerprint`` into
    ``tensors`` (unmapped there), at the offsets they had: the same bytes,
    no copy. The keeper then gives its pages and its claim up. None, with
    nothing mapped, if no keeper holds such pages."""
    for record in kept_caches():
        if record.blocks is None or record.fingerprint != fingerprint:
            continue
        with (
            contextlib.suppress(OSError, ConnectionError),
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
        ):
            sock.settimeout(START_S)
            sock.connect(str(record.socket_path))
            send_message(sock, {"op": "take", "fingerprint": fingerprint})
            answer = receive_message(sock)
            if not answer.get("adopt"):
                continue
            _map_all(sock, tensors, int(answer["tensors"]))
            send_message(sock, {"op": "taken"})
            return Adopted(answer["blocks"], record.nbytes, record.owner)
    return None


def _map_all(sock: socket.socket, tensors: Sequence[ExtensibleTensor], count: int) -> None:
    """Map every tensor's pages as they arrive, all or none: a failure
    gives back what this call mapped in the tensors before."""
    if count != len(tensors):
        raise ValueError(f"the keeper holds {count} tensors' pages, not {len(tensors)}")
    before = [tensor.buffer.mapped_runs for tensor in tensors]
    try:
        for tensor in tensors:
            layout, fds = receive_layout(sock)
            try:
                _check_same(tensor, layout)
                chunks = [(o, n, fd) for (o, n), fd in zip(layout.chunks, fds, strict=True)]
                tensor.buffer.map_imported(chunks, adopt=True)
            finally:
                for fd in fds:
                    os.close(fd)
    except BaseException:
        for tensor, runs in zip(tensors, before, strict=True):
            tensor.buffer.release_outside(runs)
        raise


def _check_same(tensor: ExtensibleTensor, layout: SharedLayout) -> None:
    """Refuse pages kept from a tensor of another shape or on another device."""
    here = (
        tensor.max_num_bytes,
        tensor.num_segments,
        tensor.buffer.driver.device_uuid(tensor.buffer.device),
    )
    there = (layout.max_num_bytes, layout.num_segments, layout.device_uuid)
    if here != there:
        raise ValueError(
            f"kept pages of a tensor of {there[0]} bytes in {there[1]} segments on {there[2]} "
            f"cannot go into one of {here[0]} bytes in {here[1]} segments on {here[2]}"
        )
