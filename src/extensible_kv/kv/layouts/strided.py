"""vLLM 0.32's description: every layer placed in one backing buffer by strides.

A 0.32 ``KVCacheTensor`` names its ``layers`` in order and places block
``b`` of ``layers[l]`` at ``offset + l * layer_stride + b * block_stride``
bytes into a backing buffer of ``size`` bytes, one page
(``spec.page_size_bytes``) long. Every tensor of a config shares that one
buffer; tensors of different groups may overlay the same bytes.

Two placements commit as prefixes, and are the ones taken here:

- **layer-outermost** (vLLM's ``LBHNC``, the CPU backend's only layout):
  ``layer_stride = num_blocks * block_stride``. Each layer is one segment;
  committing ``n`` blocks commits the first ``n * block_stride`` bytes of
  every segment. The spacing depends on the block count, so to grow in place
  the description is first laid out at the capacity (:func:`at_capacity`).
- **block-outermost** (``BLHNC``, ``BLNHC``, ``BHLNC``): every layer's page
  of block ``b`` lies in row ``b``, ``block_stride`` bytes wide. One segment;
  ``n`` blocks are the first ``n`` rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from extensible_kv.kv.layouts.block_layout import BlockLayout


def is_strided(config: Any) -> bool:
    """Whether ``config`` is vLLM 0.32's description (tensors with ``layers``
    and ``layer_stride``) rather than the seed's (``shared_by``)."""
    tensors = list(config.kv_cache_tensors)
    return bool(tensors) and all(
        hasattr(tensor, "layers") and hasattr(tensor, "layer_stride") for tensor in tensors
    )


@dataclass(frozen=True)
class Segmentation:
    """How a backing buffer splits into segments that commit as prefixes:
    ``num_segments`` equal segments, ``row_bytes`` per block in each."""

    num_segments: int
    row_bytes: int
    layer_outermost: bool

    def size_bytes(self, num_blocks: int) -> int:
        """The buffer's bytes at ``num_blocks`` blocks."""
        return self.num_segments * num_blocks * self.row_bytes


def _page_sizes(config: Any) -> dict[str, int]:
    """Each layer's page (bytes of one block), from its group's spec."""
    pages: dict[str, int] = {}
    for index, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        for name in group.layer_names:
            layer_spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)
            if getattr(layer_spec, "host_resident", False) or not getattr(
                layer_spec, "has_layer_views", True
            ):
                raise ValueError(
                    f"layer {name!r} of KV cache group {index} has no per-layer view "
                    f"({type(layer_spec).__name__}); an extensible KV cache supports "
                    f"attention and Mamba layers"
                )
            pages[name] = int(layer_spec.page_size_bytes)
    return pages


def _positive(index: int, tensor: Any, field: str, minimum: int = 1) -> int:
    value = getattr(tensor, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"KV cache tensor {index}: {field} must be an int of at least {minimum} bytes, "
            f"got {value!r}"
        )
    return value


