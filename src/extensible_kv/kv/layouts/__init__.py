"""Layouts: what an engine describes (``spec.py``: specs, tensors, groups,
attention backends, shaped like vLLM's), how one layer's blocks lie in
memory (``block_layout.py``: :class:`BlockLayout`, :class:`Geometry`,
:func:`place`), and caches whose layers share strided memory
(``strided.py``: :func:`segmentation`, :func:`at_capacity`)."""

from extensible_kv.kv.layouts.block_layout import BlockLayout, Geometry, attention_geometry, place
from extensible_kv.kv.layouts.spec import (
    AttentionBackend,
    AttentionSpec,
    BlockMajorBackend,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVFirstBlockMajorBackend,
    KVSplitBackend,
    MambaSpec,
    StridedKVCacheTensor,
)
from extensible_kv.kv.layouts.strided import Segmentation, at_capacity, segmentation

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BlockLayout",
    "BlockMajorBackend",
    "Geometry",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheTensor",
    "KVFirstBlockMajorBackend",
    "KVSplitBackend",
    "MambaSpec",
    "Segmentation",
    "StridedKVCacheTensor",
    "at_capacity",
    "attention_geometry",
    "place",
    "segmentation",
]
