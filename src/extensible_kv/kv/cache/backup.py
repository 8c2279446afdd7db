"""Host copies of KV blocks, for a sleep that keeps the cache's contents.

On a GPU the copies go through a small pinned staging ring on a dedicated
stream: device to pinned by DMA, pinned to ordinary host memory by the CPU,
two slots in flight so that both run at once. Peak pinned memory is the
ring (``2 * staging_bytes``), whatever the cache's size; the backup itself
is ordinary (pageable) memory, handed back to the OS when dropped. On the
host backend a backup is one plain copy.

A backup kept between sleeps (``recommit(keep_host_memory=True)``) is
instead registered with the GPU driver once (:meth:`HostBackup.pin`), and
its later copies run as direct DMA on the copy stream, with no CPU copy.
Pinning is paid once, at the wake that keeps the backup, so it pays off
from the next sleep on; a backup made for one sleep keeps using the ring.
(This path has not run on a GPU yet: see docs/gpu-validation.md.)

The slots come from torch's pinned-memory cache and go back to it when a
copy ends, on purpose: the next sleep or wake (and any pinned tensor of
the engine's of that size) reuses them instead of pinning pages again,
which costs milliseconds per MiB. So the process keeps at most the ring's
``2 * staging_bytes`` pinned after the first preserving sleep;
``torch.accelerator.memory.empty_host_cache()`` (where torch has it) gives
them back to the OS.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from extensible_kv.tensor import ExtensibleTensor

MiB = 1 << 20
#: Bytes per staging slot; two slots make the ring.
DEFAULT_STAGING_BYTES = 64 * MiB


class HostBackup:
    """Host copies of device byte regions (uint8, 1-D), in order.

    The copies live in one host-backend buffer: its pages arrive populated
    (several times faster than faulting them in on first write), and
    :meth:`free` hands them straight back to the OS (no allocator holds on
    to them).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        total = sum(sizes)
        self._store = ExtensibleTensor(total, "cpu")
        try:
            self._whole = self._store.resize_(total)
        except BaseException:
            # A host budget refused the copy: its address range goes now.
            self._store.free()
            raise
        offsets = [0, *itertools.accumulate(sizes)]
        self.copies = [self._whole[start:end] for start, end in itertools.pairwise(offsets)]
        self.pinned = False

    def pin(self) -> None:
        """Register the backup's pages with the GPU driver (``cudaHostRegister``
        through torch; ``hipHostRegister`` on ROCm), once, so that copies to
        and from it run as direct DMA. Does nothing without a GPU. If the
        driver refuses (a locked-memory limit), warns and stays unpinned:
        copies then go through the staging ring, as before.
        """
        if self.pinned or not self.nbytes or not torch.cuda.is_available():
            return
        error = int(_cudart().cudaHostRegister(self._whole.data_ptr(), self.nbytes, 0))
        if error:
            warnings.warn(
                f"could not pin the {self.nbytes}-byte host backup (cudaHostRegister "
                f"error {error}); its copies go through the staging ring",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.pinned = True

    def free(self) -> None:
        """Give the host memory back now (unpinning it first)."""
        if self.pinned:
            error = int(_cudart().cudaHostUnregister(self._whole.data_ptr()))
            if error:
                raise RuntimeError(f"cudaHostUnregister of the host backup failed: error {error}")
            self.pinned = False
        self.copies = []
        self._store.free()

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() for copy in self.copies)

    def fits(self, regions: Sequence[torch.Tensor]) -> bool:
        """True if this backup's copies can hold ``regions`` (for reuse)."""
        return [c.numel() for c in self.copies] == [r.numel() for r in regions]

    @classmethod
    def capture(
        cls,
        regions: Sequence[torch.Tensor],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        reuse: HostBackup | None = None,
    ) -> HostBackup:
        """Copy every region to host memory; returns once the copies are done."""
        if reuse is not None and reuse.fits(regions):
            backup = reuse
        else:
            if reuse is not None:
                reuse.free()
            backup = cls([r.numel() for r in regions])
        try:
            if regions and regions[0].device.type == "cuda":
                ring = _Ring(regions[0].device, staging_bytes, direct=backup.pinned)
                ring.to_host(regions, backup.copies)
            else:
                for region, copy in zip(regions, backup.copies, strict=True):
                    copy.copy_(region)
        except BaseException:
            if backup is not reuse:  # a reused one stays its owner's
                backup.free()
            raise
        return backup

    def restore(
        self, regions: Sequence[torch.Tensor], *, staging_bytes: int = DEFAULT_STAGING_BYTES
    ) -> None:
        """Copy the backup back into ``regions`` (same sizes, same order).

        On a GPU the current stream is made to wait for the copies, so work
        queued after this call sees the restored bytes; nothing else waits.
        """
        restorer = self.restorer(regions, staging_bytes=staging_bytes)
        try:
            restorer.copy(range(len(regions)))
        finally:
            restorer.finish()

    def restorer(
        self, regions: Sequence[torch.Tensor], *, staging_bytes: int = DEFAULT_STAGING_BYTES
    ) -> Restorer:
        """A :class:`Restorer` copying this backup into ``regions`` (same
        sizes, same order) region by region, as their memory is committed."""
        if not self.fits(regions):
            raise ValueError("the regions to restore differ from the ones backed up")
        return Restorer(self.copies, regions, staging_bytes, direct=self.pinned)