def _placement(index: int, tensor: Any, num_blocks: int, page: int) -> Segmentation:
    """The segmentation one tensor's placement needs, at ``num_blocks`` blocks."""
    layer_stride = _positive(index, tensor, "layer_stride")
    block_stride = _positive(index, tensor, "block_stride")
    offset = _positive(index, tensor, "offset", minimum=0)
    size = _positive(index, tensor, "size")
    num_layers = len(tensor.layers)
    if layer_stride == num_blocks * block_stride and offset % layer_stride + page <= block_stride:
        # Several layer-outermost tensors (one per page size) follow each
        # other: the offset is whole segments before the tensor's first layer.
        if size % layer_stride or offset // layer_stride + num_layers > size // layer_stride:
            raise ValueError(
                f"KV cache tensor {index}: its layers at offset {offset} do not fit "
                f"{size} bytes of whole {layer_stride}-byte layers"
            )
        return Segmentation(size // layer_stride, block_stride, layer_outermost=True)
    if offset + (num_layers - 1) * layer_stride + min(page, layer_stride) <= block_stride:
        if size != num_blocks * block_stride:
            raise ValueError(
                f"KV cache tensor {index}: {size} bytes are not {num_blocks} rows of "
                f"{block_stride} bytes"
            )
        return Segmentation(1, block_stride, layer_outermost=False)
    raise ValueError(
        f"KV cache tensor {index}: layer_stride {layer_stride}, block_stride {block_stride} "
        f"and offset {offset} place its {page}-byte pages neither layer-outermost "
        f"(layer_stride = num_blocks * block_stride, as LBHNC) nor block-outermost (each "
        f"block's pages in one row, as BLHNC); an extensible KV cache needs one of the two"
    )


def segmentation(config: Any) -> Segmentation:
    """The one segmentation every tensor of ``config`` agrees on, at
    ``config.num_blocks`` blocks; a ValueError naming the tensor whose
    placement is neither layer- nor block-outermost, or that disagrees."""
    pages = _page_sizes(config)
    found: Segmentation | None = None
    for index, tensor in enumerate(config.kv_cache_tensors):
        if getattr(tensor, "host_resident", False):
            raise ValueError(
                f"KV cache tensor {index} is host-resident (HiSparse); an extensible KV "
                f"cache backs device tensors only"
            )
        layers = list(tensor.layers)
        unknown = [name for name in layers if name not in pages]
        if not layers or unknown:
            raise ValueError(
                f"KV cache tensor {index} names no layer, or layers no group has: "
                f"{', '.join(unknown) or 'none'}"
            )
        page = max(pages[name] for name in layers)
        mine = _placement(index, tensor, config.num_blocks, page)
        if found is not None and mine != found:
            raise ValueError(
                f"KV cache tensor {index} splits the backing buffer into {mine.num_segments} "
                f"segments of {mine.row_bytes}-byte blocks, tensor 0 into {found.num_segments} "
                f"of {found.row_bytes}; tensors sharing the buffer must agree"
            )
        found = mine
    if found is None:
        raise ValueError("the KV cache config has no KV cache tensors")
    return found


def at_capacity(config: Any, capacity: int) -> Any:
    """``config`` (sized by vLLM for ``config.num_blocks`` blocks) laid out
    for ``capacity`` blocks: ``num_blocks = capacity``, layer-outermost
    tensors ``layer_stride = capacity * block_stride``, and every tensor's
    ``size`` the buffer's bytes at ``capacity``.

    Allocate the result (:func:`~extensible_kv.kv.allocate_kv_cache`),
    commit vLLM's count, and make the views with vLLM's
    ``create_kv_cache_views`` over ``kv.backing[0]`` and the result's
    tensors: they keep their addresses while the cache grows towards
    ``capacity``. ``config`` and its tensors are dataclasses (vLLM's are);
    they are copied, not changed.
    """
    num_blocks = config.num_blocks
    if capacity < num_blocks:
        raise ValueError(
            f"the capacity of {capacity} blocks is below the {num_blocks} blocks vLLM "
            f"sized the cache to; reserve at least that many"
        )
    split = segmentation(config)
    size = split.size_bytes(capacity)

    def respace(tensor: Any) -> Any:
        if not split.layer_outermost:
            return dataclasses.replace(tensor, size=size)
        stride = capacity * tensor.block_stride
        whole, part = divmod(tensor.offset, tensor.layer_stride)
        return dataclasses.replace(
            tensor, size=size, layer_stride=stride, offset=whole * stride + part
        )

    tensors = [respace(tensor) for tensor in config.kv_cache_tensors]
    kept = tuple(tensors) if isinstance(config.kv_cache_tensors, tuple) else tensors
    return dataclasses.replace(config, num_blocks=capacity, kv_cache_tensors=kept)


def layer_layouts(config: Any) -> dict[str, BlockLayout]:
    """Each layer's blocks as bytes, ``(config.num_blocks, page)`` uint8 at
    its place in the backing buffer: its page, where the page is one run of
    bytes (``layer_stride >= page``); else (pages of several layers
    interleaved, as BHLNC) the whole block row, which holds it."""
    capacity = config.num_blocks
    pages = _page_sizes(config)
    layouts: dict[str, BlockLayout] = {}
    for tensor in config.kv_cache_tensors:
        for position, name in enumerate(tensor.layers):
            contiguous = tensor.layer_stride >= pages[name]
            layouts.setdefault(
                name,
                BlockLayout(
                    shape=(capacity, pages[name] if contiguous else tensor.block_stride),
                    strides=(tensor.block_stride, 1),
                    dtype=torch.uint8,
                    block_dim=0,
                    offset_bytes=tensor.offset + position * tensor.layer_stride
                    if contiguous
                    else 0,
                ),
            )
    return layouts
