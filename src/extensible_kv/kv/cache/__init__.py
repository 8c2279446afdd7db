"""The cache and its parts: :class:`KVCacheBuffers` (``core.py``), the
tensors it moves in lockstep (``block_tensors.py``, ``members.py``), how
it grows and shrinks (``resize.py``), its sleep (``sleep.py``, the state;
``sleep_wake.py``, the moves; ``backup.py``, the host copy), its commits
on a worker thread (``commit_queue.py``, ``commit_ticket.py``), the
connectors' registrations (``registrations.py``), the elastic units' books
(``held_units.py``) and what ``top`` shows of it (``published.py``)."""

from extensible_kv.kv.cache.backup import HostBackup
from extensible_kv.kv.cache.commit_ticket import CommitTicket
from extensible_kv.kv.cache.core import (
    ConnectorRegistrationWarning,
    ExtensibleKVCacheBuffers,
    KVCacheBuffers,
)
from extensible_kv.kv.cache.sleep import SleepState

__all__ = [
    "CommitTicket",
    "ConnectorRegistrationWarning",
    "ExtensibleKVCacheBuffers",
    "HostBackup",
    "KVCacheBuffers",
    "SleepState",
]
