"""Layouts: how a layer's KV tensor lies in its byte buffer, and its segments.

A backend gives a logical shape (e.g. ``(2, num_blocks, block_size, heads,
head_size)``) and optionally a stride order, the physical order of the dims,
outermost first. The dims physically *before* the block dim split the
buffer into segments that grow in lockstep (K/V split: 2); the dims after it
make one block's bytes in a segment.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from extensible_kv.kv.layouts.spec import is_mamba

#: Two block counts no backend dim is likely to equal: the dim whose extent
#: follows the block count is the block dim.
_PROBE_BLOCKS = (1009, 1013)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Geometry:
    """A logical shape, the physical order of its dims and which one is the block dim."""

    shape: tuple[int, ...]
    order: tuple[int, ...]
    block_dim: int

    def __post_init__(self) -> None:
        if sorted(self.order) != list(range(len(self.shape))):
            raise ValueError(
                f"stride order {self.order} is not a permutation of the dims of {self.shape}"
            )
        if not 0 <= self.block_dim < len(self.shape):
            raise ValueError(f"block dim {self.block_dim} is not a dim of {self.shape}")

    @property
    def _position(self) -> int:
        return self.order.index(self.block_dim)

    @property
    def num_segments(self) -> int:
        """Product of the physical dims before the block dim."""
        return math.prod(self.shape[d] for d in self.order[: self._position])

    @property
    def elements_per_block_per_segment(self) -> int:
        return math.prod(self.shape[d] for d in self.order[self._position + 1 :])

    def block_major(self) -> Geometry:
        """The same logical shape stored with the block dim outermost (1 segment).

        For a ``(2, N, ...)`` attention cache this puts K and V of one block
        next to each other, as hybrid attention + Mamba caches need.
        """
        rest = tuple(d for d in self.order if d != self.block_dim)
        return replace(self, order=(self.block_dim, *rest))


@dataclass(frozen=True)
class BlockLayout:
    """One tensor's place in a byte buffer: shape, strides and offset in
    elements of ``dtype``, and its block dim."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int
    offset_bytes: int

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """The tensor over ``full``, the buffer's uint8 full view (no copy)."""
        size = itemsize(self.dtype)
        typed = full[: full.numel() // size * size].view(self.dtype)
        return typed.as_strided(self.shape, self.strides, self.offset_bytes // size)

    @property
    def end_bytes(self) -> int:
        """One past the last byte the layout's tensor covers, from the
        buffer's start (0 for an empty tensor)."""
        if 0 in self.shape:
            return 0
        last = sum((n - 1) * stride for n, stride in zip(self.shape, self.strides, strict=True))
        return self.offset_bytes + (last + 1) * itemsize(self.dtype)

    def with_blocks(self, num_blocks: int) -> BlockLayout:
        """The same layout trimmed to the first ``num_blocks`` blocks."""
        shape = list(self.shape)
        shape[self.block_dim] = num_blocks
        return replace(self, shape=tuple(shape))


def place(
    geometry: Geometry,
    dtype: torch.dtype,
    *,
    capacity: int,
    row_bytes: int,
    offset_bytes: int = 0,
) -> BlockLayout:
    """Lay ``geometry`` out in a buffer of ``capacity`` blocks per segment,
    one block of a segment being ``row_bytes`` bytes from the next.

    Dims after the block dim are contiguous; the block dim strides by
    ``row_bytes``; dims before it step from segment to segment, each segment
    ``capacity * row_bytes`` bytes.
    """
    size = itemsize(dtype)
    if row_bytes % size or offset_bytes % size:
        raise ValueError(
            f"a {dtype} layout needs the block row ({row_bytes} bytes) and its offset "
            f"({offset_bytes} bytes) to be multiples of {size} bytes"
        )
    if geometry.elements_per_block_per_segment * size > row_bytes:
        raise ValueError(
            f"a block of {geometry.shape} needs {geometry.elements_per_block_per_segment * size} "
            f"bytes per segment, more than the {row_bytes}-byte row it is given"
        )
    strides = [0] * len(geometry.shape)
    position = geometry.order.index(geometry.block_dim)
    step = 1
    for dim in reversed(geometry.order[position + 1 :]):
        strides[dim] = step
        step *= geometry.shape[dim]
    strides[geometry.block_dim] = row_bytes // size
    step = capacity * row_bytes // size
    for dim in reversed(geometry.order[:position]):
        strides[dim] = step
        step *= geometry.shape[dim]
    shape = list(geometry.shape)
    shape[geometry.block_dim] = capacity
    return BlockLayout(tuple(shape), tuple(strides), dtype, geometry.block_dim, offset_bytes)


def _name(backend: Any) -> str:
    """A backend's name, for errors: backends are classes or instances."""
    return backend.__name__ if isinstance(backend, type) else type(backend).__name__


def _call(backend: Any, method: str, args: tuple[Any, ...], cache_dtype: str) -> Any:
    """Call a backend method the way vLLM does (``args`` and a
    ``cache_dtype_str`` keyword), or, for simpler backends, with fewer.

    vLLM's backends take ``(..., block_size, num_kv_heads, head_size,
    cache_dtype_str=...)``; our own and many hand-written ones take the same
    arguments without ``cache_dtype_str``, or (``get_kv_cache_block_dim``)
    none at all. The first signature the method accepts is used.
    """
    function = getattr(backend, method)
    attempts: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (args, {"cache_dtype_str": cache_dtype}),
        (args, {}),
    ]
    if method == "get_kv_cache_block_dim":
        attempts.append(((), {}))
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: vLLM's way
        return function(*args, cache_dtype_str=cache_dtype)
    for call_args, kwargs in attempts:
        try:
            signature.bind(*call_args, **kwargs)
        except TypeError:
            continue
        return function(*call_args, **kwargs)
    raise ValueError(
        f"{_name(backend)}.{method}{signature} takes neither vLLM's arguments "
        f"({len(args)} positional and cache_dtype_str) nor the same without cache_dtype_str"
    )


def find_block_dim(backend: Any, spec: Any, cache_dtype: str, block_size: int | None = None) -> int:
    """The backend's block dim: asked for, or the dim that follows the block count.

    ``block_size`` is the kernel's block size (default: the spec's).
    """
    block_size = spec.block_size if block_size is None else block_size
    if hasattr(backend, "get_kv_cache_block_dim"):
        args = (block_size, spec.num_kv_heads, spec.head_size)
        try:
            return int(_call(backend, "get_kv_cache_block_dim", args, cache_dtype))
        except NotImplementedError:
            pass  # vLLM's base class: probe, as vLLM does
    shapes = [attention_shape(backend, spec, n, cache_dtype, block_size) for n in _PROBE_BLOCKS]
    moved = [d for d, (a, b) in enumerate(zip(*shapes, strict=True)) if a != b]
    if len(moved) != 1 or shapes[0][moved[0]] != _PROBE_BLOCKS[0]:
        raise ValueError(
            f"cannot tell the block dim of {_name(backend)}'s shape {shapes[0]}; "
            f"give the backend get_kv_cache_block_dim()"
        )
    return moved[0]


def attention_shape(
    backend: Any, spec: Any, num_blocks: int, cache_dtype: str, block_size: int | None = None
) -> tuple[int, ...]:
    """The backend's logical shape for ``num_blocks`` blocks of ``block_size``
    tokens (default: the spec's)."""
    block_size = spec.block_size if block_size is None else block_size
    args = (num_blocks, block_size, spec.num_kv_heads, spec.head_size)
    return tuple(int(n) for n in _call(backend, "get_kv_cache_shape", args, cache_dtype))


def attention_geometry(
    backend: Any,
    spec: Any,
    num_blocks: int,
    cache_dtype: str = "auto",
    kernel_block_size: int | None = None,
) -> Geometry:
    """The geometry an attention backend gives a layer of ``spec``.

    With a ``kernel_block_size`` smaller than the spec's block size, each of
    the ``num_blocks`` blocks is several kernel blocks, and the shape counts
    kernel blocks (``num_blocks * spec.block_size // kernel_block_size``).
    """
    ratio = blocks_per_kv_block(spec, kernel_block_size)
    block_size = spec.block_size // ratio
    shape = attention_shape(backend, spec, num_blocks * ratio, cache_dtype, block_size)
    return Geometry(
        shape,
        _stride_order(backend, len(shape)),
        find_block_dim(backend, spec, cache_dtype, block_size),
    )


def _stride_order(backend: Any, ndim: int) -> tuple[int, ...]:
    """The backend's stride order; the identity when it has none, as vLLM
    reads a missing method or its base class's NotImplementedError."""
    try:
        return tuple(int(d) for d in backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        return tuple(range(ndim))


def blocks_per_kv_block(spec: Any, kernel_block_size: int | None) -> int:
    """How many kernel blocks make one block of ``spec`` (vLLM's
    ``blocks_per_kv_block``); 1 without a kernel block size."""
    if kernel_block_size is None or kernel_block_size == spec.block_size:
        return 1
    if isinstance(kernel_block_size, bool) or not isinstance(kernel_block_size, int):
        raise ValueError(f"a kernel block size is an int (tokens), got {kernel_block_size!r}")
    if kernel_block_size < 1 or spec.block_size % kernel_block_size:
        raise ValueError(
            f"kernel block size {kernel_block_size} does not divide the block size "
            f"{spec.block_size} (tokens)"
        )
    return int(spec.block_size // kernel_block_size)


def mamba_layouts(
    spec: Any, *, capacity: int, row_bytes: int, offset_bytes: int = 0
) -> list[BlockLayout]:
    """One block-major layout per state of a Mamba-like spec, the states of
    a block side by side in its row."""
    layouts = []
    offset = offset_bytes
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        geometry = Geometry((capacity, *shape), tuple(range(len(shape) + 1)), 0)
        layouts.append(
            place(geometry, dtype, capacity=capacity, row_bytes=row_bytes, offset_bytes=offset)
        )
        offset += math.prod(shape) * itemsize(dtype)
    if offset - offset_bytes > row_bytes:
        raise ValueError(
            f"the states of {spec} need {offset - offset_bytes} bytes, more than the "
            f"{row_bytes}-byte row"
        )
    return layouts


def layer_segments(
    spec: Any, backend: Any, cache_dtype: str, hybrid: bool, kernel_block_size: int | None = None
) -> int:
    """How many segments a layer's buffer needs: Mamba and hybrid caches are
    block-major (1); attention follows its backend's stride order."""
    if is_mamba(spec) or hybrid:
        return 1
    return attention_geometry(backend, spec, 1, cache_dtype, kernel_block_size).num_segments
