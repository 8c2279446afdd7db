"""The CUDA and HIP backends without a GPU: struct building against the real
bindings, call order, error translation and rollback against LABELLED fakes
of the driver (tests/fake_bindings.py), and the no-driver path for real.

None of this is GPU verification; tests/test_gpu.py is, on a GPU machine.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
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
)
from extensible_kv.driver import select
from extensible_kv.driver.cuda import CudaDriver
from extensible_kv.driver.hip import HipDriver
from fake_bindings import FakeCuda, FakeHip, MiB

cuda_bindings = pytest.importorskip("cuda.bindings.driver")
G = 2 * MiB


@pytest.fixture
def fresh_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget the process's GPU driver and probe results, before and after."""
    monkeypatch.setattr(select, "_gpu", None)
    select._probe.cache_clear()
    yield
    select._probe.cache_clear()


def cuda(**kwargs: Any) -> tuple[CudaDriver, FakeCuda]:
    fake = FakeCuda(cuda_bindings, **kwargs)
    return CudaDriver(fake), fake


# -- structs, built from the real bindings' types ---------------------------


@pytest.mark.parametrize(("posix_fd", "rdma"), [(True, True), (True, False), (False, True)])
def test_shareable_props_ask_for_what_the_device_supports(posix_fd: bool, rdma: bool) -> None:
    driver, _ = cuda(posix_fd=posix_fd, rdma=rdma)
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
    driver, _ = cuda(devices=2)
    prop = driver._allocation_prop(1, False)
    assert prop.location.id == 1
    assert int(prop.requestedHandleTypes) == 0
    assert prop.allocFlags.gpuDirectRDMACapable == 0
    desc = driver.access_desc(1)
    assert desc.location.id == 1
    assert desc.flags == cuda_bindings.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE


# -- calls through a VirtualBuffer --------------------------------------------


def test_commit_creates_maps_then_grants_access_once() -> None:
    driver, fake = cuda()
    buffer = VirtualBuffer(8 * G, driver, chunk_bytes=2 * G)
    fake.calls.clear()
    buffer.commit([(0, 5 * G)])
    names = [n for n in fake.names() if n.startswith("cuMem")]
    assert names == ["cuMemCreate", "cuMemMap"] * 3 + ["cuMemSetAccess"]
    _, (ptr, size, _descs, count) = fake.calls[-1]
    assert (ptr, size, count) == (buffer.base_ptr, 5 * G, 1)
    assert fake.state.accessible == set(fake.state.mappings)
    buffer.free()
    assert fake.state.empty()


def test_release_synchronizes_the_buffers_device_first() -> None:
    driver, fake = cuda(devices=2)
    buffer = VirtualBuffer(2 * G, driver, device=1)
    buffer.commit([(0, G)])
    fake.current = 0x1000  # device 0's context is current
    fake.calls.clear()
    buffer.release_physical()
    names = fake.names()
    assert names.index("cuCtxSynchronize") < names.index("cuMemUnmap")
    assert fake.synchronized == [0x1001]
    assert fake.current == 0x1000, "the caller's context is restored"
    buffer.free()


def test_ensure_context_sets_the_primary_context_only_when_none_is_current() -> None:
    driver, fake = cuda(devices=2)
    driver.ensure_context(1)
    assert fake.current == 0x1001
    driver.ensure_context(0)
    assert fake.current == 0x1001
    assert fake.names().count("cuDevicePrimaryCtxRetain") == 1


def test_a_failing_map_rolls_the_commit_back() -> None:
    driver, fake = cuda()
    buffer = VirtualBuffer(8 * G, driver, chunk_bytes=G)
    buffer.commit([(0, G)])
    before = (dict(fake.state.handles), dict(fake.state.mappings))
    fake.failures["cuMemMap"] = FakeCuda.INVALID_VALUE
    with pytest.raises(DriverError) as info:
        buffer.commit([(0, 4 * G)])
    assert info.value.call == "cuMemMap"
    assert info.value.code == 1
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert (fake.state.handles, fake.state.mappings) == before
    buffer.free()
    assert fake.state.empty()


