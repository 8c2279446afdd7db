"""Allocate a KV cache from its description: buffers, per-layer views, narrowing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from extensible_kv._checks import check_int
from extensible_kv.dlpack import as_tensor
from extensible_kv.driver import Driver
from extensible_kv.kv.cache.core import KVCacheBuffers
from extensible_kv.kv.layouts.block_layout import (
    BlockLayout,
    attention_geometry,
    blocks_per_kv_block,
    layer_segments,
    mamba_layouts,
    place,
)
from extensible_kv.kv.layouts.spec import is_mamba
from extensible_kv.kv.layouts.strided import is_strided, layer_layouts, segmentation
from extensible_kv.tensor import ExtensibleTensor

#: A layer's view: one tensor for attention, one per state for Mamba.
LayerView = torch.Tensor | list[torch.Tensor]


@dataclass(frozen=True)
class LayerPlacement:
    """Where a layer lives: its buffer, its layouts there, whether its
    buffer is packed (several layers' pages in one block row), and how many
    kernel blocks make one of its blocks (the views count kernel blocks)."""

    buffer: ExtensibleTensor
    layouts: tuple[BlockLayout, ...]
    packed: bool
    mamba: bool
    blocks_per_kv_block: int = 1


@dataclass(repr=False)
class KVCache:
    """An allocated KV cache.

    Attributes:
        cache: the cache (commit, release, recommit, free); ``buffers`` is
            its name before 0.2.
        views: per layer, the tensor(s) the attention kernels read, spanning
            the whole capacity; valid for the cache's lifetime.
        placements: per layer, where its views live (for narrowing).
    """

    cache: KVCacheBuffers
    views: dict[str, LayerView]
    placements: dict[str, LayerPlacement]

    @property
    def buffers(self) -> KVCacheBuffers:
        """:attr:`cache` by its name before 0.2."""
        return self.cache

    @property
    def backing(self) -> list[torch.Tensor]:
        """Each buffer's whole reservation as one int8 tensor (vLLM 0.32's
        backing buffer, for its ``create_kv_cache_views``); touch only
        committed blocks. The cache keeps owning the memory."""
        return [tensor.full_view().view(torch.int8) for tensor, _ in self.cache.tensors]

    def narrowed_views(self, num_blocks: int | None = None) -> dict[str, LayerView]:
        """Views trimmed to the first ``num_blocks`` (default: the committed)
        blocks, for KV connectors registering memory; see
        :func:`narrow_to_num_blocks`."""
        n = self.cache.num_blocks_committed if num_blocks is None else num_blocks
        return narrow_to_num_blocks(self.views, n, self.placements)

    def __repr__(self) -> str:
        # Shapes only: printing a view would read its uncommitted blocks,
        # which are unmapped addresses (a fault, not an exception).
        shapes = {
            name: [tuple(t.shape) for t in view] if isinstance(view, list) else tuple(view.shape)
            for name, view in self.views.items()
        }
        return f"KVCache({self.cache!r}, views={shapes})"

    def free(self) -> None:
        self.views.clear()
        self.cache.free()


def narrow_to_num_blocks(
    views: Mapping[str, LayerView], num_blocks: int, placements: Mapping[str, LayerPlacement]
) -> dict[str, LayerView]:
    """Each layer's views trimmed to its first ``num_blocks`` blocks (which
    are ``num_blocks * blocks_per_kv_block`` kernel blocks of its views).

    Views keep their base pointers and strides, and are rebuilt on storage
    that ends at their last committed byte: a connector that registers a
    view's storage (``untyped_storage().nbytes()``) registers no address
    past the committed blocks. A block-major view's storage is exactly its
    committed blocks; packed layers (several in each block row) share one
    storage of exactly the committed rows; a view of several segments (K/V
    split) spans the uncommitted tail of every segment but the last, so
    register those per segment (``view[0]``, ``view[1]``). Register after a defragmenting
    commit: UCX cannot transfer a region spanning several physical
    allocations. ``views`` gives the layers; the placements hold their layouts.
    """
    narrowed: dict[str, LayerView] = {}
    # Packed layers (several per block row) share one storage of exactly the
    # committed rows, so a connector registering any of them sees them all.
    shared: dict[int, torch.Tensor] = {}
    for name in views:
        placement = placements[name]
        kernel_blocks = num_blocks * placement.blocks_per_kv_block
        layouts = [layout.with_blocks(kernel_blocks) for layout in placement.layouts]
        if placement.packed:
            key = id(placement.buffer)
            if key not in shared:
                end = num_blocks * _row_bytes(layouts[0])
                shared[key] = as_tensor(placement.buffer.buffer, 0, end)
            storage = shared[key]
        else:
            end = max(layout.end_bytes for layout in layouts)
            storage = as_tensor(placement.buffer.buffer, 0, end)
        trimmed = [layout.view(storage) for layout in layouts]
        narrowed[name] = trimmed if placement.mamba else trimmed[0]
    return narrowed


def _row_bytes(layout: BlockLayout) -> int:
    """Bytes from one block to the next in a layout."""
    return layout.strides[layout.block_dim] * layout.dtype.itemsize


@dataclass
class _Layer:
    name: str
    spec: Any
    backend: Any
    cache_dtype: str = "auto"
    kernel_block_size: int | None = None

    @property
    def blocks_per_kv_block(self) -> int:
        if is_mamba(self.spec):
            return 1
        return blocks_per_kv_block(self.spec, self.kernel_block_size)


def _per_group(name: str, value: Any, count: int) -> list[Any]:
    """One ``value`` for every group, or a sequence of one per group."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{count} KV cache groups need {count} {name}, got {len(value)}")
    return list(value)


