"""vLLM's model runner tests of the extensible KV cache, ported to this package.

vLLM tests its extensible KV cache through ``GPUModelRunner`` (V1:
``_allocate_kv_cache_tensors(config, extensible=True)``,
``_reshape_kv_cache_tensors``, ``extend_kv_cache``,
``_kv_cache_num_segments_by_layer``) and the V2 runner's functions
(``_allocate_extensible_kv_cache``, ``_reshape_kv_cache``), with fake
attention backends. ``_Runner`` and the V2 functions below stand in for that
runner code. They use only the names vLLM's own extensible KV cache has
(``ExtensibleTensor``, ``ExtensibleKVCacheBuffers``,
``ExtensibleKVCacheBuilder``, ``vmm_unavailable_reason``) with their vLLM
signatures, so moving the runner onto this package changes its imports and
nothing else. Config objects are
this package's duck-typed stand-ins for vLLM's.

Layouts covered: K/V split (one committed prefix per half), block-major,
a stride order making a K/V-first shape block-major, Mamba (block-major per
layer, states side by side in a page), hybrid attention + Mamba (attention
re-strided block-major), kernel blocks smaller than the manager's, and a
sleep (release, then recommit). Every buffer spans several 2 MiB granules,
so touching a block that a commit missed faults instead of passing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from extensible_kv import (
    ExtensibleKVCacheBuffers,
    ExtensibleKVCacheBuilder,
    ExtensibleTensor,
    vmm_unavailable_reason,
)
from extensible_kv.kv import (
    AttentionBackend,
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    MambaSpec,
)

DEVICE = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    vmm_unavailable_reason(DEVICE) is not None,
    reason=f"host virtual memory unavailable: {vmm_unavailable_reason(DEVICE)}",
)

BLOCK_SIZE = 16
NUM_BLOCKS = 256

#: A layer's KV cache: one tensor (attention) or one tensor per state (Mamba).
KVCaches = dict[str, torch.Tensor | list[torch.Tensor]]


# ---------------------------------------------------------------------------
# Fake attention backends, with vLLM's signatures
# ---------------------------------------------------------------------------


class _SplitKVBackend(AttentionBackend):
    """K/V-split layout, like FlashAttention."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class _BlockMajorBackend(AttentionBackend):
    """Num-blocks-first layout, like FlashInfer."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class _StrideOrderBackend(AttentionBackend):
    """A K/V-first shape whose stride order makes it block-major; it names its
    block dim, so the runner does not have to find it from the shape."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(
        include_num_layers_dimension: bool = False,
    ) -> tuple[int, ...]:
        assert not include_num_layers_dimension
        return (1, 0, 2, 3, 4)

    @staticmethod
    def get_kv_cache_block_dim(
        block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> int:
        return 1


@dataclass(frozen=True)
class _AttentionGroup:
    """vLLM's ``AttentionGroup``: layers of one KV cache group and their backend."""

    backend: type[AttentionBackend]
    layer_names: tuple[str, ...]
    kv_cache_spec: AttentionSpec | MambaSpec
    kv_cache_group_id: int


# ---------------------------------------------------------------------------
# The runner code under test (V2 functions; the V1 runner calls them)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _AttentionLayout:
    """A backend's logical shape, the physical order of its dims (outermost
    first) and its block dim."""

    shape: tuple[int, ...]
    order: tuple[int, ...]
    block_dim: int

    @property
    def num_segments(self) -> int:
        """Product of the physical dims before the block dim."""
        return math.prod(self.shape[d] for d in self.order[: self.order.index(self.block_dim)])


def _attention_layout(
    backend: type[AttentionBackend],
    spec: AttentionSpec,
    num_blocks: int,
    kernel_block_size: int | None,
    cache_dtype: str,
) -> _AttentionLayout:
    """The layout of ``num_blocks`` blocks of ``spec``, each made of
    ``spec.block_size // kernel_block_size`` kernel blocks (default: one)."""
    kernel_block_size = kernel_block_size or spec.block_size
    kernel_blocks_per_block = spec.block_size // kernel_block_size

    def shape(blocks: int) -> tuple[int, ...]:
        return tuple(
            backend.get_kv_cache_shape(
                blocks * kernel_blocks_per_block,
                kernel_block_size,
                spec.num_kv_heads,
                spec.head_size,
                cache_dtype_str=cache_dtype,
            )
        )

    logical = shape(num_blocks)
    stride_order = getattr(backend, "get_kv_cache_stride_order", None)
    order = tuple(stride_order()) if stride_order else tuple(range(len(logical)))
    get_block_dim = getattr(backend, "get_kv_cache_block_dim", None)
    if get_block_dim:
        block_dim = int(
            get_block_dim(
                kernel_block_size, spec.num_kv_heads, spec.head_size, cache_dtype_str=cache_dtype
            )
        )
    else:
        # The dim whose extent follows the block count.
        [block_dim] = [
            d for d, (a, b) in enumerate(zip(logical, shape(num_blocks + 1), strict=True)) if a != b
        ]
    return _AttentionLayout(logical, order, block_dim)


def _has_mamba(attn_groups: Sequence[_AttentionGroup]) -> bool:
    return any(isinstance(group.kv_cache_spec, MambaSpec) for group in attn_groups)


def _kv_cache_num_segments_by_layer(
    attn_groups: Sequence[_AttentionGroup],
    kernel_block_sizes: Sequence[int | None],
    cache_dtype: str,
    has_mamba: bool,
) -> dict[str, int]:
    """Segments of each layer's buffer: block-major (1) for Mamba and for
    every layer of a hybrid cache, else as the backend lays the layer out."""
    segments = {}
    for group in attn_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if has_mamba or isinstance(spec, MambaSpec):
                segments[name] = 1
            else:
                kernel_block_size = kernel_block_sizes[group.kv_cache_group_id]
                layout = _attention_layout(group.backend, spec, 1, kernel_block_size, cache_dtype)
                segments[name] = layout.num_segments
    return segments


def _allocate_extensible_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device,
    attn_groups: Sequence[_AttentionGroup],
    kernel_block_sizes: Sequence[int | None],
    cache_dtype: str,
) -> tuple[dict[str, torch.Tensor], ExtensibleKVCacheBuffers]:
    """Reserve every KV cache tensor, commit block 0; the raw tensors are
    the buffers' full uint8 views."""
    segments = _kv_cache_num_segments_by_layer(
        attn_groups, kernel_block_sizes, cache_dtype, has_mamba=_has_mamba(attn_groups)
    )
    builder = ExtensibleKVCacheBuilder(kv_cache_config.num_blocks, device)
    raw_tensors: dict[str, torch.Tensor] = {}
    for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
        [num_segments] = {segments[name] for name in kv_cache_tensor.shared_by}
        raw = builder.reserve(kv_cache_tensor.size, num_segments)
        for name in kv_cache_tensor.shared_by:
            raw_tensors[name] = raw
    return raw_tensors, builder.finish()


