"""vLLM-shaped attention backends: their signatures, kernel block sizes
smaller than the manager's block size, and a cache dtype per layer."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from extensible_kv import StatisticsDriver
from extensible_kv.kv import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSplitBackend,
    allocate_kv_cache,
)
from extensible_kv.kv.layouts.block_layout import find_block_dim

SPEC = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
CAPACITY = 1024


def config(layers: list[str], spec: Any = SPEC, capacity: int = CAPACITY) -> KVCacheConfig:
    tensors = tuple(KVCacheTensor(capacity * spec.page_size_bytes, (name,)) for name in layers)
    return KVCacheConfig(capacity, tensors, (KVCacheGroup(tuple(layers), spec),))


class VllmSplitBackend:
    """Shaped like vLLM's FlashAttention backend: every method takes vLLM's
    arguments, ``cache_dtype_str`` by keyword only, and records the calls."""

    calls: ClassVar[list[tuple[str, int, str]]] = []

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        cache_dtype_str: str,
    ) -> tuple[int, ...]:
        cls.calls.append(("shape", block_size, cache_dtype_str))
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_kv_cache_block_dim(
        cls, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> int:
        cls.calls.append(("block_dim", block_size, cache_dtype_str))
        return 1

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        assert not include_num_layers_dimension
        return (0, 1, 2, 3, 4)


class PlainBackend:
    """A hand-written backend: no cache_dtype_str at all."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


def test_vllm_signatures_are_called_the_way_vllm_calls_them(
    stats: StatisticsDriver, device: str
) -> None:
    VllmSplitBackend.calls.clear()
    cache = allocate_kv_cache(config(["a"]), VllmSplitBackend, device, driver=stats)
    view = cache.views["a"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (2, CAPACITY, 16, 2, 64)
    assert ("block_dim", 16, "auto") in VllmSplitBackend.calls
    assert ("shape", 16, "auto") in VllmSplitBackend.calls
    assert cache.buffers.tensors[0][0].num_segments == 2
    cache.free()


def test_backends_without_cache_dtype_still_work(stats: StatisticsDriver, device: str) -> None:
    cache = allocate_kv_cache(config(["a"]), PlainBackend, device, driver=stats)
    view = cache.views["a"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (CAPACITY, 2, 16, 2, 64)
    cache.free()

    class NoArgBlockDim(KVSplitBackend):
        @staticmethod
        def get_kv_cache_block_dim() -> int:
            return 1

    assert find_block_dim(NoArgBlockDim, SPEC, "auto") == 1


def test_a_backend_taking_neither_signature_is_named() -> None:
    class Odd:
        @staticmethod
        def get_kv_cache_shape(num_blocks: int) -> tuple[int, ...]:
            return (num_blocks,)

    with pytest.raises(ValueError, match=r"Odd.get_kv_cache_shape\(num_blocks: .int.\)"):
        find_block_dim(Odd, SPEC, "auto")


def test_each_layer_can_have_its_own_cache_dtype(stats: StatisticsDriver, device: str) -> None:
    VllmSplitBackend.calls.clear()
    cache = allocate_kv_cache(
        config(["a", "b"]), VllmSplitBackend, device, cache_dtype={"b": "fp8"}, driver=stats
    )
    dtypes = {dtype for _, _, dtype in VllmSplitBackend.calls}
    assert dtypes == {"auto", "fp8"}
    cache.free()
    with pytest.raises(ValueError, match="cache_dtype names layers no group has: c"):
        allocate_kv_cache(
            config(["a"]), VllmSplitBackend, device, cache_dtype={"c": "fp8"}, driver=stats
        )
    assert stats.live.reservations == 0


@pytest.mark.parametrize("backend", [KVSplitBackend, VllmSplitBackend, PlainBackend])
def test_kernel_blocks_split_each_block(stats: StatisticsDriver, device: str, backend: Any) -> None:
    """Block size 16 with kernel blocks of 4: the views hold 4 kernel blocks
    per block, block b being kernel blocks 4b to 4b + 3, and committing or
    narrowing to n blocks covers exactly 4n kernel blocks."""
    ratio = 4
    cache = allocate_kv_cache(
        config(["a"]), backend, device, kernel_block_sizes=[16 // ratio], driver=stats
    )
    view = cache.views["a"]
    assert isinstance(view, torch.Tensor)
    block_dim = 0 if backend is PlainBackend else 1
    assert view.shape[block_dim] == CAPACITY * ratio
    assert 16 // ratio in view.shape
    ((buffer, per_block),) = cache.buffers.tensors
    assert per_block * buffer.num_segments == SPEC.page_size_bytes, "bytes per block unchanged"

    n = 300
    cache.buffers.commit(n)
    last = view.select(block_dim, n * ratio - 1)
    last.fill_(7)  # the last kernel block of the last committed block is backed
    full = buffer.full_view()
    segment_row = per_block
    start = (n - 1) * segment_row + (ratio - 1) * segment_row // ratio
    assert full[start : start + segment_row // ratio].view(torch.float16).eq(7).all()

    narrowed = cache.narrowed_views(n)["a"]
    assert isinstance(narrowed, torch.Tensor)
    assert narrowed.shape[block_dim] == n * ratio
    assert narrowed.data_ptr() == view.data_ptr()
    cache.free()


@pytest.mark.parametrize(
    ("kernel", "message"),
    [(5, "kernel block size 5 does not divide"), (0, "kernel block size 0 does not divide")],
)
def test_bad_kernel_block_sizes_are_named(
    stats: StatisticsDriver, device: str, kernel: int, message: str
) -> None:
    with pytest.raises(ValueError, match=f"KV cache group 0: {message}"):
        allocate_kv_cache(
            config(["a"]), KVSplitBackend, device, kernel_block_sizes=[kernel], driver=stats
        )
    with pytest.raises(ValueError, match="1 KV cache groups need 1 kernel block sizes, got 2"):
        allocate_kv_cache(
            config(["a"]), KVSplitBackend, device, kernel_block_sizes=[8, 8], driver=stats
        )
    assert stats.live.reservations == 0


def test_packed_rows_refuse_kernel_blocks(stats: StatisticsDriver, device: str) -> None:
    row = 2 * SPEC.page_size_bytes
    packed = KVCacheConfig(
        CAPACITY,
        (
            KVCacheTensor(CAPACITY * row, ("a",), offset=0, block_stride=row),
            KVCacheTensor(CAPACITY * row, ("b",), offset=SPEC.page_size_bytes, block_stride=row),
        ),
        (KVCacheGroup(("a", "b"), SPEC),),
    )
    with pytest.raises(ValueError, match="cannot be split into kernel blocks"):
        allocate_kv_cache(packed, PlainBackend, device, kernel_block_sizes=[8], driver=stats)
    assert stats.live.reservations == 0


class VllmBaseBackend:
    """Like vLLM's AttentionBackend base class: its optional methods raise."""

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        raise NotImplementedError

    @classmethod
    def get_kv_cache_block_dim(
        cls, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> int:
        raise NotImplementedError


class SubclassedSplitBackend(VllmBaseBackend):
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def test_a_base_class_that_raises_not_implemented_means_the_default(
    stats: StatisticsDriver, device: str
) -> None:
    """vLLM's runner reads NotImplementedError as 'identity order' and probes
    the block dim; so does the cache."""
    cache = allocate_kv_cache(config(["a"]), SubclassedSplitBackend, device, driver=stats)
    view = cache.views["a"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (2, CAPACITY, 16, 2, 64)
    assert cache.buffers.tensors[0][0].num_segments == 2
    cache.free()
