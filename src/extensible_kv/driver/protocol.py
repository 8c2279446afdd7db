"""The calls every virtual-memory backend provides: bytes, integer handles, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

#: The calls of the protocol, by name: adaptors and tests use it to cover them all.
DRIVER_CALLS: tuple[str, ...] = (
    "context",
    "device_count",
    "device_uuid",
    "granularity",
    "reserve",
    "reserve_zeroed",
    "create",
    "map",
    "set_access",
    "synchronize",
    "synchronize_streams",
    "unmap",
    "release",
    "free_reserved",
    "export_handle",
    "import_handle",
)

#: The calls through which the layers above reach what adaptors do for them
#: (hold a budget for a piece of work, give back memory kept for reuse,
#: create ahead, say where memory is accounted, count memory adopted from
#: another process): each adaptor forwards them
#: and interprets them for itself, so nothing above the driver needs to know
#: which adaptors are stacked.
ADAPTOR_CALLS: tuple[str, ...] = (
    "holding",
    "release_idle",
    "create_ahead",
    "accounting",
    "adopt_import",
)


@runtime_checkable
class Driver(Protocol):
    """Virtual memory management for one kind of device.

    Sizes and pointers are in bytes; ``device`` is the device ordinal. A
    handle is an opaque integer naming one physical allocation. Rules every
    backend enforces, following the CUDA driver:

    * ``create`` sizes and ``map`` pointers and sizes are multiples of
      ``granularity(device, shareable)``;
    * ``map`` binds one whole handle onto reserved, unmapped addresses and
      grants no access: ``set_access`` must follow before the memory is used;
      one ``set_access`` may span several adjacent mappings;
    * ``unmap`` covers whole mappings only;
    * ``release`` may be called while the handle is mapped: the memory goes
      back when its last mapping and its last handle are gone;
    * ``free_reserved`` requires the range to hold no mapping;
    * in a reservation from ``reserve_zeroed``, the granules no mapping
      covers read as zeros and fault on write; ``map`` replaces the zeros
      it covers, and ``unmap`` covers exactly one mapping and puts them back;
    * calls that name a device (``granularity``, ``create``, ``set_access``,
      ``synchronize``, ``synchronize_streams``, ``device_uuid``,
      ``reserve_zeroed``) make its context current themselves;
      the others (``reserve``, ``free_reserved``, ``map``, ``unmap``,
      ``release``, ``export_handle``, ``import_handle``) need the context of
      the device they concern current on the calling thread: wrap them in
      ``with driver.context(device):`` (contexts are per thread, as on CUDA;
      HIP's imports land on the current device).

    Failures raise :class:`~extensible_kv.driver.DriverError`, and
    :class:`~extensible_kv.driver.OutOfMemoryError` when memory or address
    space runs out. A failed call changes nothing.

    The calls of :data:`ADAPTOR_CALLS` are what the layers above ask of the
    adaptors stacked over a backend, whatever they are; a backend answers
    them as :class:`Backend` does.
    """

    @property
    def dlpack_device_type(self) -> int:
        """DLPack device type of the memory: 1 (CPU), 2 (CUDA) or 10 (ROCm)."""
        ...

    @property
    def zeroes_new_memory(self) -> bool:
        """True when ``create`` hands out zero-filled memory (host: fresh
        pages); callers then need not zero what they newly commit."""
        ...

    def granularity(self, device: int, shareable: bool) -> int:
        """Minimum mapping unit, in bytes, for that kind of allocation."""
        ...

    def device_count(self) -> int:
        """Devices this backend sees (ordinals ``0 .. count - 1``)."""
        ...

    def device_uuid(self, device: int) -> str:
        """A name for ``device`` that is the same in every process of this
        machine, whatever devices each process sees (``GPU-...`` on a GPU)."""
        ...

    def reserve(self, size: int, alignment: int) -> int:
        """Reserve ``size`` bytes of virtual addresses starting at a multiple
        of ``alignment`` (a power of two: the granularity of what will be
        mapped there); no memory."""
        ...

    def reserve_zeroed(self, size: int, alignment: int, device: int) -> int:
        """Reserve as ``reserve``, with every byte no mapping covers readable
        from ``device`` as zero and not writable: a kernel reading past the
        memory committed so far (attention over a fixed length, masked) reads
        zeros instead of faulting. ``size`` and ``alignment`` are multiples of
        ``granularity(device, False)``. The zeros take no memory of their
        own, at most one granule per device shared by every such reservation."""
        ...

    def free_reserved(self, ptr: int, size: int) -> None:
        """Return a reservation made by ``reserve`` or ``reserve_zeroed``."""
        ...

    def create(self, size: int, device: int, shareable: bool) -> int:
        """Allocate ``size`` bytes of physical memory; returns its handle."""
        ...

    def release(self, handle: int) -> None:
        """Drop a handle from ``create`` or ``import_handle``."""
        ...

    def map(self, ptr: int, size: int, handle: int) -> None:
        """Bind the whole allocation ``handle`` (of ``size`` bytes) at ``ptr``."""
        ...

    def unmap(self, ptr: int, size: int) -> None:
        """Unbind the mappings covering exactly ``[ptr, ptr + size)``."""
        ...

    def set_access(self, ptr: int, size: int, device: int) -> None:
        """Grant ``device`` read-write access to mapped ``[ptr, ptr + size)``."""
        ...

    def synchronize(self, device: int) -> None:
        """Wait until no work queued on ``device`` can still touch its memory."""
        ...

    def synchronize_streams(self, device: int, streams: Sequence[int]) -> None:
        """Wait for the work queued so far on each of ``streams`` (the
        driver's stream handles, e.g. ``torch.cuda.Stream.cuda_stream``) of
        ``device``; work on its other streams is not waited for."""
        ...

    def export_handle(self, handle: int) -> int:
        """A new file descriptor for a shareable handle; the caller owns it."""
        ...

    def import_handle(self, fd: int) -> int:
        """A handle for the memory behind ``fd``; ``fd`` stays the caller's."""
        ...

    def context(self, device: int) -> AbstractContextManager[None]:
        """Make ``device``'s driver context current on this thread for a
        ``with`` block, and put back whatever was current (or nothing) after."""
        ...

    def holding(self, device: int, size: int, *, credit: int = 0) -> AbstractContextManager[object]:
        """Hold, for a ``with`` block on this thread, the memory one piece of
        work on ``device`` (a commit, a wake, a defragment, a trim) will
        create beyond what it releases, ``size`` bytes, so that the work is
        refused, or waits, before it has made anything; ``credit`` bytes more
        may be created past a limit, for memory the same block gives back
        before it ends (a trim's copy of the chunk it cuts through). Blocks
        nest. A budget claims here; a pool counts what its idle handles
        will serve; a backend holds nothing."""
        ...

    def release_idle(self) -> int:
        """Give every byte kept idle for reuse (a pool's handles) back to the
        driver below, on every device: what a sleep does, so that it returns
        all its memory. Returns the bytes; a backend keeps none (0)."""
        ...

    def create_ahead(self, size: int, count: int, device: int, shareable: bool) -> int:
        """Create up to ``count`` handles of ``size`` bytes, kept idle for the
        next creates of that kind (a growth or a wake the caller knows is
        coming, so that it only maps); returns how many were kept. A count
        of 0 creates nothing and only checks that the stack keeps handles:
        without a pool it raises :class:`ValueError` saying so."""
        ...

    def accounting(self, device: int) -> tuple[str, str] | None:
        """Where the memory created on ``device`` is claimed: the device's
        name in every process and the budget's state directory, once a
        claim has opened its ledger; None before, or with no budget in the
        stack. Calls no driver: ``extensible-kv top``'s figures ask it."""
        ...

    def adopt_import(self, handle: int, device: int, size: int) -> None:
        """Count the memory behind ``handle`` (from ``import_handle``,
        ``size`` bytes on ``device``) as this process's from now on, until
        ``release``: memory another process held and hands over for good
        (pages a keeper kept over an engine's restart), not memory two live
        processes share. A budget claims it past any limit (it exists
        already); a backend counts nothing."""
        ...


class Backend:
    """How a backend answers :data:`ADAPTOR_CALLS`: it holds nothing for a
    piece of work, keeps no memory idle, cannot create ahead and claims
    from no budget."""

    def holding(self, device: int, size: int, *, credit: int = 0) -> AbstractContextManager[object]:
        return nullcontext()

    def release_idle(self) -> int:
        return 0

    def create_ahead(self, size: int, count: int, device: int, shareable: bool) -> int:
        raise ValueError(
            f"create_ahead() fills a PoolingDriver, and the driver {self!r} has none: "
            f"create the tensor with driver=PoolingDriver(get_driver(device), cap_bytes=...)"
        )

    def accounting(self, device: int) -> tuple[str, str] | None:
        return None

    def adopt_import(self, handle: int, device: int, size: int) -> None:
        return None