def _attention_view(
    raw_tensor: torch.Tensor,
    group: _AttentionGroup,
    spec: AttentionSpec,
    kernel_block_size: int,
    cache_dtype: str,
) -> torch.Tensor:
    num_blocks = raw_tensor.numel() // spec.page_size_bytes
    layout = _attention_layout(group.backend, spec, num_blocks, kernel_block_size, cache_dtype)
    physical_shape = tuple(layout.shape[d] for d in layout.order)
    inverse_order = [layout.order.index(d) for d in range(len(layout.order))]
    return raw_tensor.view(spec.dtype).view(physical_shape).permute(*inverse_order)


def _mamba_views(raw_tensor: torch.Tensor, spec: MambaSpec) -> list[torch.Tensor]:
    """One block-major view per state; a block's states lie side by side in its page."""
    num_blocks = raw_tensor.numel() // spec.page_size_bytes
    states = []
    offset_bytes = 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        state_strides = torch.empty(shape, device="meta").stride()
        states.append(
            torch.as_strided(
                raw_tensor.view(dtype),
                (num_blocks, *shape),
                (spec.page_size_bytes // dtype.itemsize, *state_strides),
                offset_bytes // dtype.itemsize,
            )
        )
        offset_bytes += math.prod(shape) * dtype.itemsize
    return states


def _update_hybrid_attention_mamba_layout(
    kv_caches: KVCaches, attn_groups: Sequence[_AttentionGroup]
) -> None:
    """Re-stride ``(2, num_blocks, ...)`` attention caches block-major: K and V
    of one block in one page, as Mamba pages are."""
    for group in attn_groups:
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        for name in group.layer_names:
            kv_cache = kv_caches[name]
            assert isinstance(kv_cache, torch.Tensor)
            if kv_cache.shape[0] == 2:
                assert kv_cache.shape[1] != 2, "ambiguous (2, 2, ...) layout"
                hidden_size = kv_cache.shape[2:].numel()
                kv_cache.as_strided_(
                    kv_cache.shape, (hidden_size, 2 * hidden_size, *kv_cache.stride()[2:])
                )


def _reshape_kv_cache(
    attn_groups: Sequence[_AttentionGroup],
    kv_cache_raw_tensors: dict[str, torch.Tensor],
    cache_dtype: str,
    kernel_block_sizes: Sequence[int],
) -> KVCaches:
    """Each layer's typed views over its raw byte tensor."""
    kv_caches: KVCaches = {}
    for group in attn_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            raw_tensor = kv_cache_raw_tensors[name]
            if isinstance(spec, MambaSpec):
                kv_caches[name] = _mamba_views(raw_tensor, spec)
            else:
                kernel_block_size = kernel_block_sizes[group.kv_cache_group_id]
                kv_caches[name] = _attention_view(
                    raw_tensor, group, spec, kernel_block_size, cache_dtype
                )
    if _has_mamba(attn_groups):
        _update_hybrid_attention_mamba_layout(kv_caches, attn_groups)
    return kv_caches


class _Runner:
    """The extensible KV cache parts of vLLM's V1 ``GPUModelRunner``."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, attn_groups: list[list[_AttentionGroup]]
    ) -> None:
        self.device = DEVICE
        self.kv_cache_config = kv_cache_config
        self.attn_groups = attn_groups
        self.cache_dtype = "auto"
        self.extensible_kv_cache: ExtensibleKVCacheBuffers | None = None

    @property
    def _flat_attn_groups(self) -> list[_AttentionGroup]:
        return [group for groups in self.attn_groups for group in groups]

    @property
    def _extensible_kv_cache_buffers(self) -> list[tuple[ExtensibleTensor, int]]:
        return [] if self.extensible_kv_cache is None else self.extensible_kv_cache.buffers

    def _kv_cache_num_segments_by_layer(self) -> dict[str, int]:
        groups = self._flat_attn_groups
        # Segment counts do not depend on the kernel block size: use the spec's.
        kernel_block_sizes = [None] * len(self.kv_cache_config.kv_cache_groups)
        return _kv_cache_num_segments_by_layer(
            groups, kernel_block_sizes, self.cache_dtype, has_mamba=_has_mamba(groups)
        )

    def _allocate_kv_cache_tensors(
        self, kv_cache_config: KVCacheConfig, extensible: bool = False
    ) -> dict[str, torch.Tensor]:
        if extensible:
            kernel_block_sizes = [None] * len(kv_cache_config.kv_cache_groups)
            raw_tensors, self.extensible_kv_cache = _allocate_extensible_kv_cache(
                kv_cache_config,
                self.device,
                self._flat_attn_groups,
                kernel_block_sizes,
                self.cache_dtype,
            )
            return raw_tensors
        raw_tensors = {}
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            tensor = torch.zeros(kv_cache_tensor.size, dtype=torch.int8, device=self.device)
            for name in kv_cache_tensor.shared_by:
                raw_tensors[name] = tensor
        return raw_tensors

    def _reshape_kv_cache_tensors(
        self, kv_cache_raw_tensors: dict[str, torch.Tensor], kernel_block_sizes: list[int]
    ) -> KVCaches:
        return _reshape_kv_cache(
            self._flat_attn_groups, kv_cache_raw_tensors, self.cache_dtype, kernel_block_sizes
        )

    def extend_kv_cache(self, num_blocks: int) -> None:
        """Commit the first ``num_blocks`` blocks of every KV cache buffer."""
        if self.extensible_kv_cache is None:
            raise RuntimeError("extend_kv_cache needs a KV cache allocated with extensible=True")
        self.extensible_kv_cache.commit(num_blocks)


# ---------------------------------------------------------------------------
# Test helpers
# ---------------------------------------------------------------------------


def _full_attention_spec(block_size: int = BLOCK_SIZE) -> AttentionSpec:
    # page_size_bytes = 2 (K+V) * 16 * 8 * 128 * 2 bytes = 64 KiB; 256 blocks
    # = 16 MiB, 8 granules per buffer.
    return AttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def _mamba_spec() -> MambaSpec:
    # page_size_bytes = (8*128 + 16*64) * 4 bytes = 8 KiB per block per layer.
    return MambaSpec(shapes=((8, 128), (16, 64)), dtypes=(torch.float32, torch.float32))


def _attention_config(
    spec: AttentionSpec, backend: type[AttentionBackend]
) -> tuple[KVCacheConfig, list[list[_AttentionGroup]]]:
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(KVCacheTensor(NUM_BLOCKS * spec.page_size_bytes, ("layer.0",)),),
        kv_cache_groups=(KVCacheGroup(("layer.0",), spec),),
    )
    return kv_cache_config, [[_AttentionGroup(backend, ("layer.0",), spec, 0)]]


def _hybrid_config() -> tuple[KVCacheConfig, list[list[_AttentionGroup]]]:
    """One K/V-split attention layer and one Mamba layer."""
    attn_spec, mamba_spec = _full_attention_spec(), _mamba_spec()
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(
            KVCacheTensor(NUM_BLOCKS * attn_spec.page_size_bytes, ("attn.0",)),
            KVCacheTensor(NUM_BLOCKS * mamba_spec.page_size_bytes, ("mamba.0",)),
        ),
        kv_cache_groups=(
            KVCacheGroup(("attn.0",), attn_spec),
            KVCacheGroup(("mamba.0",), mamba_spec),
        ),
    )
    attn_groups = [
        [_AttentionGroup(_SplitKVBackend, ("attn.0",), attn_spec, 0)],
        [_AttentionGroup(_BlockMajorBackend, ("mamba.0",), mamba_spec, 1)],
    ]
    return kv_cache_config, attn_groups


def _attention(kv_caches: KVCaches, name: str) -> torch.Tensor:
    kv_cache = kv_caches[name]
    assert isinstance(kv_cache, torch.Tensor)
    return kv_cache


def _states(kv_caches: KVCaches, name: str) -> list[torch.Tensor]:
    states = kv_caches[name]
    assert isinstance(states, list)
    return states


def _free_buffers(runner: _Runner) -> None:
    if runner.extensible_kv_cache is not None:
        runner.extensible_kv_cache.free()


def _check_hybrid_grows(kv_caches: KVCaches, kv_cache_buffers: ExtensibleKVCacheBuffers) -> None:
    """Block 0 of a hybrid cache survives a grow to NUM_BLOCKS; the last block
    is usable and the blocks between read zero."""
    attn_cache = _attention(kv_caches, "attn.0")
    # Re-strided to interleave K/V per block: block b spans one page.
    hidden_size = attn_cache.shape[2:].numel()
    assert attn_cache.stride()[:2] == (hidden_size, 2 * hidden_size)
    states = _states(kv_caches, "mamba.0")
    assert [state.shape for state in states] == [(NUM_BLOCKS, 8, 128), (NUM_BLOCKS, 16, 64)]

    attn_cache[0, 0].fill_(1)  # K, block 0
    attn_cache[1, 0].fill_(2)  # V, block 0
    for state in states:
        state[0].fill_(3)

    kv_cache_buffers.commit(NUM_BLOCKS)
    attn_cache[0, NUM_BLOCKS - 1].fill_(4)
    attn_cache[1, NUM_BLOCKS - 1].fill_(5)
    for state in states:
        state[NUM_BLOCKS - 1].fill_(6)
    assert torch.all(attn_cache[0, 0] == 1)
    assert torch.all(attn_cache[1, 0] == 2)
    assert torch.all(attn_cache[0, NUM_BLOCKS - 1] == 4)
    assert torch.all(attn_cache[1, NUM_BLOCKS - 1] == 5)
    assert torch.count_nonzero(attn_cache[:, 1 : NUM_BLOCKS - 1]) == 0
    for state in states:
        assert torch.all(state[0] == 3)
        assert torch.all(state[NUM_BLOCKS - 1] == 6)
        assert torch.count_nonzero(state[1 : NUM_BLOCKS - 1]) == 0


# ---------------------------------------------------------------------------
# V1 runner
# ---------------------------------------------------------------------------


def test_kv_cache_num_segments_by_layer() -> None:
    """Segment counts follow the physical layout of each layer's backend."""
    spec = _full_attention_spec()
    for backend, expected in (
        (_SplitKVBackend, 2),
        (_BlockMajorBackend, 1),
        # K/V-first logical shape but block-major physical order: 1 segment.
        (_StrideOrderBackend, 1),
    ):
        runner = _Runner(*_attention_config(spec, backend))
        assert runner._kv_cache_num_segments_by_layer() == {"layer.0": expected}


def test_extensible_split_layout_grows_both_halves() -> None:
    """A K/V-split layer keeps its natural layout; both halves grow in lockstep."""
    spec = _full_attention_spec()
    kv_cache_config, attn_groups = _attention_config(spec, _SplitKVBackend)
    runner = _Runner(kv_cache_config, attn_groups)
    try:
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        kv_cache = _attention(
            runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE]), "layer.0"
        )
        assert kv_cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, 8, 128)
        [(buffer, bytes_per_block_per_segment)] = runner._extensible_kv_cache_buffers
        assert buffer.num_segments == 2
        assert bytes_per_block_per_segment == spec.page_size_bytes // 2
        # V starts half-way into the buffer.
        assert kv_cache[1].data_ptr() - kv_cache.data_ptr() == buffer.segment_capacity_bytes

        # Only block 0 is committed -- in each half.
        kv_cache[0, 0].fill_(1)  # K, block 0
        kv_cache[1, 0].fill_(2)  # V, block 0

        runner.extend_kv_cache(NUM_BLOCKS)
        # Old data survives the grow; new blocks are usable in both halves and zeroed.
        assert torch.all(kv_cache[0, 0] == 1)
        assert torch.all(kv_cache[1, 0] == 2)
        kv_cache[0, NUM_BLOCKS - 1].fill_(3)
        kv_cache[1, NUM_BLOCKS - 1].fill_(4)
        assert torch.all(kv_cache[0, NUM_BLOCKS - 1] == 3)
        assert torch.all(kv_cache[1, NUM_BLOCKS - 1] == 4)
        assert torch.count_nonzero(kv_cache[:, 1 : NUM_BLOCKS - 1]) == 0
    finally:
        _free_buffers(runner)