@pytest.mark.parametrize("operation", ["commit", "release", "free"])
def test_failure_at_every_driver_call_leaves_the_fake_driver_consistent(operation: str) -> None:
    """The host's fault-injection guarantees, through the CUDA backend."""
    driver, fake = cuda()
    stats = StatisticsDriver(driver)
    calls: dict[str, int] = {}
    probe = VirtualBuffer(8 * G, stats, chunk_bytes=G)
    probe.commit([(0, 2 * G)])
    stats.reset_calls()
    _run(probe, operation)
    calls = {name: s.calls for name, s in stats.calls.items() if s.calls}
    probe.free()
    for call, count in calls.items():
        for nth in range(1, count + 1):
            faulty = FaultInjectingDriver(stats)
            buffer = VirtualBuffer(8 * G, faulty, chunk_bytes=G)
            buffer.commit([(0, 2 * G)])
            state = (
                dict(fake.state.handles),
                dict(fake.state.mappings),
                set(fake.state.accessible),
            )
            faulty.fail_at(call, nth)
            with pytest.raises(DriverError):
                _run(buffer, operation)
            if call not in ("release", "free_reserved"):
                now = (fake.state.handles, fake.state.mappings, fake.state.accessible)
                assert now == state, f"{operation}: {call} #{nth}"
            _run(buffer, operation)
            buffer.free()
            assert fake.state.empty(), f"{operation}: {call} #{nth}"


def _run(buffer: VirtualBuffer, operation: str) -> None:
    if operation == "commit":
        buffer.commit([(0, 6 * G)])
    elif operation == "release":
        buffer.release_physical()
    else:
        buffer.free()


# -- errors -------------------------------------------------------------------


def test_out_of_memory_is_a_torch_out_of_memory_error() -> None:
    driver, fake = cuda()
    fake.failures["cuMemCreate"] = FakeCuda.OUT_OF_MEMORY
    with pytest.raises(OutOfMemoryError) as info:
        driver.create(G, 0, False)
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert (info.value.call, info.value.code, info.value.name) == (
        "cuMemCreate",
        2,
        "CUDA_ERROR_OUT_OF_MEMORY",
    )
    assert "fake driver error" in str(info.value)


def test_refused_shareable_memory_falls_back_with_one_warning() -> None:
    driver, fake = cuda()
    fake.refuse_shareable = True
    with pytest.warns(RuntimeWarning, match="refused shareable memory") as record:
        first = driver.create(G, 0, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = driver.create(G, 0, True)
    assert len(record) == 1
    assert fake.state.handles[first] == (G, False)
    assert fake.state.handles[second] == (G, False)
    with pytest.raises(DriverError, match="cuMemExportToShareableHandle"):
        driver.export_handle(first)


def test_out_of_memory_is_not_mistaken_for_a_refusal() -> None:
    driver, fake = cuda()
    fake.failures["cuMemCreate"] = FakeCuda.OUT_OF_MEMORY
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(OutOfMemoryError):
            driver.create(G, 0, True)


def test_export_and_import_posix_fds() -> None:
    driver, fake = cuda()
    handle = driver.create(G, 0, True)
    fd = driver.export_handle(handle)
    imported = driver.import_handle(fd)
    assert fake.state.handles[imported] == fake.state.handles[handle]
    os.close(fd)


# -- probing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "device", "reason"),
    [
        ({}, 0, None),
        ({"devices": 2}, 3, "cuda:3 does not exist; 2 CUDA device"),
        ({"vmm": False}, 0, "does not support virtual memory management on cuda:0 (WSL2"),
    ],
)
def test_unavailable_reason_of_a_fake_device(
    kwargs: dict[str, Any], device: int, reason: str | None
) -> None:
    driver, fake = cuda(**kwargs)
    found = driver.unavailable_reason(device)
    if reason is None:
        assert found is None
        assert fake.state.empty()
    else:
        assert found is not None
        assert reason in found


def test_no_device_at_init(monkeypatch: pytest.MonkeyPatch, fresh_selection: None) -> None:
    monkeypatch.setattr(
        "extensible_kv.driver.cuda.load_bindings", lambda: FakeCuda(cuda_bindings, devices=0)
    )
    assert select.unavailable_reason("cuda") == (
        "no CUDA device is visible to this process (cuInit failed with "
        "CUDA_ERROR_NO_DEVICE (100): fake driver error)"
    )


