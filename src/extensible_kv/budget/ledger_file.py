"""The ledger's file: its layout, made whole or not at all, checked at open,
and moved up from the layout before this one.

A ledger is ``devices/<uuid>.ledger`` in the state directory, mapped
``MAP_SHARED`` by every process that uses the device: a 64-byte header
(magic, version, slots, the limit and its revision, slots ever taken), then
one array of int64s per field below, one entry per slot (process). Version 1
had the first three arrays; version 2 appends the rest, so a version 1 file
is moved up in place (made longer, the version rewritten), and processes
that mapped it before go on reading what they read. Every open checks the
file, and moves it up, under the file's lock: no process reads a move half
done.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
from pathlib import Path

from extensible_kv.budget.state_dir import StateDirError

MAGIC = b"EKVBUDG1"
VERSION = 2
#: Processes one device's ledger has room for.
SLOTS = 128
#: magic, version, slots, limit (-1: none), revision, slots ever taken (a
#: bound for sums); padded to 64 bytes.
_HEADER = struct.Struct("<8sIIqqq")
HEADER_BYTES = 64
#: The header's fields read as int64s: their indexes.
LIMIT, REVISION, HIGH = 2, 3, 4
#: The per-slot arrays, in file order: the process's pid and token, the
#: bytes it claims; then (version 2) the bytes it wants and has not got, the
#: CLOCK_MONOTONIC ns its want lapses at and began at, the ns its last met
#: want waited, its floor and its cap in bytes (0: none).
FIELDS = (
    *("pids", "tokens", "claims"),
    *("wants", "want_until", "want_since", "waited", "floors", "caps"),
)
_V1_FIELDS = 3
V1_FILE_BYTES = HEADER_BYTES + 8 * SLOTS * _V1_FIELDS
FILE_BYTES = HEADER_BYTES + 8 * SLOTS * len(FIELDS)


class LedgerFile:
    """One ledger file mapped: ``header`` and one int64 memoryview per
    field of :data:`FIELDS` (``self.claims[slot]`` and so on). The caller
    owns it and calls :meth:`close`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = _open(path)
        try:
            self._map = mmap.mmap(self.fd, FILE_BYTES)
        except (OSError, ValueError) as exc:
            os.close(self.fd)
            raise foreign(path, f"cannot be mapped ({exc})") from None
        whole = memoryview(self._map)
        self.header = whole[:HEADER_BYTES].cast("q")
        self._views = [self.header]
        for index, name in enumerate(FIELDS):
            start = HEADER_BYTES + 8 * SLOTS * index
            view = whole[start : start + 8 * SLOTS].cast("q")
            setattr(self, name, view)
            self._views.append(view)

    pids: memoryview
    tokens: memoryview
    claims: memoryview
    wants: memoryview
    want_until: memoryview
    want_since: memoryview
    waited: memoryview
    floors: memoryview
    caps: memoryview

    def close(self) -> None:
        for view in self._views:
            view.release()
        self._map.close()
        os.close(self.fd)


def _open(path: Path) -> int:
    """A read-write descriptor of the ledger at ``path``, made if missing,
    moved up to this version if it is the one before.

    A new ledger is written whole under a temporary name and linked into
    place, so no process ever sees a half-made one.
    """
    try:
        fd = _open_file(path)
    except FileNotFoundError:
        _create(path)
        fd = _open_file(path)
    try:
        # Under the lock, so that no opener reads another's move half done.
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            _move_up(fd)
            _validate(path, fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file(path: Path) -> int:
    """A read-write descriptor of the file at ``path`` itself, never of where
    a symbolic link there points: FileNotFoundError if there is none, else
    :class:`StateDirError` if it cannot be opened."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            where = f"to {path.resolve()}" if path.exists() else "that points nowhere"
            raise foreign(path, f"is a symbolic link {where}; a ledger is a file") from None
        raise foreign(path, f"cannot be opened ({exc.strerror})") from None


def _create(path: Path) -> None:
    fresh = bytearray(FILE_BYTES)
    _HEADER.pack_into(fresh, 0, MAGIC, VERSION, SLOTS, -1, 0, 0)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        temporary.write_bytes(fresh)
        os.chmod(temporary, 0o600)
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


def _move_up(fd: int) -> None:
    """Make a version 1 ledger a version 2 one, in place: its arrays stay
    where they are and the new ones, zero (no want, no floor, no cap), follow.
    A move its process died in (the file made longer, the version not yet
    rewritten) is finished. The caller holds the file's lock."""
    if os.fstat(fd).st_size not in (V1_FILE_BYTES, FILE_BYTES):
        return  # _validate says
    magic, version, slots, *_ = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if (magic, version, slots) != (MAGIC, 1, SLOTS):
        return  # moved up already, or not a version 1 ledger: _validate says
    os.ftruncate(fd, FILE_BYTES)
    os.pwrite(fd, struct.pack("<I", VERSION), 8)


def _validate(path: Path, fd: int) -> None:
    size = os.fstat(fd).st_size
    if size != FILE_BYTES:
        raise foreign(path, f"is {size} bytes long, not {FILE_BYTES}")
    magic, version, slots, limit, revision, high = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if magic != MAGIC:
        raise foreign(path, f"does not start with {MAGIC!r}")
    if version != VERSION or slots != SLOTS:
        raise foreign(
            path,
            f"is a version {version} ledger with {slots} slots; this extensible-kv "
            f"reads version {VERSION} with {SLOTS}",
        )
    if limit < -1 or revision < 0 or not 0 <= high <= SLOTS:
        raise foreign(path, f"holds a limit of {limit} at revision {revision}, {high} slots")


def foreign(path: Path, what: str) -> StateDirError:
    return StateDirError(
        f"{path} is not an extensible-kv ledger: it {what}. Remove it (the processes "
        f"using that device lose their shared budget) or set EXTENSIBLE_KV_STATE_DIR "
        f"to another directory"
    )
