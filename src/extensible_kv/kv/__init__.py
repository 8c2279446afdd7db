"""The KV cache by idea: the cache and its parts (``cache/``), layouts
(``layouts/``), growth policies (``growth/``); beside them, allocation
from a description (``allocate.py``, ``builder.py``) and sizing after
warm-up (``sizing.py``, ``ranks.py``, ``runner.py``)."""

from extensible_kv.kv.allocate import (
    KVCache,
    LayerPlacement,
    allocate_kv_cache,
    narrow_to_num_blocks,
)
from extensible_kv.kv.builder import ExtensibleKVCacheBuilder
from extensible_kv.kv.cache import (
    CommitTicket,
    ConnectorRegistrationWarning,
    ExtensibleKVCacheBuffers,
    HostBackup,
    KVCacheBuffers,
    SleepState,
)
from extensible_kv.kv.growth import (
    ElasticBlocks,
    ElasticOrders,
    ElasticReport,
    OnDemandGrowth,
    UnitRanges,
)
from extensible_kv.kv.layouts import (
    AttentionBackend,
    AttentionSpec,
    BlockLayout,
    BlockMajorBackend,
    Geometry,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVFirstBlockMajorBackend,
    KVSplitBackend,
    MambaSpec,
    StridedKVCacheTensor,
    at_capacity,
    attention_geometry,
    place,
)
from extensible_kv.kv.ranks import agree_num_blocks
from extensible_kv.kv.runner import (
    WarmupMeter,
    commit_final_size,
    fit_max_model_len,
    register_connector,
    sized_config,
)
from extensible_kv.kv.sizing import (
    KVCacheTooSmallError,
    KVSizing,
    MemorySnapshot,
    size_kv_cache,
)

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BlockLayout",
    "BlockMajorBackend",
    "CommitTicket",
    "ConnectorRegistrationWarning",
    "ElasticBlocks",
    "ElasticOrders",
    "ElasticReport",
    "ExtensibleKVCacheBuffers",
    "ExtensibleKVCacheBuilder",
    "Geometry",
    "HostBackup",
    "KVCache",
    "KVCacheBuffers",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheTensor",
    "KVCacheTooSmallError",
    "KVFirstBlockMajorBackend",
    "KVSizing",
    "KVSplitBackend",
    "LayerPlacement",
    "MambaSpec",
    "MemorySnapshot",
    "OnDemandGrowth",
    "SleepState",
    "StridedKVCacheTensor",
    "UnitRanges",
    "WarmupMeter",
    "agree_num_blocks",
    "allocate_kv_cache",
    "at_capacity",
    "attention_geometry",
    "commit_final_size",
    "fit_max_model_len",
    "narrow_to_num_blocks",
    "place",
    "register_connector",
    "size_kv_cache",
    "sized_config",
]
