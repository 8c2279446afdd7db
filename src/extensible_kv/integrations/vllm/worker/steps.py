"""What a vLLM step says about KV blocks, read from vLLM's own objects: the
block ids a scheduled step is about to use, and whether a runner's request
ended with its last token. Plain reads of vLLM's fields; no import of vLLM."""

from __future__ import annotations

from typing import Any

__all__ = ["ended", "scheduled_block_ids"]


def ended(state: Any, max_model_len: int) -> bool:
    """Whether a runner's request ended with its last token, by vLLM's own
    rules for the tokens it has (``SamplingParams``)."""
    params, output = state.sampling_params, state.output_token_ids
    if params is None or not output:
        return False
    if params.max_tokens is not None and len(output) >= params.max_tokens:
        return True
    if len(state.prompt_token_ids or ()) + len(output) >= max_model_len:
        return True
    return len(output) >= params.min_tokens and output[-1] in params.all_stop_token_ids


def scheduled_block_ids(scheduler_output: Any) -> list[int]:
    """Every block id a vLLM step is about to use: new requests' blocks,
    running requests' new blocks, and the blocks it zeroes or copies into."""
    ids: list[int] = []
    for request in scheduler_output.scheduled_new_reqs:
        for group in request.block_ids:
            ids.extend(group)
    for blocks in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for group in blocks or ():
            ids.extend(group)
    ids.extend(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        ids.extend((copy.src_block_id, copy.dst_block_id))
    return ids