def test_selection_hands_out_the_probed_driver(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setattr("extensible_kv.driver.cuda.load_bindings", lambda: FakeCuda(cuda_bindings))
    assert select.unavailable_reason("cuda:0") is None
    assert isinstance(select.get_driver("cuda:0"), CudaDriver)
    assert select.get_driver(0) is select.get_driver("cuda")


def test_missing_bindings_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    reason = select.unavailable_reason("cuda")
    assert reason is not None
    assert "pip install 'extensible-kv[cuda]'" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_driver_library_every_entry_point_says_so(fresh_selection: None) -> None:
    """The real bindings on a machine with no NVIDIA driver: no fake here."""
    reason = select.unavailable_reason("cuda")
    assert reason is not None
    assert reason.startswith("the CUDA driver library could not be loaded")
    with pytest.raises(BackendUnavailableError, match="driver library could not be loaded"):
        select.get_driver("cuda")
    with pytest.raises(BackendUnavailableError, match="driver library could not be loaded"):
        ExtensibleTensor(1024, "cuda:0")


# -- HIP --------------------------------------------------------------------


@pytest.fixture
def hip_bindings() -> Any:
    return pytest.importorskip("hip").hip


def test_hip_structs_take_enum_instances(hip_bindings: Any) -> None:
    driver = HipDriver(FakeHip(hip_bindings))
    prop = driver._allocation_prop(0, False)
    assert prop.type == hip_bindings.hipMemAllocationType.hipMemAllocationTypePinned
    assert prop.location.type == hip_bindings.hipMemLocationType.hipMemLocationTypeDevice
    desc = driver.access_desc(0)
    assert desc.flags == hip_bindings.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite


def test_hip_buffer_grants_access_with_one_descriptor(hip_bindings: Any) -> None:
    fake = FakeHip(hip_bindings)
    buffer = VirtualBuffer(4 * G, HipDriver(fake))
    buffer.commit([(0, 3 * G)])
    _, (_, _, desc, count) = next(c for c in fake.calls if c[0] == "hipMemSetAccess")
    assert isinstance(desc, hip_bindings.hipMemAccessDesc)
    assert count == 1
    buffer.free()
    assert fake.state.empty()


def test_hip_synchronize_restores_the_current_device(hip_bindings: Any) -> None:
    fake = FakeHip(hip_bindings, devices=2)
    driver = HipDriver(fake)
    fake.device = 0
    driver.synchronize(1)
    assert fake.synchronized == [1]
    assert fake.device == 0


def test_hip_shareable_is_plain_with_one_warning(hip_bindings: Any) -> None:
    driver = HipDriver(FakeHip(hip_bindings))
    with pytest.warns(RuntimeWarning, match="does not expose hipMemAllocationProp"):
        driver.create(G, 0, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        driver.create(G, 0, True)


@pytest.mark.parametrize("version", [60_400_000, 70_100_000])
def test_hip_fd_export_and_import_by_rocm_version(hip_bindings: Any, version: int) -> None:
    fake = FakeHip(hip_bindings, version=version)
    driver = HipDriver(fake)
    handle = driver.create(G, 0, False)
    fd = driver.export_handle(handle)
    assert fd >= 0
    imported = driver.import_handle(fd)
    assert fake.state.handles[imported] == fake.state.handles[handle]
    os_handle = fake.calls[-1][1][0]
    assert (os_handle == fd) == (version >= 70_100_000)
    os.close(fd)


def test_hip_errors_carry_the_runtime_name(hip_bindings: Any) -> None:
    fake = FakeHip(hip_bindings)
    driver = HipDriver(fake)
    fake.failures["hipMemCreate"] = FakeHip.OUT_OF_MEMORY
    with pytest.raises(OutOfMemoryError) as info:
        driver.create(G, 0, False)
    assert info.value.name == "hipErrorOutOfMemory"
    assert info.value.call == "hipMemCreate"


def test_rocm_torch_selects_hip(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None, hip_bindings: Any
) -> None:
    monkeypatch.setattr(torch.version, "hip", "7.1.0")
    monkeypatch.setattr("extensible_kv.driver.hip.load_bindings", lambda: FakeHip(hip_bindings))
    assert select.unavailable_reason("cuda") is None
    driver = select.get_driver("cuda:0")
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
