"""Which processes are alive, told by locks the OS lets go of when they die.

Each process that uses a state directory creates ``procs/<pid>-<token>.lock``
and holds an exclusive ``flock`` on it for the rest of its life. The kernel
drops that lock when the last descriptor of the file goes, which is when the
process exits, however it exits (SIGKILL and OOM kills included). Another
process asks whether the owner lives by trying a shared lock without waiting:
refused means alive. A PID alone could not say this: PIDs are reused, and a
PID check cannot tell a live process from a new one that took its number.
The random token makes a registration unique even when a PID comes back.

Liveness is never decided on a file its owner has not locked yet. Creating a
file and locking it are two steps, and a reader that opened the file between
them would be granted its shared lock, conclude "dead", and remove the files
of a process that is about to claim memory; the ledger would then zero that
process's slot while it holds memory, and hand the slot to another. So the
owner creates and locks the file under a temporary name that starts with a
dot (``.<pid>-<token>.lock.tmp``, which readers skip), and only then links it
to its final name: the final name exists only ever locked, and the lock goes
with the inode, not the name. A reader that finds the final name unlocked
therefore sees a dead owner, and the name cannot come back for another
process (a new registration takes a new token, and a link never replaces a
file), so removing it by name after the check removes nothing alive.

Can a live process still be taken for dead, and its files removed? Not
through this module. Something outside it can: removing the file (the state
directory removed while processes use it, a cleaner of old files in /tmp) or
closing the descriptor (a daemon closing every descriptor it has); every
other process then takes the owner for dead. The owner does not watch for
that: a check would cost a system call on paths that make none (a claim
without a limit is a store into a mapping), and could not undo what the
others did on seeing it dead (its claims zeroed, its slot handed on). A
process killed while it registers may leave its temporary file behind;
nothing reads it, and the directory is emptied at reboot.

A forked child inherits the descriptor, and with it the lock; so that a
parent's death is seen while its child lives on, the child closes its copy
(``os.register_at_fork``) and registers itself afresh when it needs to.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessId:
    """One process's registration: its PID and a random 63-bit token."""

    pid: int
    token: int

    @property
    def stem(self) -> str:
        return f"{self.pid}-{self.token:016x}"

    @classmethod
    def from_stem(cls, stem: str) -> ProcessId | None:
        """The id a file name stem spells, or None if it spells none."""
        pid, _, token = stem.partition("-")
        if not (pid.isdigit() and len(token) == 16):
            return None
        try:
            return cls(int(pid), int(token, 16))
        except ValueError:
            return None


_lock = threading.Lock()
#: This process's registration in each state directory, with its lock's descriptor.
_registered: dict[Path, tuple[ProcessId, int]] = {}


def this_process(state_dir: Path) -> ProcessId:
    """This process's id in ``state_dir``, registering it on first use."""
    with _lock:
        found = _registered.get(state_dir)
        if found is not None:
            return found[0]
        while True:
            me = ProcessId(os.getpid(), secrets.randbits(63))
            fd = _locked_in_place(lock_path(state_dir, me))
            if fd is not None:
                _registered[state_dir] = (me, fd)
                return me


def _locked_in_place(path: Path) -> int | None:
    """A descriptor holding the exclusive lock of a new file at ``path``, or
    None if that name is taken (another token is then drawn).

    The file is made and locked under a temporary name, then linked to
    ``path``: a reader never finds ``path`` unlocked while its owner lives.
    """
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(temporary, path)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        temporary.unlink(missing_ok=True)
    return fd


def lock_path(state_dir: Path, process: ProcessId) -> Path:
    return state_dir / "procs" / f"{process.stem}.lock"


def is_alive(state_dir: Path, process: ProcessId) -> bool:
    """True while the process holding ``process``'s registration lives."""
    try:
        fd = os.open(lock_path(state_dir, process), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def forget_dead(state_dir: Path, process: ProcessId) -> None:
    """Remove the files a dead process left in ``state_dir``'s ``procs``."""
    for suffix in (".json", ".lock"):
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "procs" / f"{process.stem}{suffix}").unlink()


def command_line(pid: int) -> str:
    """``pid``'s command line, from /proc (empty when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def one_line(command: str, width: int = 60) -> str:
    """A command line on one line, cut to ``width`` characters ("?" if empty)."""
    command = " ".join(command.split()) or "?"
    return command if len(command) <= width else command[: width - 1] + "…"


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for _, fd in _registered.values():
        os.close(fd)
    _registered.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