def test_extensible_block_major_layout() -> None:
    """A layer whose physical layout is block-major uses a single segment."""
    spec = _full_attention_spec()
    kv_cache_config, attn_groups = _attention_config(spec, _BlockMajorBackend)
    runner = _Runner(kv_cache_config, attn_groups)
    try:
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        kv_cache = _attention(
            runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE]), "layer.0"
        )
        assert kv_cache.shape == (NUM_BLOCKS, 2, BLOCK_SIZE, 8, 128)
        [(buffer, bytes_per_block_per_segment)] = runner._extensible_kv_cache_buffers
        assert buffer.num_segments == 1
        assert bytes_per_block_per_segment == spec.page_size_bytes

        kv_cache[0].fill_(1)
        runner.extend_kv_cache(NUM_BLOCKS)
        kv_cache[NUM_BLOCKS - 1].fill_(2)
        assert torch.all(kv_cache[0] == 1)
        assert torch.all(kv_cache[NUM_BLOCKS - 1] == 2)
        assert torch.count_nonzero(kv_cache[1 : NUM_BLOCKS - 1]) == 0
    finally:
        _free_buffers(runner)


def test_legacy_split_layout_commits_everything() -> None:
    """Without ``extensible`` the whole cache is allocated up front and
    cannot be extended."""
    spec = _full_attention_spec()
    kv_cache_config, attn_groups = _attention_config(spec, _SplitKVBackend)
    runner = _Runner(kv_cache_config, attn_groups)
    raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=False)
    assert runner._extensible_kv_cache_buffers == []
    kv_cache = _attention(runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE]), "layer.0")
    assert kv_cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, 8, 128)
    kv_cache[0, NUM_BLOCKS - 1].fill_(1)
    kv_cache[1, NUM_BLOCKS - 1].fill_(2)
    assert torch.all(kv_cache[0, NUM_BLOCKS - 1] == 1)
    assert torch.all(kv_cache[1, NUM_BLOCKS - 1] == 2)
    with pytest.raises(RuntimeError, match="extensible"):
        runner.extend_kv_cache(NUM_BLOCKS)


