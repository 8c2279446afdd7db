"""Which tensors may join a KV cache.

A :class:`~extensible_kv.kv.KVCacheBuffers` takes its tensors as
``(tensor, bytes_per_block_per_segment)`` pairs, at construction and later
(:meth:`~extensible_kv.kv.KVCacheBuffers.add`); these checks say, before
anything changes, what it cannot take and why. They keep no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extensible_kv._checks import check_int
from extensible_kv.tensor import ExtensibleTensor

__all__ = ["as_pairs", "check_all_joining", "check_joining"]


def as_pairs(items: Sequence[Any]) -> list[tuple[ExtensibleTensor, int]]:
    """``items`` as ``(tensor, bytes_per_block_per_segment)`` pairs, or a
    TypeError saying that is what a KV cache takes."""
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(
                f"a KV cache takes (ExtensibleTensor, bytes_per_block_per_segment) pairs, "
                f"got {type(item).__name__}"
            )
        pairs.append((item[0], item[1]))
    return pairs


def check_joining(
    tensor: ExtensibleTensor,
    bytes_per_block: int,
    num_blocks_capacity: int,
    members: Sequence[tuple[ExtensibleTensor, int]],
) -> None:
    """Refuse ``tensor`` as a new member of a cache of ``num_blocks_capacity``
    blocks holding ``members``: it must be an :class:`ExtensibleTensor` not
    among them, with positive ``bytes_per_block`` (bytes per block per
    segment) and room in each segment for the capacity."""
    if not isinstance(tensor, ExtensibleTensor):
        raise TypeError(f"a KV cache tensor is an ExtensibleTensor, got {type(tensor).__name__}")
    if any(tensor is mine for mine, _ in members):
        raise ValueError(f"{tensor!r} is already in this KV cache; each tensor joins once")
    check_int("bytes_per_block_per_segment", bytes_per_block)
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block_per_segment must be positive, got {bytes_per_block}")
    needed = num_blocks_capacity * bytes_per_block
    if needed > tensor.segment_capacity_bytes:
        raise ValueError(
            f"{num_blocks_capacity} blocks of {bytes_per_block} bytes per segment "
            f"({needed} bytes) exceed the segment capacity "
            f"{tensor.segment_capacity_bytes} of {tensor!r}"
        )


def check_all_joining(
    items: Sequence[tuple[ExtensibleTensor, int]],
    num_blocks_capacity: int,
    members: Sequence[tuple[ExtensibleTensor, int]],
) -> None:
    """:func:`check_joining` for each of ``items`` joining together, none
    of them given twice."""
    for index, (tensor, per_block) in enumerate(items):
        if any(tensor is other for other, _ in items[:index]):
            raise ValueError(f"{tensor!r} is given twice; each tensor joins once")
        check_joining(tensor, per_block, num_blocks_capacity, members)
