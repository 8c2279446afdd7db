"""The CUDA and HIP backends without a GPU: struct building against the real
bindings; contexts, devices, call order, errors and rollback over the
LABELLED driver simulator (tests/gpusim); and the no-driver path for real.

None of this is GPU verification; tests/test_gpu.py is, on a GPU machine.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from extensible_kv import (
    BackendUnavailableError,
    DriverError,
    ExtensibleTensor,
    FaultInjectingDriver,
    OutOfMemoryError,
    StatisticsDriver,
    VirtualBuffer,
    devices,
)
from extensible_kv.driver import select
from extensible_kv.driver.cuda import CudaDriver
from extensible_kv.driver.hip import HipDriver, request_posix_fd
from gpusim import (
    HipMemAllocationPropC,
    HostViews,
    MiB,
    SimCuda,
    SimHip,
    SimMachine,
    cuda_sim,
    hip_sim,
)

cuda_bindings = pytest.importorskip("cuda.bindings.driver")
G = 2 * MiB


@pytest.fixture
def fresh_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's GPU driver and probe results for the test."""
    monkeypatch.setattr(select, "_gpu", None)
    monkeypatch.setattr(select, "_usable", set())


def in_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` on a new thread (no context current there); its result or error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def current_context(bindings: SimCuda) -> int:
    return int(bindings.cuCtxGetCurrent()[1])


# -- structs, built from the real bindings' types ---------------------------


@pytest.mark.parametrize(("posix_fd", "rdma"), [(True, True), (True, False), (False, True)])
def test_shareable_props_ask_for_what_the_device_supports(posix_fd: bool, rdma: bool) -> None:
    driver, _ = cuda_sim(SimMachine(posix_fd=posix_fd, rdma=rdma))
    prop = driver._allocation_prop(0, True)
    assert isinstance(prop, cuda_bindings.CUmemAllocationProp)
    assert prop.type == cuda_bindings.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert prop.location.type == cuda_bindings.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    handle_types = cuda_bindings.CUmemAllocationHandleType
    expected = (
        handle_types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if posix_fd
        else handle_types.CU_MEM_HANDLE_TYPE_NONE
    )
    assert prop.requestedHandleTypes == expected
    assert prop.allocFlags.gpuDirectRDMACapable == int(rdma)


def test_plain_props_and_access_descriptors() -> None:
    driver, _ = cuda_sim(SimMachine(devices=2))
    prop = driver._allocation_prop(1, False)
    assert prop.location.id == 1
    assert int(prop.requestedHandleTypes) == 0
    assert prop.allocFlags.gpuDirectRDMACapable == 0
    desc = driver.access_desc(1)
    assert desc.location.id == 1
    assert desc.flags == cuda_bindings.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE


# -- contexts and devices -----------------------------------------------------


def test_a_thread_without_a_context_is_left_without_one() -> None:
    """Buffer work on a fresh thread pushes the device's primary context and
    pops it after: the thread does not end up with cuda:N current."""
    driver, bindings = cuda_sim(SimMachine(devices=2))

    def work() -> int:
        buffer = VirtualBuffer(4 * G, driver, device=1)
        buffer.commit([(0, 2 * G)])
        buffer.free()
        return current_context(bindings)

    assert in_thread(work) == 0
    assert bindings.machine.empty()


def test_the_callers_context_is_restored_and_the_buffers_device_used() -> None:
    driver, bindings = cuda_sim(SimMachine(devices=2))
    device0 = bindings.cuDevicePrimaryCtxRetain(cuda_bindings.CUdevice(0))[1]
    bindings.cuCtxSetCurrent(device0)
    buffer = VirtualBuffer(2 * G, driver, device=1)
    buffer.commit([(0, G)])
    bindings.machine.launch(buffer.base_ptr, 8, 1, device=1)
    bindings.calls.clear()
    buffer.release_physical()
    names = bindings.names()
    assert names.index("cuCtxSynchronize") < names.index("cuMemUnmap")
    assert not bindings.machine.pending, "device 1's work was waited for"
    assert current_context(bindings) == int(device0)
    buffer.free()
    bindings.cuCtxSetCurrent(0)


def test_export_makes_its_context_current() -> None:
    driver, _ = cuda_sim()
    buffer = VirtualBuffer(4 * G, driver, shareable=True)
    buffer.commit([(0, 4 * G)])
    exported = in_thread(buffer.export_chunks)
    assert len(exported) == 1
    for _, fd in exported:
        os.close(fd)
    buffer.free()


def test_reservations_are_aligned_to_the_memorys_granularity() -> None:
    """Shareable (POSIX fd, RDMA) memory has a coarser granularity than the
    driver's default alignment: the reservation must ask for it."""
    driver, bindings = cuda_sim()
    assert driver.granularity(0, True) == 2 * driver.granularity(0, False)
    for _ in range(3):
        buffer = VirtualBuffer(8 * G, driver, shareable=True)
        assert buffer.base_ptr % (2 * G) == 0
        buffer.commit([(0, 8 * G)])
        buffer.free()
    assert bindings.machine.empty()


def test_hip_makes_the_buffers_device_current_and_restores_the_callers(
    hip_module: Any,
) -> None:
    """HIP creates memory on the current device: a buffer on device 1, with
    device 0 current, must set device 1 for its calls."""
    driver, bindings = hip_sim(SimMachine(devices=2))
    buffer = VirtualBuffer(4 * G, driver, device=1)
    buffer.commit([(0, 4 * G)])
    assert bindings.machine.handles[next(iter(bindings.machine.handles))].device == 1
    assert bindings.hipGetDevice()[1] == 0
    buffer.free()
    assert bindings.machine.empty()


def test_torch_initializes_cuda_before_the_driver_is_touched(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    """MOCKED at the GPU boundary: torch's CUDA (absent on this CPU build) is
    replaced by a recorder, the driver by the simulator."""
    order: list[str] = []
    bindings = SimCuda(cuda_bindings, SimMachine())
    original = bindings.cuInit

    def cu_init(flags: int) -> Any:
        order.append("cuInit")
        return original(flags)

    bindings.cuInit = cu_init  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: order.append("torch.cuda.init"))
    # Asking torch for the current device initializes CUDA through torch too.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: order.append("torch") or 0)
    monkeypatch.setattr("extensible_kv.driver.cuda.load_bindings", lambda: bindings)
    assert select.unavailable_reason("cuda") is None
    assert order == ["torch", "torch.cuda.init", "cuInit"]


def test_a_failed_probe_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    def missing() -> Any:
        raise ImportError("no cuda-bindings")

    monkeypatch.setattr("extensible_kv.driver.cuda.load_bindings", missing)
    assert "pip install" in (select.unavailable_reason("cuda:0") or "")
    bindings = SimCuda(cuda_bindings, SimMachine())
    monkeypatch.setattr("extensible_kv.driver.cuda.load_bindings", lambda: bindings)
    assert select.unavailable_reason("cuda:0") is None
    probes = bindings.names().count("cuMemAddressReserve")
    assert select.unavailable_reason("cuda:0") is None
    assert bindings.names().count("cuMemAddressReserve") == probes, "a success is kept"


# -- calls through a VirtualBuffer --------------------------------------------


def test_commit_creates_maps_then_grants_access_once() -> None:
    driver, bindings = cuda_sim()
    buffer = VirtualBuffer(8 * G, driver, chunk_bytes=2 * G)
    bindings.calls.clear()
    buffer.commit([(0, 5 * G)])
    names = [n for n in bindings.names() if n.startswith("cuMem")]
    assert names == ["cuMemCreate", "cuMemMap"] * 3 + ["cuMemSetAccess"]
    _, (ptr, size, _descs, count) = next(c for c in bindings.calls if c[0] == "cuMemSetAccess")
    assert (ptr, size, count) == (buffer.base_ptr, 5 * G, 1)
    buffer.free()
    assert bindings.machine.empty()


def test_a_failing_map_rolls_the_commit_back() -> None:
    driver, bindings = cuda_sim()
    machine = bindings.machine
    buffer = VirtualBuffer(8 * G, driver, chunk_bytes=G)
    buffer.commit([(0, G)])
    before = (set(machine.handles), set(machine.mappings), machine.used())
    bindings.failures["cuMemMap"] = 1
    with pytest.raises(DriverError) as info:
        buffer.commit([(0, 4 * G)])
    assert info.value.call == "cuMemMap"
    assert info.value.code == 1
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert (set(machine.handles), set(machine.mappings), machine.used()) == before
    buffer.free()
    assert machine.empty()


@pytest.mark.parametrize("kind", ["cuda", "hip"])
@pytest.mark.parametrize("operation", ["commit", "release", "free"])
def test_failure_at_every_driver_call_leaves_the_simulated_driver_consistent(
    kind: str, operation: str
) -> None:
    """The host's fault-injection guarantees, through each GPU backend."""
    if kind == "hip":
        pytest.importorskip("hip")
    driver, bindings = (cuda_sim if kind == "cuda" else hip_sim)()
    machine = bindings.machine
    stats = StatisticsDriver(driver)
    probe = VirtualBuffer(8 * G, stats, chunk_bytes=G)
    probe.commit([(0, 2 * G)])
    stats.reset_calls()
    _run(probe, operation)
    calls = {name: s.calls for name, s in stats.calls.items() if s.calls}
    assert calls, f"{operation} makes no driver call: the test would inject nothing"
    probe.free()
    for call, count in calls.items():
        for nth in range(1, count + 1):
            faulty = FaultInjectingDriver(stats)
            buffer = VirtualBuffer(8 * G, faulty, chunk_bytes=G)
            buffer.commit([(0, 2 * G)])
            state = (set(machine.handles), dict(machine.mappings), machine.used())
            faulty.fail_at(call, nth)
            with pytest.raises(DriverError):
                _run(buffer, operation)
            if call not in ("release", "free_reserved"):
                now = (set(machine.handles), dict(machine.mappings), machine.used())
                assert now == state, f"{operation}: {call} #{nth}"
            _run(buffer, operation)
            buffer.free()
            assert machine.empty(), f"{operation}: {call} #{nth}"


def _run(buffer: VirtualBuffer, operation: str) -> None:
    if operation == "commit":
        buffer.commit([(0, 6 * G)])
    elif operation == "release":
        buffer.release_physical()
    else:
        buffer.free()


# -- errors -------------------------------------------------------------------


def test_out_of_memory_is_a_torch_out_of_memory_error_and_changes_nothing() -> None:
    driver, bindings = cuda_sim(SimMachine(capacity=4 * G))
    et = ExtensibleTensor(16 * G, "cpu", driver=HostViews(driver))
    et.resize_(3 * G)
    with pytest.raises(OutOfMemoryError) as info:
        et.resize_(8 * G)
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert (info.value.call, info.value.code, info.value.name) == (
        "cuMemCreate",
        2,
        "CUDA_ERROR_OUT_OF_MEMORY",
    )
    assert et.num_bytes == 3 * G
    assert bindings.machine.used() == 3 * G
    et.free()


def test_refused_shareable_memory_falls_back_with_one_warning() -> None:
    driver, bindings = cuda_sim()
    bindings.failures["cuMemCreate"] = 801
    with driver.context(0):
        with pytest.warns(RuntimeWarning, match="refused shareable memory") as record:
            first = driver.create(2 * G, 0, True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = driver.create(2 * G, 0, True)
        assert len(record) == 1
        assert not bindings.machine.handles[first].posix_fd
        with pytest.raises(DriverError, match="cuMemExportToShareableHandle"):
            driver.export_handle(first)
        driver.release(first)
        driver.release(second)


def test_out_of_memory_is_not_mistaken_for_a_refusal() -> None:
    driver, bindings = cuda_sim()
    bindings.failures["cuMemCreate"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(OutOfMemoryError):
            driver.create(2 * G, 0, True)


def test_export_and_import_posix_fds() -> None:
    driver, bindings = cuda_sim()
    with driver.context(0):
        handle = driver.create(2 * G, 0, True)
        fd = driver.export_handle(handle)
        imported = driver.import_handle(fd)
        os.close(fd)
        assert bindings.machine.handles[imported].size == 2 * G
        driver.release(handle)
        driver.release(imported)
    assert bindings.machine.empty()


def test_device_uuids_name_devices_whatever_their_ordinal() -> None:
    exporter, _ = cuda_sim(SimMachine(devices=2))
    importer, _ = cuda_sim(SimMachine(devices=2, order=[1, 0]))
    uuid = exporter.device_uuid(1)
    assert uuid.startswith("GPU-")
    assert len(uuid) == len("GPU-") + 36
    assert select.device_with_uuid(importer, uuid) == 0
    assert select.device_with_uuid(exporter, uuid) == 1
    with pytest.raises(ValueError, match="not visible to this process"):
        select.device_with_uuid(cuda_sim(SimMachine(order=[2]))[0], uuid)


# -- probing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "device", "reason"),
    [
        ({}, 0, None),
        ({"devices": 2}, 3, "cuda:3 does not exist; 2 CUDA device"),
        ({"vmm": False}, 0, "does not support virtual memory management on cuda:0 (WSL2"),
    ],
)
def test_unavailable_reason_of_a_simulated_device(
    machine: dict[str, Any], device: int, reason: str | None
) -> None:
    driver, bindings = cuda_sim(SimMachine(**machine))
    found = driver.unavailable_reason(device)
    if reason is None:
        assert found is None
        assert bindings.machine.empty()
        assert current_context(bindings) == 0
    else:
        assert found is not None
        assert reason in found


def test_no_device_at_init(monkeypatch: pytest.MonkeyPatch, fresh_selection: None) -> None:
    monkeypatch.setattr(
        "extensible_kv.driver.cuda.load_bindings",
        lambda: SimCuda(cuda_bindings, SimMachine(devices=0)),
    )
    assert select.unavailable_reason("cuda") == (
        "no CUDA device is visible to this process (cuInit failed with "
        "CUDA_ERROR_NO_DEVICE (100): simulated: NO_DEVICE)"
    )


def test_selection_hands_out_the_probed_driver(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setattr(
        "extensible_kv.driver.cuda.load_bindings", lambda: SimCuda(cuda_bindings, SimMachine())
    )
    assert select.unavailable_reason("cuda:0") is None
    assert isinstance(devices.get_driver("cuda:0").inner, CudaDriver)
    assert devices.get_driver(0) is devices.get_driver("cuda")


def test_missing_bindings_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    reason = select.unavailable_reason("cuda")
    assert reason is not None
    assert "pip install 'extensible-kv[cuda]'" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_driver_library_every_entry_point_says_so(fresh_selection: None) -> None:
    """The real bindings on a machine with no NVIDIA driver: no simulator here."""
    reason = select.unavailable_reason("cuda")
    assert reason is not None
    assert reason.startswith("the CUDA driver library could not be loaded")
    with pytest.raises(BackendUnavailableError, match="driver library could not be loaded"):
        devices.get_driver("cuda")
    with pytest.raises(BackendUnavailableError, match="driver library could not be loaded"):
        ExtensibleTensor(1024, "cuda:0")


# -- HIP --------------------------------------------------------------------


@pytest.fixture
def hip_module() -> Any:
    return pytest.importorskip("hip").hip


def test_hip_structs_take_enum_instances(hip_module: Any) -> None:
    driver, _ = hip_sim()
    prop = driver._allocation_prop(0, False)
    assert prop.type == hip_module.hipMemAllocationType.hipMemAllocationTypePinned
    assert prop.location.type == hip_module.hipMemLocationType.hipMemLocationTypeDevice
    desc = driver.access_desc(0)
    assert desc.flags == hip_module.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite


def test_hip_shareable_props_request_posix_fds_where_the_c_struct_has_them(
    hip_module: Any,
) -> None:
    """Against the real hip-python struct: the handle type lands in the C
    header's field, and nothing else moves."""
    driver, _ = hip_sim(SimMachine(devices=2))
    prop = driver._allocation_prop(1, True)
    c = HipMemAllocationPropC.from_address(prop.as_c_void_p().value)
    posix = hip_module.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
    assert c.requestedHandleType == int(posix)
    assert (c.type, c.location.type, c.location.id) == (1, 1, 1)
    assert prop.location.id == 1
    plain_prop = driver._allocation_prop(1, False)
    plain = HipMemAllocationPropC.from_address(plain_prop.as_c_void_p().value)
    assert (plain.requestedHandleType, plain.location.id) == (0, 1)


def test_hip_request_refuses_a_layout_it_does_not_know(hip_module: Any) -> None:
    class Odd:
        """A struct whose location is not where the C header puts it."""

        def __init__(self) -> None:
            self.buffer = (HipMemAllocationPropC * 1)()
            self.location = self

        def as_c_void_p(self) -> Any:
            return ctypes.c_void_p(ctypes.addressof(self.buffer))

    with pytest.raises(TypeError, match="cannot be found"):
        request_posix_fd(Odd(), 1)


def test_hip_buffer_grants_access_with_one_descriptor(hip_module: Any) -> None:
    driver, bindings = hip_sim()
    buffer = VirtualBuffer(4 * G, driver)
    buffer.commit([(0, 3 * G)])
    _, (_, _, desc, count) = next(c for c in bindings.calls if c[0] == "hipMemSetAccess")
    assert isinstance(desc, hip_module.hipMemAccessDesc)
    assert count == 1
    buffer.free()
    assert bindings.machine.empty()


def test_hip_synchronize_restores_the_current_device(hip_module: Any) -> None:
    driver, bindings = hip_sim(SimMachine(devices=2))
    buffer = VirtualBuffer(2 * G, driver, device=1)
    buffer.commit([(0, G)])
    bindings.machine.launch(buffer.base_ptr, 8, 1, device=1)
    driver.synchronize(1)
    assert not bindings.machine.pending
    assert bindings.hipGetDevice()[1] == 0
    buffer.free()


@pytest.mark.parametrize("version", [60_400_000, 70_100_000])
def test_hip_shareable_memory_exports_and_imports_by_rocm_version(
    hip_module: Any, version: int
) -> None:
    driver, bindings = hip_sim(version=version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exporter = VirtualBuffer(4 * G, driver, shareable=True)
    exporter.commit([(0, 4 * G)])
    [(chunk, fd)] = exporter.export_chunks()
    importer = VirtualBuffer(4 * G, driver, shareable=True)
    importer.map_imported([(chunk.offset, chunk.size, fd)])
    os_handle = next(c for c in bindings.calls if c[0] == "hipMemImportFromShareableHandle")[1][0]
    assert (os_handle == fd) == (version >= 70_100_000)
    os.close(fd)
    ctypes.memset(importer.base_ptr, 4, 8)
    assert ctypes.string_at(exporter.base_ptr, 8) == b"\x04" * 8
    importer.free()
    exporter.free()
    assert bindings.machine.empty()


def test_hip_errors_carry_the_runtime_name(hip_module: Any) -> None:
    driver, bindings = hip_sim()
    bindings.failures["hipMemCreate"] = 2
    with pytest.raises(OutOfMemoryError) as info:
        driver.create(G, 0, False)
    assert info.value.name == "hipErrorOutOfMemory"
    assert info.value.call == "hipMemCreate"


def test_rocm_torch_selects_hip(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None, hip_module: Any
) -> None:
    monkeypatch.setattr(torch.version, "hip", "7.1.0")
    monkeypatch.setattr(
        "extensible_kv.driver.hip.load_bindings", lambda: SimHip(hip_module, SimMachine())
    )
    assert select.unavailable_reason("cuda") is None
    driver = select.backend("cuda:0")
    assert isinstance(driver, HipDriver)
    assert driver.dlpack_device_type == 10


def test_rocm_without_hip_python_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setattr(torch.version, "hip", "7.1.0")
    monkeypatch.setitem(sys.modules, "hip", None)
    reason = select.unavailable_reason("cuda")
    assert reason is not None
    assert "pip install 'extensible-kv[rocm]'" in reason
