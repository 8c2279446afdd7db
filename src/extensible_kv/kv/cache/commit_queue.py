"""Background commits of a KV cache
(:meth:`~extensible_kv.kv.KVCacheBuffers.commit_async`).

One worker thread per cache runs the queued commits in order, under the
cache's lock, so that the driver calls overlap the caller's compute
(vAttention's idea). On a GPU each commit runs on the cache's commit
stream, so the zeroing of its new blocks is ordered by the event its
:class:`~extensible_kv.kv.cache.commit_ticket.CommitTicket` carries.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import torch

from extensible_kv.kv.cache.commit_ticket import CommitTicket

__all__ = ["CommitQueue", "serialized"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Names of the worker threads start so; a commit running on one never
#: waits for the queue (it would wait for itself).
WORKER_PREFIX = "extensible-kv-commit"


class CommitQueue:
    """The background commits of one cache: its worker (made at the first
    :meth:`submit`), the future of the commit queued last, and, once a
    commit ran on a GPU, the commit stream. Owned by the cache; it holds
    nothing of the cache but ``lock``, the cache's lock, which every queued
    commit runs under (so that a cache nobody holds is freed at once).
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._executor: ThreadPoolExecutor | None = None
        self._queued: Future[CommitTicket] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._closing = False

    @property
    def stream_handle(self) -> int | None:
        """The driver handle of the commit stream (None until a commit ran on a GPU)."""
        return None if self._stream is None else int(self._stream.cuda_stream)

    def submit(
        self,
        num_blocks: int,
        commit: Callable[[int], None],
        device: Callable[[], torch.device],
        stream_made: Callable[[], None],
    ) -> Future[CommitTicket]:
        """Queue a commit of ``num_blocks`` blocks behind those queued so far;
        refused once :meth:`close` was called. Errors surface in the future.

        It runs under the lock: ``commit`` (the cache's, of a block count)
        on the commit stream when ``device`` (the cache's, asked as it runs)
        is a GPU, after ``stream_made`` once that stream exists (the cache
        makes its releases wait for it too).
        """
        with self._lock:
            if self._closing:
                raise ValueError("the KV cache has been freed; commit_async is no longer possible")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=WORKER_PREFIX)
            future = self._executor.submit(self._run, num_blocks, commit, device, stream_made)
            self._queued = future
        return future

    def _run(
        self,
        num_blocks: int,
        commit: Callable[[int], None],
        device: Callable[[], torch.device],
        stream_made: Callable[[], None],
    ) -> CommitTicket:
        with self._lock:
            where = device()
            if where.type != "cuda":
                commit(num_blocks)
                return CommitTicket(num_blocks, None, where)
            if self._stream is None:
                self._stream = torch.cuda.Stream(where)  # type: ignore[no-untyped-call]
                stream_made()
            with torch.cuda.stream(self._stream):
                commit(num_blocks)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            return CommitTicket(num_blocks, event, where)

    def wait(self) -> None:
        """Wait until the commits queued so far have run (their errors stay
        in their futures). The worker itself never waits."""
        queued = self._queued
        if queued is not None and not threading.current_thread().name.startswith(WORKER_PREFIX):
            queued.exception()

    def close(self) -> None:
        """Refuse every later :meth:`submit`; the caller holds the cache's lock."""
        self._closing = True

    def finish(self) -> None:
        """After :meth:`close`, wait for the commits queued before it and let
        the worker go. Call it without holding the cache's lock: the queued
        commits take it to run."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def serialized(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a cache's public method after the commits queued so far and
    under the cache's lock, which its queue (``_commits``) holds. Internal
    calls use the undecorated bodies, so nothing waits while holding the lock."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        cache: Any = args[0]  # a KV cache or its elastic blocks (both above this module)
        queue: CommitQueue = cache._commits
        queue.wait()
        with queue._lock:
            return method(*args, **kwargs)

    return wrapper