def _layers(
    config: Any,
    backends: Any,
    cache_dtype: str | Mapping[str, str],
    kernel_block_sizes: Sequence[int] | None,
) -> dict[str, _Layer]:
    groups = list(config.kv_cache_groups)
    backends = _per_group("backends", backends, len(groups))
    kernels = _per_group("kernel block sizes", kernel_block_sizes, len(groups))
    layers: dict[str, _Layer] = {}
    seen: dict[str, int] = {}
    for index, (group, backend, kernel) in enumerate(zip(groups, backends, kernels, strict=True)):
        spec = group.kv_cache_spec
        if backend is None and not is_mamba(spec):
            raise ValueError(f"KV cache group {index} is attention and needs a backend")
        if not is_mamba(spec):
            try:
                blocks_per_kv_block(spec, kernel)
            except ValueError as exc:
                raise ValueError(f"KV cache group {index}: {exc}") from None
        for name in group.layer_names:
            if name in seen:
                raise ValueError(f"layer {name!r} is in KV cache groups {seen[name]} and {index}")
            seen[name] = index
            dtype = cache_dtype if isinstance(cache_dtype, str) else cache_dtype.get(name, "auto")
            layers[name] = _Layer(name, spec, backend, dtype, kernel)
    if not isinstance(cache_dtype, str):
        unknown = sorted(set(cache_dtype) - set(layers))
        if unknown:
            raise ValueError(f"cache_dtype names layers no group has: {', '.join(unknown)}")
    return layers


def _check_coverage(config: Any, layers: Mapping[str, _Layer]) -> None:
    owner: dict[str, int] = {}
    for index, tensor in enumerate(config.kv_cache_tensors):
        unknown = [n for n in tensor.shared_by if n not in layers]
        if unknown:
            raise ValueError(
                f"KV cache tensor {index} names layers no group has: {', '.join(unknown)}"
            )
        for name in tensor.shared_by:
            if name in owner:
                raise ValueError(
                    f"layer {name!r} is backed by KV cache tensors {owner[name]} and {index}"
                )
            owner[name] = index
    missing = [name for name in layers if name not in owner]
    if missing:
        raise ValueError(f"layers not backed by any KV cache tensor: {', '.join(missing)}")