def test_extensible_mamba_grows_per_layer() -> None:
    """Mamba per-layer buffers are block-major and grow with the KV cache."""
    spec = _mamba_spec()
    num_blocks = 512  # 4 MiB per layer
    layer_names = ("mamba.0", "mamba.1")
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tuple(
            KVCacheTensor(num_blocks * spec.page_size_bytes, (name,)) for name in layer_names
        ),
        kv_cache_groups=(KVCacheGroup(layer_names, spec),),
    )
    runner = _Runner(kv_cache_config, [[_AttentionGroup(_BlockMajorBackend, layer_names, spec, 0)]])
    try:
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        kv_caches = runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE])
        assert set(kv_caches) == set(layer_names)
        assert len(runner._extensible_kv_cache_buffers) == len(layer_names)
        for buffer, bytes_per_block_per_segment in runner._extensible_kv_cache_buffers:
            assert buffer.num_segments == 1
            assert bytes_per_block_per_segment == spec.page_size_bytes
        for name in layer_names:
            conv, ssm = _states(kv_caches, name)
            assert conv.shape == (num_blocks, 8, 128)
            assert ssm.shape == (num_blocks, 16, 64)
            # Both states of a block share its page, the second after the first.
            assert conv.stride(0) == ssm.stride(0) == spec.page_size_bytes // 4
            assert ssm.data_ptr() - conv.data_ptr() == 8 * 128 * 4

        # Write block 0 of every state of every layer (the committed
        # prefixes), then grow.
        for name in layer_names:
            for state in _states(kv_caches, name):
                state[0].fill_(1)
        runner.extend_kv_cache(num_blocks)
        for name in layer_names:
            for state in _states(kv_caches, name):
                state[num_blocks - 1].fill_(2)
        for name in layer_names:
            for state in _states(kv_caches, name):
                assert torch.all(state[0] == 1)
                assert torch.all(state[num_blocks - 1] == 2)
                assert torch.count_nonzero(state[1 : num_blocks - 1]) == 0
    finally:
        _free_buffers(runner)


