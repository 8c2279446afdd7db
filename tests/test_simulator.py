"""The driver SIMULATOR (tests/gpusim) refuses what the CUDA documentation
says the driver refuses, with the driver's own code, so that the backends'
tests over it mean something. Each rule, one test; HIP where it differs.

Passing the simulator is not GPU verification (docs/gpu-validation.md).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from child import run_python
from gpusim import Code, HipMemAllocationPropC, MiB, SimCuda, SimMachine, cuda_sim, hip_sim

cuda = pytest.importorskip("cuda.bindings.driver")
G = 2 * MiB


def code(result: Any) -> int:
    return int(result[0])


@pytest.fixture
def machine() -> SimMachine:
    return SimMachine(devices=2, capacity=16 * G, posix_fd=True, rdma=False)


@pytest.fixture
def cu(machine: SimMachine) -> Iterator[SimCuda]:
    """Simulated CUDA with device 0's primary context current on this thread."""
    _, bindings = cuda_sim(machine)
    ctx = bindings.cuDevicePrimaryCtxRetain(cuda.CUdevice(0))[1]
    bindings.cuCtxPushCurrent(ctx)
    yield bindings
    bindings.cuCtxPopCurrent()


def prop(device: int = 0, posix: bool = False, rdma: bool = False) -> Any:
    p = cuda.CUmemAllocationProp()
    p.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    if posix:
        p.requestedHandleTypes = (
            cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
    if rdma:
        p.allocFlags.gpuDirectRDMACapable = 1
    return p


def access(device: int = 0) -> list[Any]:
    desc = cuda.CUmemAccessDesc()
    desc.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [desc]


def mapped(cu: SimCuda, granules: int, *, chunks: int = 1) -> tuple[int, list[int]]:
    """A reservation with ``granules`` mapped as ``chunks`` equal chunks, accessible."""
    ptr = int(cu.cuMemAddressReserve(8 * G, G, 0, 0)[1])
    size = granules * G // chunks
    handles = []
    for i in range(chunks):
        handles.append(int(cu.cuMemCreate(size, prop(), 0)[1]))
        assert code(cu.cuMemMap(ptr + i * size, size, 0, handles[-1], 0)) == 0
    assert code(cu.cuMemSetAccess(ptr, granules * G, access(), 1)) == 0
    return ptr, handles


def test_memory_calls_need_a_context_current_on_the_calling_thread(
    machine: SimMachine, cu: SimCuda
) -> None:
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(code(cu.cuMemCreate(G, prop(), 0))))
    thread.start()
    thread.join()
    assert results == [Code.INVALID_CONTEXT]
    assert code(cu.cuMemAddressReserve(G, G, 0, 0)) == 0, "this thread has one"
    assert machine.used() == 0


def test_sizes_addresses_flags_and_offsets_follow_the_rules(cu: SimCuda) -> None:
    assert code(cu.cuMemCreate(G + 4096, prop(), 0)) == Code.INVALID_VALUE
    assert code(cu.cuMemCreate(G, prop(), 1)) == Code.INVALID_VALUE
    assert code(cu.cuMemAddressReserve(G + 4096, 0, 0, 0)) == Code.INVALID_VALUE
    assert code(cu.cuMemAddressReserve(G, 3 * G, 0, 0)) == Code.INVALID_VALUE
    assert code(cu.cuMemAddressReserve(G, 0, 0, 1)) == Code.INVALID_VALUE
    ptr = int(cu.cuMemAddressReserve(4 * G, G, 0, 0)[1])
    handle = int(cu.cuMemCreate(G, prop(), 0)[1])
    assert code(cu.cuMemMap(ptr + 4096, G, 0, handle, 0)) == Code.INVALID_VALUE
    assert code(cu.cuMemMap(ptr, G, G, handle, 0)) == Code.INVALID_VALUE
    assert code(cu.cuMemMap(ptr, G, 0, handle, 1)) == Code.INVALID_VALUE
    assert code(cu.cuMemMap(ptr + 4 * G, G, 0, handle, 0)) == Code.INVALID_VALUE, "outside"
    assert code(cu.cuMemMap(ptr, G, 0, handle, 0)) == 0
    assert code(cu.cuMemMap(ptr, G, 0, handle, 0)) == Code.INVALID_VALUE, "mapped twice"


