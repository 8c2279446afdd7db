"""Host copies of KV blocks, for a sleep that keeps the cache's contents.

On a GPU the copies go through a small pinned staging ring on a dedicated
stream: device to pinned by DMA, pinned to ordinary host memory by the CPU,
two slots in flight so that both run at once. Peak pinned memory is the
ring (``2 * staging_bytes``), whatever the cache's size; the backup itself
is ordinary (pageable) memory, handed back to the OS when dropped. On the
host backend a backup is one plain copy.

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
from collections.abc import Sequence

import torch

from extensible_kv.tensor import ExtensibleTensor

MiB = 1 << 20
#: Bytes per staging slot; two slots make the ring.
DEFAULT_STAGING_BYTES = 64 * MiB


class HostBackup:
    """Host copies of device byte regions (uint8, 1-D), in order.

    The copies live in one host-backend buffer: its pages arrive as
    populated huge pages (several times faster than faulting in ordinary
    pages on first write), and :meth:`free` hands them straight back to the
    OS (no allocator holds on to them).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        total = sum(sizes)
        self._store = ExtensibleTensor(total, "cpu")
        whole = self._store.resize_(total)
        offsets = [0, *itertools.accumulate(sizes)]
        self.copies = [whole[start:end] for start, end in itertools.pairwise(offsets)]

    def free(self) -> None:
        """Give the host memory back now."""
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
        if regions and regions[0].device.type == "cuda":
            _Ring(regions[0].device, staging_bytes).to_host(regions, backup.copies)
        else:
            for region, copy in zip(regions, backup.copies, strict=True):
                copy.copy_(region)
        return backup

    def restore(
        self, regions: Sequence[torch.Tensor], *, staging_bytes: int = DEFAULT_STAGING_BYTES
    ) -> None:
        """Copy the backup back into ``regions`` (same sizes, same order).

        On a GPU the current stream is made to wait for the copies, so work
        queued after this call sees the restored bytes; nothing else waits.
        """
        if not self.fits(regions):
            raise ValueError("the regions to restore differ from the ones backed up")
        if regions and regions[0].device.type == "cuda":
            _Ring(regions[0].device, staging_bytes).to_device(self.copies, regions)
        else:
            for region, copy in zip(regions, self.copies, strict=True):
                region.copy_(copy)


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
    """Two pinned slots and a copy stream, for staged device <-> host copies."""

    def __init__(self, device: torch.device, staging_bytes: int) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.device = device
        self.size = staging_bytes
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.slots = [
            torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
        ]
        self.events = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]

    def to_host(self, regions: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> None:
        # Kernels writing the cache run on the current stream: copy after them.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        waiting: list[tuple[int, torch.Tensor] | None] = [None, None]
        for i, (device_part, host_part) in enumerate(_pieces(regions, copies, self.size)):
            slot = i % 2
            self._drain(slot, waiting)
            staged = self.slots[slot][: device_part.numel()]
            with torch.cuda.stream(self.stream):
                staged.copy_(device_part, non_blocking=True)
                self.events[slot].record(self.stream)
            waiting[slot] = (device_part.numel(), host_part)
        for slot in (0, 1):
            self._drain(slot, waiting)

    def _drain(self, slot: int, waiting: list[tuple[int, torch.Tensor] | None]) -> None:
        """Finish the slot's device-to-host copy: wait for it, then move it on."""
        pending = waiting[slot]
        if pending is not None:
            self.events[slot].synchronize()
            size, host_part = pending
            host_part.copy_(self.slots[slot][:size])
            waiting[slot] = None

    def to_device(self, copies: Sequence[torch.Tensor], regions: Sequence[torch.Tensor]) -> None:
        current = torch.cuda.current_stream(self.device)
        # Zeroing of freshly committed memory runs on the current stream.
        self.stream.wait_stream(current)
        used = [False, False]
        for i, (device_part, host_part) in enumerate(_pieces(regions, copies, self.size)):
            slot = i % 2
            if used[slot]:
                self.events[slot].synchronize()  # the slot's last upload is done
            staged = self.slots[slot][: device_part.numel()]
            staged.copy_(host_part)
            with torch.cuda.stream(self.stream):
                device_part.copy_(staged, non_blocking=True)
                self.events[slot].record(self.stream)
            used[slot] = True
        current.wait_stream(self.stream)
        for slot in (0, 1):
            if used[slot]:
                # The pinned slots go back to torch's cache once the copies
                # that read them are done.
                self.events[slot].synchronize()
