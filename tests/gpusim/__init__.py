"""A LABELLED SIMULATOR of the GPU drivers, for machines without a GPU.

``SimCuda`` stands in for ``cuda.bindings.driver`` and ``SimHip`` for
``hip.hip`` at the one boundary no real thing reaches here: the GPU driver.
Above that boundary everything is the library's own code: the real
``CudaDriver`` and ``HipDriver`` run over the simulated bindings, with the
real bindings' types and structs. The simulated driver enforces the rules
the CUDA documentation states (contexts per thread, granularity, whole
mappings, access, handle types, capacity, garbage in new memory, work in
flight; see :mod:`gpusim.machine`) and fails with the real error codes.

Its memory is host memory, so views of it are CPU tensors
(:class:`HostViews`): the simulator checks the backends' driver calls and
the library's logic over them, not GPU kernels.

Passing tests against this simulator is NOT GPU verification: see
docs/gpu-validation.md for what has run on hardware.
"""

from __future__ import annotations

from typing import Any

from extensible_kv.driver import Driver, DriverAdaptor
from extensible_kv.driver.cuda import CudaDriver
from extensible_kv.driver.hip import HipDriver
from gpusim.bindings import HipMemAllocationPropC, SimCuda, SimHip
from gpusim.machine import Code, MiB, SimError, SimMachine, device_uuid


class HostViews(DriverAdaptor):
    """A simulated GPU driver whose memory torch sees as CPU memory (it is)."""

    @property
    def dlpack_device_type(self) -> int:
        return 1


def real_cuda_bindings() -> Any:
    import cuda.bindings.driver

    return cuda.bindings.driver


def real_hip_bindings() -> Any:
    import hip

    return hip.hip


def cuda_sim(machine: SimMachine | None = None) -> tuple[CudaDriver, SimCuda]:
    """The real CUDA backend over a simulated driver."""
    bindings = SimCuda(real_cuda_bindings(), machine or SimMachine())
    return CudaDriver(bindings), bindings


def hip_sim(
    machine: SimMachine | None = None, version: int = 70_100_000
) -> tuple[HipDriver, SimHip]:
    """The real HIP backend over a simulated runtime."""
    bindings = SimHip(real_hip_bindings(), machine or SimMachine(), version)
    return HipDriver(bindings), bindings


def sim_driver(kind: str, machine: SimMachine | None = None) -> tuple[Driver, SimCuda | SimHip]:
    """``"cuda-sim"`` or ``"hip-sim"``: the backend, with CPU views, and its bindings."""
    driver, bindings = cuda_sim(machine) if kind == "cuda-sim" else hip_sim(machine)
    return HostViews(driver), bindings


__all__ = [
    "Code",
    "HipMemAllocationPropC",
    "HostViews",
    "MiB",
    "SimCuda",
    "SimError",
    "SimHip",
    "SimMachine",
    "cuda_sim",
    "device_uuid",
    "hip_sim",
    "sim_driver",
]
