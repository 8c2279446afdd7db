"""The composition root: the driver stack every tensor and cache gets by
default, a device's backend under the budget shared by every process
(:class:`~extensible_kv.budget.adaptor.BudgetDriver`), and what a tensor is
given to name its device and streams, made concrete. The one module that
puts the driver and the budget together; below it ``driver/`` knows no budget.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from extensible_kv.budget.adaptor import BudgetDriver, waiting_for_budget, without_wants
from extensible_kv.driver.protocol import Driver
from extensible_kv.driver.select import backend, parse_device

__all__ = [
    "BudgetDriver",
    "get_driver",
    "resolve_device",
    "stream_handles",
    "waiting_for_budget",
    "without_wants",
]

#: The DLPack device types a driver may serve, by torch's device type.
_DLPACK_TYPES = {"cpu": (1,), "cuda": (2, 10)}

_budgets_lock = threading.Lock()
#: The budget adaptor over each backend, by the backend's id (backends live
#: as long as the process).
_budgets: dict[int, BudgetDriver] = {}


def get_driver(device: object) -> Driver:
    """The shared driver for ``device``'s type: its backend under a
    :class:`~extensible_kv.budget.adaptor.BudgetDriver`, so that every
    process's commits count against the device's shared limit
    (``extensible-kv limit``) and show in ``extensible-kv top``. Raises
    :class:`~extensible_kv.driver.BackendUnavailableError` saying why when
    there is none."""
    return _with_budget(backend(device))


def _with_budget(below: Driver) -> BudgetDriver:
    with _budgets_lock:
        found = _budgets.get(id(below))
        if found is None or found.inner is not below:
            found = _budgets[id(below)] = BudgetDriver(below)
        return found


def resolve_device(
    device: torch.device | str | int | None, driver: Driver | None
) -> tuple[torch.device, Driver]:
    """The concrete device (with its ordinal) and the driver serving it:
    ``device`` None is the current CUDA device if there is one, else the
    host; ``driver`` None is :func:`get_driver`'s, and a driver given must
    serve that kind of device (a ValueError says so)."""
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    spec = parse_device(device)
    if driver is None:
        driver = get_driver(spec)
    elif driver.dlpack_device_type not in _DLPACK_TYPES[spec.type]:
        raise ValueError(
            f"driver {driver!r} serves DLPack device type {driver.dlpack_device_type}, "
            f"which is not a {spec.type} device"
        )
    if spec.type == "cpu":
        return torch.device("cpu"), driver
    index = torch.cuda.current_device() if spec.index is None else spec.index
    return torch.device("cuda", index), driver


def stream_handles(streams: Iterable[Any] | None) -> tuple[int, ...] | None:
    """Driver handles of ``streams`` (``torch.cuda.Stream`` objects or ints);
    None stays None (the whole device). A handle is a pointer: an int from 0
    (the legacy default stream) to ``2**64 - 1``; anything else is refused
    here rather than at the next wait, in the driver's bindings."""
    if streams is None:
        return None
    handles = []
    for stream in streams:
        handle = getattr(stream, "cuda_stream", stream)
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError(
                f"a stream is a torch.cuda.Stream or an int handle, got "
                f"{type(handle).__name__} {handle!r}"
            )
        if not 0 <= handle < 1 << 64:
            raise ValueError(f"a stream handle is 0 to 2**64 - 1 (a pointer), got {handle}")
        handles.append(handle)
    return tuple(handles)
