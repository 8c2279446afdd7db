"""Small descriptions of a KV cache, shaped like vLLM's, for users without an engine.

Engine objects are taken by duck typing wherever these are accepted: any
object with the same attribute names works (vLLM's ``KVCacheConfig``,
``KVCacheTensor``, ``KVCacheGroupSpec``, ``AttentionSpec``, ``MambaSpec``
and attention backends among them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Paged attention: per block, K and V of ``block_size`` tokens."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True)
class MambaSpec:
    """Mamba (or other state-space) layer: per block, one set of states.

    ``page_size_padded`` lets hybrid models give every layer the same page.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    @property
    def page_size_bytes(self) -> int:
        raw = sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        return raw if self.page_size_padded is None else self.page_size_padded


@dataclass(frozen=True)
class KVCacheTensor:
    """One piece of KV memory and the layers that use it.

    ``size`` is bytes at ``num_blocks`` blocks. ``block_stride > 0`` marks
    the packed layout: block ``b`` of every sharing layer lives in row ``b``
    (``block_stride`` bytes wide) at ``offset`` within the row.
    """

    size: int
    shared_by: tuple[str, ...]
    offset: int = 0
    block_stride: int = 0


@dataclass(frozen=True)
class StridedKVCacheTensor:
    """vLLM 0.32's ``KVCacheTensor``: ``layers`` in order, placed in one
    backing buffer of ``size`` bytes. Block ``b`` of ``layers[l]`` starts at
    ``offset + l * layer_stride + b * block_stride`` and is one page long
    (see :mod:`extensible_kv.kv.layouts.strided`)."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one spec (and one attention backend)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: AttentionSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: its block count (the capacity), tensors and groups."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...] | tuple[StridedKVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroup, ...] = field(default_factory=tuple)


@runtime_checkable
class AttentionBackend(Protocol):
    """What the cache needs from an attention backend (vLLM's names).

    Optional: ``get_kv_cache_stride_order()`` (a permutation of the shape's
    dims, outermost first; identity when absent) and
    ``get_kv_cache_block_dim()`` (found by probing the shape when absent).
    """

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]: ...


class KVSplitBackend:
    """Shape ``(2, num_blocks, block_size, heads, head_size)``: K and V are two
    segments (FlashAttention's layout)."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class BlockMajorBackend:
    """Shape ``(num_blocks, 2, block_size, heads, head_size)``: one segment."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class KVFirstBlockMajorBackend(KVSplitBackend):
    """Logical shape ``(2, num_blocks, ...)`` stored block-major (stride order
    ``(1, 0, 2, 3, 4)``): one segment, K and V of a block adjacent."""

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (1, 0, 2, 3, 4)


def is_mamba(spec: Any) -> bool:
    """Mamba-like specs describe their states by ``shapes``."""
    return hasattr(spec, "shapes")
