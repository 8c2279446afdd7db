"""Per-device limits by device name: what ``extensible-kv limit`` sets, for
engines and RL frameworks to call as well.

A device is named as torch names it (``"cpu"``, ``"cuda:1"``) in the calling
process, or by its UUID (``GPU-...``, ``host-...``: see
``ExtensibleTensor.device_uuid``), which is the same in every process. The
limit itself is kept under the UUID, so processes that see the device under
other ordinals (``CUDA_VISIBLE_DEVICES``) share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from extensible_kv.budget import Ledger, Limit, parse_size, state_dir
from extensible_kv.budget.holders import check_limit, check_revision
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
