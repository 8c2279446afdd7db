"""Creating memory ahead, off the caller's thread: the handles a growth or
a wake will create, made into the pools of their drivers' stacks
(:meth:`~extensible_kv.driver.Driver.create_ahead`) while the caller does
something else (an engine reloading its weights)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from extensible_kv.driver.protocol import Driver

#: What a handle made ahead must match: (size in bytes, device, shareable).
Kind = tuple[int, int, bool]


def in_background(work: Callable[..., int], *args: Any) -> Future[int]:
    """``work(*args)`` on a thread of its own; the future gives its result."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extensible-kv-ahead")
    future = executor.submit(work, *args)
    executor.shutdown(wait=False)
    return future


def create_ahead_in_background(handles: Iterable[tuple[Driver, Kind]]) -> Future[int]:
    """Create handles ahead, one ``(driver, (size, device, shareable))`` per
    handle, on a thread of its own; the future gives the bytes kept. Checks
    first, on the caller's thread, that each driver's stack keeps handles
    (a ValueError saying so). Each pool stops at its cap; a failing create
    ends the work with that error, the handles made before it staying idle."""
    wanted = Counter(handles)
    for driver, kind in wanted:
        driver.create_ahead(kind[0], 0, *kind[1:])

    def create_all() -> int:
        return sum(
            driver.create_ahead(size, count, device, shareable) * size
            for (driver, (size, device, shareable)), count in wanted.items()
        )

    return in_background(create_all)
