"""Errors raised by drivers, carrying the failing call and the driver's own code."""

from __future__ import annotations

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
