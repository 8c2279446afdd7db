"""ExtensibleTensor (``core.py``): a segmented byte buffer that grows in place;
the operations over several tensors at once (``group.py``: grow, release,
remap discarding; ``remap.py``: shrink and defragment keeping contents); its
memory shared with other processes (``sharing.py``, the layout it
exports in ``shared_layout.py``)."""

from extensible_kv.tensor.core import ExtensibleTensor, published_figures
from extensible_kv.tensor.group import (
    commit_ranges_all,
    create_ahead_all,
    holding_growth,
    in_one_chunk_per_segment,
    release_physical_all,
    remap_per_segment_all,
    resize_per_segment_all,
)
from extensible_kv.tensor.remap import defragment_all, shrink_per_segment_all
from extensible_kv.tensor.shared_layout import SharedLayout

__all__ = [
    "ExtensibleTensor",
    "SharedLayout",
    "commit_ranges_all",
    "defragment_all",
    "holding_growth",
    "in_one_chunk_per_segment",
    "published_figures",
    "release_physical_all",
    "remap_per_segment_all",
    "create_ahead_all",
    "resize_per_segment_all",
    "shrink_per_segment_all",
]
