"""vLLM 0.32's own objects and functions over ``allocate_kv_cache``: what an
engine author on 0.32 calls directly.

For every layout vLLM names, the strides come from vLLM's
``compute_layout_strides``, the config is vLLM's ``KVCacheConfig`` and the
views are vLLM's ``create_kv_cache_views`` over ``kv.backing[0]``. The
layouts that commit as prefixes (layer- or block-outermost) must give views
at the same offsets as over a plain buffer, writable in every committed
block and kept while the cache grows; the others are refused by name.
Runs in ``nox -s vllm``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from extensible_kv.kv import allocate_kv_cache, at_capacity

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
PREFIX_LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC"]


def vllm_config(layout: KVCacheLayout, num_blocks: int) -> KVCacheConfig:
    """One group, as vLLM's get_kv_cache_config lays it out."""
    layer_stride, block_stride, *_ = compute_layout_strides(SPEC, num_blocks, len(LAYERS), layout)
    size = len(LAYERS) * num_blocks * SPEC.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=SPEC)],
    )


def views(backing: torch.Tensor, config: KVCacheConfig, layout: KVCacheLayout, n: int) -> list:
    (tensor,) = config.kv_cache_tensors
    return create_kv_cache_views(backing, SPEC, n, layout, tensor)


@pytest.mark.parametrize("name", PREFIX_LAYOUTS)
def test_vllms_views_over_our_backing_grow_in_place(name: str) -> None:
    layout = KVCacheLayout[name]
    n, grown, capacity = 40, 300, 1000
    spaced = at_capacity(vllm_config(layout, n), capacity)
    kv = allocate_kv_cache(spaced, device="cpu")
    try:
        kv.cache.commit(n)
        (backing,) = kv.backing
        base = backing.data_ptr()
        plain = torch.zeros(backing.numel(), dtype=torch.int8)
        expected = views(plain, spaced, layout, n)
        ours = views(backing, spaced, layout, n)
        for mine, theirs in zip(ours, expected, strict=True):
            assert mine.shape == theirs.shape
            assert mine.stride() == theirs.stride()
            assert mine.data_ptr() - base == theirs.data_ptr() - plain.data_ptr()
        for index, view in enumerate(ours):
            view.fill_(index + 1)  # every committed block of every layer
        kv.cache.commit(grown)
        bigger = views(backing, spaced, layout, grown)
        for index, (old, new) in enumerate(zip(ours, bigger, strict=True)):
            assert new.data_ptr() == old.data_ptr()
            assert bool((new[:n] == index + 1).all())
            assert int(new[n:].count_nonzero()) == 0
            new.fill_(index + 7)
        assert kv.cache.base_ptrs == [base]
    finally:
        kv.free()


def test_a_layout_that_is_not_a_prefix_is_refused_by_name() -> None:
    config = vllm_config(KVCacheLayout.LHBNC, 40)
    with pytest.raises(ValueError, match="neither layer-outermost"):
        at_capacity(config, 1000)
