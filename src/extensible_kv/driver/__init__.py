"""Virtual memory drivers: one protocol, a backend per device kind, and adaptors.

Only this package talks to a driver; everything above it speaks the
:class:`Driver` protocol in bytes and integer handles. The budget's adaptor
and the default stack live above it (``budget/adaptor.py``, ``devices.py``).
"""

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
from extensible_kv.driver.pool import PoolingDriver
from extensible_kv.driver.protocol import ADAPTOR_CALLS, DRIVER_CALLS, Backend, Driver
from extensible_kv.driver.select import (
    DeviceSpec,
    backend,
    device_with_uuid,
    parse_device,
    unavailable_reason,
)

__all__ = [
    "ADAPTOR_CALLS",
    "DRIVER_CALLS",
    "Backend",
    "BackendUnavailableError",
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
    "parse_device",
    "unavailable_reason",
]
