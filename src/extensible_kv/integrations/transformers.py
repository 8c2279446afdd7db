"""A Hugging Face ``transformers`` cache with fixed addresses and the memory
of the sequence.

``DynamicCache`` grows by ``torch.cat``: memory follows the sequence, but
every step copies the whole cache and moves it. ``StaticCache`` keeps its
addresses, but takes ``max_cache_len`` of memory for every layer up front.
:class:`ExtensibleCache` reserves ``max_cache_len`` of address space per
layer and commits memory as tokens arrive: every layer's keys and values
stay at the same addresses for the whole generation, and physical memory is
what the tokens take, rounded up to one granule per tensor.

Use it as any cache::

    cache = ExtensibleCache(max_cache_len=4096, config=model.config)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

Positions are stored outermost (physically ``[position, batch, head,
dim]``, seen as transformers' ``[batch, head, position, dim]``), so the
committed tokens are a prefix of each tensor's memory. The keys and values
handed to attention span the committed positions only: a kernel never sees
an address without memory behind it.

Between two turns of a chat the cache can sleep
(:meth:`ExtensibleCache.release_physical`, preserving or not) and wake
(:meth:`ExtensibleCache.recommit`), at the same addresses.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from extensible_kv._checks import check_int
from extensible_kv.driver import Driver
from extensible_kv.integrations.transformers_layers import (
    ExtensibleLayer,
    ExtensibleStaticLayer,
    Lockstep,
)
from extensible_kv.kv.cache.core import KVCacheBuffers

__all__ = ["ExtensibleCache", "ExtensibleLayer", "ExtensibleStaticLayer"]


class ExtensibleCache(Cache):
    """A transformers cache whose layers keep their addresses and commit
    memory as tokens arrive.

    Args:
        max_cache_len: tokens each layer reserves address space for (the
            prompt and every new token must fit).
        config: the model's config; when given, one layer per hidden layer
            is made up front, else layers are made as the model reaches them.
        driver: the driver to use, e.g. wrapped in an adaptor (default: the
            one serving the device of the first keys).
        chunk_bytes: largest physical chunk one commit maps.
        static_shapes: StaticCache's shapes (:class:`ExtensibleStaticLayer`):
            keys and values span all ``max_cache_len`` positions, so a decode
            step compiles (``torch.compile``, CUDA graphs) once; the memory
            still follows the tokens. Needs ``config``.

    The cache owns its memory: :meth:`free` returns it (and the address
    ranges once no view is left); :meth:`release_physical` and
    :meth:`recommit` put it to sleep and wake it between turns.
    """

    def __init__(
        self,
        max_cache_len: int,
        config: Any = None,
        *,
        driver: Driver | None = None,
        chunk_bytes: int | None = None,
        static_shapes: bool = False,
    ) -> None:
        check_int("max_cache_len", max_cache_len)
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        if static_shapes and config is None:
            raise ValueError(
                "static_shapes=True needs the model's config: a compiled step needs every "
                "layer made before it runs"
            )
        self._layer_class = ExtensibleStaticLayer if static_shapes else ExtensibleLayer
        self._lockstep = Lockstep(max_cache_len)
        self._driver = driver
        self._chunk_bytes = chunk_bytes
        if config is None:
            # Cache calls it with no argument to make each layer it reaches.
            replicate: Any = self._new_layer
            super().__init__(layer_class_to_replicate=replicate)
        else:
            text = config.get_text_config(decoder=True)
            layers: list[Any] = [self._new_layer() for _ in range(text.num_hidden_layers)]
            super().__init__(layers=layers)

    def _new_layer(self) -> ExtensibleLayer:
        return self._layer_class(
            self.max_cache_len, self._lockstep, driver=self._driver, chunk_bytes=self._chunk_bytes
        )

    @property
    def static_shapes(self) -> bool:
        """True when keys and values span all ``max_cache_len`` positions."""
        return self._layer_class is ExtensibleStaticLayer

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new states; with static shapes the first layer's
        call commits memory for the step's tokens first, for every layer."""
        if layer_idx == 0 and self.static_shapes:
            self._advance(key_states, value_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys, values

    def _advance(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Count the step's positions and commit them for every layer, once
        the first layer has taken its reservation and checked the states:
        a refused step moves nothing."""
        first = cast(ExtensibleLayer, self.layers[0])  # static shapes: made by __init__
        if not first.is_initialized:
            first.lazy_initialization(key_states, value_states)
        first.check_states(key_states, value_states)
        length = self._lockstep.length_on(key_states.device)
        length.copy_(torch.ops.extensible_kv.advance(length, key_states.shape[-2]))

    def prepare(self, num_tokens: int) -> None:
        """Commit memory for the first ``num_tokens`` positions of every
        layer now, from the host (``static_shapes`` caches).

        generate's own compile needs none of this: its compiled step
        commits as it goes. A step captured by hand (``torch.cuda.graph``)
        replays without its host side, so it cannot commit: call this before
        capturing, and again before replays that go past it (after a
        :meth:`reset` or a sleep too). Layers not made yet commit it when
        they are.
        """
        check_int("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self.max_cache_len:
            raise ValueError(
                f"num_tokens must be 0 to max_cache_len={self.max_cache_len}, got {num_tokens}"
            )
        self._lockstep.prepared = num_tokens
        self._lockstep.ensure(num_tokens)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative int); with
        static shapes their positions read zero again."""
        super().crop(tokens_to_remove)
        if self.static_shapes:
            self._lockstep.forget(max(0, self._lockstep.tokens + tokens_to_remove))

    @property
    def max_cache_len(self) -> int:
        """Tokens each layer can hold."""
        return self._lockstep.cache.num_blocks_capacity

    @property
    def cache(self) -> KVCacheBuffers:
        """The cache of every layer's keys and values, committed in lockstep
        by tokens."""
        return self._lockstep.cache

    @property
    def buffers(self) -> KVCacheBuffers:
        """:attr:`cache` by its name before 0.2."""
        return self.cache

    @property
    def physical_bytes(self) -> int:
        """Physical memory held, in bytes (whole granules)."""
        return self.cache.physical_bytes

    def reset(self) -> None:
        """Forget every token and give their memory back; addresses stay.
        During a preserving sleep the host copy goes too: nothing old comes
        back at the wake."""
        self._lockstep.check_alive()
        super().reset()
        self._lockstep.set_tokens(0)
        self._lockstep.prepared = 0
        self._lockstep.release()

    def release_physical(self, preserve: bool = False) -> None:
        """Sleep between turns: give every byte back, keeping addresses
        (memory the driver stacks keep idle for reuse goes back too).

        With ``preserve`` the tokens are copied to host memory first and
        :meth:`recommit` restores them (an update before it wakes the cache
        too). Without, their contents go with the memory, so the cache
        forgets its tokens: the next ``generate`` (or :meth:`recommit`)
        wakes it empty and prefills the conversation again.
        """
        if preserve:
            self.cache.release_physical(preserve=True)
            return
        self.reset()
        self.cache.release_physical()

    def recommit(self) -> None:
        """Wake after :meth:`release_physical`: the tokens a preserving
        sleep kept, or none after a discarding one; awake, nothing."""
        self._lockstep.wake()

    def free(self) -> None:
        """Return the memory now and the address ranges once no view is
        left; every later call that would touch the memory raises."""
        self._lockstep.freed = True
        self.cache.free()
