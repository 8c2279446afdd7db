"""KV connector registrations of a cache's memory, and the rules they impose.

A KV connector (NIXL, UCX, an RDMA library) registers a cache's memory
with its transport; while it does, nothing may unmap or change that memory.
:class:`Registrations` keeps the names a cache's connectors registered
under, checks a new one, refuses what would pull the memory from under
them, and drops them, with a :class:`ConnectorRegistrationWarning`, when a
preserving sleep released the memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from extensible_kv.tensor import ExtensibleTensor, in_one_chunk_per_segment

__all__ = ["ConnectorRegistrationWarning", "Registrations"]


class ConnectorRegistrationWarning(UserWarning):
    """A sleep released memory a KV connector had registered: the connector
    must register the views again after :meth:`KVCacheBuffers.recommit`."""


class Registrations:
    """The names under which KV connectors registered one cache's memory,
    in the order registered. Owned by the cache, which calls it under its
    lock; it owns nothing but the names."""

    def __init__(self) -> None:
        self._names: list[str] = []

    @property
    def names(self) -> tuple[str, ...]:
        """The names registered, oldest first."""
        return tuple(self._names)

    def add(self, name: str, tensors: Sequence[ExtensibleTensor]) -> None:
        """Record ``name``, once its memory suits a connector: every tensor
        shareable and mapped one physical chunk per segment (UCX cannot
        transfer a region spanning several physical allocations)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a registration is named by a non-empty str, got {name!r}")
        if name in self._names:
            raise ValueError(f"{name!r} is already registered")
        plain = [b for b in tensors if not b.buffer.shareable]
        if plain:
            raise ValueError(
                f"{len(plain)} of {len(tensors)} tensors are not shareable; a KV connector "
                f"needs memory made with shareable=True (allocate_kv_cache(..., shareable=True))"
            )
        scattered = [b for b in tensors if not in_one_chunk_per_segment(b)]
        if scattered:
            raise ValueError(
                f"{len(scattered)} of {len(tensors)} tensors span several physical "
                f"allocations per segment, which UCX cannot transfer; call "
                f"commit(num_blocks, defragment=True) before registering"
            )
        self._names.append(name)

    def remove(self, name: str) -> None:
        """Forget ``name``, or a ValueError listing what is registered."""
        if name not in self._names:
            listed = ", ".join(map(repr, self._names)) or "none"
            raise ValueError(f"{name!r} is not registered (registered: {listed})")
        self._names.remove(name)

    def check_unregistered(self, what: str) -> None:
        """Refuse what would unmap or change memory a connector registered."""
        if self._names:
            raise ValueError(
                f"{what} would change memory that KV connector registrations "
                f"({', '.join(self._names)}) point at; unregister_external() first, "
                f"then register the views again after"
            )

    def drop_released(self) -> None:
        """Forget every name after a preserving sleep released their memory,
        warning that the connectors must register again.

        Called by :meth:`KVCacheBuffers.release_physical` through its
        serializing wrapper: the warning points at the caller of that."""
        if self._names:
            warnings.warn(
                f"release_physical(preserve=True) released memory that KV connector "
                f"registrations ({', '.join(self._names)}) point at; they are dropped: "
                f"register kv.narrowed_views() again after recommit()",
                ConnectorRegistrationWarning,
                stacklevel=4,
            )
            self._names.clear()

    def clear(self) -> None:
        """Forget every name, silently (the cache is freed)."""
        self._names.clear()
