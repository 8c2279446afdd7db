"""ExtensibleKVCacheBuilder: vLLM's allocation hook, for runners that lay
out their KV cache tensors themselves."""

from __future__ import annotations

import torch

from extensible_kv._checks import check_bool, check_int
from extensible_kv.driver import Driver
from extensible_kv.kv.cache.core import KVCacheBuffers
from extensible_kv.tensor import ExtensibleTensor


class ExtensibleKVCacheBuilder:
    """Reserves one buffer per KV cache tensor where a runner would have
    called ``torch.zeros(size, dtype=torch.int8)``, then hands over the
    lockstep buffers with one block committed (vLLM's names).

    A runner that reshapes raw tensors itself calls :meth:`reserve` for
    each and views the result as before; :meth:`finish` gives the
    :class:`KVCacheBuffers` that commit, sleep and wake them. Runners
    without their own layout code call :func:`allocate_kv_cache` instead.

    Args:
        num_blocks_capacity: blocks every tensor is reserved for.
        device: as for :class:`ExtensibleTensor`.
        shareable: memory a KV connector can register.
        driver: the driver to use, e.g. wrapped in an adaptor.
    """

    def __init__(
        self,
        num_blocks_capacity: int,
        device: torch.device | str | int | None = None,
        shareable: bool = False,
        *,
        driver: Driver | None = None,
    ) -> None:
        check_int("num_blocks_capacity", num_blocks_capacity)
        check_bool("shareable", shareable)
        if num_blocks_capacity < 1:
            raise ValueError(f"num_blocks_capacity must be positive, got {num_blocks_capacity}")
        self.num_blocks_capacity = num_blocks_capacity
        self.device = device
        self.shareable = shareable
        self.driver = driver
        self.buffers: list[tuple[ExtensibleTensor, int]] = []
        self._finished = False

    def reserve(self, size: int, num_segments: int = 1) -> torch.Tensor:
        """Reserve ``size`` bytes (the tensor's bytes at the capacity) in
        ``num_segments`` segments; returns the uint8 view of all of it.

        Only the committed blocks may be touched: one after :meth:`finish`.
        """
        if self._finished:
            raise ValueError("finish() has run; the buffers belong to the KV cache now")
        check_int("size", size)
        check_int("num_segments", num_segments)
        per_block, remainder = divmod(size, self.num_blocks_capacity)
        if remainder or size <= 0:
            raise ValueError(
                f"a KV cache tensor of {size} bytes is not a positive whole number of "
                f"{self.num_blocks_capacity} blocks"
            )
        if num_segments < 1 or per_block % num_segments:
            raise ValueError(
                f"{per_block} bytes per block do not split into {num_segments} segments"
            )
        buffer = ExtensibleTensor(
            size, self.device, num_segments, self.shareable, driver=self.driver
        )
        self.buffers.append((buffer, per_block // num_segments))
        return buffer.full_view()

    def finish(self) -> KVCacheBuffers:
        """The lockstep buffers of everything reserved, one block committed.

        If that commit fails, every reservation is freed and the error
        propagates."""
        if self._finished:
            raise ValueError("finish() has already run")
        cache = KVCacheBuffers(self.buffers, self.num_blocks_capacity)
        try:
            cache.commit(1)
        except BaseException:
            cache.free()
            raise
        self._finished = True
        return cache
