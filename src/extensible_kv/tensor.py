"""ExtensibleTensor: a segmented byte buffer that grows in place.

API-compatible with vLLM's in-tree ``ExtensibleTensor``, so an engine can
swap its module for an import, plus ``shrink_per_segment_``, DLPack export,
host (CPU) memory, and pluggable drivers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch

from extensible_kv._checks import check_bool, check_bytes, check_int
from extensible_kv.budget.publish import cache_figures, register_cache
from extensible_kv.buffer import (
    Remap,
    Staging,
    VirtualBuffer,
    commit_together,
    defragment_together,
    hold_locks,
    release_outside_together,
    release_together,
    swap_in_together,
    synchronize_buffers,
)
from extensible_kv.devices import get_driver
from extensible_kv.dlpack import ByteView, as_tensor
from extensible_kv.driver import Driver, device_with_uuid, parse_device
from extensible_kv.driver.ahead import Kind, create_ahead_in_background
from extensible_kv.intervals import IntervalSet

_DLPACK_TYPES = {"cpu": (1,), "cuda": (2, 10)}


@dataclass(frozen=True)
class SharedLayout:
    """An exported tensor, without its memory: sizes in bytes, the chunks as
    ``(offset, size)``, one file descriptor each, in order, and the device
    the memory lives on: its type, its ordinal in the exporting process and
    its UUID, which names it in every process whatever devices each sees."""

    max_num_bytes: int
    num_segments: int
    bytes_per_segment: int
    chunks: tuple[tuple[int, int], ...]
    device: str
    device_index: int
    device_uuid: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SharedLayout:
        """Read :meth:`to_json`'s text; anything else (it may come from another
        process) is a ValueError or TypeError saying what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a shared layout must be JSON: {exc}") from None
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ValueError(f"a shared layout is an object with the fields {sorted(fields)}")
        for name in ("max_num_bytes", "num_segments", "bytes_per_segment", "device_index"):
            check_int(name, data[name])
        for name in ("device", "device_uuid"):
            if not isinstance(data[name], str):
                raise ValueError(f"{name} must be a string, got {data[name]!r}")
        chunks = data["chunks"]
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(_is_int(v) for v in c) for c in chunks
        ):
            raise ValueError("chunks must be a list of [offset, size] pairs of ints")
        data["chunks"] = tuple((offset, size) for offset, size in chunks)
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve(
    device: torch.device | str | int | None, driver: Driver | None
) -> tuple[torch.device, Driver]:
    """The concrete device (with its ordinal) and the driver serving it."""
    spec = parse_device(_default_device() if device is None else device)
    if driver is None:
        driver = get_driver(spec)
    elif driver.dlpack_device_type not in _DLPACK_TYPES[spec.type]:
        raise ValueError(
            f"driver {driver!r} serves DLPack device type {driver.dlpack_device_type}, "
            f"which is not a {spec.type} device"
        )
    if spec.type == "cpu":
        return torch.device("cpu"), driver
    index = torch.cuda.current_device() if spec.index is None else spec.index
    return torch.device("cuda", index), driver


def _importing_device(
    layout: SharedLayout, device: torch.device | str | int | None, driver: Driver | None
) -> tuple[torch.device, Driver]:
    """The device of this process holding the memory ``layout`` describes,
    and its driver: found by UUID, or ``device`` after checking it is that one."""
    if device is None:
        ordinal = device_with_uuid(driver or get_driver(layout.device), layout.device_uuid)
        device = f"cuda:{ordinal}" if layout.device == "cuda" else layout.device
    here, driver = _resolve(device, driver)
    found = driver.device_uuid(here.index or 0)
    if found != layout.device_uuid:
        raise ValueError(
            f"the shared memory lives on device {layout.device_uuid} "
            f"({layout.device}:{layout.device_index} in the exporting process), but {here} "
            f"here is {found}; pass device=None to find it"
        )
    return here, driver


