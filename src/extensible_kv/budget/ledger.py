"""One device's budget, shared by every process: its limit and each process's claim.

The ledger is a small file, ``devices/<uuid>.ledger`` in the state directory,
that every process using the device maps ``MAP_SHARED``: a header (magic,
version, the limit and its revision) and a table of slots, one per process,
each holding that process's id and the bytes it claims. Asking whether there
is a limit and adding to one's own slot are loads and stores into the mapping,
with no system call; only a claim against a limit, taking a slot, and setting
or reading the limit with its revision hold the file's ``flock``, so claims
under a limit are checked and recorded atomically across processes, a limit
is read as one write left it, and with no limit nothing is locked at all.

A slot whose process died still shows its claim until a process needs the
room: a claim that does not fit first asks whether each holder lives
(:mod:`extensible_kv.budget.liveness`) and zeroes the slots of the dead.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from extensible_kv._checks import check_int
from extensible_kv.budget.liveness import (
    ProcessId,
    command_line,
    forget_dead,
    is_alive,
    one_line,
    this_process,
)
from extensible_kv.budget.sizes import MAX_SIZE_BYTES, format_bytes
from extensible_kv.budget.state_dir import StateDirError, prepare
from extensible_kv.driver.errors import BudgetExceededError

MAGIC = b"EKVBUDG1"
VERSION = 1
#: Processes one device's ledger has room for.
SLOTS = 128
#: magic, version, slots, limit (-1: none), revision, slots ever taken (a
#: bound for sums); padded to 64 bytes.
_HEADER = struct.Struct("<8sIIqqq")
_HEADER_BYTES = 64
_LIMIT, _REVISION, _HIGH = 2, 3, 4  # their indexes in the header read as int64s
_PIDS = _HEADER_BYTES
_TOKENS = _PIDS + 8 * SLOTS
_CLAIMS = _TOKENS + 8 * SLOTS
FILE_BYTES = _CLAIMS + 8 * SLOTS
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Seconds between tries while a claim waits for room.
POLL_S = 0.01


class StaleRevisionError(ValueError):
    """A limit was written by someone who had read an older revision."""


@dataclass(frozen=True)
class Limit:
    """A device's limit in bytes (None: unlimited) and its revision, which
    every write of the limit increments."""

    bytes: int | None
    revision: int


@dataclass(frozen=True)
class LedgerView:
    """What a ledger holds at one moment: the limit and the live claims."""

    device: str
    limit: Limit
    claims: dict[ProcessId, int]

    @property
    def claimed_bytes(self) -> int:
        return sum(self.claims.values())


def check_limit(name: str, limit_bytes: object) -> None:
    """Refuse a limit that is not None or an int of 1 to :data:`MAX_SIZE_BYTES`
    bytes (what a ledger holds): TypeError or ValueError naming ``name``."""
    if limit_bytes is None:
        return
    limit = check_int(name, limit_bytes)
    if limit < 1:
        raise ValueError(f"a limit must be at least 1 byte, got {limit}; use None for none")
    if limit > MAX_SIZE_BYTES:
        raise ValueError(
            f"{name} must be at most {MAX_SIZE_BYTES} bytes (2**63 - 1, what a ledger "
            f"holds), got {limit}"
        )


def check_revision(name: str, revision: object) -> None:
    """Refuse a revision that is not None or an int of at least 0:
    TypeError or ValueError naming ``name``."""
    if revision is not None and check_int(name, revision) < 0:
        raise ValueError(f"{name} must be at least 0, got {revision}")


def check_uuid(device: str) -> None:
    """Refuse a device UUID that cannot name a ledger file: ValueError."""
    if _UUID_RE.fullmatch(device) is None:
        raise ValueError(
            f"device name {device!r} is not a device UUID (letters, digits, '.', '_' "
            f"and '-', at most 128)"
        )


def ledger_path(state_dir: Path, device: str) -> Path:
    check_uuid(device)
    return state_dir / "devices" / f"{device}.ledger"


class Ledger:
    """This process's handle on one device's ledger (made if missing).

    Args:
        state_dir: the state directory.
        device: the device's UUID (``Driver.device_uuid``), the same in
            every process.

    Raises :class:`StateDirError` when the file is not a ledger.
    """

    def __init__(self, state_dir: Path, device: str) -> None:
        self.state_dir = state_dir
        self.device = device
        self.path = ledger_path(state_dir, device)
        prepare(state_dir)
        # Reentrant: a finalizer releasing a dropped buffer's memory may run
        # at an allocation inside a claim, on the same thread (see BudgetDriver).
        self._mutex = threading.RLock()
        self._fd = _open(self.path)
        try:
            self._map = mmap.mmap(self._fd, FILE_BYTES)
        except (OSError, ValueError) as exc:
            os.close(self._fd)
            raise _foreign(self.path, f"cannot be mapped ({exc})") from None
        whole = memoryview(self._map)
        self._header = whole[:_HEADER_BYTES].cast("q")
        self._pids = whole[_PIDS:_TOKENS].cast("q")
        self._tokens = whole[_TOKENS:_CLAIMS].cast("q")
        self._claims = whole[_CLAIMS:FILE_BYTES].cast("q")
        self._slot: int | None = None

    def close(self) -> None:
        """Unmap and close (the claim stays: it is given back by releasing)."""
        for view in (self._header, self._pids, self._tokens, self._claims):
            view.release()
        self._map.close()
        os.close(self._fd)

    # -- the limit ------------------------------------------------------------

    @property
    def limited(self) -> bool:
        """True while the device has a limit (one load from the mapping)."""
        return self._header[_LIMIT] >= 0

    def limit(self) -> Limit:
        """The limit and its revision, as one write left them.

        Read under the file's lock, which every write of the limit holds: the
        limit and its revision are two stores, and two loads without the lock
        could pair one write's bytes with the next's revision, which a
        controller would then pass as ``expect_revision``.
        """
        with self._locked():
            return self._limit_now()

    def _limit_now(self) -> Limit:
        """The limit and its revision (caller holds the flock)."""
        raw = self._header[_LIMIT]
        return Limit(None if raw < 0 else raw, self._header[_REVISION])

    def set_limit(self, limit_bytes: int | None, expect_revision: int | None = None) -> Limit:
        """Set the limit in bytes (None: none); with ``expect_revision`` (an
        int), only if the revision is still that one, else
        :class:`StaleRevisionError`."""
        check_limit("limit_bytes", limit_bytes)
        check_revision("expect_revision", expect_revision)
        with self._locked():
            revision = self._header[_REVISION]
            if expect_revision is not None and expect_revision != revision:
                raise StaleRevisionError(
                    f"the limit of {self.device} is at revision {revision}, not "
                    f"{expect_revision}: someone set it since it was read; read it again"
                )
            self._header[_LIMIT] = -1 if limit_bytes is None else limit_bytes
            self._header[_REVISION] = revision + 1
            return Limit(limit_bytes, revision + 1)

    # -- claims ---------------------------------------------------------------

    @property
    def held(self) -> int:
        """Bytes this process claims on the device."""
        return 0 if self._slot is None else self._claims[self._slot]

    def claim(self, size: int, timeout_s: float = 0.0) -> None:
        """Claim ``size`` bytes for this process, before it creates them.

        With no limit this is a store into the mapping. Under a limit, a claim
        that does not fit waits up to ``timeout_s`` seconds for room, then
        raises :class:`BudgetExceededError`.
        """
        slot = self._slot
        if slot is not None and self._header[_LIMIT] < 0:  # the common case, inlined
            with self._mutex:
                self._claims[slot] += size
            return
        if self._try_claim(size):
            return
        deadline = time.monotonic() + timeout_s
        while not self._try_claim(size):
            if time.monotonic() >= deadline:
                raise self._refusal(size)
            time.sleep(POLL_S)

    def claim_unchecked(self, size: int) -> None:
        """Claim ``size`` bytes without the limit's check: only for memory the
        caller gives back before it is done (see ``BudgetDriver.prepaid``)."""
        with self._mutex:
            self._claims[self._own_slot()] += size

    def give_back(self, size: int) -> None:
        """Return ``size`` bytes of this process's claim (memory freed)."""
        with self._mutex:
            assert self._slot is not None, "giving back what was never claimed"
            self._claims[self._slot] -= size

    def _try_claim(self, size: int) -> bool:
        with self._mutex:
            slot = self._own_slot()
            limit = self._header[_LIMIT]
            if limit < 0:
                self._claims[slot] += size
                return True
            with self._flocked():
                fits = self._total() + size <= limit
                if not fits and self._forget_dead():
                    fits = self._total() + size <= limit
                if fits:
                    self._claims[slot] += size
                return fits

    def _total(self) -> int:
        """Bytes claimed in every slot (caller holds the flock): slots are
        taken lowest first, so only those below the high-water mark count."""
        return sum(self._claims[: self._header[_HIGH]])

    def _refusal(self, size: int) -> BudgetExceededError:
        view = self.read()
        limit = view.limit.bytes
        holders = tuple(
            (process.pid, claimed, command_line(process.pid))
            for process, claimed in sorted(view.claims.items(), key=lambda item: -item[1])
            if claimed
        )
        who = ", ".join(
            f"pid {pid} ({one_line(command)}) {format_bytes(claimed)}"
            for pid, claimed, command in holders
        )
        detail = (
            f"the budget of device {self.device} is {format_bytes(limit or 0)} and "
            f"{format_bytes(view.claimed_bytes)} of it is claimed ({who or 'by nobody now'}); "
            f"{format_bytes(size)} more was asked by pid {os.getpid()}. Wait for the room "
            f"(extensible_kv.waiting_for_budget), free memory elsewhere, or raise the limit "
            f"(extensible-kv limit)"
        )
        return BudgetExceededError(self.device, limit or 0, size, holders, detail)

    # -- slots and the file lock -------------------------------------------

    def _own_slot(self) -> int:
        """This process's slot, taken on first use (caller holds the mutex)."""
        if self._slot is not None:
            return self._slot
        me = this_process(self.state_dir)
        with self._flocked():
            free = [i for i in range(SLOTS) if self._pids[i] == 0]
            if not free:
                self._forget_dead()
                free = [i for i in range(SLOTS) if self._pids[i] == 0]
            if not free:
                raise StateDirError(
                    f"{self.path} has a slot for {SLOTS} live processes and all are taken"
                )
            slot = free[0]
            self._claims[slot] = 0
            self._tokens[slot] = me.token
            self._pids[slot] = me.pid
            self._header[_HIGH] = max(self._header[_HIGH], slot + 1)
        self._slot = slot
        return slot

    def _forget_dead(self) -> bool:
        """Zero the slots of processes that died (caller holds the flock);
        True if any claim came back."""
        returned = False
        for i in range(SLOTS):
            process = self._holder(i)
            if process is None or i == self._slot or is_alive(self.state_dir, process):
                continue
            returned |= self._claims[i] != 0
            self._claims[i] = 0
            self._pids[i] = 0
            self._tokens[i] = 0
            forget_dead(self.state_dir, process)
        return returned

    def _holder(self, slot: int) -> ProcessId | None:
        pid = self._pids[slot]
        return None if pid == 0 else ProcessId(pid, self._tokens[slot])

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex, self._flocked():
            yield

    @contextmanager
    def _flocked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- reading ----------------------------------------------------------------

    def read(self) -> LedgerView:
        """The limit and the claims of live processes (dead ones' slots are
        cleared on the way)."""
        with self._locked():
            self._forget_dead()
            claims: dict[ProcessId, int] = {}
            for i in range(SLOTS):
                process = self._holder(i)
                if process is not None:
                    claims[process] = claims.get(process, 0) + self._claims[i]
            return LedgerView(self.device, self._limit_now(), claims)


