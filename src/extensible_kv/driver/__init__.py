"""Virtual memory drivers: one protocol, a backend per device kind, and adaptors.

Only this package talks to a driver; everything above it speaks the
:class:`Driver` protocol in bytes and integer handles.
"""

from extensible_kv.driver.adaptors import (
    CallStats,
    DriverAdaptor,
    FaultInjectingDriver,
    LiveUsage,
    StatisticsDriver,
)
from extensible_kv.driver.budgeted import BudgetDriver, waiting_for_budget
from extensible_kv.driver.errors import (
    BackendUnavailableError,
    BudgetExceededError,
    DriverError,
    OutOfMemoryError,
)
from extensible_kv.driver.host import HostDriver
from extensible_kv.driver.pool import PoolingDriver, drain_pools
from extensible_kv.driver.protocol import DRIVER_CALLS, Driver
from extensible_kv.driver.select import (
    DeviceSpec,
    backend,
    device_with_uuid,
    get_driver,
    parse_device,
    unavailable_reason,
)

__all__ = [
    "DRIVER_CALLS",
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
