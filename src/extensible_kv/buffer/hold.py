"""The budget a piece of work holds: one
:meth:`~extensible_kv.driver.Driver.holding` per driver stack and device
of the buffers it changes, for the bytes it will create there.

A commit holds what it plans (:func:`~extensible_kv.buffer.commit_together`);
work of several steps (a wake restoring buffer by buffer, a defragment that
releases before it creates) holds once around them all, and the commits
inside draw on that hold instead of claiming again."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extensible_kv.driver import Driver

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = ["holding"]


def holding(
    items: Sequence[tuple[VirtualBuffer, int, int]],
) -> contextlib.AbstractContextManager[object]:
    """Hold, for a ``with`` block on this thread, what the work on
    ``items`` needs: ``(buffer, bytes it creates beyond what it releases,
    bytes of credit)``, summed per driver stack and device; each adaptor in
    a stack decides for itself what to hold (a budget claims, a pool counts
    its idle handles, a backend holds nothing)."""
    totals: dict[tuple[int, int], tuple[Driver, int, int]] = {}
    for buffer, size, credit in items:
        key = (id(buffer.driver), buffer.device)
        _, claimed, credited = totals.get(key, (buffer.driver, 0, 0))
        totals[key] = (buffer.driver, claimed + size, credited + credit)
    if len(totals) == 1:  # a cache's buffers on one stack and device
        (((_, device), (driver, size, credit)),) = totals.items()
        return driver.holding(device, max(0, size), credit=credit)
    stack = contextlib.ExitStack()
    try:
        for (_, device), (driver, size, credit) in totals.items():
            stack.enter_context(driver.holding(device, max(0, size), credit=credit))
    except BaseException:
        stack.close()
        raise
    return stack