def allocate_kv_cache(
    config: Any,
    backends: Any = None,
    device: torch.device | str | int | None = None,
    *,
    cache_dtype: str | Mapping[str, str] = "auto",
    kernel_block_sizes: Sequence[int] | None = None,
    shareable: bool = False,
    driver: Driver | None = None,
    chunk_bytes: int | None = None,
) -> KVCache:
    """Reserve a KV cache for ``config.num_blocks`` blocks and commit one.

    Args:
        config: a KV cache description (``num_blocks``, ``kv_cache_tensors``,
            ``kv_cache_groups``): the seed's (tensors with ``shared_by``, as
            :class:`~extensible_kv.kv.KVCacheConfig`), or vLLM 0.32's (tensors
            with ``layers``, ``layer_stride``, ``block_stride`` and ``offset``
            sharing one backing buffer; lay it out at the capacity first with
            :func:`~extensible_kv.kv.at_capacity`).
        backends: the attention backend of each group, in group order (None
            for Mamba groups), or one backend for every group. Not used for
            vLLM 0.32's description, whose views vLLM makes itself from
            :attr:`KVCache.backing`.
        device: as for :class:`ExtensibleTensor`; None: the current GPU, else the host.
        cache_dtype: passed to the backends as ``cache_dtype_str``: one for
            every layer, or a mapping from layer name to its own (layers it
            does not name: ``"auto"``).
        kernel_block_sizes: per group, the block size (tokens) the attention
            kernel uses, when it divides the spec's block size (vLLM's V2
            runner): each block is then ``block_size // kernel_block_size``
            kernel blocks and the views count kernel blocks. None: the
            spec's block size. Ignored for Mamba groups.
        shareable: allocate memory other processes can map (see :mod:`extensible_kv.share`).
        driver: the driver to use, e.g. wrapped in an adaptor.
        chunk_bytes: largest physical chunk one commit maps (see the chunk policy).

    Every layer must be backed by exactly one KV cache tensor; layers
    sharing a tensor must agree on its number of segments. A cache with a
    Mamba group is hybrid: its attention layers are stored block-major.
    With vLLM 0.32's description, ``views`` holds each layer's blocks as
    bytes, ``(num_blocks, page)`` uint8.
    """
    capacity = check_int("num_blocks", config.num_blocks)
    if capacity < 1:
        raise ValueError(f"num_blocks must be positive, got {capacity}")
    make = {"device": device, "shareable": shareable, "driver": driver, "chunk_bytes": chunk_bytes}
    if is_strided(config):
        return _allocate_strided(config, make)
    layers = _layers(config, backends, cache_dtype, kernel_block_sizes)
    _check_coverage(config, layers)
    packed: dict[int, list[tuple[int, Any]]] = defaultdict(list)
    plain: list[tuple[int, Any]] = []
    for index, tensor in enumerate(config.kv_cache_tensors):
        _check_offsets(index, tensor)
        if tensor.block_stride:
            packed[int(tensor.block_stride)].append((index, tensor))
        else:
            plain.append((index, tensor))
    builder = _Builder(layers, capacity, make)
    try:
        for index, tensor in plain:
            builder.plain_buffer(index, tensor)
        for row_bytes, members in packed.items():
            builder.packed_buffer(row_bytes, members)
        views = builder.views()
        cache = KVCacheBuffers(builder.tensors, capacity)
        cache.commit(1)
    except BaseException:
        for buffer, _ in builder.tensors:
            buffer.free()
        raise
    return KVCache(cache, views, builder.placements)


def _allocate_strided(config: Any, make: dict[str, Any]) -> KVCache:
    """vLLM 0.32's description: one backing buffer, its segments as
    :func:`~extensible_kv.kv.layouts.strided.segmentation` finds them."""
    capacity = config.num_blocks
    split = segmentation(config)
    layouts = layer_layouts(config)
    buffer = ExtensibleTensor(split.size_bytes(capacity), num_segments=split.num_segments, **make)
    try:
        full = buffer.full_view()
        views: dict[str, LayerView] = {name: layout.view(full) for name, layout in layouts.items()}
        placements = {
            name: LayerPlacement(buffer, (layout,), packed=not split.layer_outermost, mamba=False)
            for name, layout in layouts.items()
        }
        cache = KVCacheBuffers([(buffer, split.row_bytes)], capacity)
        cache.commit(1)
    except BaseException:
        buffer.free()
        raise
    return KVCache(cache, views, placements)


def _check_offsets(index: int, tensor: Any) -> None:
    """A KV cache tensor's ``offset`` and ``block_stride`` are whole, non-negative bytes."""
    for field in ("offset", "block_stride"):
        value = getattr(tensor, field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"KV cache tensor {index}: {field} must be a non-negative int (bytes), "
                f"got {value!r}"
            )


