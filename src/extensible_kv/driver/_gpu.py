"""What the CUDA and HIP backends share: result checking, error translation,
probing, cached granularity and the shareable-memory fallback.

Both bindings return a tuple from every call whose first item is the error
code (0 on success) followed by the values the call produces.
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

from extensible_kv.driver.errors import DriverError, OutOfMemoryError


def format_uuid(raw: bytes) -> str:
    """16 bytes of a device UUID as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``
    (the form nvidia-smi and ``CUDA_VISIBLE_DEVICES`` use)."""
    h = bytes(raw[:16]).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class GpuDriver(ABC):
    """Base of the GPU backends; subclasses bind the calls to their module.

    Args:
        bindings: the bindings module (``cuda.bindings.driver`` or ``hip.hip``).
    """

    #: Name used in messages ("CUDA", "HIP").
    backend = ""
    dlpack_device_type = 0
    zeroes_new_memory = False
    #: The error code a backend returns when memory or addresses run out.
    out_of_memory_code = 2

    def __init__(self, bindings: Any) -> None:
        self._b = bindings
        self._lock = threading.Lock()
        self._granularity: dict[tuple[int, bool], int] = {}
        self._plain_only: set[int] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- results and errors ---------------------------------------------------

    @abstractmethod
    def _error_text(self, code: Any) -> tuple[str, str]:
        """The symbolic name and the description of an error code."""

    def _check(self, call: str, result: Any) -> Any:
        """The value(s) of a call's result tuple; raise on a failure code."""
        code = result[0]
        if int(code) != 0:
            name, message = self._error_text(code)
            error = OutOfMemoryError if int(code) == self.out_of_memory_code else DriverError
            raise error(call, int(code), name, message)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    # -- devices ----------------------------------------------------------------

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_uuid(self, device: int) -> str: ...

    @abstractmethod
    def supports_vmm(self, device: int) -> bool: ...

    @abstractmethod
    def context(self, device: int) -> AbstractContextManager[None]: ...

    def unavailable_reason(self, device: int) -> str | None:
        """Why ``device`` cannot use virtual memory management, or None.

        Checks that the device exists and supports VMM, then reserves and
        frees one granule. Never raises.
        """
        try:
            count = self.device_count()
            if count == 0:
                return f"no {self.backend} device is visible to this process"
            if device >= count:
                return f"cuda:{device} does not exist; {count} {self.backend} device(s) are visible"
            if not self.supports_vmm(device):
                return (
                    f"the {self.backend} driver does not support virtual memory management "
                    f"on cuda:{device} (WSL2 and some virtualized GPUs lack it)"
                )
            size = self.granularity(device, False)
            with self.context(device):
                self.free_reserved(self.reserve(size, size), size)
        except DriverError as exc:
            return f"probing cuda:{device} failed: {exc}"
        return None

    @abstractmethod
    def reserve(self, size: int, alignment: int) -> int: ...

    @abstractmethod
    def free_reserved(self, ptr: int, size: int) -> None: ...

    # -- allocation properties ------------------------------------------------

    @abstractmethod
    def _allocation_prop(self, device: int, shareable: bool) -> Any: ...

    def _prop_for(self, device: int, shareable: bool) -> Any:
        return self._allocation_prop(device, shareable and device not in self._plain_only)

    @abstractmethod
    def _query_granularity(self, prop: Any) -> int: ...

    def granularity(self, device: int, shareable: bool) -> int:
        key = (device, shareable)
        if key not in self._granularity:
            with self.context(device):
                granularity = self._query_granularity(self._prop_for(device, shareable))
            with self._lock:
                self._granularity[key] = granularity
        return self._granularity[key]

    # -- allocation -------------------------------------------------------------

    @abstractmethod
    def _create(self, size: int, prop: Any) -> int: ...

    def create(self, size: int, device: int, shareable: bool) -> int:
        with self.context(device):
            return self._create_on(size, device, shareable)

    def _create_on(self, size: int, device: int, shareable: bool) -> int:
        if not shareable or device in self._plain_only:
            return self._create(size, self._allocation_prop(device, False))

        try:
            return self._create(size, self._allocation_prop(device, True))
        except OutOfMemoryError:
            raise
        except DriverError as exc:
            with self._lock:
                first = device not in self._plain_only
                self._plain_only.add(device)
            if first:
                warnings.warn(
                    f"{self.backend} device {device} refused shareable memory ({exc}); "
                    f"allocating plain memory instead: it cannot be exported to other "
                    f"processes or registered for RDMA",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return self._create(size, self._allocation_prop(device, False))

    @abstractmethod
    def synchronize(self, device: int) -> None: ...

    @abstractmethod
    def release(self, handle: int) -> None: ...

    @abstractmethod
    def map(self, ptr: int, size: int, handle: int) -> None: ...

    @abstractmethod
    def unmap(self, ptr: int, size: int) -> None: ...

    @abstractmethod
    def set_access(self, ptr: int, size: int, device: int) -> None: ...

    @abstractmethod
    def export_handle(self, handle: int) -> int: ...

    @abstractmethod
    def import_handle(self, fd: int) -> int: ...