def stream_handles(streams: Iterable[Any] | None) -> tuple[int, ...] | None:
    """Driver handles of ``streams`` (``torch.cuda.Stream`` objects or ints);
    None stays None (the whole device). A handle is a pointer: an int from 0
    (the legacy default stream) to ``2**64 - 1``; anything else is refused
    here rather than at the next wait, in the driver's bindings."""
    if streams is None:
        return None
    handles = []
    for stream in streams:
        handle = getattr(stream, "cuda_stream", stream)
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError(
                f"a stream is a torch.cuda.Stream or an int handle, got "
                f"{type(handle).__name__} {handle!r}"
            )
        if not 0 <= handle < 1 << 64:
            raise ValueError(f"a stream handle is 0 to 2**64 - 1 (a pointer), got {handle}")
        handles.append(handle)
    return tuple(handles)


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
        self._device, driver = _resolve(device, driver)
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
        self._cache: weakref.ref[Any] | None = None
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

    def reserve_ahead(self, bytes_per_segment: int) -> Future[int]:
        """Create, on a background thread, the physical memory that growing
        to ``bytes_per_segment`` bytes per segment will map, into the
        handle pool of this tensor's driver stack
        (:meth:`~extensible_kv.driver.Driver.create_ahead`), so that the
        growth, when it comes, only maps (creating is the costly driver
        call). The future gives the bytes added; the pool stops at its cap,
        and what it does not hold is created at the growth, as usual. Needs
        a pool in the stack (a ValueError says so).
        """
        return create_ahead_in_background(self._handles_to_grow(bytes_per_segment))

    def _handles_to_grow(self, bytes_per_segment: int) -> list[tuple[Driver, Kind]]:
        """One ``(driver, kind)`` per handle a growth to ``bytes_per_segment``
        would create now (none if it is not a growth); validates."""
        buffer = self._buffer
        buffer.driver.create_ahead(buffer.granularity, 0, buffer.device, buffer.shareable)
        self._check_alive("reserve_ahead")
        check_int("bytes_per_segment", bytes_per_segment)
        if 0 <= bytes_per_segment <= self._bytes_per_segment:
            return []
        ranges, _ = self._grow_plan(bytes_per_segment, False)
        kind = (buffer.device, buffer.shareable)
        return [(buffer.driver, (size, *kind)) for size in buffer.chunk_sizes(ranges)]

    def _grow_plan(
        self, bytes_per_segment: int, zero_new: bool
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Validate a grow; the ranges to commit and the ranges to zero after."""
        self._check_alive("resize_per_segment_")
        check_int("bytes_per_segment", bytes_per_segment)
        old = self._bytes_per_segment
        if bytes_per_segment < 0:
            raise ValueError(f"bytes_per_segment must be non-negative, got {bytes_per_segment}")
        if bytes_per_segment < old:
            raise ValueError(
                f"ExtensibleTensor is grow-only: cannot resize from {old} to "
                f"{bytes_per_segment} bytes per segment; use shrink_per_segment_ "
                f"to give memory back"
            )
        if bytes_per_segment > self._segment_capacity_bytes:
            raise ValueError(
                f"Requested {bytes_per_segment} bytes per segment exceeds the "
                f"segment capacity {self._segment_capacity_bytes}"
            )
        if bytes_per_segment == old:
            return [], []
        ranges = self._segment_ranges(old, bytes_per_segment)
        if not zero_new:
            return ranges, []
        if self._buffer.driver.zeroes_new_memory:
            # Fresh memory arrives zeroed: only granules mapped before this
            # commit (shared with a neighbour, kept by a shrink) can hold old bytes.
            return ranges, [part for r in ranges for part in self._buffer.mapped_in(*r)]
        return ranges, ranges

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

    def _check_shrink(self, bytes_per_segment: int) -> None:
        self._check_alive("shrink_per_segment_")
        check_int("bytes_per_segment", bytes_per_segment)
        old = self._bytes_per_segment
        if bytes_per_segment < 0:
            raise ValueError(f"bytes_per_segment must be non-negative, got {bytes_per_segment}")
        if bytes_per_segment > old:
            raise ValueError(
                f"shrink_per_segment_ cannot grow from {old} to {bytes_per_segment} "
                f"bytes per segment; use resize_per_segment_"
            )

    def _fill(self, staging: Staging) -> None:
        """Copy the live bytes of the chunks being replaced into ``staging``
        (device copies on the current stream)."""
        for offset, size, at in staging.places:
            as_tensor(staging.scratch, at, size).copy_(as_tensor(self._buffer, offset, size))

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
        here, driver = _importing_device(layout, device, driver)
        tensor = cls(layout.max_num_bytes, here, layout.num_segments, shareable=True, driver=driver)
        try:
            tensor._buffer.map_imported(
                [(offset, size, fd) for (offset, size), fd in zip(layout.chunks, fds, strict=True)]
            )
            tensor._adopt_committed(layout.bytes_per_segment)
        except BaseException:
            tensor.free()
            raise
        return tensor

    def _adopt_committed(self, bytes_per_segment: object) -> None:
        """Take an imported layout's committed size, after checking that the
        imported chunks back every byte of it (a peer's word is not enough)."""
        size = check_int("bytes_per_segment", bytes_per_segment)
        if not 0 <= size <= self._segment_capacity_bytes:
            raise ValueError(
                f"the shared layout's bytes_per_segment {size} is not between 0 "
                f"and the segment capacity {self._segment_capacity_bytes}"
            )
        for offset, length in self._segment_ranges(0, size):
            backed = sum(n for _, n in self._buffer.mapped_in(offset, length))
            if backed != length:
                raise ValueError(
                    f"the shared layout says {size} bytes per segment are committed, "
                    f"but its chunks back {backed} of the {length} at offset {offset}"
                )
        self._bytes_per_segment = size

    def shared_layout(self) -> tuple[SharedLayout, list[int]]:
        """What another process needs to map this tensor's committed memory:
        the layout and one new fd per chunk (the caller closes them). Needs a
        tensor created with ``shareable=True``.

        Waits first for all work queued on the device (every stream): the
        receiver reads the memory at once, without any order to that work.
        """
        with self._buffer._lock:
            self._check_alive("sharing")
            self._buffer.synchronize()
            exported = self._buffer.export_chunks()
            index = self._buffer.device
            layout = SharedLayout(
                max_num_bytes=self._max_num_bytes,
                num_segments=self._num_segments,
                bytes_per_segment=self._bytes_per_segment,
                chunks=tuple((chunk.offset, chunk.size) for chunk, _ in exported),
                device=self._device.type,
                device_index=index,
                device_uuid=self._buffer.driver.device_uuid(index),
            )
            return layout, [fd for _, fd in exported]

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
    owner = tensor._cache
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


def resize_per_segment_all(
    items: Sequence[tuple[ExtensibleTensor, int]], *, zero_new: bool = False
) -> None:
    """Grow several tensors to ``bytes_per_segment`` each, all or nothing.

    Like :meth:`ExtensibleTensor.resize_per_segment_` on each, but if any
    driver call fails no tensor has grown.
    """
    with hold_locks(tensor._buffer for tensor, _ in items):
        plans = [(tensor, n, *tensor._grow_plan(n, zero_new)) for tensor, n in items]
        requests = [(tensor._buffer, ranges) for tensor, _, ranges, _ in plans]
        with _reserving([(b, sum(b.chunk_sizes(ranges)), 0) for b, ranges in requests]):
            mapped = commit_together(requests)
        for (tensor, n, ranges, to_zero), runs in zip(plans, mapped, strict=True):
            if ranges:
                tensor._bytes_per_segment = n
            tensor._zero(to_zero)
            tensor._zero_tails(within=runs)


def claimed_at_once(
    items: Sequence[tuple[ExtensibleTensor, int]],
) -> contextlib.AbstractContextManager[object]:
    """Claim at once what growing each tensor to its ``bytes_per_segment``
    will create, for work that grows them one at a time (a wake restoring
    buffer by buffer): under a limit it is refused, or waits, before any of
    it is made, and holds nothing while it waits. Validates the sizes."""
    with hold_locks(tensor._buffer for tensor, _ in items):
        plans = [(tensor._buffer, tensor._grow_plan(n, False)[0]) for tensor, n in items]
        sizes = [(buffer, sum(buffer.chunk_sizes(ranges))) for buffer, ranges in plans]
    return _reserving([(buffer, size, 0) for buffer, size in sizes if size])


def _reserving(
    items: Sequence[tuple[VirtualBuffer, int, int]],
) -> contextlib.AbstractContextManager[object]:
    """One hold (:meth:`~extensible_kv.driver.Driver.reserving`) per driver
    stack and device for the work on ``items``: ``(buffer, bytes it creates
    beyond what it releases, bytes of credit)``, summed per stack and device;
    each adaptor in the stack decides for itself what to hold."""
    totals: dict[tuple[int, int], tuple[Driver, int, int]] = {}
    for buffer, size, credit in items:
        key = (id(buffer.driver), buffer.device)
        _, claimed, credited = totals.get(key, (buffer.driver, 0, 0))
        totals[key] = (buffer.driver, claimed + size, credited + credit)
    if len(totals) == 1:  # a cache's buffers on one stack and device
        (((_, device), (driver, size, credit)),) = totals.items()
        return driver.reserving(device, max(0, size), credit=credit)
    stack = contextlib.ExitStack()
    try:
        for (_, device), (driver, size, credit) in totals.items():
            stack.enter_context(driver.reserving(device, max(0, size), credit=credit))
    except BaseException:
        stack.close()
        raise
    return stack


def release_physical_all(tensors: Sequence[ExtensibleTensor]) -> None:
    """Release several tensors' memory; if an unmap fails, all are as they were.

    See :func:`~extensible_kv.buffer.release_together` for what a failure
    while releasing handles leaves (a retry finishes it).
    """
    with hold_locks(tensor._buffer for tensor in tensors):
        for tensor in tensors:
            tensor._check_alive("release_physical")
        try:
            release_together([tensor._buffer for tensor in tensors], idle=True)
        finally:
            for tensor in tensors:
                if tensor._buffer.physical_bytes == 0:
                    tensor._bytes_per_segment = 0


def shrink_per_segment_all(items: Sequence[tuple[ExtensibleTensor, int]]) -> int:
    """Cut several tensors, each to its ``bytes_per_segment``, and give back
    the physical memory past the new ends. Returns the bytes given back.

    All or nothing up to a point of no return, then done:

    1. one synchronize of their devices, so that work queued on any stream,
       not only the caller's, is done before anything is copied or unmapped;
    2. the chunks straddling a new end are staged smaller and their live
       bytes copied (this needs memory for the kept part of each such
       chunk: with ``chunk_bytes`` set, at most a chunk per segment);
    3. the staged chunks are swapped in and the chunks past the ends
       unmapped, all or nothing across the tensors;
    4. the point of no return: the prefixes are cut and the old handles
       released. A failure from here on (releasing a handle, returning a
       scratch reservation) leaves the shrink done, keeps what could not
       be returned for the next call to return, and propagates.

    A failure before it (out of memory while staging, a failing map or
    unmap) leaves every tensor as it was.
    """
    with hold_locks(tensor._buffer for tensor, _ in items):
        for tensor, bytes_per_segment in items:
            tensor._check_shrink(bytes_per_segment)
        before = sum(tensor.physical_bytes for tensor, _ in items)
        buffers = [tensor._buffer for tensor, _ in items]
        synchronize_buffers(buffers)
        doomed, plans = [], []
        for tensor, n in items:
            remaps = tensor._buffer.plan_remaps(tensor._segment_ranges(0, n), merge=False)
            doomed.append((tensor._buffer, [c for r in remaps if not r.runs for c in r.old]))
            plans.append((tensor, [r for r in remaps if r.runs]))
        # The copies of the chunks cut through replace them: they are
        # claimed as credit, so a cache can trim under a full or lowered limit.
        copies = [(t._buffer, 0, sum(n for r in rs for _, n in r.runs)) for t, rs in plans]
        try:
            with _reserving(copies):
                stagings = _stage_all(plans)
                swap_in_together(
                    [(tensor._buffer, staging) for tensor, staging in stagings], doomed=doomed
                )
        except BaseException:
            # Past the point of no return the shrink is done, error or not.
            if sum(tensor.physical_bytes for tensor, _ in items) < before:
                _cut(items)
            raise
        _cut(items)
        return before - sum(tensor.physical_bytes for tensor, _ in items)


def _cut(items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
    """Set the new prefixes; past them, the kept granules' old bytes go."""
    for tensor, bytes_per_segment in items:
        tensor._bytes_per_segment = bytes_per_segment
        tensor._zero_tails()


def _stage_all(
    plans: Sequence[tuple[ExtensibleTensor, list[Remap]]],
) -> list[tuple[ExtensibleTensor, Staging]]:
    """Stage every plan's new chunks and copy the live bytes into them, then
    synchronize once (the copies are done). All or nothing: if staging
    fails (out of memory), nothing is left staged."""
    staged: list[tuple[ExtensibleTensor, Staging]] = []
    try:
        for tensor, remaps in plans:
            if remaps:
                staged.append((tensor, tensor._buffer.stage(remaps)))
                tensor._fill(staged[-1][1])
        synchronize_buffers(tensor._buffer for tensor, _ in staged)
    except BaseException:
        for _, staging in staged:
            staging.discard()
        raise
    return staged


def _remap_all(
    items: Sequence[tuple[ExtensibleTensor, list[tuple[int, int]]]], *, merge: bool, headroom: int
) -> None:
    """Map again, contents kept, each tensor's chunks holding granules its
    kept ranges do not need (with ``merge``: every run of chunks, as one
    chunk per run of kept granules).

    The new chunks of a tensor are made at a scratch reservation and filled
    by device copies; a batch of tensors is then synchronized once and
    swapped in under the same addresses. A batch stages at most ``headroom``
    bytes (what was just released) or one tensor's worth, so memory never
    peaks above what the tensors held before plus one tensor's new chunks.
    Each batch is all or nothing (:func:`swap_in_together`): a failure
    leaves it, and the batches after it, as they were; contents are intact
    either way.
    """
    plans = [(tensor, tensor._buffer.plan_remaps(keep, merge=merge)) for tensor, keep in items]
    for batch in _batches([(t, remaps) for t, remaps in plans if remaps], headroom):
        stagings = _stage_all(batch)
        swap_in_together([(tensor._buffer, staging) for tensor, staging in stagings])


def _batches(
    plans: list[tuple[ExtensibleTensor, list[Remap]]], headroom: int
) -> list[list[tuple[ExtensibleTensor, list[Remap]]]]:
    """``plans`` in order, grouped so that a group's new bytes stay within
    ``headroom`` or the largest plan's, whichever is more."""
    sizes = [sum(n for remap in remaps for _, n in remap.runs) for _, remaps in plans]
    most = max([headroom, *sizes])  # bytes a batch may stage
    batches: list[list[tuple[ExtensibleTensor, list[Remap]]]] = []
    total = 0
    for plan, size in zip(plans, sizes, strict=True):
        if not batches or total + size > most:
            batches.append([])
            total = 0
        batches[-1].append(plan)
        total += size
    return batches


def defragment_all(tensors: Sequence[ExtensibleTensor], *, preserve: bool = False) -> None:
    """:meth:`ExtensibleTensor.defragment_` on several tensors.

    Discarding: all or nothing; if the new chunks cannot be made, each tensor
    keeps its committed size on its previous chunk layout, zeroed, and the
    error propagates. Preserving: contents are kept whatever fails; tensors
    are remapped in batches (see :func:`_remap_all`), and if making the new
    chunks fails (out of memory) the tensors of that batch are as they were.
    """
    with hold_locks(tensor._buffer for tensor in tensors):
        _defragment(tensors, preserve)


def _defragment(tensors: Sequence[ExtensibleTensor], preserve: bool) -> None:
    for tensor in tensors:
        tensor._check_alive("defragment_")
    if not preserve:
        _remap([(tensor, tensor._bytes_per_segment) for tensor in tensors])
        return
    prefixes = [tensor._segment_ranges(0, tensor._bytes_per_segment) for tensor in tensors]
    synchronize_buffers(tensor._buffer for tensor in tensors)
    # What the release gives back stays this defragment's for its new chunks.
    with _reserving([(tensor._buffer, 0, 0) for tensor in tensors]):
        released = release_outside_together(
            [(t._buffer, r) for t, r in zip(tensors, prefixes, strict=True)], synchronized=True
        )
        _remap_all(list(zip(tensors, prefixes, strict=True)), merge=True, headroom=released)


def remap_per_segment_all(items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
    """Discard every tensor's memory and commit each segment's first
    ``bytes_per_segment`` bytes again as one chunk, reading zero.

    The size may be smaller or larger than the committed one: this is a
    discarding defragment to a new size, what a KV connector's final commit
    needs. All or nothing: if the new chunks cannot be made, each tensor
    keeps its committed size on its previous chunk layout, zeroed, and the
    error propagates.
    """
    with hold_locks(tensor._buffer for tensor, _ in items):
        for tensor, bytes_per_segment in items:
            tensor._check_alive("remap_per_segment_all")
            check_int("bytes_per_segment", bytes_per_segment)
            if not 0 <= bytes_per_segment <= tensor._segment_capacity_bytes:
                raise ValueError(
                    f"bytes_per_segment must be 0 to the segment capacity "
                    f"{tensor._segment_capacity_bytes}, got {bytes_per_segment}"
                )
        _remap(items)


def in_one_chunk_per_segment(tensor: ExtensibleTensor) -> bool:
    """True when each segment's committed prefix is mapped by one chunk of
    exactly its granules (what :func:`remap_per_segment_all` makes)."""
    chunks = {(c.offset, c.end) for c in tensor._buffer.chunks}
    runs = tensor._buffer.granules_covering(tensor._segment_ranges(0, tensor._bytes_per_segment))
    return all((start, end) in chunks for start, end in runs) and len(chunks) == len(runs)


def _granule_bytes(buffer: VirtualBuffer, ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of the granules covering ``ranges`` in ``buffer``."""
    return sum(end - start for start, end in buffer.granules_covering(ranges))


def _late_failure(
    tensors: Sequence[ExtensibleTensor],
    old: Sequence[list[tuple[int, int]]],
    new: Sequence[list[tuple[int, int]]],
) -> bool:
    """Whether a failed remap failed late (a handle not released, the new
    chunks in place) rather than early (the old layout restored or never
    left). Told apart by what is mapped; where the old and new granules are
    the same, the two look alike and the remap counts as not done, which
    keeps the old count: safe, since its blocks are backed either way."""
    mapped = [[(o, o + n) for o, n in tensor._buffer.mapped_runs] for tensor in tensors]
    wanted = [t._buffer.granules_covering(r) for t, r in zip(tensors, new, strict=True)]
    before = [t._buffer.granules_covering(r) for t, r in zip(tensors, old, strict=True)]
    return mapped == wanted and wanted != before


def _remap(items: Sequence[tuple[ExtensibleTensor, int]]) -> None:
    tensors = [tensor for tensor, _ in items]
    old = [tensor._segment_ranges(0, tensor._bytes_per_segment) for tensor in tensors]
    new = [tensor._segment_ranges(0, size) for tensor, size in items]
    layouts = [tensor._buffer.chunks for tensor in tensors]
    # The new chunks are claimed before the old memory goes, and the old
    # memory's claim stays this remap's until it ends: another process cannot
    # take the room between the release and the creates, so a refusal comes
    # first, with nothing changed, and the old layout can always come back.
    growth = [
        (t._buffer, _granule_bytes(t._buffer, r) - t._buffer.physical_bytes, 0)
        for t, r in zip(tensors, new, strict=True)
    ]
    finished = False
    try:
        with _reserving(growth):
            defragment_together([(t._buffer, r) for t, r in zip(tensors, new, strict=True)])
        finished = True
    finally:
        done = finished or _late_failure(tensors, old, new)
        for (tensor, size), ranges, before, layout in zip(items, new, old, layouts, strict=True):
            if done:
                tensor._bytes_per_segment = size
            kept = ranges if done else before
            # By identity: memory mapped again is a new Chunk, even when a
            # handle pool gave the same handle back for the same place.
            now = tensor._buffer.chunks
            remapped = len(now) != len(layout) or any(
                a is not b for a, b in zip(now, layout, strict=True)
            )
            backed = all(sum(n for _, n in tensor._buffer.mapped_in(*r)) == r[1] for r in kept)
            if remapped and backed and not tensor._buffer.driver.zeroes_new_memory:
                tensor._zero(kept)
                tensor._zero_tails()
