"""The KV cache: lockstep buffers, layouts, allocation from a description,
narrowing for connectors, and sizing after warm-up."""

from extensible_kv.kv.allocate import (
    KVCache,
    LayerPlacement,
    allocate_kv_cache,
    narrow_to_num_blocks,
)
from extensible_kv.kv.backup import HostBackup
from extensible_kv.kv.buffers import (
    ConnectorRegistrationWarning,
    ExtensibleKVCacheBuffers,
    KVCacheBuffers,
)
from extensible_kv.kv.builder import ExtensibleKVCacheBuilder
from extensible_kv.kv.commit_ticket import CommitTicket
from extensible_kv.kv.growth import OnDemandGrowth
from extensible_kv.kv.layout import BlockLayout, Geometry, attention_geometry, place
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
from extensible_kv.kv.sleep import SleepState
from extensible_kv.kv.spec import (
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
from extensible_kv.kv.strided import at_capacity

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BlockLayout",
    "BlockMajorBackend",
    "CommitTicket",
    "ConnectorRegistrationWarning",
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
