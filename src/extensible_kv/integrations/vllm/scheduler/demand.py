"""Free blocks an elastic engine's requests need, counted from vLLM's
``Request`` objects: soon (the next step or two), or to finish.

The plan asks for what the requests need soon while the budget grants it,
so memory follows the load. Once the budget refused it, it asks for what
they need to finish, in one want: another process's idle engine then
gives way in one step instead of one step per unit as decode fills its
blocks (each such step costs the giver a step, and its worker a core for
a second on vLLM's CPU build).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["blocks_at_end", "blocks_soon", "blocks_to_finish"]


def blocks_soon(waiting: Iterable[Any], running: Iterable[Any], block_size: int) -> int:
    """Blocks the requests need soon: the rest of every waiting prompt, and
    what running requests need for two more tokens (beyond the tokens
    async scheduling has scheduled ahead of their output)."""
    need: int = sum(-(-(r.num_tokens + 2) // block_size) for r in waiting)
    for request in running:
        need += max(0, -(-_ahead(request) // block_size) - _held(request, block_size))
    return need


def blocks_to_finish(
    waiting: Iterable[Any], running: Iterable[Any], block_size: int, max_model_len: int
) -> int:
    """Blocks the requests need to finish: every request's prompt and its
    ``max_tokens`` of output (at most ``max_model_len`` tokens in all),
    less the blocks a running one holds; never less than
    :func:`blocks_soon`'s count for it."""
    need = sum(blocks_at_end(request, block_size, max_model_len) for request in waiting)
    for request in running:
        tokens = max(_final(request, max_model_len), _ahead(request))
        need += max(0, -(-tokens // block_size) - _held(request, block_size))
    return need


def blocks_at_end(request: Any, block_size: int, max_model_len: int) -> int:
    """Blocks a request holds when it finishes: its prompt and its
    ``max_tokens`` of output, at most ``max_model_len`` tokens (and never
    fewer than it holds two tokens from now)."""
    return -(-max(_final(request, max_model_len), int(request.num_tokens) + 2) // block_size)


def _final(request: Any, max_model_len: int) -> int:
    """Tokens a request holds when it finishes at its ``max_tokens``."""
    return int(min(request.num_prompt_tokens + request.max_tokens, max_model_len))


def _ahead(request: Any) -> int:
    """Tokens a running request holds after two more steps."""
    return int(request.num_tokens_with_spec + request.num_output_placeholders + 2)


def _held(request: Any, block_size: int) -> int:
    """Blocks a running request holds (its computed tokens')."""
    return int(-(-request.num_computed_tokens // block_size))
