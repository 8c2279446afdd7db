"""VirtualBuffer: one virtual address reservation and the physical chunks in
it (``virtual.py``); what the chunks are (``chunks.py``); the operations over
several buffers at once (``group.py``), each one transaction (``txn.py``)
holding from the driver stacks what it creates (``hold.py``);
chunks mapped again with their contents (``remap.py``); memory shared with
other processes (``sharing.py``)."""

from extensible_kv.buffer.chunks import Chunk, Remap, Staging
from extensible_kv.buffer.group import (
    commit_together,
    defragment_together,
    release_idle,
    release_outside_together,
    release_together,
    synchronize_buffers,
)
from extensible_kv.buffer.hold import holding
from extensible_kv.buffer.remap import swap_in_together
from extensible_kv.buffer.txn import Transaction, contexts_of, hold_locks
from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = [
    "Chunk",
    "Remap",
    "Staging",
    "Transaction",
    "VirtualBuffer",
    "commit_together",
    "contexts_of",
    "defragment_together",
    "hold_locks",
    "holding",
    "release_idle",
    "release_outside_together",
    "release_together",
    "swap_in_together",
    "synchronize_buffers",
]