class _Builder:
    """Makes the buffers of one allocation and places its layers in them."""

    def __init__(self, layers: Mapping[str, _Layer], capacity: int, make: dict[str, Any]) -> None:
        self.layers = layers
        self.capacity = capacity
        self.make = make
        self.hybrid = any(is_mamba(layer.spec) for layer in layers.values())
        self.tensors: list[tuple[ExtensibleTensor, int]] = []
        self.placements: dict[str, LayerPlacement] = {}

    def segments(self, name: str) -> int:
        layer = self.layers[name]
        return layer_segments(
            layer.spec, layer.backend, layer.cache_dtype, self.hybrid, layer.kernel_block_size
        )

    def layouts(self, name: str, row_bytes: int, offset: int) -> tuple[BlockLayout, ...]:
        """A layer's layouts in a buffer of ``capacity`` blocks with that row."""
        layer = self.layers[name]
        if is_mamba(layer.spec):
            return tuple(
                mamba_layouts(
                    layer.spec, capacity=self.capacity, row_bytes=row_bytes, offset_bytes=offset
                )
            )
        geometry = attention_geometry(
            layer.backend, layer.spec, self.capacity, layer.cache_dtype, layer.kernel_block_size
        )
        if self.hybrid:
            geometry = geometry.block_major()
        # A block of r kernel blocks is r rows of row_bytes / r: kernel block
        # j = b * r + k lies k rows into block b, so one stride serves both.
        ratio = layer.blocks_per_kv_block
        if row_bytes % ratio:
            raise ValueError(
                f"its {row_bytes}-byte block rows do not split into {ratio} kernel blocks"
            )
        return (
            place(
                geometry,
                layer.spec.dtype,
                capacity=self.capacity * ratio,
                row_bytes=row_bytes // ratio,
                offset_bytes=offset,
            ),
        )

    def _place(
        self, buffer: ExtensibleTensor, where: str, name: str, row: int, offset: int, packed: bool
    ) -> None:
        try:
            layouts = self.layouts(name, row, offset)
        except ValueError as exc:
            raise ValueError(f"layer {name!r} does not fit {where}: {exc}") from None
        layer = self.layers[name]
        self.placements[name] = LayerPlacement(
            buffer,
            layouts,
            packed=packed,
            mamba=is_mamba(layer.spec),
            blocks_per_kv_block=layer.blocks_per_kv_block,
        )

    def _add(self, buffer: ExtensibleTensor, row: int) -> None:
        self.tensors.append((buffer, row))

    def views(self) -> dict[str, LayerView]:
        """Every layer's view(s) over its buffer, spanning the capacity.

        Made before any memory is committed; a layout that does not fit its
        buffer (an offset past the row, say) is a ValueError naming the layer.
        """
        views: dict[str, LayerView] = {}
        for name, placement in self.placements.items():
            full = placement.buffer.full_view()
            try:
                tensors = [layout.view(full) for layout in placement.layouts]
            except RuntimeError as exc:
                raise ValueError(
                    f"layer {name!r} does not fit its buffer of {full.numel()} bytes "
                    f"(check its KV cache tensor's offset and size): {exc}"
                ) from None
            views[name] = tensors if placement.mamba else tensors[0]
        return views

    def plain_buffer(self, index: int, tensor: Any) -> None:
        """One buffer for one KV cache tensor and the layers sharing it."""
        capacity = self.capacity
        if tensor.size % capacity:
            raise ValueError(
                f"KV cache tensor {index} has {tensor.size} bytes, not a multiple of "
                f"num_blocks {capacity}"
            )
        counts = {name: self.segments(name) for name in tensor.shared_by}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{name} has {n}" for name, n in counts.items())
            raise ValueError(
                f"layers sharing KV cache tensor {index} disagree on segments: {listed}"
            )
        segments = next(iter(counts.values()))
        bytes_per_block = tensor.size // capacity
        if bytes_per_block % segments:
            raise ValueError(
                f"KV cache tensor {index}: {bytes_per_block} bytes per block do not split "
                f"into {segments} segments"
            )
        row = bytes_per_block // segments
        buffer = ExtensibleTensor(capacity * bytes_per_block, num_segments=segments, **self.make)
        self._add(buffer, row)
        for name in tensor.shared_by:
            self._place(buffer, f"KV cache tensor {index}", name, row, int(tensor.offset), False)

    def packed_buffer(self, row_bytes: int, members: list[tuple[int, Any]]) -> None:
        """One single-segment buffer for every tensor packed into rows of that width."""
        for index, tensor in members:
            for name in tensor.shared_by:
                if self.layers[name].blocks_per_kv_block != 1:
                    raise ValueError(
                        f"layer {name!r} of packed KV cache tensor {index}: a packed row holds "
                        f"several layers' pages, so it cannot be split into kernel blocks "
                        f"(kernel block size {self.layers[name].kernel_block_size}, block size "
                        f"{self.layers[name].spec.block_size})"
                    )
                if self.segments(name) != 1:
                    raise ValueError(
                        f"layer {name!r} of packed KV cache tensor {index} is not block-major "
                        f"(its layout has several segments); packed rows need one segment"
                    )
                if int(tensor.offset) + self.layers[name].spec.page_size_bytes > row_bytes:
                    raise ValueError(
                        f"layer {name!r} of packed KV cache tensor {index}: its page at offset "
                        f"{tensor.offset} runs past the {row_bytes}-byte row"
                    )
        buffer = ExtensibleTensor(self.capacity * row_bytes, **self.make)
        self._add(buffer, row_bytes)
        for index, tensor in members:
            for name in tensor.shared_by:
                where = f"packed KV cache tensor {index}"
                self._place(buffer, where, name, row_bytes, int(tensor.offset), True)
