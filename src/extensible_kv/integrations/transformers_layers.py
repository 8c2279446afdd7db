"""The layers of :class:`~extensible_kv.integrations.transformers.ExtensibleCache`
(transformers' ``CacheLayerMixin``): one :class:`ExtensibleLayer` per model
layer, its keys and values in one reservation each, positions outermost;
:class:`ExtensibleStaticLayer` with StaticCache's shapes; and the
:class:`Lockstep` that keeps every layer's committed length together.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from extensible_kv._checks import round_up
from extensible_kv.driver import Driver
from extensible_kv.kv import KVCacheBuffers, SleepState
from extensible_kv.tensor import ExtensibleTensor

__all__ = ["ExtensibleLayer", "ExtensibleStaticLayer", "Lockstep"]


class Lockstep:
    """The buffers of every layer, committed together by tokens: each
    layer's keys and values are two buffers of one token row each.

    Every call that touches the memory goes through :meth:`wake` first (via
    :meth:`ensure` for updates): a freed cache is refused and a sleeping
    one restored, since its views point at addresses with no memory.
    """

    def __init__(self, max_cache_len: int) -> None:
        self.cache = KVCacheBuffers([], max_cache_len)
        #: Positions every layer holds, counted on the host for committing;
        #: ``length`` counts them on the device for a compiled step.
        self.tokens = 0
        #: Positions committed ahead by ExtensibleCache.prepare.
        self.prepared = 0
        self.length: torch.Tensor | None = None
        self.freed = False

    def length_on(self, device: torch.device) -> torch.Tensor:
        """The positions held, as a tensor on ``device`` (made once)."""
        if self.length is None:
            self.length = torch.full((), self.tokens, dtype=torch.long, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.length)
            _LOCKSTEPS[self.length.data_ptr()] = self
        return self.length

    def advance(self, num_tokens: int) -> None:
        """Commit memory for ``num_tokens`` more positions of every layer."""
        end = self.tokens + num_tokens
        if end > self.cache.num_blocks_capacity:
            raise ValueError(
                f"the cache holds max_cache_len={self.cache.num_blocks_capacity} tokens; "
                f"{end} do not fit (make the cache with a larger max_cache_len)"
            )
        self.ensure(end)
        self.tokens = end

    def set_tokens(self, num_tokens: int) -> None:
        """Hold ``num_tokens`` positions from now on (after a crop or a reset)."""
        self.tokens = num_tokens
        if self.length is not None:
            self.length.fill_(num_tokens)

    def ensure(self, num_tokens: int) -> None:
        """Back the first ``num_tokens`` positions of every layer (waking
        the cache first).

        Commits up to the end of the granules those positions need: the
        memory is mapped anyway, and the steps that follow then find their
        positions committed without a call.
        """
        self.wake()
        if num_tokens <= self.cache.num_blocks_committed or not self.cache.tensors:
            return
        fits = min(
            round_up(num_tokens * row, tensor.buffer.granularity) // row
            for tensor, row in self.cache.tensors
        )
        self.cache.commit(min(self.cache.num_blocks_capacity, max(num_tokens, fits)))

    def check_alive(self) -> None:
        """Refuse a freed cache: its views point at addresses with no memory."""
        if self.freed:
            raise ValueError(
                "the ExtensibleCache has been freed: its memory is gone and touching it would "
                "fault; make a new cache"
            )

    def wake(self) -> None:
        """Make the memory touchable: refuse a freed cache, restore a
        sleeping one (touching released memory is SIGSEGV on the host and an
        illegal address on a GPU)."""
        self.check_alive()
        if self.cache.state is SleepState.ASLEEP_DISCARDED:
            self.cache.recommit(num_blocks=0)  # no token left: commit as they come
        elif self.cache.asleep:
            self.cache.recommit()

    def forget(self, num_tokens: int) -> None:
        """Zero positions ``num_tokens`` to :attr:`tokens` of every layer and
        hold ``num_tokens`` (a crop with static shapes, whose attention
        reads every position)."""
        if num_tokens < self.tokens:
            self.wake()
            for tensor, row in self.cache.tensors:
                tensor.full_view()[num_tokens * row : self.tokens * row].zero_()
        self.set_tokens(num_tokens)

    def release(self) -> None:
        """Give every position's memory back; during a preserving sleep,
        drop the host copy too, so that nothing old comes back."""
        self.check_alive()
        self.cache.clear()


_LOCKSTEPS: weakref.WeakValueDictionary[int, Lockstep] = weakref.WeakValueDictionary()


# A custom op, not a graph break: a compiled decode step calls it as one
# node, and its Python body runs on every step, outside any CUDA graph
# (``cudagraph_unsafe``: inductor's graph partitions replay around it). It
# commits memory for the step's tokens from the host before any layer
# writes; the graph itself never changes. Every layer's write positions
# derive from its result, which orders the writes after it.
@torch.library.custom_op(
    "extensible_kv::advance", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _advance(length: torch.Tensor, num_tokens: int) -> torch.Tensor:
    _LOCKSTEPS[length.data_ptr()].advance(num_tokens)
    return length + num_tokens


@_advance.register_fake
def _advance_fake(length: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return torch.empty_like(length)


class ExtensibleLayer(CacheLayerMixin):
    """One layer's keys and values, reserved for ``max_cache_len`` tokens and
    committed as they arrive (transformers' cache-layer extension point).

    Made by :class:`ExtensibleCache`, which commits every layer in lockstep
    and owns the memory. ``keys`` and ``values`` are views of the committed
    positions; their ``data_ptr()`` never changes.
    """

    is_compileable = False  # the views' sequence length grows every step
    is_croppable = True
    is_sliding = False
    #: Whether positions not yet committed read as zeros.
    zero_backed = False

    def __init__(
        self,
        max_cache_len: int,
        lockstep: Lockstep,
        *,
        driver: Driver | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.cumulative_length = 0
        self._lockstep = lockstep
        self._driver = driver
        self._chunk_bytes = chunk_bytes
        # Keys and values over all max_cache_len positions (uncommitted
        # ones included: only slices of committed positions leave the layer).
        self._full: tuple[torch.Tensor, torch.Tensor] | None = None
        self._batch = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Reserve both tensors for ``max_cache_len`` tokens of this batch;
        nothing is committed until tokens arrive (a sleeping cache wakes)."""
        self._lockstep.wake()
        made: list[tuple[ExtensibleTensor, int]] = []
        try:
            for states in (key_states, value_states):
                made.append(self._reserve(states))
            # Both join the lockstep, or neither (a layer made mid-generation
            # is committed to the tokens already there).
            self._lockstep.cache.add_all(made)
        except BaseException:
            for buffer, _ in made:
                buffer.free()
            raise
        self.device = key_states.device
        self._batch = self.batch_size = key_states.shape[0]
        keys, values = (
            self._positions_inner(buffer, states)
            for (buffer, _), states in zip(made, (key_states, value_states), strict=True)
        )
        self._full = keys, values
        self.is_initialized = True
        self._narrow()

    def _reserve(self, states: torch.Tensor) -> tuple[ExtensibleTensor, int]:
        """A buffer for ``max_cache_len`` tokens of ``states``, and its bytes per token."""
        batch, heads, _, dim = states.shape
        row = batch * heads * dim * states.element_size()
        buffer = ExtensibleTensor(
            self.max_cache_len * row,
            states.device,
            driver=self._driver,
            chunk_bytes=self._chunk_bytes,
            zero_backed=self.zero_backed,
        )
        return buffer, row

    def _positions_inner(self, buffer: ExtensibleTensor, states: torch.Tensor) -> torch.Tensor:
        """The buffer as transformers' ``[batch, heads, positions, dim]``.

        Positions are outermost in memory, so the committed tokens are a
        prefix of the buffer and grow it in place.
        """
        batch, heads, _, dim = states.shape
        full = buffer.full_view().view(states.dtype)
        return full.view(self.max_cache_len, batch, heads, dim).permute(1, 2, 0, 3)

    def _narrow(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Point ``keys`` and ``values`` at the committed positions; return them."""
        keys, values = (full[: self._batch, :, : self.cumulative_length] for full in self._both())
        self.keys, self.values = keys, values
        return keys, values

    def _both(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None:
            raise RuntimeError("the layer has no memory before its first update")
        return self._full

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new states after the cached ones; return all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        full_keys, full_values = self._both()
        start = self.cumulative_length
        end = start + key_states.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(
                f"the cache holds max_cache_len={self.max_cache_len} tokens; {end} do not fit "
                f"(make the cache with a larger max_cache_len)"
            )
        self.check_states(key_states, value_states)
        self._lockstep.ensure(end)
        full_keys[: self._batch, :, start:end].copy_(key_states)
        full_values[: self._batch, :, start:end].copy_(value_states)
        self.cumulative_length = end
        return self._narrow()

    def check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse states this layer's reservation cannot take, before
        anything changes: the batch, heads and head size it was made for."""
        for name, states, full in self._pairs(key_states, value_states):
            if states.shape[0] != self._batch:
                raise ValueError(
                    f"the cache holds a batch of {self._batch}, not {states.shape[0]}; "
                    f"use one cache per batch"
                )
            if states.dim() != 4 or (states.shape[1], states.shape[3]) != (
                full.shape[1],
                full.shape[3],
            ):
                raise ValueError(
                    f"the cache holds {name} of {full.shape[1]} heads of {full.shape[3]} per "
                    f"position ([batch, heads, positions, head size]), not {tuple(states.shape)}"
                )

    def _pairs(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, new states, full tensor)`` for the keys and the values."""
        return list(zip(("keys", "values"), (key_states, value_states), self._both(), strict=True))

    def _beams(self, beam_idx: torch.Tensor) -> torch.Tensor:
        """``beam_idx`` on the layer's device, refused unless it names one
        row of the batch for every row (a shorter index would broadcast its
        rows over the batch; one out of range faults on a GPU)."""
        index = torch.as_tensor(beam_idx, device=self.device)
        batch = self._batch
        if (
            index.dim() != 1
            or index.numel() != batch
            or bool(((index < 0) | (index >= batch)).any())
        ):
            raise ValueError(
                f"reorder_cache needs one beam index in 0 to {batch - 1} per row of the batch "
                f"of {batch}, got {index.tolist()}"
            )
        return index

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget the tokens (the cache gives their memory back)."""
        self.cumulative_length = 0
        if self.is_initialized:
            self._narrow()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative int, as
        ``DynamicLayer``); the next update overwrites them in place."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache "
                "instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)
        self._narrow()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` takes row ``beam_idx[i]``, in place
        (``beam_idx``: one row of the batch per row)."""
        if self.cumulative_length == 0:
            return
        index = self._beams(beam_idx)
        self._lockstep.wake()
        for states in self._narrow():
            states.copy_(states.index_select(0, index))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` of the batch, moved to the front in place
        (the memory of the rows dropped stays until the cache is reset)."""
        if not self.is_initialized:
            return
        self._lockstep.wake()
        index = torch.as_tensor(indices, device=self.device).flatten()
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        kept = [states.index_select(0, index) for states in self._narrow()]
        self._batch = self.batch_size = index.numel()
        for states, rows in zip(self._narrow(), kept, strict=True):
            states.copy_(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Unsupported once reserved: the reservation holds the batch of
        the first update. Start ``generate`` from an empty cache instead."""
        if not self.is_initialized or repeats == 1:
            return
        raise NotImplementedError(
            f"ExtensibleLayer.batch_repeat_interleave: the cache is reserved for a batch of "
            f"{self._batch} and cannot grow it {repeats}x; give generate() an empty "
            f"ExtensibleCache (it reserves for the expanded batch)"
        )

    def offload(self) -> None:
        raise NotImplementedError(
            "ExtensibleLayer.offload: use ExtensibleCache.release_physical(preserve=True), "
            "which keeps the addresses"
        )

    def prefetch(self) -> None:
        raise NotImplementedError("ExtensibleLayer.prefetch: use ExtensibleCache.recommit()")


class ExtensibleStaticLayer(ExtensibleLayer):
    """StaticCache's shapes on an extensible reservation: ``keys`` and
    ``values`` span all ``max_cache_len`` positions, so a decode step is
    compiled or captured once and replayed as the cache grows.

    Positions not yet committed read as zeros (a zero-backed reservation:
    no memory, and no NaN a mask could not cancel); the attention mask,
    StaticCache's, hides them. Memory is committed from the host before
    each step by :class:`ExtensibleCache` (``static_shapes=True``).
    """

    is_compileable = True
    zero_backed = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._lockstep.ensure(max(self._lockstep.tokens, self._lockstep.prepared))
        # Shared by every layer: one count of positions, on the device, which
        # a compiled step reads instead of specializing on a Python int.
        self._length = self._lockstep.length_on(self.device)
        if not torch.compiler.is_compiling():
            # Fixed addresses: CUDA graphs then read them in place, uncopied.
            for tensor in self._both():
                torch._dynamo.mark_static_address(tensor)

    def _narrow(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._both()
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new states at the positions after the cached ones (in
        memory the cache committed before this step); return all positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_states(key_states, value_states)
        keys, values = self._both()
        length = key_states.shape[-2]
        # The cache has advanced the count by this step's tokens already.
        start = self._length - length
        positions = torch.arange(length, device=self.device) + start
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> Any:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        """Nothing per layer: the cache counts the positions of every layer."""

    def crop(self, tokens_to_remove: int) -> None:
        """Checks the argument; the cache counts the positions of every layer."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache "
                "instead."
            )

    def check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As the dynamic layer's, and the dtype and device too:
        ``index_copy_`` converts neither."""
        super().check_states(key_states, value_states)
        for name, states, full in self._pairs(key_states, value_states):
            if (states.dtype, states.device) != (full.dtype, full.device):
                raise ValueError(
                    f"the cache holds {name} of {full.dtype} on {full.device}, not "
                    f"{states.dtype} on {states.device}"
                )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` takes row ``beam_idx[i]``, in place, over
        the committed positions (the zeros past them are not writable)."""
        held = self._lockstep.tokens
        if held == 0:
            return
        index = self._beams(beam_idx)
        self._lockstep.wake()
        for states in self._both():
            cached = states[:, :, :held]
            cached.copy_(cached.index_select(0, index))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(
            "ExtensibleStaticLayer.batch_select_indices: static shapes keep the batch; "
            "use ExtensibleCache(static_shapes=False)"
        )