def test_granularity_depends_on_the_properties_and_the_option(machine: SimMachine) -> None:
    machine.devices[0].rdma = True
    _, cu = cuda_sim(machine)
    cu.cuCtxPushCurrent(cu.cuDevicePrimaryCtxRetain(cuda.CUdevice(0))[1])
    flags = cuda.CUmemAllocationGranularity_flags
    minimum = flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    recommended = flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    assert cu.cuMemGetAllocationGranularity(prop(), minimum)[1] == G
    assert cu.cuMemGetAllocationGranularity(prop(), recommended)[1] == 2 * G
    assert cu.cuMemGetAllocationGranularity(prop(posix=True), minimum)[1] == 2 * G
    assert cu.cuMemGetAllocationGranularity(prop(rdma=True), minimum)[1] == 2 * G
    assert code(cu.cuMemCreate(G, prop(posix=True), 0)) == Code.INVALID_VALUE
    # A reservation with the default alignment is aligned to the smallest
    # granularity only: too little for shareable memory.
    ptr = int(cu.cuMemAddressReserve(4 * G, 0, 0, 0)[1])
    assert ptr % G == 0
    assert ptr % (2 * G) != 0
    assert int(cu.cuMemAddressReserve(4 * G, 2 * G, 0, 0)[1]) % (2 * G) == 0


def test_devices_must_exist_and_support_what_is_asked(cu: SimCuda) -> None:
    assert code(cu.cuMemCreate(G, prop(device=2), 0)) == Code.INVALID_DEVICE
    assert code(cu.cuMemCreate(2 * G, prop(rdma=True), 0)) == Code.NOT_SUPPORTED
    no_fd = SimMachine(posix_fd=False)
    _, other = cuda_sim(no_fd)
    other.cuCtxPushCurrent(other.cuDevicePrimaryCtxRetain(cuda.CUdevice(0))[1])
    assert code(other.cuMemCreate(2 * G, prop(posix=True), 0)) == Code.NOT_SUPPORTED


def test_unmap_covers_whole_mappings_and_access_needs_mapped_memory(cu: SimCuda) -> None:
    ptr, _ = mapped(cu, 2, chunks=1)
    assert code(cu.cuMemUnmap(ptr, G)) == Code.INVALID_VALUE, "part of a mapping"
    assert code(cu.cuMemSetAccess(ptr, 3 * G, access(), 1)) == Code.INVALID_VALUE
    assert code(cu.cuMemSetAccess(ptr, G, access(1), 1)) == Code.INVALID_DEVICE, "not its device"
    assert code(cu.cuMemUnmap(ptr, 2 * G)) == 0


def test_a_released_handle_keeps_its_memory_until_the_last_unmap(
    machine: SimMachine, cu: SimCuda
) -> None:
    ptr, (handle,) = mapped(cu, 1)
    ctypes.memset(ptr, 7, G)
    assert code(cu.cuMemRelease(handle)) == 0
    assert machine.used() == G
    assert ctypes.string_at(ptr, 4) == b"\x07" * 4
    assert code(cu.cuMemRelease(handle)) == Code.INVALID_VALUE, "released twice"
    assert code(cu.cuMemUnmap(ptr, G)) == 0
    assert machine.used() == 0


def test_memory_runs_out_at_the_capacity(machine: SimMachine, cu: SimCuda) -> None:
    handle = int(cu.cuMemCreate(12 * G, prop(), 0)[1])
    assert code(cu.cuMemCreate(6 * G, prop(), 0)) == Code.OUT_OF_MEMORY
    assert code(cu.cuMemCreate(4 * G, prop(), 0)) == 0
    cu.cuMemRelease(handle)


def test_new_memory_holds_garbage_not_zeros(cu: SimCuda) -> None:
    ptr, _ = mapped(cu, 1)
    assert ctypes.string_at(ptr, 16) != bytes(16)


def test_unmapping_under_work_in_flight_kills_the_context(machine: SimMachine, cu: SimCuda) -> None:
    ptr, _ = mapped(cu, 2, chunks=2)
    machine.launch(ptr + G, 64, 3, stream=1)
    assert code(cu.cuMemUnmap(ptr, G)) == 0, "no work touches the first chunk"
    assert code(cu.cuMemUnmap(ptr + G, G)) == Code.ILLEGAL_ADDRESS
    assert code(cu.cuMemCreate(G, prop(), 0)) == Code.ILLEGAL_ADDRESS, "sticky"
    assert code(cu.cuCtxSynchronize()) == Code.ILLEGAL_ADDRESS