def test_extensible_hybrid_attention_mamba() -> None:
    """In hybrid models the attention cache is re-strided to block-major, so
    its buffer must use a single segment."""
    kv_cache_config, attn_groups = _hybrid_config()
    runner = _Runner(kv_cache_config, attn_groups)
    try:
        # The K/V-split attention layer is forced to one segment by the
        # hybrid block-major re-stride.
        assert runner._kv_cache_num_segments_by_layer() == {"attn.0": 1, "mamba.0": 1}
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        assert [buffer.num_segments for buffer, _ in runner._extensible_kv_cache_buffers] == [1, 1]
        kv_caches = runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE, BLOCK_SIZE])
        assert runner.extensible_kv_cache is not None
        _check_hybrid_grows(kv_caches, runner.extensible_kv_cache)
    finally:
        _free_buffers(runner)


def test_extensible_kernel_blocks_split_each_block() -> None:
    """With kernel blocks half the manager's, the view counts twice the
    blocks of half the tokens; both halves still grow by whole blocks."""
    spec = _full_attention_spec()
    kernel_block_size = BLOCK_SIZE // 2
    kernel_blocks = 2 * NUM_BLOCKS
    kv_cache_config, attn_groups = _attention_config(spec, _SplitKVBackend)
    runner = _Runner(kv_cache_config, attn_groups)
    try:
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        kv_caches = runner._reshape_kv_cache_tensors(raw_tensors, [kernel_block_size])
        kv_cache = _attention(kv_caches, "layer.0")
        assert kv_cache.shape == (2, kernel_blocks, kernel_block_size, 8, 128)
        [(buffer, bytes_per_block_per_segment)] = runner._extensible_kv_cache_buffers
        assert buffer.num_segments == 2
        assert bytes_per_block_per_segment == spec.page_size_bytes // 2

        # Block 0 is committed: kernel blocks 0 and 1 of each half.
        kv_cache[0, 1].fill_(1)
        kv_cache[1, 1].fill_(2)
        runner.extend_kv_cache(NUM_BLOCKS)
        kv_cache[0, kernel_blocks - 1].fill_(3)
        kv_cache[1, kernel_blocks - 1].fill_(4)
        assert torch.all(kv_cache[0, 1] == 1)
        assert torch.all(kv_cache[1, 1] == 2)
        assert torch.all(kv_cache[0, kernel_blocks - 1] == 3)
        assert torch.all(kv_cache[1, kernel_blocks - 1] == 4)
        assert torch.count_nonzero(kv_cache[:, 0]) == 0
        assert torch.count_nonzero(kv_cache[:, 2 : kernel_blocks - 1]) == 0
    finally:
        _free_buffers(runner)


