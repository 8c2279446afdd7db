"""ExtensibleTensor (``core.py``): a segmented byte buffer that grows in place;
the operations over several tensors at once (``group.py``: grow, release,
remap discarding; ``remap.py``: shrink and defragment keeping contents); its
memory shared with other processes (``sharing.py``)."""

from extensible_kv.devices import stream_handles
from extensible_kv.share import SharedLayout
from extensible_kv.tensor.core import ExtensibleTensor, published_figures
from extensible_kv.tensor.group import (
    claimed_at_once,
    in_one_chunk_per_segment,
    release_physical_all,
    remap_per_segment_all,
    reserve_ahead_all,
    reserving,
    resize_per_segment_all,
)
from extensible_kv.tensor.remap import defragment_all, shrink_per_segment_all

__all__ = [
    "ExtensibleTensor",
    "SharedLayout",
    "claimed_at_once",
    "defragment_all",
    "in_one_chunk_per_segment",
    "published_figures",
    "release_physical_all",
    "remap_per_segment_all",
    "reserve_ahead_all",
    "reserving",
    "resize_per_segment_all",
    "shrink_per_segment_all",
    "stream_handles",
]
