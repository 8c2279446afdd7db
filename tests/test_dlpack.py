"""DLPack views: zero-copy, both capsule kinds, and they keep the range alive."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import torch

from extensible_kv import StatisticsDriver, VirtualBuffer, uint8_tensor_from_ptr
from extensible_kv.dlpack import ByteView, as_tensor


@pytest.fixture
def buffer(stats: StatisticsDriver, granularity: int) -> VirtualBuffer:
    buffer = VirtualBuffer(2 * granularity, stats)
    buffer.commit([(0, 2 * granularity)])
    yield buffer
    gc.collect()
    buffer.free()


def test_torch_views_are_zero_copy(buffer: VirtualBuffer, device: str) -> None:
    view = as_tensor(buffer, 16, 64)
    assert view.dtype == torch.uint8
    assert view.shape == (64,)
    assert view.data_ptr() == buffer.base_ptr + 16
    assert view.device.type == device
    other = as_tensor(buffer, 0, 128)
    before = other.clone()
    view.fill_(5)
    assert other[16:80].eq(5).all()
    assert torch.equal(other[:16], before[:16])


def test_numpy_views_host_memory(stats: StatisticsDriver, device: str) -> None:
    if device != "cpu":
        pytest.skip("NumPy reads host memory only")
    buffer = VirtualBuffer(1, stats)
    buffer.commit([(0, 1)])
    array = np.from_dlpack(ByteView(buffer, 0, 32))
    array[3] = 42
    assert ctypes.string_at(buffer.base_ptr + 3, 1) == b"*"
    assert buffer.live_views == 1
    del array
    assert buffer.live_views == 0
    buffer.free()


@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (1, 3)])
def test_capsule_kind_follows_max_version(
    buffer: VirtualBuffer, max_version: tuple[int, int] | None
) -> None:
    capsule = ByteView(buffer, 0, 8).__dlpack__(max_version=max_version)
    versioned = max_version is not None and max_version[0] >= 1
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype = ctypes.c_char_p
    name.argtypes = [ctypes.py_object]
    assert name(capsule) == (b"dltensor_versioned" if versioned else b"dltensor")
    assert buffer.live_views == 1
    if not versioned:
        view = torch.from_dlpack(capsule)
        assert view.data_ptr() == buffer.base_ptr
        del view
    del capsule
    gc.collect()
    assert buffer.live_views == 0


def test_refuses_copies_and_other_devices(buffer: VirtualBuffer) -> None:
    view = ByteView(buffer, 0, 8)
    with pytest.raises(BufferError, match="zero-copy"):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="lives on DLPack device"):
        view.__dlpack__(dl_device=(99, 0))
    assert buffer.live_views == 0


def test_view_must_lie_inside_the_buffer(buffer: VirtualBuffer) -> None:
    with pytest.raises(ValueError, match="outside"):
        ByteView(buffer, buffer.size - 4, 8)
    with pytest.raises(ValueError, match="outside"):
        ByteView(buffer, -1, 8)


def test_the_last_view_returns_the_range(stats: StatisticsDriver, granularity: int) -> None:
    buffer = VirtualBuffer(granularity, stats)
    buffer.commit([(0, granularity)])
    views = [as_tensor(buffer, 0, 8) for _ in range(3)]
    slices = [v[2:4] for v in views]
    buffer.free()
    del views
    gc.collect()
    assert stats.live.reservations == 1, "slices still hold the storage"
    del slices
    gc.collect()
    assert stats.live.reservations == 0


def test_unowned_tensor_from_pointer() -> None:
    backing = (ctypes.c_uint8 * 16)(*range(16))
    view = uint8_tensor_from_ptr(ctypes.addressof(backing), 16, 0, device_type="cpu")
    assert view.tolist() == list(range(16))
    with pytest.raises(ValueError, match="device_type"):
        uint8_tensor_from_ptr(ctypes.addressof(backing), 16, 0, device_type="tpu")


def test_versioned_capsules_carry_strides(buffer: VirtualBuffer) -> None:
    """DLPack 1.2 and later forbid NULL strides; we declare 1.3."""
    from ctypes_dlpack import DLManagedTensorVersioned

    capsule = ByteView(buffer, 0, 64).__dlpack__(max_version=(1, 3))
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = DLManagedTensorVersioned.from_address(get(capsule, b"dltensor_versioned"))
    assert (managed.version.major, managed.version.minor) >= (1, 2)
    assert managed.dl_tensor.strides
    assert managed.dl_tensor.strides[0] == 1
    view = torch.from_dlpack(capsule)
    assert view.stride() == (1,)
    del view
