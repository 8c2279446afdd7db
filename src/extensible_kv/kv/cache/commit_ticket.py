"""What an asynchronous commit gives back: the count, and the event its
zeroing recorded (:meth:`~extensible_kv.kv.KVCacheBuffers.commit_async`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CommitTicket"]


@dataclass(frozen=True)
class CommitTicket:
    """The outcome of :meth:`~extensible_kv.kv.KVCacheBuffers.commit_async`.

    ``event`` (GPU only) is recorded after the zeroing of the new blocks, on
    the cache's commit stream on ``device``; :meth:`wait` makes a stream
    wait for it.
    """

    num_blocks: int
    event: torch.cuda.Event | None
    device: torch.device

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream of the cache's device,
        not of the current device) wait for the zeroing."""
        if self.event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self.event)
