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

This module is the format, below the tensor: :class:`SharedLayout` is what
:meth:`ExtensibleTensor.shared_layout
<extensible_kv.tensor.ExtensibleTensor.shared_layout>` makes and
:meth:`~extensible_kv.tensor.ExtensibleTensor.from_shared` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from extensible_kv._checks import check_int
from extensible_kv.driver import Driver

if TYPE_CHECKING:
    from extensible_kv.tensor import ExtensibleTensor

__all__ = ["MalformedMessageError", "SharedLayout", "receive_tensor", "send_tensor"]


@dataclass(frozen=True)
class SharedLayout:
    """An exported tensor, without its memory: sizes in bytes, the chunks as
    ``(offset, size)``, one file descriptor each, in order, and the device
    the memory lives on: its type, its ordinal in the exporting process and
    its UUID, which names it in every process whatever devices each sees."""

    max_num_bytes: int
    num_segments: int
    bytes_per_segment: int
    chunks: tuple[tuple[int, int], ...]
    device: str
    device_index: int
    device_uuid: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SharedLayout:
        """Read :meth:`to_json`'s text; anything else (it may come from another
        process) is a ValueError or TypeError saying what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a shared layout must be JSON: {exc}") from None
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ValueError(f"a shared layout is an object with the fields {sorted(fields)}")
        for name in ("max_num_bytes", "num_segments", "bytes_per_segment", "device_index"):
            check_int(name, data[name])
        for name in ("device", "device_uuid"):
            if not isinstance(data[name], str):
                raise ValueError(f"{name} must be a string, got {data[name]!r}")
        chunks = data["chunks"]
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(_is_int(v) for v in c) for c in chunks
        ):
            raise ValueError("chunks must be a list of [offset, size] pairs of ints")
        data["chunks"] = tuple((offset, size) for offset, size in chunks)
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_BATCH = 250
#: The longest layout accepted: 16 MiB of JSON, some 500,000 chunks.
_MAX_LAYOUT_BYTES = 16 << 20


class MalformedMessageError(ValueError):
    """What arrived on the socket is not a message :func:`send_tensor` wrote."""


def send_tensor(sock: socket.socket, tensor: ExtensibleTensor) -> None:
    """Send ``tensor``'s layout and committed memory over a Unix socket."""
    layout, fds = tensor.shared_layout()
    try:
        payload = layout.to_json().encode()
        sock.sendall(struct.pack(">Q", len(payload)) + payload)
        for start in range(0, len(fds), _BATCH):
            batch = fds[start : start + _BATCH]
            socket.send_fds(sock, [struct.pack(">I", len(batch))], batch)
    finally:
        for fd in fds:
            os.close(fd)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
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
    # The one import upward: the format sits below the tensor, which makes
    # and reads its layouts; only this helper builds a tensor from one.
    from extensible_kv.tensor import ExtensibleTensor

    (length,) = struct.unpack(">Q", _receive_exactly(sock, 8))
    if length > _MAX_LAYOUT_BYTES:
        raise MalformedMessageError(
            f"the layout announced is {length} bytes, more than the {_MAX_LAYOUT_BYTES} accepted"
        )
    try:
        layout = SharedLayout.from_json(_receive_exactly(sock, length).decode())
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise MalformedMessageError(f"the layout received is malformed: {exc}") from None
    fds: list[int] = []
    try:
        while len(fds) < len(layout.chunks):
            data, batch, _, _ = socket.recv_fds(sock, 4, _BATCH)
            fds.extend(batch)
            if len(data) != 4 or struct.unpack(">I", data)[0] != len(batch):
                raise ConnectionError("a batch of file descriptors arrived incomplete")
        return ExtensibleTensor.from_shared(layout, fds, device, driver=driver)
    finally:
        for fd in fds:
            os.close(fd)
