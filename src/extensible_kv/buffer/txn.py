"""One all-or-nothing operation over several buffers, written once.

Every operation that changes several buffers (a cache's 40 layers commit,
sleep or remap together) does the same four things: it takes the buffers'
locks, in one global order so that two operations over overlapping sets
cannot deadlock; it makes each buffer's device current once, before the
first change, so that failing to do so changes nothing; it logs how to undo
each change, so that a failure before the work is done puts every buffer
back; and past its point of no return it finishes the clean-up whatever
fails, raising the first failure at the end. :class:`Transaction` is that,
after cuda.core's (``with Transaction() as t: ... t.append(undo) ...
t.commit()``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = ["Transaction", "contexts_of", "hold_locks"]

#: The innermost transaction open on each thread (``innermost``), which a
#: transaction opened inside it hands its late failures to.
_open = threading.local()


def contexts_of(buffers: Iterable[VirtualBuffer]) -> contextlib.ExitStack:
    """Enter the device context of every buffer (see ``VirtualBuffer._context``)."""
    stack = contextlib.ExitStack()
    with stack:
        for buffer in buffers:
            stack.enter_context(buffer._context())
        return stack.pop_all()


def hold_locks(buffers: Iterable[VirtualBuffer]) -> contextlib.AbstractContextManager[Any]:
    """Hold the locks of ``buffers``, taken in one global order, so that
    threads locking overlapping sets of buffers cannot deadlock. Reentrant."""
    unique = sorted(set(buffers), key=id)
    if len(unique) == 1:
        # The common case, on every single-buffer call: the lock itself.
        return unique[0]._lock
    return _Locks(unique)


class _Locks(contextlib.ExitStack):
    def __init__(self, buffers: list[VirtualBuffer]) -> None:
        super().__init__()
        self._buffers = buffers

    def __enter__(self) -> _Locks:
        super().__enter__()
        for buffer in self._buffers:
            self.enter_context(buffer._lock)
        return self


class Transaction:
    """An operation over ``buffers``, all or nothing until :meth:`commit`.

    ::

        with Transaction(buffers) as txn:      # their locks, in one order
            txn.enter_contexts(changed)        # devices current, before any change
            change(); txn.undo(unchange, ...)  # each change, with its undo
            txn.after(clean_up, ...)           # work for the point of no return
            txn.commit()                       # the point of no return
            txn.collect(clean_up, ...)         # failures kept, the rest goes on

    An error before :meth:`commit` runs the undo log, newest first, and
    propagates (an undo that fails propagates its own error instead, the
    log stopping there: the buffer it concerns keeps what it could not give
    back, for the next call to return). After :meth:`commit`, every
    :meth:`after` and :meth:`collect` runs, and the first failure collected
    (or :meth:`note`-d) is raised once the locks are released.

    Transactions nest: one opened while another is open on the same thread
    (a tensor's remap around its buffers' defragment) hands the failures it
    collected past its own point of no return to the enclosing one, which
    raises them once its own work is done. So an exception out of any
    operation means that operation changed nothing, and work past a point
    of no return is never left half done by a failure below it.
    """

    def __init__(self, buffers: Iterable[VirtualBuffer]) -> None:
        self._locks = hold_locks(buffers)
        self._contexts: contextlib.ExitStack | None = None
        self._undo: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._after: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._errors: list[Exception] = []
        self._outer: Transaction | None = None

    def __enter__(self) -> Transaction:
        self._locks.__enter__()
        self._outer = getattr(_open, "innermost", None)
        _open.innermost = self
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Not an ExitStack of its own: every commit passes here, and the
        # locks' own context managers cost less.
        _open.innermost = self._outer
        try:
            try:
                if error is not None:
                    self.rollback()
            finally:
                if self._contexts is not None:
                    self._contexts.close()
        finally:
            self._locks.__exit__(None, None, None)
        if error is None and self._errors:
            if self._outer is not None:
                self._outer._errors.extend(self._errors)
                return
            raise self._errors[0]

    def enter_contexts(self, buffers: Iterable[VirtualBuffer]) -> None:
        """Make the devices of ``buffers`` current until the end."""
        entered = contexts_of(buffers)
        if self._contexts is None:
            self._contexts = entered
        else:
            self._contexts.enter_context(entered)

    def undo(self, action: Callable[..., object], *args: Any) -> None:
        """Log ``action(*args)`` as the undo of the change just made."""
        self._undo.append((action, args))

    def rollback(self) -> None:
        """Undo every logged change now, newest first; the log empties."""
        while self._undo:
            action, args = self._undo.pop()
            action(*args)

    def after(self, action: Callable[..., object], *args: Any) -> None:
        """Run ``action(*args)`` at :meth:`commit`, its failure collected
        (see :meth:`collect`): clean-up that must wait until nothing can be
        undone, such as releasing the handles of unmapped chunks."""
        self._after.append((action, args))

    def commit(self) -> None:
        """The point of no return: the changes logged so far stay, and the
        work deferred with :meth:`after` runs, in order."""
        self._undo.clear()
        after, self._after = self._after, []
        for action, args in after:
            self.collect(action, *args)

    def note(self, error: Exception) -> None:
        """Keep ``error`` to raise at the end: the work goes on past it."""
        self._errors.append(error)

    def collect(self, action: Callable[..., object], *args: Any) -> bool:
        """Run ``action(*args)``; a failure is kept for the end (see
        :meth:`note`) instead of stopping the work. Whether it succeeded."""
        try:
            action(*args)
        except Exception as error:
            self.note(error)
            return False
        return True