def _cudart() -> Any:
    """torch's CUDA runtime bindings (HIP's on ROCm builds, same names)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


class Restorer:
    """Copies a backup back while the caller commits the memory it goes to.

    A wake commits memory and then fills it from the host copy; done one
    after the other, the wake costs their sum. Here the caller commits a
    part, hands its regions to :meth:`copy` and goes on to commit the next
    part while one worker thread copies (the copies release the GIL), so
    the wake costs about the larger of the two. :meth:`finish` waits for
    every copy and raises the first error; it must be called, also when
    committing failed, before the memory is released again.
    """

    def __init__(
        self,
        copies: Sequence[torch.Tensor],
        regions: Sequence[torch.Tensor],
        staging_bytes: int,
        *,
        direct: bool = False,
    ) -> None:
        self._copies = copies
        self._regions = regions
        on_gpu = bool(regions) and regions[0].device.type == "cuda"
        # Made here, on the caller's thread, so that it orders the copies
        # after the caller's current stream and that stream after them.
        self._ring = _Ring(regions[0].device, staging_bytes, direct=direct) if on_gpu else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="extensible-kv-restore")
        self._pending: list[Future[None]] = []

    def copy(self, indices: Iterable[int]) -> None:
        """Start copying the regions at ``indices``; their memory must be
        committed. Returns at once."""
        chosen = list(indices)
        regions = [self._regions[i] for i in chosen]
        copies = [self._copies[i] for i in chosen]
        self._pending.append(self._worker.submit(self._copy, copies, regions))

    def _copy(self, copies: list[torch.Tensor], regions: list[torch.Tensor]) -> None:
        if self._ring is not None:
            self._ring.to_device(copies, regions)
        else:
            for region, copy in zip(regions, copies, strict=True):
                region.copy_(copy)

    def finish(self) -> None:
        """Wait for every copy started; raise the first one's error, if any."""
        self._worker.shutdown(wait=True)
        if self._ring is not None:
            self._ring.finish_upload()
        error = next((e for e in (f.exception() for f in self._pending) if e is not None), None)
        self._pending = []
        if error is not None:
            try:
                raise error
            finally:
                error = None  # no cycle through this frame: the regions go with the error


def _pieces(
    regions: Sequence[torch.Tensor], copies: Sequence[torch.Tensor], size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device slice, host slice) pairs of at most ``size`` bytes."""
    pieces = []
    for region, copy in zip(regions, copies, strict=True):
        for start in range(0, region.numel(), size):
            end = min(start + size, region.numel())
            pieces.append((region[start:end], copy[start:end]))
    return pieces


class _Ring:
    """A copy stream for device <-> host copies: staged through two pinned
    slots, or ``direct`` when the host side is pinned already.

    Made on the caller's thread: its copies run after the work queued on
    the caller's current stream, and, for uploads, :meth:`finish_upload`
    makes that stream wait for them.
    """

    def __init__(self, device: torch.device, staging_bytes: int, *, direct: bool = False) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.device = device
        self.size = staging_bytes
        self.direct = direct
        self.caller = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Kernels writing the cache, or zeroing freshly committed memory,
        # run on the caller's stream: copy after them.
        self.stream.wait_stream(self.caller)
        slots = 0 if direct else 2
        self.slots = [
            torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)
        ]
        self.events = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]
        self.used = [False] * slots
        self.next_slot = 0

    def to_host(self, regions: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> None:
        """Copy ``regions`` into ``copies``; returns once the copies are done."""
        if self.direct:
            with torch.cuda.stream(self.stream):
                for region, copy in zip(regions, copies, strict=True):
                    copy.copy_(region, non_blocking=True)
            self.stream.synchronize()
            return
        waiting: list[tuple[int, torch.Tensor] | None] = [None, None]
        for i, (device_part, host_part) in enumerate(_pieces(regions, copies, self.size)):
            slot = i % 2
            self._finish(slot, waiting)
            staged = self.slots[slot][: device_part.numel()]
            with torch.cuda.stream(self.stream):
                staged.copy_(device_part, non_blocking=True)
                self.events[slot].record(self.stream)
            waiting[slot] = (device_part.numel(), host_part)
        for slot in (0, 1):
            self._finish(slot, waiting)

    def _finish(self, slot: int, waiting: list[tuple[int, torch.Tensor] | None]) -> None:
        """Finish the slot's device-to-host copy: wait for it, then move it on."""
        pending = waiting[slot]
        if pending is not None:
            self.events[slot].synchronize()
            size, host_part = pending
            host_part.copy_(self.slots[slot][:size])
            waiting[slot] = None

    def to_device(self, copies: Sequence[torch.Tensor], regions: Sequence[torch.Tensor]) -> None:
        """Queue uploads of ``copies`` into ``regions``; may be called
        again (from one thread at a time), then :meth:`finish_upload`."""
        if self.direct:
            with torch.cuda.stream(self.stream):
                for region, copy in zip(regions, copies, strict=True):
                    region.copy_(copy, non_blocking=True)
            return
        for device_part, host_part in _pieces(regions, copies, self.size):
            slot = self.next_slot
            self.next_slot = 1 - slot
            if self.used[slot]:
                self.events[slot].synchronize()  # the slot's last upload is done
            staged = self.slots[slot][: device_part.numel()]
            staged.copy_(host_part)
            with torch.cuda.stream(self.stream):
                device_part.copy_(staged, non_blocking=True)
                self.events[slot].record(self.stream)
            self.used[slot] = True

    def finish_upload(self) -> None:
        """Order the caller's stream after the uploads, and wait for them:
        the host memory they read (the slots, which go back to torch's
        cache, or the backup, which may be freed next) must outlive them."""
        self.caller.wait_stream(self.stream)
        self.stream.synchronize()
