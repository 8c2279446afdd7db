"""Sharing a buffer with another process over a Unix socket.

The exporter sends the tensor's layout and one file descriptor per physical
chunk (``SCM_RIGHTS``); the receiver maps the chunks at an address range of
its own and sees the same bytes. The descriptors are the only way in: host
memory is an anonymous memfd, GPU memory a POSIX-fd handle, neither has a
name another process could open. Only buffers created ``shareable=True``
can be sent.

Wire format: an 8-byte big-endian length and the layout
(:class:`SharedLayout`) as JSON, then the descriptors in batches of at most
250 (the kernel's limit per message is 253), each batch with a 4-byte count.

This module is the transport, above the tensor: :class:`SharedLayout`
(``tensor/shared_layout.py``) is what
:meth:`ExtensibleTensor.shared_layout
<extensible_kv.tensor.ExtensibleTensor.shared_layout>` makes and
:meth:`~extensible_kv.tensor.ExtensibleTensor.from_shared` reads.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence

import torch

from extensible_kv.driver import Driver
from extensible_kv.tensor import ExtensibleTensor, SharedLayout

__all__ = [
    "MalformedMessageError",
    "SharedLayout",
    "receive_exactly",
    "receive_layout",
    "receive_tensor",
    "send_layout",
    "send_tensor",
]


_BATCH = 250
#: The longest layout accepted: 16 MiB of JSON, some 500,000 chunks.
_MAX_LAYOUT_BYTES = 16 << 20


class MalformedMessageError(ValueError):
    """What arrived on the socket is not a message :func:`send_tensor` wrote."""


def send_tensor(sock: socket.socket, tensor: ExtensibleTensor) -> None:
    """Send ``tensor``'s layout and committed memory over a Unix socket."""
    layout, fds = tensor.shared_layout()
    try:
        send_layout(sock, layout, fds)
    finally:
        for fd in fds:
            os.close(fd)


def send_layout(sock: socket.socket, layout: SharedLayout, fds: Sequence[int]) -> None:
    """Send an exported ``layout`` and its chunks' ``fds`` (still the caller's)."""
    payload = layout.to_json().encode()
    sock.sendall(struct.pack(">Q", len(payload)) + payload)
    for start in range(0, len(fds), _BATCH):
        batch = list(fds[start : start + _BATCH])
        socket.send_fds(sock, [struct.pack(">I", len(batch))], batch)


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``; ConnectionError if the peer closes first."""
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError(f"the sender closed the socket {size - len(data)} bytes early")
        data += part
    return data


def receive_tensor(
    sock: socket.socket,
    device: torch.device | str | int | None = None,
    *,
    driver: Driver | None = None,
) -> ExtensibleTensor:
    """Receive a tensor sent by :func:`send_tensor` and map its memory here."""
    layout, fds = receive_layout(sock)
    try:
        return ExtensibleTensor.from_shared(layout, fds, device, driver=driver)
    finally:
        for fd in fds:
            os.close(fd)


def receive_layout(sock: socket.socket) -> tuple[SharedLayout, list[int]]:
    """Receive what :func:`send_layout` sent: the layout, and one new fd per
    chunk, which the caller owns and closes."""
    (length,) = struct.unpack(">Q", receive_exactly(sock, 8))
    if length > _MAX_LAYOUT_BYTES:
        raise MalformedMessageError(
            f"the layout announced is {length} bytes, more than the {_MAX_LAYOUT_BYTES} accepted"
        )
    try:
        layout = SharedLayout.from_json(receive_exactly(sock, length).decode())
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise MalformedMessageError(f"the layout received is malformed: {exc}") from None
    fds: list[int] = []
    try:
        while len(fds) < len(layout.chunks):
            data, batch, _, _ = socket.recv_fds(sock, 4, _BATCH)
            fds.extend(batch)
            if len(data) != 4 or struct.unpack(">I", data)[0] != len(batch):
                raise ConnectionError("a batch of file descriptors arrived incomplete")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return layout, fds
