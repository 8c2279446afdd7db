"""ExtensibleTensor: a segmented byte buffer that grows in place.

API-compatible with vLLM's in-tree ``ExtensibleTensor``, so an engine can
swap its module for an import, plus ``shrink_per_segment_``, DLPack export,
host (CPU) memory, and pluggable drivers. Its operations are those over
several tensors (``group.py``, ``remap.py``) applied to one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from extensible_kv._checks import check_bool, check_bytes, check_int
from extensible_kv.budget.publish import cache_figures, register_cache
from extensible_kv.buffer import VirtualBuffer, hold_locks
from extensible_kv.devices import resolve_device, stream_handles
from extensible_kv.dlpack import ByteView, as_tensor
from extensible_kv.driver import Driver
from extensible_kv.intervals import IntervalSet
from extensible_kv.tensor.group import (
    create_ahead_all,
    release_physical_all,
    resize_per_segment_all,
)
from extensible_kv.tensor.remap import defragment_all, shrink_per_segment_all
from extensible_kv.tensor.shared_layout import SharedLayout
from extensible_kv.tensor.sharing import committed_in, exported_layout, importing_device

__all__ = ["ExtensibleTensor", "published_figures"]


class ExtensibleTensor:
    """A 1-D byte buffer of ``max_num_bytes`` whose base pointer never moves.

    The buffer is ``num_segments`` equal segments that grow in lockstep;
    segment ``i`` spans ``[i * segment_capacity_bytes, (i + 1) *
    segment_capacity_bytes)`` of :meth:`full_view`, and its committed bytes
    are always a prefix of it (``bytes_per_segment`` of them). A K/V-split
    KV cache has 2 segments. Committed bytes are backed by physical memory;
    the rest of the range is reserved addresses only: touching it faults,
    or, with ``zero_backed``, reading it gives zeros and writing faults.
    With ``zero_backed`` every byte past a segment's prefix reads zero, also
    the mapped rest of the granule the prefix ends in, whatever memory the
    driver hands out (zeroed after every grow, shrink and remap).

    Args:
        max_num_bytes: size of the full view in bytes; divisible by ``num_segments``.
        device: ``"cpu"`` (host virtual memory), ``"cuda"``/``"cuda:N"``, an
            int (CUDA ordinal) or a ``torch.device``. None: the current CUDA
            device if there is one, else the host.
        num_segments: number of equal segments.
        shareable: allocate memory exportable to other processes.
        driver: the driver to use (e.g. wrapped in an adaptor); by default the
            shared driver for ``device``.
        chunk_bytes: largest physical chunk one commit maps; a multiple of the
            granularity. None: one chunk per run of new granules.
        zero_backed: let kernels read the uncommitted bytes as zeros (a
            decode step captured once attends over the full length, masked),
            at the cost of at most one granule per device for all such buffers.
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: torch.device | str | int | None = None,
        num_segments: int = 1,
        shareable: bool = False,
        *,
        driver: Driver | None = None,
        chunk_bytes: int | None = None,
        zero_backed: bool = False,
    ) -> None:
        check_bytes("max_num_bytes", max_num_bytes)
        check_int("num_segments", num_segments)
        check_bool("shareable", shareable)
        check_bool("zero_backed", zero_backed)
        if num_segments < 1:
            raise ValueError(f"num_segments must be positive, got {num_segments}")
        if max_num_bytes % num_segments:
            raise ValueError(
                f"max_num_bytes ({max_num_bytes}) must be divisible by "
                f"num_segments ({num_segments})"
            )
        self._device, driver = resolve_device(device, driver)
        self._max_num_bytes = max_num_bytes
        self._num_segments = num_segments
        self._segment_capacity_bytes = max_num_bytes // num_segments
        self._buffer = VirtualBuffer(
            max_num_bytes,
            driver,
            self._device.index or 0,
            shareable=shareable,
            chunk_bytes=chunk_bytes,
            zero_backed=zero_backed,
        )
        self._bytes_per_segment = 0
        self._full: torch.Tensor | None = None
        #: The KV cache this tensor is part of, which then publishes for it.
        self._owner: weakref.ref[Any] | None = None
        register_cache(self, _published)

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(max_num_bytes={self._max_num_bytes}, "
            f"num_segments={self._num_segments}, bytes_per_segment="
            f"{self._bytes_per_segment}, physical_bytes={self.physical_bytes}, "
            f"device={self._device})"
        )

    # -- views ----------------------------------------------------------------

    def _check_alive(self, what: str) -> None:
        if self._buffer.freed:
            raise ValueError(f"ExtensibleTensor has been freed; {what} is no longer possible")

    def _check_single_segment(self, what: str, instead: str) -> None:
        if self._num_segments != 1:
            raise ValueError(
                f"{what} is a single committed prefix, only valid for num_segments=1 "
                f"(this buffer has {self._num_segments}); use {instead}"
            )

    def _full_view(self) -> torch.Tensor:
        # One DLPack view, made once; every view handed out slices it.
        if self._full is None:
            self._full = as_tensor(self._buffer, 0, self._max_num_bytes)
        return self._full

    @property
    def tensor(self) -> torch.Tensor:
        """A uint8 view of the committed prefix (single-segment buffers)."""
        self._check_single_segment("tensor", "full_view() and index the segments")
        self._check_alive("a view")
        return self._full_view()[: self._bytes_per_segment]

    def full_view(self) -> torch.Tensor:
        """A uint8 view of all ``max_num_bytes``; touch only committed bytes.

        Reading or writing a byte that is not committed is not an exception:
        the address is reserved but has no memory, so the host process dies
        of SIGSEGV and a GPU kernel hits an illegal address (which kills the
        CUDA context). :meth:`checked_view` checks first, for debugging.
        """
        self._check_alive("a view")
        return self._full_view()[:]

    def segment(self, index: int) -> torch.Tensor:
        """A uint8 view of segment ``index``'s committed prefix (K is segment
        0 and V segment 1 of a K/V-split cache); it grows with the buffer
        only when taken again, like :attr:`tensor`."""
        self._check_alive("a view")
        check_int("index", index)
        if not 0 <= index < self._num_segments:
            raise ValueError(f"segment {index} does not exist; there are {self._num_segments}")
        start = index * self._segment_capacity_bytes
        return self._full_view()[start : start + self._bytes_per_segment]

    def checked_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of bytes ``[offset, offset + nbytes)`` of the full view,
        after checking that every one is committed (a ValueError naming the
        committed ranges otherwise, where an unchecked read would crash)."""
        self._check_alive("a view")
        check_int("offset", offset)
        check_int("nbytes", nbytes)
        cap, committed = self._segment_capacity_bytes, self._bytes_per_segment
        segment = offset // cap if offset >= 0 and cap else -1
        outside = not 0 <= segment < self._num_segments
        if nbytes < 0 or outside or offset + nbytes > segment * cap + committed:
            ranges = ", ".join(
                f"[{i * cap}, {i * cap + committed})" for i in range(self._num_segments)
            )
            raise ValueError(
                f"bytes [{offset}, {offset + nbytes}) are not all committed; the committed "
                f"bytes are {ranges if committed else 'none'}"
            )
        return self._full_view()[offset : offset + nbytes]

    # -- growth ---------------------------------------------------------------

    def _segment_ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` of every segment, as ``(offset, size)`` of the full view."""
        cap = self._segment_capacity_bytes
        return [(i * cap + start, end - start) for i in range(self._num_segments)]

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        """Grow every segment's committed prefix to ``bytes_per_segment`` bytes.

        Existing bytes are kept and the base pointer does not move. With
        ``zero_new`` the newly committed bytes read as zero. Grow-only: use
        :meth:`shrink_per_segment_` to give memory back. All segments grow or
        none does.
        """
        resize_per_segment_all([(self, bytes_per_segment)], zero_new=zero_new)

    def create_ahead(self, bytes_per_segment: int) -> Future[int]:
        """Create, on a background thread, the physical memory that growing
        to ``bytes_per_segment`` bytes per segment will map, into the
        handle pool of this tensor's driver stack
        (:meth:`~extensible_kv.driver.Driver.create_ahead`), so that the
        growth, when it comes, only maps (creating is the costly driver
        call). The future gives the bytes added; the pool stops at its cap,
        and what it does not hold is created at the growth, as usual. Needs
        a pool in the stack (a ValueError says so).
        """
        return create_ahead_all([(self, bytes_per_segment)])

    #: The name before 0.2 ("reserve" now means address space only).
    reserve_ahead = create_ahead

    def _zero(self, ranges: list[tuple[int, int]]) -> None:
        full = self._full_view()
        for offset, size in ranges:
            full[offset : offset + size].zero_()

    def _zero_tails(self, within: list[tuple[int, int]] | None = None) -> None:
        """Zero the mapped bytes past each segment's prefix, of a zero-backed
        tensor; with ``within`` (the runs a grow just mapped, ``(offset,
        size)``), only those parts of them, and only where the driver hands
        out memory that is not zeroed.

        Memory is mapped by whole granules but committed by bytes, so the
        granule a prefix ends in is mapped past it. Kernels over a zero-backed
        tensor read past the prefix (a captured step attends over the full
        length, masked) and a mask cannot cancel a NaN: what lies there must
        read zero, as the unmapped bytes do. Fresh memory from a GPU or a
        handle pool holds garbage or old bytes, and a shrink copies the old
        bytes of the granule it keeps; everything else past the prefix is
        zero already, so this costs at most one granule per segment.
        """
        buffer = self._buffer
        if not buffer.zero_backed or (within is not None and buffer.driver.zeroes_new_memory):
            return
        past = self._segment_ranges(self._bytes_per_segment, self._segment_capacity_bytes)
        tails = [part for start, size in past for part in buffer.mapped_in(start, size)]
        if within is not None:
            fresh = IntervalSet()
            for offset, size in within:
                fresh.add(offset, offset + size)
            tails = [(lo, hi - lo) for at, n in tails for lo, hi in fresh.overlaps(at, at + n)]
        self._zero(tails)

    def resize_(self, num_bytes: int) -> torch.Tensor:
        """Grow the committed prefix to ``num_bytes``; returns :attr:`tensor`."""
        self._check_single_segment("resize_", "resize_per_segment_")
        self.resize_per_segment_(num_bytes)
        return self.tensor

    def append(self, num_bytes: int) -> torch.Tensor:
        """Grow the committed prefix by ``num_bytes``; returns :attr:`tensor`."""
        self._check_single_segment("append", "resize_per_segment_")
        check_int("num_bytes", num_bytes)
        if num_bytes < 0:
            raise ValueError(f"num_bytes to append must be non-negative, got {num_bytes}")
        return self.resize_(self._bytes_per_segment + num_bytes)

    # -- giving memory back ---------------------------------------------------

    def shrink_per_segment_(self, bytes_per_segment: int) -> int:
        """Cut every segment's committed prefix to ``bytes_per_segment`` bytes
        and give back the physical memory past it.

        Chunks holding no committed byte are released; a chunk straddling the
        new end is mapped again smaller (its live bytes copied into a new
        chunk that takes its place under the same addresses), so
        :attr:`physical_bytes` ends at the minimum the granularity allows.
        Returns the physical bytes given back. See :func:`shrink_per_segment_all`.
        """
        return shrink_per_segment_all([(self, bytes_per_segment)])

    def wait_for_streams(self, streams: Iterable[Any] | None) -> None:
        """What a release, trim, defragment or copy of this tensor waits for.

        None (the default): every stream of the device (a device-wide
        synchronize). Otherwise the work queued so far on ``streams`` only
        (``torch.cuda.Stream`` objects or driver stream handles), so work
        elsewhere on the device is not waited for. Name every stream that
        reads or writes the memory, the one committing it included: work on
        a stream left out may still run when its memory is unmapped.
        """
        self._buffer.wait_streams = stream_handles(streams)

    def release_physical(self) -> None:
        """Release all physical memory, keeping the address range and views.

        Views must not be touched until memory is committed again; the data
        is discarded and :attr:`num_bytes` drops to 0.
        """
        release_physical_all([self])

    def defragment_(self, preserve: bool = False) -> None:
        """Map each segment's committed prefix again as one chunk.

        KV connectors need this before registering memory: UCX cannot
        transfer a region spanning several physical allocations. Without
        ``preserve`` contents are discarded (they read as zero after) and the
        old memory goes before the new is made. With ``preserve`` every
        committed byte is kept: each new chunk is mapped at a scratch
        reservation, filled by a device copy and swapped in, so old and new
        memory coexist for a moment (up to twice the committed bytes).
        """
        defragment_all([self], preserve=preserve)

    def free(self) -> None:
        """Release the memory now and the address range once no view is left.

        Idempotent. Views made earlier stay valid as pointers (the range stays
        reserved for them) but must not be touched.
        """
        self._full = None
        try:
            self._buffer.free()
        finally:
            if self._buffer.physical_bytes == 0:
                self._bytes_per_segment = 0

    # -- sharing --------------------------------------------------------------

    @classmethod
    def from_shared(
        cls,
        layout: SharedLayout,
        fds: Sequence[int],
        device: torch.device | str | int | None = None,
        *,
        driver: Driver | None = None,
    ) -> ExtensibleTensor:
        """A tensor over memory another process exported (see
        :mod:`extensible_kv.share`), at an address range of this process's own.

        Both processes read and write the same bytes. The fds stay the
        caller's. Growing the result maps memory of this process only.
        ``device`` None finds the exporter's device among this process's by
        its UUID; a device given must be that one.
        """
        if len(fds) != len(layout.chunks):
            raise ValueError(
                f"{len(layout.chunks)} chunks need {len(layout.chunks)} fds, got {len(fds)}"
            )
        here, driver = importing_device(layout, device, driver)
        tensor = cls(layout.max_num_bytes, here, layout.num_segments, shareable=True, driver=driver)
        try:
            tensor.buffer.map_imported(
                [(offset, size, fd) for (offset, size), fd in zip(layout.chunks, fds, strict=True)]
            )
            tensor._bytes_per_segment = committed_in(tensor, layout.bytes_per_segment)
        except BaseException:
            tensor.free()
            raise
        return tensor

    def shared_layout(self) -> tuple[SharedLayout, list[int]]:
        """What another process needs to map this tensor's committed memory:
        the layout and one new fd per chunk (the caller closes them). Needs a
        tensor created with ``shareable=True``.

        Waits first for all work queued on the device (every stream): the
        receiver reads the memory at once, without any order to that work.
        """
        with hold_locks([self._buffer]):
            self._check_alive("sharing")
            return exported_layout(self)

    def publish_within(self, owner: object) -> None:
        """From now on ``owner`` (the KV cache this tensor joined) shows this
        tensor's memory in ``extensible-kv top`` as part of its own, so the
        tensor stops showing it alone while ``owner`` lives (kept weakly)."""
        self._owner = weakref.ref(owner)

    # -- properties -----------------------------------------------------------

    @property
    def num_bytes(self) -> int:
        """Committed bytes, summed over all segments."""
        return self._bytes_per_segment * self._num_segments

    @property
    def bytes_per_segment(self) -> int:
        """Committed prefix of each segment, in bytes."""
        return self._bytes_per_segment

    @property
    def num_segments(self) -> int:
        return self._num_segments

    @property
    def segment_capacity_bytes(self) -> int:
        """Largest prefix of one segment: ``max_num_bytes / num_segments``."""
        return self._segment_capacity_bytes

    @property
    def max_num_bytes(self) -> int:
        return self._max_num_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of address space reserved (``max_num_bytes`` rounded up to granules)."""
        return self._buffer.size

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical memory mapped: a whole number of granules."""
        return self._buffer.physical_bytes

    @property
    def base_ptr(self) -> int:
        """Address of byte 0; constant until :meth:`free`, then 0."""
        return 0 if self._buffer.freed else self._buffer.base_ptr

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def buffer(self) -> VirtualBuffer:
        """The virtual buffer underneath (owned by this tensor)."""
        return self._buffer

    # -- DLPack ---------------------------------------------------------------

    def __dlpack__(self, **kwargs: Any) -> Any:
        """A DLPack capsule over the full view (see :class:`ByteView`)."""
        self._check_alive("a view")
        return ByteView(self._buffer, 0, self._max_num_bytes).__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self._buffer.driver.dlpack_device_type, self._buffer.device)


def published_figures(
    tensor: ExtensibleTensor, kind: str, **figures: object
) -> dict[str, Any] | None:
    """``top``'s figures of a cache holding ``tensor`` (see ``budget.publish.cache_figures``)."""
    buffer = tensor.buffer
    return cache_figures(buffer.driver, buffer.device, str(tensor.device), kind, **figures)


def _published(tensor: ExtensibleTensor) -> dict[str, Any] | None:
    """What ``extensible-kv top`` shows of a tensor that no KV cache owns."""
    owner = tensor._owner
    if tensor.buffer.freed or (owner is not None and owner() is not None):
        return None
    return published_figures(
        tensor,
        "ExtensibleTensor",
        reserved_bytes=tensor.capacity_bytes,
        committed_bytes=tensor.num_bytes,
        physical_bytes=tensor.physical_bytes,
        asleep=None,
    )