def test_extensible_sleep_keeps_addresses_and_zeroes() -> None:
    """Releasing the memory and committing it again keeps every address (the
    views stay valid); the blocks come back zeroed."""
    spec = _full_attention_spec()
    kv_cache_config, attn_groups = _attention_config(spec, _SplitKVBackend)
    runner = _Runner(kv_cache_config, attn_groups)
    try:
        raw_tensors = runner._allocate_kv_cache_tensors(kv_cache_config, extensible=True)
        kv_cache = _attention(
            runner._reshape_kv_cache_tensors(raw_tensors, [BLOCK_SIZE]), "layer.0"
        )
        runner.extend_kv_cache(NUM_BLOCKS)
        kv_cache.fill_(7)
        kv_cache_buffers = runner.extensible_kv_cache
        assert kv_cache_buffers is not None
        [(buffer, _)] = kv_cache_buffers.buffers
        base_ptr = buffer.full_view().data_ptr()
        assert kv_cache.data_ptr() == base_ptr

        kv_cache_buffers.release_physical()
        assert kv_cache_buffers.physical_bytes == 0
        assert kv_cache_buffers.num_blocks_committed == 0

        kv_cache_buffers.recommit()
        assert kv_cache_buffers.num_blocks_committed == NUM_BLOCKS
        assert kv_cache_buffers.physical_bytes >= NUM_BLOCKS * spec.page_size_bytes
        assert buffer.full_view().data_ptr() == base_ptr
        assert torch.count_nonzero(kv_cache) == 0
        kv_cache[1, NUM_BLOCKS - 1].fill_(8)
        assert torch.all(kv_cache[1, NUM_BLOCKS - 1] == 8)
    finally:
        _free_buffers(runner)


