"""vLLM 0.32's description (one backing buffer, layers placed by
``layer_stride``, ``block_stride`` and ``offset``) through ``allocate_kv_cache``.

The model: block ``b`` of ``layers[l]`` starts at ``offset + l *
layer_stride + b * block_stride`` (vLLM's formula). After ``at_capacity``
and a commit of ``n`` blocks, every byte of every layer's first ``n``
blocks is committed, at that formula's address from the base pointer,
and keeps its bytes while the cache grows; new blocks read zero.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from extensible_kv import StatisticsDriver
from extensible_kv.kv import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    StridedKVCacheTensor,
    allocate_kv_cache,
    at_capacity,
)
from extensible_kv.kv.layouts.strided import is_strided, segmentation

SPEC = AttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
PAGE = SPEC.page_size_bytes  # 4 KiB


def described(
    num_layers: int, num_blocks: int, *, block_outermost: bool = False, pad: int = 0
) -> KVCacheConfig:
    """What vLLM 0.32's get_kv_cache_config gives one group of ``num_layers``:
    LBHNC (layer-outermost) or BLHNC (block-outermost, rows padded by ``pad``)."""
    names = tuple(f"layer.{i}" for i in range(num_layers))
    if block_outermost:
        row = num_layers * PAGE + pad
        tensor = StridedKVCacheTensor(num_blocks * row, names, PAGE, row)
    else:
        tensor = StridedKVCacheTensor(
            num_layers * num_blocks * PAGE, names, num_blocks * PAGE, PAGE
        )
    return KVCacheConfig(num_blocks, (tensor,), (KVCacheGroup(names, SPEC),))


def block_address(tensor: StridedKVCacheTensor, layer: int, block: int) -> int:
    return tensor.offset + layer * tensor.layer_stride + block * tensor.block_stride


@given(
    num_layers=st.integers(1, 5),
    counts=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    extra=st.integers(0, 400),
    block_outermost=st.booleans(),
    pad=st.sampled_from([0, 64, PAGE]),
)
def test_committed_blocks_follow_vllms_formula_and_grow_in_place(
    num_layers: int, counts: list[int], extra: int, block_outermost: bool, pad: int
) -> None:
    sized = described(num_layers, counts[0], block_outermost=block_outermost, pad=pad)
    capacity = max(counts) + extra
    layout = at_capacity(sized, capacity)
    (tensor,) = layout.kv_cache_tensors
    kv = allocate_kv_cache(layout, device="cpu")
    try:
        (full,) = kv.backing
        base = kv.cache.base_ptrs[0]
        assert full.dtype == torch.int8
        assert full.data_ptr() == base
        ((buffer, _),) = kv.cache.tensors
        committed = 0
        for count in sorted(set(counts)):
            kv.cache.commit(count)
            for layer, name in enumerate(tensor.layers):
                view = kv.views[name]
                assert isinstance(view, torch.Tensor)
                assert view.shape == (capacity, PAGE)
                for block in {0, committed, count - 1} - {count}:
                    start = block_address(tensor, layer, block)
                    assert view[block].data_ptr() == base + start
                    buffer.checked_view(start, PAGE)  # committed: no ValueError
                    page = view[block]
                    if block >= committed:
                        assert int(page.count_nonzero()) == 0  # new blocks read zero
                    page.fill_(layer + 1)
                    assert kv.cache.base_ptrs == [base]
            for layer, name in enumerate(tensor.layers):
                view = kv.views[name]
                assert isinstance(view, torch.Tensor)
                assert bool((view[0] == layer + 1).all())  # kept through the growth
            committed = count
    finally:
        kv.free()


def test_layer_outermost_is_one_segment_per_layer_spaced_for_the_capacity() -> None:
    sized = described(3, 100)
    layout = at_capacity(sized, 1000)
    (tensor,) = layout.kv_cache_tensors
    assert (layout.num_blocks, tensor.layer_stride, tensor.size) == (1000, 1000 * PAGE, 3000 * PAGE)
    assert segmentation(layout).num_segments == 3
    assert sized.num_blocks == 100
    assert sized.kv_cache_tensors[0].layer_stride == 100 * PAGE


def test_block_outermost_is_one_segment_of_rows() -> None:
    layout = at_capacity(described(3, 100, block_outermost=True, pad=64), 1000)
    (tensor,) = layout.kv_cache_tensors
    assert (tensor.layer_stride, tensor.block_stride, tensor.size) == (
        PAGE,
        3 * PAGE + 64,
        1000 * (3 * PAGE + 64),
    )
    split = segmentation(layout)
    assert (split.num_segments, split.row_bytes) == (1, 3 * PAGE + 64)


def test_layer_outermost_tensors_one_after_another_keep_their_segments(
    stats: StatisticsDriver, device: str
) -> None:
    """vLLM gives each page size of a group its own tensor, the next one's
    offset whole layers past the last one's."""
    a, b = ("a.0", "a.1"), ("b.0",)
    n = 50
    tensors = (
        StridedKVCacheTensor(3 * n * PAGE, a, n * PAGE, PAGE),
        StridedKVCacheTensor(3 * n * PAGE, b, n * PAGE, PAGE, offset=2 * n * PAGE),
    )
    config = KVCacheConfig(n, tensors, (KVCacheGroup(a + b, SPEC),))
    layout = at_capacity(config, 400)
    assert layout.kv_cache_tensors[1].offset == 2 * 400 * PAGE
    kv = allocate_kv_cache(layout, device=device, driver=stats)
    try:
        kv.cache.commit(n)
        base = kv.cache.base_ptrs[0]
        view = kv.views["b.0"]
        assert isinstance(view, torch.Tensor)
        assert view[n - 1].data_ptr() == base + 2 * 400 * PAGE + (n - 1) * PAGE
        view[n - 1].fill_(9)
        assert kv.cache.committed_bytes == 3 * n * PAGE
    finally:
        kv.free()


