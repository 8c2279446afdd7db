"""Per-device limits, and each process's floor and cap, by device name:
what ``extensible-kv limit`` sets, for engines and RL frameworks to call as
well.

A device is named as torch names it (``"cpu"``, ``"cuda:1"``) in the calling
process, or by its UUID (``GPU-...``, ``host-...``: see
``ExtensibleTensor.device_uuid``), which is the same in every process. The
limit itself is kept under the UUID, so processes that see the device under
other ordinals (``CUDA_VISIBLE_DEVICES``) share it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from enum import Enum
from typing import Final

import torch

from extensible_kv._checks import check_int
from extensible_kv.budget import (
    Ledger,
    LedgerView,
    Limit,
    StaleRevisionError,
    parse_size,
    state_dir,
)
from extensible_kv.budget.holders import check_limit, check_revision, check_size
from extensible_kv.budget.ledger import check_uuid
from extensible_kv.budget.snapshot import read_ledgers
from extensible_kv.devices import get_driver
from extensible_kv.driver import parse_device


@dataclass(frozen=True)
class NamedDevice:
    """A device as the user named it, and its UUID."""

    name: str
    uuid: str


def named_device(device: object) -> NamedDevice:
    """Read ``device`` (``"cpu"``, ``"cuda:N"``, a ``torch.device``, or a
    device UUID); ValueError or BackendUnavailableError saying why not."""
    if isinstance(device, str) and device.startswith(("GPU-", "host-")):
        check_uuid(device)
        return NamedDevice(device, device)
    spec = parse_device(device)
    if spec.type == "cpu":
        return NamedDevice("cpu", get_driver("cpu").device_uuid(0))
    index = torch.cuda.current_device() if spec.index is None else spec.index
    return NamedDevice(f"cuda:{index}", get_driver(spec).device_uuid(index))


def total_bytes(device: NamedDevice) -> int | None:
    """The device's memory in bytes, when this process can see it."""
    if device.uuid.startswith("host-"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.name.startswith("cuda:"):
        return int(torch.cuda.get_device_properties(int(device.name[5:])).total_memory)
    return None


def device_limit(device: object) -> Limit:
    """``device``'s limit and its revision (no limit: ``Limit(None, r)``)."""
    ledger = Ledger(state_dir(), named_device(device).uuid)
    try:
        return ledger.limit()
    finally:
        ledger.close()


def set_device_limit(
    device: object, limit: int | str | None, *, expect_revision: int | None = None
) -> Limit:
    """Limit what every process may claim on ``device`` together.

    Args:
        device: ``"cpu"``, ``"cuda:N"``, a ``torch.device`` or a device UUID.
        limit: bytes (1 to 2**63 - 1), a size such as ``"8GiB"`` or ``"50%"``
            of the device, or None (or ``"off"``) for no limit.
        expect_revision: an int: write only if the limit is still at this
            revision (the one read before deciding), else raise
            :class:`~extensible_kv.budget.StaleRevisionError`.

    Memory already claimed stays; a limit below it refuses new claims until
    enough is given back. Returns the new limit and revision.
    """
    named = named_device(device)
    if isinstance(limit, str):
        limit = None if limit == "off" else parse_size(limit, total_bytes(named))
    else:
        check_limit("limit", limit)
    check_revision("expect_revision", expect_revision)
    ledger = Ledger(state_dir(), named.uuid)
    try:
        return ledger.set_limit(limit, expect_revision)
    finally:
        ledger.close()


def all_limits() -> dict[str, Limit]:
    """Every device with a ledger in the state directory, by UUID."""
    return {view.device: view.limit for view in read_ledgers(state_dir())}


class Keep(Enum):
    """The type of :data:`KEEP`."""

    KEEP = "keep"


#: Leave a floor or a cap as the ledger has it.
KEEP: Final = Keep.KEEP
#: Tries of a write that keeps one of the two, when another write lands
#: between its read and its write.
_TRIES = 5
_NONE = ("none", "off")


@dataclass(frozen=True)
class FloorAndCap:
    """A process's floor and cap on a device as a write left them.

    Attributes:
        floor_bytes: kept for the process while it holds less (0: none).
        cap_bytes: the most it may claim (None: no cap).
        revision: the device's revision the write made.
    """

    floor_bytes: int
    cap_bytes: int | None
    revision: int


def set_floor_and_cap(
    device: object,
    pid: int,
    *,
    floor: int | str | Keep = KEEP,
    cap: int | str | Keep | None = KEEP,
    expect_revision: int | None = None,
) -> FloorAndCap:
    """Keep ``floor`` for process ``pid`` on ``device`` while it holds less,
    and let it claim at most ``cap`` (see docs/budget.md).

    Args:
        device: ``"cpu"``, ``"cuda:N"``, a ``torch.device`` or a device UUID.
        pid: a live process that has claimed memory on the device.
        floor: bytes, a size such as ``"2GiB"`` or ``"10%"`` of the device,
            0 (or ``"none"``) for none, or :data:`KEEP` for the one it has.
        cap: bytes (at least 1), a size, None (or ``"none"``) for none, or
            :data:`KEEP` for the one it has.
        expect_revision: an int: write only if the device is still at this
            revision, else raise :class:`StaleRevisionError`. Without it, a
            write that keeps one of the two is tried again when another
            write lands between its read and its own.

    Refused with ValueError, nothing written: a floor above the cap, a
    process with no claim on the device, floors past the device's limit.
    """
    named = named_device(device)
    if check_int("pid", pid) < 1:
        raise ValueError(f"pid must be at least 1, got {pid}")
    total = total_bytes(named) if isinstance(floor, str) or isinstance(cap, str) else None
    floor_bytes = floor if floor is KEEP else read_floor(floor, total)
    cap_bytes = cap if cap is KEEP else read_cap(cap, total)
    check_revision("expect_revision", expect_revision)
    keeps = KEEP in (floor_bytes, cap_bytes)
    tries = _TRIES if keeps and expect_revision is None else 1
    ledger = Ledger(state_dir(), named.uuid)
    try:
        for _ in range(tries - 1):
            with contextlib.suppress(StaleRevisionError):
                return _write(ledger, pid, floor_bytes, cap_bytes, expect_revision)
        return _write(ledger, pid, floor_bytes, cap_bytes, expect_revision)
    finally:
        ledger.close()


def _write(
    ledger: Ledger,
    pid: int,
    floor: int | Keep,
    cap: int | Keep | None,
    expect_revision: int | None,
) -> FloorAndCap:
    """One write of process ``pid``'s floor and cap; one kept is read first,
    and the write expects the revision read."""
    if KEEP in (floor, cap):
        view = ledger.read()
        now_floor, now_cap = _floor_and_cap(view, pid)
        floor = now_floor if floor is KEEP else floor
        cap = now_cap if cap is KEEP else cap
        if expect_revision is None:
            expect_revision = view.limit.revision
    assert not isinstance(floor, Keep)
    assert not isinstance(cap, Keep)
    written = ledger.set_floor_and_cap(floor, cap, pid, expect_revision)
    return FloorAndCap(floor, cap, written.revision)


def _floor_and_cap(view: LedgerView, pid: int) -> tuple[int, int | None]:
    """Process ``pid``'s floor and cap in ``view`` (0 and None: none)."""
    for process, held in view.holders.items():
        if process.pid == pid:
            return held.floor_bytes, held.cap_bytes
    return 0, None


def read_floor(floor: int | str, device_bytes: int | None = None) -> int:
    """A floor in bytes, from bytes (0 or more) or a size (``"0"`` or
    ``"none"``: none; a percentage of ``device_bytes``); ValueError or
    TypeError saying why not."""
    if isinstance(floor, str):
        if floor.strip().lower() in _NONE:
            return 0
        return parse_size(floor, device_bytes, zero=True)
    check_size("floor", floor)
    return floor


def read_cap(cap: int | str | None, device_bytes: int | None = None) -> int | None:
    """A cap in bytes, from bytes (1 or more) or a size (a percentage of
    ``device_bytes``), None or ``"none"`` for none; ValueError or TypeError
    saying why not."""
    if isinstance(cap, str):
        if cap.strip().lower() in _NONE:
            return None
        if parse_size(cap, device_bytes, zero=True) == 0:
            raise ValueError(f"a cap must be at least 1 byte, got {cap!r}; give none for no cap")
        return parse_size(cap, device_bytes)
    if cap is not None and check_int("cap", cap) < 1:
        raise ValueError(f"a cap must be at least 1 byte, got {cap}; give None for no cap")
    check_limit("cap", cap)
    return cap