# ---------------------------------------------------------------------------
# V2 runner
# ---------------------------------------------------------------------------


def _v2_allocate(
    kv_cache_config: KVCacheConfig,
    attn_groups: list[list[_AttentionGroup]],
    kernel_block_sizes: list[int],
) -> tuple[KVCaches, ExtensibleKVCacheBuffers]:
    flat_groups = [group for groups in attn_groups for group in groups]
    raw_tensors, kv_cache_buffers = _allocate_extensible_kv_cache(
        kv_cache_config, DEVICE, flat_groups, kernel_block_sizes, "auto"
    )
    kv_caches = _reshape_kv_cache(
        attn_groups=flat_groups,
        kv_cache_raw_tensors=raw_tensors,
        cache_dtype="auto",
        kernel_block_sizes=kernel_block_sizes,
    )
    return kv_caches, kv_cache_buffers


def test_v2_num_segments_by_layer() -> None:
    """V2 segment counts follow the layer's physical layout, and hybrid
    models force block-major (one segment)."""
    spec = _full_attention_spec()
    for backend, expected in (
        (_SplitKVBackend, 2),
        (_BlockMajorBackend, 1),
        (_StrideOrderBackend, 1),
    ):
        _, attn_groups = _attention_config(spec, backend)
        flat_groups = [group for groups in attn_groups for group in groups]
        assert _kv_cache_num_segments_by_layer(
            flat_groups, [BLOCK_SIZE], "auto", has_mamba=False
        ) == {"layer.0": expected}
        assert _kv_cache_num_segments_by_layer(
            flat_groups, [BLOCK_SIZE], "auto", has_mamba=True
        ) == {"layer.0": 1}