def test_the_seeds_description_is_not_taken_for_vllm_032s() -> None:
    config = described(2, 10)
    assert is_strided(config)
    from extensible_kv.kv import KVCacheTensor

    seed = KVCacheConfig(10, (KVCacheTensor(10 * PAGE, ("x",)),), (KVCacheGroup(("x",), SPEC),))
    assert not is_strided(seed)


def bad(config: KVCacheConfig, **changes: object) -> KVCacheConfig:
    (tensor,) = config.kv_cache_tensors
    return dataclasses.replace(config, kv_cache_tensors=(dataclasses.replace(tensor, **changes),))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # LHBNC: a layer's block is one piece per head, neither outermost.
        (bad(described(2, 10), block_stride=PAGE // 2), "neither layer-outermost"),
        (bad(described(2, 10), layers=("layer.0", "ghost")), "layers no group has: ghost"),
        (bad(described(2, 10), size=21 * PAGE), "whole"),
        (bad(described(2, 10, block_outermost=True), size=7), "rows of"),
        (bad(described(2, 10), layer_stride=-1), "layer_stride must be an int"),
        (bad(described(2, 10), offset=1.5), "offset must be an int"),
    ],
)
def test_layouts_it_cannot_commit_as_prefixes_are_named(
    config: KVCacheConfig, message: str, stats: StatisticsDriver
) -> None:
    with pytest.raises(ValueError, match=message):
        allocate_kv_cache(config, device="cpu", driver=stats)
    assert stats.live.reservations == 0  # refused before anything was reserved


def test_tensors_that_split_the_buffer_differently_are_refused() -> None:
    names = ("x", "y")
    tensors = (
        StridedKVCacheTensor(2 * 10 * PAGE, names, 10 * PAGE, PAGE),
        StridedKVCacheTensor(10 * 2 * PAGE, names, PAGE, 2 * PAGE),
    )
    config = KVCacheConfig(10, tensors, (KVCacheGroup(names, SPEC),))
    with pytest.raises(ValueError, match="KV cache tensor 1 splits the backing buffer"):
        allocate_kv_cache(config, device="cpu")


def test_a_capacity_below_the_count_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity of 5 blocks is below the 10 blocks"):
        at_capacity(described(2, 10), 5)
