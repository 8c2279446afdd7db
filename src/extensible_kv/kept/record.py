"""What a keeper publishes: one JSON file per keeper in the state
directory's ``kept/`` folder, beside its socket, for ``extensible-kv kept``
and for engines looking for pages to adopt."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from extensible_kv.budget.liveness import ProcessId, is_alive
from extensible_kv.budget.state_dir import state_dir
from extensible_kv.kept.wire import send_message

__all__ = ["KeptCache", "drop", "kept_caches", "kept_dir"]


@dataclass(frozen=True)
class KeptCache:
    """A stopped engine's cached blocks, held by a keeper process.

    ``keeper_pid``: the keeper's pid (``keeper_token``: its registration in
    the state directory, which tells whether it lives); ``fingerprint``: what an engine must
    match exactly to adopt them (model, dtype, block size, layout...: the
    engine's words); ``blocks``: ``[block id, hash]`` of each kept block
    (None until named: not adoptable before); ``owner``: who left them, in
    its own words, so that it can name them once it knows (JSON);
    ``nbytes``: the memory held (whole granules); ``device_uuid``;
    ``until``: when the keeper gives the pages back (seconds since the epoch).
    """

    keeper_pid: int
    keeper_token: int
    fingerprint: dict[str, Any]
    blocks: list[list[Any]] | None
    owner: Any
    nbytes: int
    device_uuid: str
    until: float

    @property
    def alive(self) -> bool:
        return is_alive(state_dir(), ProcessId(self.keeper_pid, self.keeper_token))

    @property
    def socket_path(self) -> Path:
        return kept_dir() / f"{self.keeper_pid}.sock"

    def write(self) -> None:
        """Publish this record (atomically: a reader sees all of it or none)."""
        path = kept_dir() / f"{self.keeper_pid}.json"
        part = path.with_suffix(".part")
        part.write_text(json.dumps(asdict(self)))
        os.replace(part, path)

    def remove(self) -> None:
        for suffix in (".json", ".sock"):
            with contextlib.suppress(FileNotFoundError):
                (kept_dir() / f"{self.keeper_pid}{suffix}").unlink()


def kept_dir(state: Path | None = None) -> Path:
    """The folder keepers publish in (made if missing)."""
    path = (state or state_dir()) / "kept"
    path.mkdir(parents=True, exist_ok=True)
    return path


def kept_caches() -> list[KeptCache]:
    """Every live keeper's record, oldest first; the records of keepers
    that died are removed."""
    found = []
    for path in sorted(kept_dir().glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            record = KeptCache(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if record.alive:
            found.append(record)
        else:
            record.remove()
    return found


def drop(keeper_pid: int, timeout_s: float = 10.0) -> bool:
    """Ask keeper ``keeper_pid`` to give its pages back now; False if there
    is no such keeper. Returns once the keeper has gone; one that does not
    answer within ``timeout_s`` seconds is killed (its pages go with it)."""
    record = next((r for r in kept_caches() if r.keeper_pid == keeper_pid), None)
    if record is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(record.socket_path))
            send_message(sock, {"op": "drop"})
            sock.recv(1)  # the keeper closes it once its pages are given back
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper_pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while record.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    record.remove()
    return True
