"""One look at the whole state directory: every device, its limit, and every
live process's claims and caches; what ``extensible-kv top --once --json``
prints (schema in docs/budget.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from extensible_kv.budget.holders import Holder, LedgerView
from extensible_kv.budget.ledger import Ledger
from extensible_kv.budget.liveness import ProcessId, forget_dead, is_alive
from extensible_kv.budget.publish import PROCESS_SCHEMA
from extensible_kv.budget.state_dir import STATE_DIR_ENV, StateDirError, prepare

#: Version of the snapshot's layout; a change that removes or renames a key
#: increments it (keys are added within a version: docs/budget.md).
SCHEMA_VERSION = 1

_CACHE_KEYS = {
    "kind": str,
    "device": str,
    "device_uuid": str,
    "reserved_bytes": int,
    "committed_bytes": int,
    "physical_bytes": int,
}


def device_type(uuid: str) -> str:
    """``cpu`` for the host's memory, ``cuda`` for a GPU."""
    return "cpu" if uuid.startswith("host-") else "cuda"


def read_ledgers(state_dir: Path) -> list[LedgerView]:
    """Every device's ledger in ``state_dir``, by name; a file there that is
    not one raises :class:`StateDirError`."""
    prepare(state_dir)
    views = []
    for path in sorted((state_dir / "devices").iterdir()):
        if path.name.startswith("."):  # a ledger being made
            continue
        # A symbolic link goes on to Ledger, which says where it points.
        if path.suffix != ".ledger" or not (path.is_file() or path.is_symlink()):
            raise _foreign(path, "is not a device ledger (*.ledger)")
        try:
            ledger = Ledger(state_dir, path.stem)
        except ValueError:
            raise _foreign(path, "is not named after a device") from None
        try:
            views.append(ledger.read())
        finally:
            ledger.close()
    return views


def read_processes(state_dir: Path) -> dict[ProcessId, dict[str, Any]]:
    """What every live process published, by its id; the files of dead
    processes are removed on the way."""
    prepare(state_dir)
    files: dict[ProcessId, list[Path]] = {}
    for path in sorted((state_dir / "procs").iterdir()):
        if path.name.startswith("."):  # a file being written
            continue
        process = ProcessId.from_stem(path.stem)
        if process is None or path.suffix not in (".json", ".lock"):
            raise _foreign(path, "is not a process's file (<pid>-<token>.json or .lock)")
        files.setdefault(process, []).append(path)
    found: dict[ProcessId, dict[str, Any]] = {}
    for process, paths in files.items():
        if not is_alive(state_dir, process):
            forget_dead(state_dir, process)
            continue
        for path in paths:
            if path.suffix == ".json":
                found[process] = _read_record(path, process)
    return found


def _read_record(path: Path, process: ProcessId) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {"pid": process.pid, "command": "", "caches": []}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _foreign(path, f"cannot be read as JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("schema_version") != PROCESS_SCHEMA:
        raise _foreign(path, f"is not a version {PROCESS_SCHEMA} process record")
    caches = record.get("caches")
    if record.get("pid") != process.pid or not isinstance(caches, list):
        raise _foreign(path, "does not hold its process's pid and a list of caches")
    for cache in caches:
        if not isinstance(cache, dict) or not all(
            isinstance(cache.get(key), kind) for key, kind in _CACHE_KEYS.items()
        ):
            raise _foreign(path, f"holds a cache without {', '.join(_CACHE_KEYS)}")
    return record


def snapshot(state_dir: Path) -> dict[str, Any]:
    """The state directory as one JSON-ready document:
    ``{"schema_version", "state_dir", "devices": [{"device", "type",
    "limit_bytes", "revision", "claimed_bytes", "processes": [{"pid",
    "command", "claimed_bytes", "wanted_bytes", "floor_bytes", "cap_bytes",
    "waited_s", "wanting_s", "in_use_bytes", "cached_bytes", "caches":
    [...]}]}]}``;
    devices by UUID, processes by pid (keys: docs/budget.md)."""
    ledgers = {view.device: view for view in read_ledgers(state_dir)}
    records = read_processes(state_dir)
    uuids = set(ledgers)
    for record in records.values():
        uuids.update(cache["device_uuid"] for cache in record["caches"])
    devices = []
    for uuid in sorted(uuids):
        view = ledgers.get(uuid)
        holders = {} if view is None else view.holders
        processes = []
        for process in sorted(set(holders) | set(records), key=lambda p: (p.pid, p.token)):
            record = records.get(process, {})
            caches = [c for c in record.get("caches", []) if c["device_uuid"] == uuid]
            if process not in holders and not caches:
                continue
            processes.append(_process(process, record, holders.get(process), caches))
        devices.append(
            {
                "device": uuid,
                "type": device_type(uuid),
                "limit_bytes": None if view is None else view.limit.bytes,
                "revision": 0 if view is None else view.limit.revision,
                "claimed_bytes": sum(held.claimed_bytes for held in holders.values()),
                "processes": processes,
            }
        )
    return {"schema_version": SCHEMA_VERSION, "state_dir": str(state_dir), "devices": devices}


def _process(
    process: ProcessId,
    record: dict[str, Any],
    held: Holder | None,
    caches: list[dict[str, Any]],
) -> dict[str, Any]:
    """One process on one device: its entry in the ledger (``held``; None:
    it has none there), what it published, and its ``caches`` there."""
    held = held or Holder(0)
    return {
        "pid": process.pid,
        "command": record.get("command", ""),
        "claimed_bytes": held.claimed_bytes,
        "wanted_bytes": held.wanted_bytes,
        "floor_bytes": held.floor_bytes,
        "cap_bytes": held.cap_bytes,
        "waited_s": held.waited_s,
        "wanting_s": held.wanting_s,
        "in_use_bytes": _summed(caches, "in_use_bytes"),
        "cached_bytes": _summed(caches, "cached_bytes"),
        "caches": caches,
    }


def _summed(caches: list[dict[str, Any]], key: str) -> int | None:
    """``key`` summed over the caches that report it (None: none does);
    a value that is not a whole number counts as not reported."""
    values = [
        value
        for cache in caches
        if isinstance(value := cache.get(key), int) and not isinstance(value, bool)
    ]
    return sum(values) if values else None


def _foreign(path: Path, what: str) -> StateDirError:
    return StateDirError(
        f"{path} {what}: the state directory holds a file extensible-kv did not write. "
        f"Remove it, or set {STATE_DIR_ENV} to another directory"
    )