def test_v2_extensible_split_layout_grows_incrementally() -> None:
    """A K/V-split layer grows both halves in lockstep through the staged
    commits of the V2 flow (init -> warm-up prefix -> final size)."""
    spec = _full_attention_spec()
    kv_cache_config, attn_groups = _attention_config(spec, _SplitKVBackend)
    kv_caches, kv_cache_buffers = _v2_allocate(kv_cache_config, attn_groups, [BLOCK_SIZE])
    try:
        kv_cache = _attention(kv_caches, "layer.0")
        assert kv_cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, 8, 128)
        assert kv_cache_buffers.num_blocks_committed == 1
        [(buffer, bytes_per_block_per_segment)] = kv_cache_buffers.buffers
        assert buffer.num_segments == 2
        assert bytes_per_block_per_segment == spec.page_size_bytes // 2

        kv_cache[0, 0].fill_(1)  # K, block 0
        kv_cache[1, 0].fill_(2)  # V, block 0

        # Warm-up touches a prefix, then the final post-warm-up commit.
        kv_cache_buffers.ensure_blocks(8)
        assert kv_cache_buffers.num_blocks_committed == 8
        kv_cache[0, 7].fill_(3)
        kv_cache_buffers.commit(NUM_BLOCKS)
        # Shrink requests are ignored.
        kv_cache_buffers.commit(1)
        assert kv_cache_buffers.num_blocks_committed == NUM_BLOCKS

        kv_cache[1, NUM_BLOCKS - 1].fill_(4)
        assert torch.all(kv_cache[0, 0] == 1)
        assert torch.all(kv_cache[1, 0] == 2)
        assert torch.all(kv_cache[0, 7] == 3)
        assert torch.all(kv_cache[1, NUM_BLOCKS - 1] == 4)
        assert torch.count_nonzero(kv_cache[:, 1:7]) == 0
        assert torch.count_nonzero(kv_cache[:, 8 : NUM_BLOCKS - 1]) == 0
        assert kv_cache_buffers.physical_bytes >= NUM_BLOCKS * spec.page_size_bytes
    finally:
        kv_cache_buffers.free()


def test_v2_extensible_hybrid_attention_mamba() -> None:
    """V2 hybrid models re-stride attention to block-major; both the
    attention and Mamba buffers grow as single-segment prefixes."""
    kv_cache_config, attn_groups = _hybrid_config()
    kv_caches, kv_cache_buffers = _v2_allocate(kv_cache_config, attn_groups, [BLOCK_SIZE] * 2)
    try:
        assert [buffer.num_segments for buffer, _ in kv_cache_buffers.buffers] == [1, 1]
        _check_hybrid_grows(kv_caches, kv_cache_buffers)
    finally:
        kv_cache_buffers.free()
