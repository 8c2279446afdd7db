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
from typing import Any

from extensible_kv._checks import check_seconds
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.kept.record import KeptCache, kept_caches
from extensible_kv.kept.wire import receive_message, send_message
from extensible_kv.share import SharedLayout, receive_layout, send_layout
from extensible_kv.tensor import ExtensibleTensor

__all__ = ["Adopted", "adopt", "leave", "name"]

#: Seconds a keeper may take to start and take the pages.
START_S = 60.0


def leave(
    tensors: Sequence[ExtensibleTensor],
    fingerprint: dict[str, Any],
    blocks: list[list[Any]] | None,
    keep_s: float,
    *,
    owner: Any = None,
) -> KeptCache:
    """Hand the memory mapped in ``tensors`` (made ``shareable``) to a new
    keeper process, which holds it for ``keep_s`` seconds or until an
    :func:`adopt` with an equal ``fingerprint`` (JSON) takes it; ``blocks``
    (JSON: what names the pages, ``[block id, hash]`` each) goes with it.
    With ``blocks`` None the pages are named later (:func:`name`, by
    whoever knows the names, finding the keeper by ``owner``, JSON): until
    then nobody adopts them. The tensors stay the caller's: free them after
    (the pages live on in the keeper). Returns the keeper's record.

    Raises ValueError, starting nothing, if ``keep_s`` is not a positive,
    finite number of seconds, ``fingerprint`` or ``blocks`` is not JSON, or
    a tensor is not ``shareable``; RuntimeError if the keeper did not take
    the pages (the tensors are as they were).
    """
    if check_seconds("keep_s", keep_s) <= 0 or keep_s == float("inf"):
        raise ValueError(f"keep_s must be a positive, finite number of seconds, got {keep_s!r}")
    try:
        json.dumps([fingerprint, blocks, owner])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the fingerprint, blocks and owner must be JSON: {exc}") from None
    exported: list[tuple[SharedLayout, list[int]]] = []
    try:
        for tensor in tensors:
            exported.append(tensor.shared_layout())
        names = {"fingerprint": fingerprint, "blocks": blocks, "owner": owner}
        return _start_keeper(exported, names, keep_s)
    finally:
        for _, fds in exported:
            for fd in fds:
                os.close(fd)


def _start_keeper(
    exported: list[tuple[SharedLayout, list[int]]], names: dict[str, Any], keep_s: float
) -> KeptCache:
    """Start a keeper and hand it the pages; its record once it holds them."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(START_S)
        starter = subprocess.Popen(
            [sys.executable, "-m", "extensible_kv.kept.keeper", str(theirs.fileno()), str(keep_s)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "EXTENSIBLE_KV_STATE_DIR": str(state_dir())},
        )
        theirs.close()
        try:
            starter.wait(START_S)
            send_message(ours, {**names, "tensors": len(exported)})
            for layout, fds in exported:
                send_layout(ours, layout, fds)
            pid = int(receive_message(ours)["keeper_pid"])
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
            starter.kill()
            raise RuntimeError(
                f"the keeper process did not take the pages ({exc}); its error, if any, "
                f"is on this process's stderr"
            ) from exc
    found = [r for r in kept_caches() if r.keeper_pid == pid]
    if not found:
        raise RuntimeError(f"keeper {pid} took the pages but has gone already")
    return found[0]


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
    """What :func:`adopt` mapped: the keeper's ``blocks`` and the bytes."""

    blocks: list[list[Any]]
    nbytes: int


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
            return Adopted(answer["blocks"], record.nbytes)
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
