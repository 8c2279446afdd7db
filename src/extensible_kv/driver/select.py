"""Which backend serves a device, and why one cannot. The default stack over
it, with the budget, is :func:`extensible_kv.devices.get_driver`."""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass

import torch

from extensible_kv.driver._gpu import GpuDriver
from extensible_kv.driver.errors import BackendUnavailableError, DriverError
from extensible_kv.driver.host import HostDriver
from extensible_kv.driver.protocol import Driver

_DEVICE_TYPES = ("cpu", "cuda")
#: CUDA_ERROR_NO_DEVICE and hipErrorNoDevice.
_NO_DEVICE = 100
_DEVICE_RE = re.compile(r"(?P<type>[a-z]+)(?::(?P<index>[0-9]+))?")


@dataclass(frozen=True)
class DeviceSpec:
    """A device as the drivers see it: its type and ordinal (None: current)."""

    type: str
    index: int | None


def parse_device(device: object) -> DeviceSpec:
    """Read ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int (a CUDA ordinal) or a
    ``torch.device``; raise :class:`ValueError` naming the supported types."""
    if isinstance(device, bool):
        raise ValueError(f"device must be a torch.device, str or int, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device ordinal must be non-negative, got {device}")
        return DeviceSpec("cuda", device)
    if isinstance(device, str):
        match = _DEVICE_RE.fullmatch(device)
        if match is None:
            raise ValueError(f"cannot read device {device!r}; use 'cpu' or 'cuda:N'")
        kind, index = match["type"], match["index"]
        spec = DeviceSpec(kind, None if index is None else int(index))
    elif hasattr(device, "type") and hasattr(device, "index"):
        spec = DeviceSpec(str(device.type), device.index)
    else:
        raise ValueError(f"device must be a torch.device, str or int, got {device!r}")
    if spec.type not in _DEVICE_TYPES:
        raise ValueError(
            f"device type {spec.type!r} is not supported; use 'cpu' (host "
            f"virtual memory) or 'cuda' (GPU virtual memory)"
        )
    if spec.type == "cpu" and spec.index not in (None, 0):
        raise ValueError(f"the host has one device, cpu:0; got cpu:{spec.index}")
    return DeviceSpec("cpu", 0) if spec.type == "cpu" else spec


@functools.cache
def _host_driver() -> HostDriver:
    return HostDriver()


def is_rocm() -> bool:
    """True on ROCm builds of torch, where "cuda" devices are AMD GPUs."""
    return bool(getattr(torch.version, "hip", None))


_gpu_lock = threading.Lock()
_gpu: GpuDriver | None = None


def _gpu_driver() -> GpuDriver:
    """The process's GPU driver, made on first use: HIP on ROCm torch, else CUDA.

    Raises ImportError (no bindings), RuntimeError (no driver library) or
    DriverError (initialization failed); a later call tries again.
    """
    global _gpu
    with _gpu_lock:
        if _gpu is None:
            _initialize_torch()
            if is_rocm():
                from extensible_kv.driver.hip import HipDriver

                _gpu = HipDriver()
            else:
                from extensible_kv.driver.cuda import CudaDriver

                _gpu = CudaDriver()
        return _gpu


def device_with_uuid(driver: Driver, uuid: str) -> int:
    """The ordinal under which ``driver`` sees the device named ``uuid``
    (processes may see different devices, or the same in another order)."""
    seen = [driver.device_uuid(ordinal) for ordinal in range(driver.device_count())]
    if uuid not in seen:
        raise ValueError(
            f"device {uuid} is not visible to this process, which sees "
            f"{', '.join(seen) or 'no device'} (check CUDA_VISIBLE_DEVICES)"
        )
    return seen.index(uuid)


def _initialize_torch() -> None:
    """Initialize CUDA (or ROCm) through torch before the driver is touched.

    The backend's ``cuInit`` and primary context would otherwise initialize
    the device while ``torch.cuda.is_initialized()`` stays False, and an
    engine that checks that flag before forking workers would fork with
    CUDA initialized underneath. A torch without GPU support is left alone.
    """
    if torch.cuda.is_available():
        torch.cuda.init()  # type: ignore[no-untyped-call]


def backend(device: object) -> Driver:
    """The backend serving ``device``'s type itself, with no adaptor above
    it (its own extras, such as ``CudaDriver.capabilities``, are there);
    raises :class:`BackendUnavailableError` saying why when there is none."""
    spec = parse_device(device)
    reason = unavailable_reason(spec)
    if reason is not None:
        raise BackendUnavailableError(f"no virtual memory backend for {spec.type}: {reason}")
    if spec.type == "cpu":
        return _host_driver()
    return _gpu_driver()


def unavailable_reason(device: object = "cuda") -> str | None:
    """Why virtual memory management cannot be used on ``device``, or None.

    Probes the device (bindings import, driver loads, device exists and
    supports VMM, granularity, reserve and free) and never raises: an
    unreadable device is itself a reason. A device found usable is not
    probed again; one that is not is probed again on the next call, since
    what was missing (a driver, a free device) may have come since.
    ``"cuda"`` without an ordinal probes the current device, as vLLM's does.
    """
    try:
        spec = parse_device(device)
    except ValueError as exc:
        return str(exc)
    key = (spec.type, _ordinal(spec))
    if key in _usable:
        return None
    reason = _probe(*key)
    if reason is None:
        _usable.add(key)
    return reason


def _ordinal(spec: DeviceSpec) -> int | None:
    """The ordinal to probe: the one given, else torch's current device
    (which initializes CUDA, as the probe would); None on the host or when
    torch sees no GPU (the probe then says why)."""
    if spec.index is not None or spec.type == "cpu" or not torch.cuda.is_available():
        return spec.index
    return int(torch.cuda.current_device())


#: Devices whose probe passed, as (type, index).
_usable: set[tuple[str, int | None]] = set()


def _probe(kind: str, index: int | None) -> str | None:
    if kind == "cpu":
        try:
            driver = _host_driver()
            size = driver.granularity(0, False)
            driver.free_reserved(driver.reserve(size, size), size)
        except (DriverError, OSError) as exc:
            return str(exc)
        return None
    backend, package, extra = (
        ("HIP", "hip-python", "rocm")
        if is_rocm()
        else ("CUDA", "cuda-python's cuda-bindings", "cuda")
    )
    try:
        gpu = _gpu_driver()
    except ImportError as exc:
        return f"{package} is not installed ({exc}): pip install 'extensible-kv[{extra}]'"
    except DriverError as exc:
        if exc.code == _NO_DEVICE:
            return f"no {backend} device is visible to this process ({exc})"
        return f"the {backend} driver failed to initialize: {exc}"
    except RuntimeError as exc:
        return f"the {backend} driver library could not be loaded: {exc}"
    return gpu.unavailable_reason(0 if index is None else index)
