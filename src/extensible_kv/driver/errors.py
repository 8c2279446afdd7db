"""Errors raised by drivers, carrying the failing call and the driver's own code."""

from __future__ import annotations

import errno
from typing import Any

import torch


class DriverError(RuntimeError):
    """A driver call failed.

    Attributes:
        call: the protocol or driver function that failed (``"cuMemMap"``, ``"mmap"``).
        code: the driver's numeric error code (a ``CUresult``, ``hipError_t`` or errno).
        name: the symbolic name of ``code`` (``"CUDA_ERROR_INVALID_VALUE"``, ``"ENOMEM"``).
    """

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        super().__init__(f"{call} failed with {name} ({code}): {message}")
        self.call = call
        self.code = code
        self.name = name
        self.message = message

    def __reduce__(self) -> tuple[type[DriverError], tuple[str, int, str, str]]:
        return (type(self), (self.call, self.code, self.name, self.message))


class OutOfMemoryError(DriverError, torch.OutOfMemoryError):
    """The driver could not provide the physical memory or address space asked for.

    A subclass of ``torch.OutOfMemoryError`` so that an engine's existing
    out-of-memory handlers catch it.
    """


class BackendUnavailableError(RuntimeError):
    """No virtual memory backend can serve the device; the text says why."""


class BudgetExceededError(OutOfMemoryError):
    """A claim would take a device past the limit every process shares
    (``extensible-kv limit``); the driver was not called.

    Attributes:
        device: the device's UUID, as every process names it.
        limit_bytes: the device's limit.
        asked_bytes: what this claim asked for.
        holders: ``(pid, claimed_bytes, command_line)`` of each live process
            holding a claim on the device, this one included.
    """

    def __init__(
        self,
        device: str,
        limit_bytes: int,
        asked_bytes: int,
        holders: tuple[tuple[int, int, str], ...],
        detail: str,
    ) -> None:
        super().__init__("create", errno.ENOMEM, "BUDGET_EXCEEDED", detail)
        self.device = device
        self.limit_bytes = limit_bytes
        self.asked_bytes = asked_bytes
        self.holders = holders

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.device, self.limit_bytes, self.asked_bytes, self.holders, self.message),
        )