def _open(path: Path) -> int:
    """A read-write descriptor of the ledger at ``path``, made if missing.

    A new ledger is written whole under a temporary name and linked into
    place, so no process ever sees a half-made one.
    """
    try:
        fd = _open_file(path)
    except FileNotFoundError:
        _create(path)
        fd = _open_file(path)
    try:
        _validate(path, fd)
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
            raise _foreign(path, f"is a symbolic link {where}; a ledger is a file") from None
        raise _foreign(path, f"cannot be opened ({exc.strerror})") from None


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


def _validate(path: Path, fd: int) -> None:
    size = os.fstat(fd).st_size
    if size != FILE_BYTES:
        raise _foreign(path, f"is {size} bytes long, not {FILE_BYTES}")
    magic, version, slots, limit, revision, high = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if magic != MAGIC:
        raise _foreign(path, f"does not start with {MAGIC!r}")
    if version != VERSION or slots != SLOTS:
        raise _foreign(
            path,
            f"is a version {version} ledger with {slots} slots; this extensible-kv "
            f"reads version {VERSION} with {SLOTS}",
        )
    if limit < -1 or revision < 0 or not 0 <= high <= SLOTS:
        raise _foreign(path, f"holds a limit of {limit} at revision {revision}, {high} slots")


def _foreign(path: Path, what: str) -> StateDirError:
    return StateDirError(
        f"{path} is not an extensible-kv ledger: it {what}. Remove it (the processes "
        f"using that device lose their shared budget) or set EXTENSIBLE_KV_STATE_DIR "
        f"to another directory"
    )
