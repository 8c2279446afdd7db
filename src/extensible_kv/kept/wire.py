"""The keeper's messages: one JSON object, its length first (8 bytes, big
endian), and for pages the tensors' layouts and descriptors as
:mod:`extensible_kv.share` sends them."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from extensible_kv.share import MalformedMessageError, receive_exactly

__all__ = ["receive_message", "send_message"]

#: The longest message accepted: 64 MiB of JSON (block hashes of a large cache).
_MAX_MESSAGE_BYTES = 64 << 20


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = json.dumps(message).encode()
    sock.sendall(struct.pack(">Q", len(payload)) + payload)


def receive_message(sock: socket.socket) -> dict[str, Any]:
    """One message; a ConnectionError if the peer closed first, a
    MalformedMessageError if what came is not a message."""
    (length,) = struct.unpack(">Q", receive_exactly(sock, 8))
    if length > _MAX_MESSAGE_BYTES:
        raise MalformedMessageError(f"a message of {length} bytes announced, over the limit")
    try:
        message = json.loads(receive_exactly(sock, length))
    except ValueError as exc:
        raise MalformedMessageError(f"a message that is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedMessageError("a message is a JSON object")
    return message
