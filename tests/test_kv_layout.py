"""KV layouts: segments, strides, growth per layer and per segment, packed and
hybrid caches, coverage errors and narrowing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from extensible_kv import StatisticsDriver
from extensible_kv.kv import (
    AttentionSpec,
    BlockMajorBackend,
    Geometry,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVFirstBlockMajorBackend,
    KVSplitBackend,
    MambaSpec,
    allocate_kv_cache,
    attention_geometry,
)
from extensible_kv.kv.layouts.block_layout import find_block_dim

SPEC = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
# 1024 blocks of 4 KiB per segment: each segment spans 2 granules of 2 MiB,
# so a block committed without its granule would fault.
CAPACITY = 1024
HIDDEN = SPEC.block_size * SPEC.num_kv_heads * SPEC.head_size


def config(layers: list[str], spec: Any = SPEC, capacity: int = CAPACITY) -> KVCacheConfig:
    tensors = tuple(KVCacheTensor(capacity * spec.page_size_bytes, (name,)) for name in layers)
    return KVCacheConfig(capacity, tensors, (KVCacheGroup(tuple(layers), spec),))


@pytest.mark.parametrize(
    ("backend", "segments", "shape", "strides"),
    [
        (KVSplitBackend, 2, (2, CAPACITY, 16, 2, 64), (CAPACITY * HIDDEN, HIDDEN, 128, 64, 1)),
        (BlockMajorBackend, 1, (CAPACITY, 2, 16, 2, 64), (2 * HIDDEN, HIDDEN, 128, 64, 1)),
        (KVFirstBlockMajorBackend, 1, (2, CAPACITY, 16, 2, 64), (HIDDEN, 2 * HIDDEN, 128, 64, 1)),
    ],
)
def test_layout_table(
    stats: StatisticsDriver,
    device: str,
    backend: Any,
    segments: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
) -> None:
    cache = allocate_kv_cache(config(["a", "b"]), backend, device, driver=stats)
    buffers = cache.buffers
    assert buffers.num_blocks_committed == 1, "allocation commits one block"
    assert [b.num_segments for b, _ in buffers.buffers] == [segments, segments]
    for name in ("a", "b"):
        view = cache.views[name]
        assert isinstance(view, torch.Tensor)
        assert view.shape == shape
        assert view.stride() == strides
        assert view.dtype == torch.float16
    _grow_and_check(cache, segments_dims=segments)
    cache.free()


def _grow_and_check(cache: Any, segments_dims: int) -> None:
    """Block 0 survives growth, the last block is writable, middle blocks are zero."""
    for name, view in cache.views.items():
        dim = cache.placements[name].layouts[0].block_dim
        view.select(dim, 0).fill_(1.5)
    cache.buffers.commit(CAPACITY)
    for name, view in cache.views.items():
        dim = cache.placements[name].layouts[0].block_dim
        assert view.select(dim, 0).eq(1.5).all(), name
        view.select(dim, CAPACITY - 1).fill_(-2.0)
        assert view.select(dim, CAPACITY - 1).eq(-2.0).all(), name
        middle = view.narrow(dim, 1, CAPACITY - 2)
        assert int(middle.count_nonzero()) == 0, name
        if segments_dims == 2:  # K and V, each its own segment
            assert view[0].select(0, 0).eq(1.5).all()
            assert view[1].select(0, 0).eq(1.5).all()


def test_hybrid_attention_is_block_major_with_adjacent_k_and_v(
    stats: StatisticsDriver, device: str
) -> None:
    mamba = MambaSpec(
        shapes=((4, 32), (8, 16)),
        dtypes=(torch.float16, torch.float32),
        page_size_padded=SPEC.page_size_bytes,
    )
    cfg = KVCacheConfig(
        CAPACITY,
        (KVCacheTensor(CAPACITY * SPEC.page_size_bytes, ("attn", "ssm")),),
        (KVCacheGroup(("attn",), SPEC), KVCacheGroup(("ssm",), mamba)),
    )
    cache = allocate_kv_cache(cfg, [KVSplitBackend, None], device, driver=stats)
    attn = cache.views["attn"]
    assert isinstance(attn, torch.Tensor)
    assert attn.shape == (2, CAPACITY, 16, 2, 64)
    assert attn.stride()[:2] == (HIDDEN, 2 * HIDDEN)
    assert cache.buffers.tensors[0][0].num_segments == 1
    states = cache.views["ssm"]
    assert isinstance(states, list)
    assert [s.shape for s in states] == [(CAPACITY, 4, 32), (CAPACITY, 8, 16)]
    assert [s.dtype for s in states] == [torch.float16, torch.float32]
    row = SPEC.page_size_bytes
    assert states[0].data_ptr() == attn.data_ptr()
    assert states[1].data_ptr() == attn.data_ptr() + 4 * 32 * 2
    assert states[0].stride(0) * 2 == row
    assert states[1].stride(0) * 4 == row
    states[1][0].fill_(3.0)
    cache.buffers.commit(CAPACITY)
    assert states[1][0].eq(3.0).all()
    states[1][CAPACITY - 1].fill_(1.0)
    cache.free()


def test_packed_rows_hold_several_layers(stats: StatisticsDriver, device: str) -> None:
    page = SPEC.page_size_bytes
    row = 2 * page
    cfg = KVCacheConfig(
        CAPACITY,
        (
            KVCacheTensor(CAPACITY * page, ("a",), offset=0, block_stride=row),
            KVCacheTensor(CAPACITY * page, ("b",), offset=page, block_stride=row),
        ),
        (KVCacheGroup(("a", "b"), SPEC),),
    )
    cache = allocate_kv_cache(cfg, BlockMajorBackend, device, driver=stats)
    assert len(cache.buffers.tensors) == 1, "packed tensors share one buffer"
    a, b = cache.views["a"], cache.views["b"]
    assert isinstance(a, torch.Tensor)
    assert isinstance(b, torch.Tensor)
    assert a.stride(0) * 2 == row
    assert b.data_ptr() - a.data_ptr() == page
    a[0].fill_(1.0)
    b[0].fill_(2.0)
    cache.buffers.commit(CAPACITY)
    assert a[0].eq(1.0).all()
    assert b[0].eq(2.0).all()
    b[CAPACITY - 1].fill_(5.0)
    narrowed = cache.narrowed_views(10)
    storages = set()
    for name in ("a", "b"):
        view = narrowed[name]
        assert isinstance(view, torch.Tensor)
        assert view.shape[0] == 10
        # One storage of exactly the committed rows, as a connector registers it.
        assert view.untyped_storage().nbytes() == 10 * row
        storages.add(view.untyped_storage().data_ptr())
    assert storages == {a.data_ptr()}, "the packed layers share one storage"
    assert narrowed["b"][0].eq(2.0).all()
    cache.free()


def test_narrowing_keeps_pointers_and_strides(stats: StatisticsDriver, device: str) -> None:
    cache = allocate_kv_cache(config(["a"]), KVSplitBackend, device, driver=stats)
    cache.buffers.commit(100)
    full = cache.views["a"]
    narrowed = cache.narrowed_views()["a"]
    assert isinstance(full, torch.Tensor)
    assert isinstance(narrowed, torch.Tensor)
    assert narrowed.shape == (2, 100, 16, 2, 64)
    assert narrowed.stride() == full.stride()
    assert narrowed.data_ptr() == full.data_ptr()
    half = SPEC.page_size_bytes // 2
    # Storage ends at V's 100th block: K's uncommitted tail lies between.
    assert narrowed.untyped_storage().nbytes() == CAPACITY * half + 100 * half
    cache.free()


def test_a_block_major_narrowed_view_is_exactly_the_committed_blocks(
    stats: StatisticsDriver, device: str
) -> None:
    """What a connector that registers ``untyped_storage()`` registers."""
    cache = allocate_kv_cache(config(["a"]), BlockMajorBackend, device, driver=stats)
    cache.buffers.commit(100)
    narrowed = cache.narrowed_views()["a"]
    assert isinstance(narrowed, torch.Tensor)
    assert narrowed.untyped_storage().nbytes() == 100 * SPEC.page_size_bytes
    assert cache.narrowed_views(0)["a"].untyped_storage().nbytes() == 0  # type: ignore[union-attr]
    cache.free()


def test_block_dim_is_found_by_probing_or_asked() -> None:
    assert find_block_dim(KVSplitBackend, SPEC, "auto") == 1
    assert find_block_dim(BlockMajorBackend, SPEC, "auto") == 0

    class Explicit(KVSplitBackend):
        @staticmethod
        def get_kv_cache_block_dim() -> int:
            return 1

    assert find_block_dim(Explicit, SPEC, "auto") == 1

    class Opaque:
        @staticmethod
        def get_kv_cache_shape(*args: Any) -> tuple[int, ...]:
            return (4, 8)

    with pytest.raises(ValueError, match="cannot tell the block dim"):
        find_block_dim(Opaque, SPEC, "auto")


def test_geometry_counts_segments_from_the_stride_order() -> None:
    assert attention_geometry(KVSplitBackend, SPEC, 10).num_segments == 2
    assert attention_geometry(KVFirstBlockMajorBackend, SPEC, 10).num_segments == 1
    geometry = Geometry((3, 2, 10, 4), (0, 1, 2, 3), 2)
    assert geometry.num_segments == 6
    assert geometry.block_major().num_segments == 1
    assert geometry.elements_per_block_per_segment == 4
    with pytest.raises(ValueError, match="not a permutation"):
        Geometry((2, 10), (0, 0), 1)


def _mixed_config() -> KVCacheConfig:
    return KVCacheConfig(
        CAPACITY,
        (KVCacheTensor(CAPACITY * SPEC.page_size_bytes, ("split", "major")),),
        (KVCacheGroup(("split",), SPEC), KVCacheGroup(("major",), SPEC)),
    )


@pytest.mark.parametrize(
    ("make", "backends", "message"),
    [
        (
            lambda: config(["a", "b"]).__class__(
                CAPACITY, config(["a"]).kv_cache_tensors, config(["a", "b"]).kv_cache_groups
            ),
            KVSplitBackend,
            "not backed by any KV cache tensor: b",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY, config(["a"]).kv_cache_tensors * 2, config(["a"]).kv_cache_groups
            ),
            KVSplitBackend,
            "'a' is backed by KV cache tensors 0 and 1",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (KVCacheTensor(CAPACITY * SPEC.page_size_bytes, ("a", "ghost")),),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "names layers no group has: ghost",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY, config(["a"]).kv_cache_tensors, config(["a"]).kv_cache_groups * 2
            ),
            KVSplitBackend,
            "'a' is in KV cache groups 0 and 1",
        ),
        (
            _mixed_config,
            [KVSplitBackend, BlockMajorBackend],
            "disagree on segments: split has 2, major has 1",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (KVCacheTensor(CAPACITY * SPEC.page_size_bytes + 1, ("a",)),),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "not a multiple of num_blocks",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (
                    KVCacheTensor(
                        CAPACITY * SPEC.page_size_bytes, ("a",), block_stride=SPEC.page_size_bytes
                    ),
                ),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "packed rows need one segment",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (
                    KVCacheTensor(
                        CAPACITY * SPEC.page_size_bytes,
                        ("a",),
                        offset=8,
                        block_stride=SPEC.page_size_bytes,
                    ),
                ),
                config(["a"]).kv_cache_groups,
            ),
            BlockMajorBackend,
            "runs past the",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (KVCacheTensor(CAPACITY * SPEC.page_size_bytes // 2, ("a",)),),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "does not fit KV cache tensor 0",
        ),
        (lambda: config(["a"], capacity=0), KVSplitBackend, "num_blocks must be positive"),
        (
            lambda: config(["a"]),
            [KVSplitBackend, KVSplitBackend],
            "1 KV cache groups need 1 backends",
        ),
        (lambda: config(["a"]), [None], "needs a backend"),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (KVCacheTensor(CAPACITY * SPEC.page_size_bytes, ("a",), offset=-64),),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "KV cache tensor 0: offset must be a non-negative int",
        ),
        (
            lambda: KVCacheConfig(
                CAPACITY,
                (
                    KVCacheTensor(
                        CAPACITY * SPEC.page_size_bytes, ("a",), offset=SPEC.page_size_bytes
                    ),
                ),
                config(["a"]).kv_cache_groups,
            ),
            KVSplitBackend,
            "layer 'a' does not fit its buffer",
        ),
    ],
    ids=[
        "uncovered",
        "covered-twice",
        "unknown-layer",
        "two-groups",
        "segments-disagree",
        "size-not-multiple",
        "packed-multi-segment",
        "packed-past-row",
        "too-small",
        "no-blocks",
        "backend-count",
        "no-backend",
        "negative-offset",
        "offset-a-page",
    ],
)
def test_bad_descriptions_name_the_problem_and_leak_nothing(
    stats: StatisticsDriver, device: str, make: Any, backends: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        allocate_kv_cache(make(), backends, device, driver=stats)
    assert stats.live.reservations == 0


def test_duck_typed_engine_objects(stats: StatisticsDriver, device: str) -> None:
    """Objects that merely have vLLM's attribute names are enough."""

    class Obj:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    spec = Obj(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        page_size_bytes=SPEC.page_size_bytes,
    )
    cfg = Obj(
        num_blocks=64,
        kv_cache_tensors=[
            Obj(size=64 * SPEC.page_size_bytes, shared_by=["x"], offset=0, block_stride=0)
        ],
        kv_cache_groups=[Obj(layer_names=["x"], kv_cache_spec=spec)],
    )
    cache = allocate_kv_cache(cfg, [KVSplitBackend], device, driver=stats)
    view = cache.views["x"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (2, 64, 16, 2, 64)
    assert math.prod(view.shape) * 2 == 64 * SPEC.page_size_bytes
    cache.free()
