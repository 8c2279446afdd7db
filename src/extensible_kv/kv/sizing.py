"""Sizing the KV cache after warm-up, from what memory warm-up really used."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 1 << 20
#: Head room left free after sizing, as vLLM leaves (bytes).
DEFAULT_MARGIN_BYTES = 150 * MiB
#: Share of the device's total memory the process may fill (vLLM's default
#: ``gpu_memory_utilization``).
DEFAULT_MEMORY_UTILIZATION = 0.9


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


class KVCacheTooSmallError(ValueError):
    """Sizing found no room for one block: the engine cannot serve.

    The message names the figures that decided it, as vLLM's does, so the
    remedy (a larger ``memory_utilization``, a smaller model or batch, a
    smaller margin) can be read from it.
    """


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
    memory_utilization: float | None = DEFAULT_MEMORY_UTILIZATION,
    cudagraph_memory_bytes: int = 0,
) -> KVSizing:
    """The final block count, from snapshots taken around warm-up.

    Warm-up's own use is the drop in free memory minus the KV memory it
    committed (``kv_bytes_after - kv_bytes_before``), and at least
    ``cudagraph_memory_bytes``, an estimate of CUDA-graph memory still to
    come (give it when graphs are captured after sizing; an extensible cache
    captures them during warm-up, where they are measured, so it needs no
    estimate). The limit on the device is then, as vLLM's:

    - ``memory_utilization`` (default 0.9, vLLM's ``gpu_memory_utilization``):
      that share of the *total* memory, less what everything but the KV cache
      holds after warm-up;
    - ``memory_utilization=None``: all the free memory after warm-up plus
      what the cache already holds;
    - ``kv_budget_bytes``: exactly that, whatever the snapshots say.

    The first two leave ``margin_bytes`` free besides. The count is capped at
    the capacity. ``bytes_per_block`` is the physical bytes one block adds,
    summed over all buffers and segments.

    Raises:
        KVCacheTooSmallError: not one block fits; the message names free
            memory, warm-up use, the margin and the share.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if memory_utilization is not None and not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if cudagraph_memory_bytes < 0:
        raise ValueError(f"cudagraph_memory_bytes must be >= 0, got {cudagraph_memory_bytes}")
    measured = max(0, before.free_bytes - after.free_bytes - (kv_bytes_after - kv_bytes_before))
    warmup = max(measured, cudagraph_memory_bytes)
    # Graph memory estimated beyond what warm-up showed is still to come.
    still_to_come = warmup - measured
    if kv_budget_bytes is not None:
        available = kv_budget_bytes
        rule = f"the KV budget of {kv_budget_bytes / MiB:.1f} MiB"
    elif memory_utilization is not None:
        used_by_others = after.total_bytes - after.free_bytes - kv_bytes_after
        share = int(after.total_bytes * memory_utilization)
        available = share - used_by_others - still_to_come - margin_bytes
        rule = (
            f"memory_utilization {memory_utilization} allows {share / MiB:.1f} MiB of "
            f"{after.total_bytes / MiB:.1f} MiB; {used_by_others / MiB:.1f} MiB is held by "
            f"everything but the KV cache"
        )
    else:
        available = after.free_bytes + kv_bytes_after - still_to_come - margin_bytes
        rule = f"{after.free_bytes / MiB:.1f} MiB was free after warm-up"
    blocks = min(num_blocks_capacity, available // bytes_per_block)
    if blocks < 1:
        raise KVCacheTooSmallError(
            f"no room for one KV block of {bytes_per_block} bytes: {rule}; warm-up used "
            f"{warmup / MiB:.1f} MiB (measured {measured / MiB:.1f} MiB, CUDA-graph estimate "
            f"{cudagraph_memory_bytes / MiB:.1f} MiB) and the margin is "
            f"{margin_bytes / MiB:.1f} MiB, leaving {available / MiB:.1f} MiB for the KV cache. "
            f"Raise memory_utilization, lower the margin, or free memory"
        )
    return KVSizing(warmup, kv_bytes_after, available, bytes_per_block, blocks, num_blocks_capacity)
