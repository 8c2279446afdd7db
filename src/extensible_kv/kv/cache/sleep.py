"""Where a KV cache stands in its sleep cycle: one value, and its transitions.

A cache is awake; asleep with its contents discarded; asleep with them kept
in a host copy (a preserving sleep); or partly awake, after a commit while
asleep woke only the blocks it asked for, so that the next wake grows it
back to the count it slept at. :class:`Sleep` holds all of it in one frozen
value, and each transition below makes the next one: a cache keeps
exactly one (in its :class:`~extensible_kv.kv.cache.sleep_wake.SleepWake`), so no
combination of fields can disagree with another.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from extensible_kv.kv.cache.backup import HostBackup

__all__ = ["Sleep", "SleepState"]


class SleepState(enum.Enum):
    """What :attr:`KVCacheBuffers.state <extensible_kv.kv.KVCacheBuffers.state>` says."""

    AWAKE = "awake"
    ASLEEP_DISCARDED = "asleep, contents discarded"
    ASLEEP_PRESERVED = "asleep, contents kept"
    PARTLY_AWAKE = "partly awake"


@dataclass(frozen=True)
class Sleep:
    """A cache's place in its sleep cycle.

    ``asleep_at``: the blocks it held when it went to sleep (None: awake).
    ``backup``: the host copy of them, after a preserving sleep (owned by
    the cache's :class:`~extensible_kv.kv.cache.sleep_wake.SleepWake`; None
    otherwise). ``wake_to``: the block count the next wake grows to, once a
    commit while asleep woke part of the cache (None: the count slept at);
    a cache partly awake may sleep again and keep it.
    """

    asleep_at: int | None = None
    backup: HostBackup | None = None
    wake_to: int | None = None

    @property
    def state(self) -> SleepState:
        if self.asleep_at is not None:
            if self.backup is not None:
                return SleepState.ASLEEP_PRESERVED
            return SleepState.ASLEEP_DISCARDED
        return SleepState.AWAKE if self.wake_to is None else SleepState.PARTLY_AWAKE

    @property
    def asleep(self) -> bool:
        return self.asleep_at is not None

    def fallen_asleep(self, committed: int, backup: HostBackup | None) -> Sleep:
        """After a release of every byte: asleep at the blocks held
        (``committed``; asleep already, still at the count it slept at),
        with ``backup`` if this release made one."""
        at = committed if self.asleep_at is None else self.asleep_at
        return replace(self, asleep_at=at, backup=backup or self.backup)

    def without_backup(self) -> Sleep:
        """The host copy forgotten (the caller frees it): a discarding sleep."""
        return replace(self, backup=None)

    def woken(self) -> Sleep:
        """The blocks it slept at committed again (restored, or zeroed);
        what a commit while asleep asked to grow to stays."""
        return replace(self, asleep_at=None, backup=None)

    def partly_woken(self) -> Sleep:
        """A commit while asleep (its contents discarded) woke some blocks:
        the next wake grows to the count it slept at, or to more."""
        assert self.asleep_at is not None
        return Sleep(wake_to=max(self.wake_to or 0, self.asleep_at))
