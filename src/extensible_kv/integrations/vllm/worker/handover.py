"""How the KV cache vLLM allocates becomes our reservation: a torch function
mode over vLLM's allocation context, answering its one ``torch.zeros``."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HandOver"]


class HandOver(TorchFunctionMode):
    """The context vLLM allocates its KV cache in, returning our reservation.

    vLLM hands the worker's ``kv_cache_allocation_context`` to its
    ``allocate_kv_cache`` so that a worker can place the cache in its own
    memory (it is how vLLM's CuMem sleep pool gets it). Inside, that
    function makes the backing buffer with one ``torch.zeros(size,
    dtype=torch.int8)``; this torch function mode answers exactly that call
    with our reservation (already committed and zeroed for vLLM's block
    count) and lets every other call through.
    """

    def __init__(self, backing: torch.Tensor) -> None:
        super().__init__()
        self.backing = backing
        self.used = False

    def _is_backing(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a ``torch.zeros`` call asks for our buffer's bytes as int8."""
        size = args if len(args) != 1 else args[0]
        if isinstance(size, (tuple, list, torch.Size)) and len(size) == 1:
            size = size[0]
        return not self.used and kwargs.get("dtype") is torch.int8 and size == self.backing.numel()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self._is_backing(args, kwargs):
            self.used = True
            return self.backing
        return func(*args, **kwargs)
