"""Zero-copy DLPack views of buffer bytes that keep their buffer's addresses alive.

A view is a DLPack capsule over ``(pointer, bytes, device)``, uint8 and 1-D;
``torch.from_dlpack`` (or NumPy, CuPy, JAX) turns it into an array without
copying. The capsule's deleter holds a view reference on the owning
:class:`~extensible_kv.buffer.VirtualBuffer`, so ``free()`` returns the
physical memory at once but the address range only after the last view is
gone: a view never aliases memory that later belongs to someone else.

The DLPack structs and the capsule protocol (versioned capsule when the
consumer passes ``max_version``, legacy otherwise; the destructor of a
capsule nobody consumed) come from ``ctypes-dlpack``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch
from ctypes_dlpack import (
    DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
    DLDataTypeCode,
    DLManagedTensorVersioned,
    DLPackArray,
)
from torch.utils.dlpack import from_dlpack

from extensible_kv._checks import check_bytes, check_int
from extensible_kv.buffer import VirtualBuffer

DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_ROCM = 10

_DeleterType = dict(DLManagedTensorVersioned._fields_)["deleter"]
_ShapeType = ctypes.c_int64 * 1
_MAX_ADDRESS = (1 << 64) - 1

# Managed structs alive in a consumer, by address: the struct, its shape and
# strides arrays and the buffer it holds a view reference on (None for
# unowned views).
_LIVE: dict[int, tuple[DLManagedTensorVersioned, Any, Any, VirtualBuffer | None]] = {}


def _delete(managed: Any, _finalizing: Any = sys.is_finalizing) -> None:
    # Consumers call this from whatever thread drops their array, possibly
    # during interpreter shutdown, when module state may already be gone.
    if _finalizing():
        return
    _forget(ctypes.cast(managed, ctypes.c_void_p).value or 0)


def _forget(key: int) -> None:
    """Drop a managed struct and its view reference; a second call does nothing."""
    entry = _LIVE.pop(key, None)
    if entry is not None and entry[3] is not None:
        entry[3].drop_view_ref()


_DELETER = _DeleterType(_delete)
# The C function pointer lives as long as this object does: make it immortal,
# so a consumer freeing its array during shutdown still finds it.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_DELETER))


def _managed_tensor(
    ptr: int, nbytes: int, device: tuple[int, int], owner: VirtualBuffer | None
) -> tuple[DLPackArray, int]:
    """A DLPack array over the bytes, and its key in the registry of live views."""
    managed = DLManagedTensorVersioned()
    shape = _ShapeType(nbytes)
    # DLPack 1.2 and later forbid NULL strides: one element apart.
    strides = _ShapeType(1)
    managed.version.major = DLPACK_MAJOR_VERSION
    managed.version.minor = DLPACK_MINOR_VERSION
    managed.deleter = _DELETER
    managed.flags = 0
    tensor = managed.dl_tensor
    tensor.data = ptr
    tensor.device.device_type = device[0]
    tensor.device.device_id = device[1]
    tensor.ndim = 1
    tensor.dtype.code = DLDataTypeCode.kDLUInt
    tensor.dtype.bits = 8
    tensor.dtype.lanes = 1
    tensor.shape = ctypes.cast(shape, type(tensor.shape))
    tensor.strides = ctypes.cast(strides, type(tensor.strides))
    tensor.byte_offset = 0
    if owner is not None:
        owner.add_view_ref()
    key = ctypes.addressof(managed)
    _LIVE[key] = (managed, shape, strides, owner)
    return DLPackArray(ctypes.pointer(managed)), key


class ByteView:
    """Bytes ``[offset, offset + nbytes)`` of a buffer, exportable through DLPack.

    Each ``__dlpack__`` call makes a new capsule, holding its own reference
    on the buffer until the consumer releases it.
    """

    def __init__(self, buffer: VirtualBuffer, offset: int, nbytes: int) -> None:
        check_int("offset", offset)
        check_int("nbytes", nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > buffer.size:
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) lies outside the {buffer.size}-byte buffer"
            )
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.buffer.driver.dlpack_device_type, self.buffer.device)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A capsule over the bytes.

        ``stream`` is accepted and not waited on: the buffer queues no work
        of its own, so the consumer's stream order is the only order there is.
        """
        if copy:
            raise BufferError("views of a buffer are zero-copy; copy=True is refused")
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the buffer lives on DLPack device {device}, not {dl_device}")
        array, _ = _managed_tensor(
            self.buffer.base_ptr + self.offset, self.nbytes, device, self.buffer
        )
        return array.__dlpack__(max_version=max_version)


def as_tensor(buffer: VirtualBuffer, offset: int, nbytes: int) -> torch.Tensor:
    """A uint8 torch view of ``nbytes`` bytes of ``buffer`` from ``offset``."""
    view = ByteView(buffer, offset, nbytes)
    return _to_torch(buffer.base_ptr + offset, nbytes, view.__dlpack_device__(), buffer)


def _to_torch(
    ptr: int, nbytes: int, device: tuple[int, int], owner: VirtualBuffer | None
) -> torch.Tensor:
    """The torch tensor over a new managed struct; if torch refuses it, the
    struct (and its view reference) goes at once instead of leaking."""
    if device[0] != DLPACK_CPU and not torch.cuda.is_available():
        raise ValueError(
            f"this torch ({torch.__version__}) has no usable GPU, so it cannot view memory "
            f"on DLPack device {device}"
        )
    array, key = _managed_tensor(ptr, nbytes, device, owner)
    try:
        # torch.from_dlpack passes its current stream to a GPU array's
        # __dlpack__, and ctypes-dlpack refuses any stream but None. The bytes
        # have no work queued on any stream (see ByteView.__dlpack__), so
        # hand torch the capsule itself: no stream is asked for.
        return from_dlpack(array.__dlpack__())
    except BaseException:
        _forget(key)
        raise


def uint8_tensor_from_ptr(
    ptr: int, num_bytes: int, device_index: int, *, device_type: str = "cuda"
) -> torch.Tensor:
    """A 1-D uint8 tensor over memory this library does not own.

    Nothing keeps the memory alive: the caller must outlive the tensor.
    Prefer views made by :class:`ByteView`, which do. ``device_type`` is
    ``"cuda"`` (reported as ROCm on ROCm builds of torch) or ``"cpu"``.
    """
    check_int("ptr", ptr)
    check_bytes("num_bytes", num_bytes)
    check_int("device_index", device_index)
    if not 0 <= ptr <= _MAX_ADDRESS - num_bytes:
        raise ValueError(f"[{ptr:#x}, +{num_bytes}) is not a range of 64-bit addresses")
    if device_type == "cpu":
        device = (DLPACK_CPU, 0)
    elif device_type == "cuda":
        device = (DLPACK_ROCM if torch.version.hip else DLPACK_CUDA, device_index)
    else:
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    return _to_torch(ptr, num_bytes, device, None)
