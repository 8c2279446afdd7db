"""Sizing the KV cache after warm-up, from what memory warm-up really used."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 1 << 20
#: Head room left free after sizing, as vLLM leaves (bytes).
DEFAULT_MARGIN_BYTES = 150 * MiB


@dataclass(frozen=True)
class MemorySnapshot:
    """Free and total memory of a device, in bytes, at one moment."""

    free_bytes: int
    total_bytes: int

    @classmethod
    def take(cls, device: torch.device | str) -> MemorySnapshot:
        """Read the device: ``torch.cuda.mem_get_info`` for a GPU, the
        kernel's available memory (``MemAvailable``) for the host."""
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
            return cls(int(free), int(total))
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
        return cls(info["MemAvailable"], info["MemTotal"])


@dataclass(frozen=True)
class KVSizing:
    """The outcome of sizing, every figure in bytes except ``num_blocks``."""

    warmup_bytes: int
    kv_bytes_at_warmup: int
    available_bytes: int
    bytes_per_block: int
    num_blocks: int
    #: The reservation's upper bound, in blocks.
    num_blocks_capacity: int

    @property
    def capped(self) -> bool:
        """True when the capacity, not the memory, decided the count."""
        return self.available_bytes // self.bytes_per_block > self.num_blocks_capacity

    def describe(self) -> str:
        kv = self.num_blocks * self.bytes_per_block
        text = (
            f"warm-up used {self.warmup_bytes / MiB:.1f} MiB besides "
            f"{self.kv_bytes_at_warmup / MiB:.1f} MiB of KV; {self.available_bytes / MiB:.1f} MiB "
            f"available for the KV cache -> {self.num_blocks} blocks of {self.bytes_per_block} "
            f"bytes ({kv / MiB:.1f} MiB)"
        )
        if self.capped:
            text += f", capped by the capacity of {self.num_blocks_capacity} blocks"
        return text


def size_kv_cache(
    before: MemorySnapshot,
    after: MemorySnapshot,
    *,
    kv_bytes_before: int,
    kv_bytes_after: int,
    bytes_per_block: int,
    num_blocks_capacity: int,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    kv_budget_bytes: int | None = None,
    memory_utilization: float | None = None,
) -> KVSizing:
    """The final block count, from snapshots taken around warm-up.

    Warm-up's own use is the drop in free memory minus the KV memory it
    committed (``kv_bytes_after - kv_bytes_before``). The KV cache may then
    have the free memory after warm-up, plus what it already holds, minus
    ``margin_bytes``; with ``memory_utilization`` (a fraction of the total,
    like vLLM's ``gpu_memory_utilization``) the limit is that share of the
    device instead of all of it. An explicit ``kv_budget_bytes`` is honoured
    as asked. The count is capped at the capacity and is at least 1.

    ``bytes_per_block`` is the physical bytes one block adds, summed over
    all buffers and segments.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if memory_utilization is not None and not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    kv_grown = kv_bytes_after - kv_bytes_before
    warmup = max(0, before.free_bytes - after.free_bytes - kv_grown)
    if kv_budget_bytes is not None:
        available = kv_budget_bytes
    elif memory_utilization is not None:
        used_by_others = after.total_bytes - after.free_bytes - kv_bytes_after
        available = int(after.total_bytes * memory_utilization) - used_by_others - margin_bytes
    else:
        available = after.free_bytes + kv_bytes_after - margin_bytes
    blocks = max(1, min(num_blocks_capacity, available // bytes_per_block))
    return KVSizing(
        warmup, kv_bytes_after, max(0, available), bytes_per_block, blocks, num_blocks_capacity
    )
