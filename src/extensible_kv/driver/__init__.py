"""Virtual memory drivers: one protocol, a backend per device kind, and adaptors.

Only this package talks to a driver; everything above it speaks the
:class:`Driver` protocol in bytes and integer handles. The budget's adaptor
and the default stack live above it (``budget/adaptor.py``, ``devices.py``);
their names stay importable from here, as they were before they moved.
"""

from typing import Any

from extensible_kv.driver.adaptors import (
    CallStats,
    DriverAdaptor,
    FaultInjectingDriver,
    LiveUsage,
    StatisticsDriver,
)
from extensible_kv.driver.errors import (
    BackendUnavailableError,
    BudgetExceededError,
    DriverError,
    OutOfMemoryError,
)
from extensible_kv.driver.host import HostDriver
from extensible_kv.driver.pool import PoolingDriver, drain_pools
from extensible_kv.driver.protocol import ADAPTOR_CALLS, DRIVER_CALLS, Backend, Driver
from extensible_kv.driver.select import (
    DeviceSpec,
    backend,
    device_with_uuid,
    parse_device,
    unavailable_reason,
)

#: Names that moved above this package, kept importable from here.
_MOVED = ("BudgetDriver", "get_driver", "waiting_for_budget")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from extensible_kv import devices

        return getattr(devices, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADAPTOR_CALLS",
    "DRIVER_CALLS",
    "Backend",
    "BackendUnavailableError",
    "BudgetDriver",
    "BudgetExceededError",
    "CallStats",
    "DeviceSpec",
    "Driver",
    "DriverAdaptor",
    "DriverError",
    "FaultInjectingDriver",
    "HostDriver",
    "LiveUsage",
    "OutOfMemoryError",
    "PoolingDriver",
    "StatisticsDriver",
    "backend",
    "device_with_uuid",
    "drain_pools",
    "get_driver",
    "parse_device",
    "unavailable_reason",
    "waiting_for_budget",
]