def test_a_synchronize_completes_the_work_of_every_stream(machine: SimMachine, cu: SimCuda) -> None:
    ptr, _ = mapped(cu, 1)
    machine.launch(ptr, 8, 5, stream=1)
    machine.launch(ptr + 8, 8, 6, stream=2)
    assert ctypes.string_at(ptr, 1) != b"\x05", "not done before a synchronize"
    assert code(cu.cuCtxSynchronize()) == 0
    assert ctypes.string_at(ptr, 16) == b"\x05" * 8 + b"\x06" * 8
    assert code(cu.cuMemUnmap(ptr, G)) == 0


def test_a_kernel_touching_unmapped_memory_is_an_illegal_address(
    machine: SimMachine, cu: SimCuda
) -> None:
    ptr, _ = mapped(cu, 1)
    with pytest.raises(Exception, match="ILLEGAL_ADDRESS"):
        machine.launch(ptr + G, 8, 1)
    assert machine.sticky == Code.ILLEGAL_ADDRESS


def test_exported_fds_are_real_and_outlive_the_exporters_handle(cu: SimCuda) -> None:
    posix = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    plain = int(cu.cuMemCreate(G, prop(), 0)[1])
    assert code(cu.cuMemExportToShareableHandle(plain, posix, 0)) == Code.INVALID_VALUE
    handle = int(cu.cuMemCreate(2 * G, prop(posix=True), 0)[1])
    fd = int(cu.cuMemExportToShareableHandle(handle, posix, 0)[1])
    cu.cuMemRelease(handle)
    # The memory lives on in the fd: another process imports and maps it.
    child = run_python(
        f"""
        import sys, ctypes
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import cuda.bindings.driver as cuda
        from gpusim import cuda_sim
        driver, cu = cuda_sim()
        with driver.context(0):
            h = driver.import_handle({fd})
            p = driver.reserve({2 * G}, {2 * G})
            driver.map(p, {2 * G}, h)
            driver.set_access(p, {2 * G}, 0)
            ctypes.memset(p, 9, 8)
            print(ctypes.string_at(p, 8).hex())
        """,
        pass_fds=(fd,),
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "09" * 8
    os.close(fd)
    cu.cuMemRelease(plain)


# -- HIP ------------------------------------------------------------------------


@pytest.fixture
def hip_module() -> Any:
    return pytest.importorskip("hip").hip


def hip_prop(hip_module: Any, device: int) -> Any:
    p = hip_module.hipMemAllocationProp()
    p.type = hip_module.hipMemAllocationType.hipMemAllocationTypePinned
    p.location.type = hip_module.hipMemLocationType.hipMemLocationTypeDevice
    p.location.id = device
    return p


def test_hip_reads_the_struct_as_the_c_header_lays_it_out(hip_module: Any) -> None:
    p = hip_prop(hip_module, 1)
    assert ctypes.sizeof(HipMemAllocationPropC) == p.c_sizeof()
    c = HipMemAllocationPropC.from_address(p.as_c_void_p().value)
    assert (c.type, c.location.type, c.location.id, c.requestedHandleType) == (1, 1, 1, 0)


def test_hip_memory_calls_use_the_current_device(machine: SimMachine, hip_module: Any) -> None:
    _, hip = hip_sim(machine)
    assert int(hip.hipMemCreate(G, hip_prop(hip_module, 1), 0)[0]) == Code.INVALID_DEVICE
    hip.hipSetDevice(1)
    handle = hip.hipMemCreate(G, hip_prop(hip_module, 1), 0)[1]
    assert int(hip.hipMemRelease(int(handle))[0]) == 0
    assert hip.hipGetDevice()[1] == 1


def test_hip_exports_only_memory_created_with_the_handle_type(
    machine: SimMachine, hip_module: Any
) -> None:
    _, hip = hip_sim(machine)
    posix = hip_module.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
    handle = int(hip.hipMemCreate(G, hip_prop(hip_module, 0), 0)[1])
    out = ctypes.c_int(-1)
    result = hip.hipMemExportToShareableHandle(ctypes.addressof(out), handle, posix, 0)
    assert int(result[0]) == Code.INVALID_VALUE
    hip.hipMemRelease(handle)
