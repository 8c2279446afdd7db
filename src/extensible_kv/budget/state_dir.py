"""Where the budget's shared state lives: one directory per user of the machine."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

#: The environment variable naming the state directory.
STATE_DIR_ENV = "EXTENSIBLE_KV_STATE_DIR"


class StateDirError(RuntimeError):
    """The state directory, or a file in it, is not what extensible-kv wrote:
    the text names the path and what to do about it."""


def state_dir() -> Path:
    """The state directory every process of this user shares, created if
    missing (mode 0700).

    ``$EXTENSIBLE_KV_STATE_DIR`` when set; else ``extensible-kv`` under
    ``$XDG_RUNTIME_DIR`` (the user's runtime directory, a tmpfs the system
    empties at logout); else ``/dev/shm/extensible-kv-<uid>``; else the
    temporary directory. Memory-backed locations are preferred: the state
    is small, rewritten often, and means nothing after a reboot.
    """
    chosen = os.environ.get(STATE_DIR_ENV)
    path = Path(chosen) if chosen else _default()
    prepare(path)
    return path


def _default() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "extensible-kv"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm") / f"extensible-kv-{os.getuid()}"
    return Path(tempfile.gettempdir()) / f"extensible-kv-{os.getuid()}"


def prepare(path: Path) -> None:
    """Make ``path`` and its ``devices`` and ``procs`` folders; refuse one that
    is not a directory this user owns, since every process trusts its files."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise StateDirError(
            f"cannot use the state directory {path}: {exc.strerror}; set "
            f"{STATE_DIR_ENV} to a writable directory"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"the state directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise StateDirError(
            f"the state directory {path} belongs to uid {info.st_uid}, not to this user "
            f"({os.getuid()}); set {STATE_DIR_ENV} to a directory of your own"
        )
    for sub in ("devices", "procs"):
        target = path / sub
        try:
            target.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StateDirError(f"cannot make {target}: {exc.strerror}") from None
        if not target.is_dir():
            raise StateDirError(
                f"{target} is not a directory: the state directory holds a foreign file; "
                f"remove it or set {STATE_DIR_ENV} elsewhere"
            )
