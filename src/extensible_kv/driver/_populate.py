"""Making fresh anonymous memory present now, on several cores at once.

A commit on the host costs its page faults up front, like ``cuMemCreate``,
and runs out of memory there rather than at first touch.
``MADV_POPULATE_WRITE`` (Linux 5.14) faults a range in without writing it,
but one call runs on one core, and with 4 KiB pages most of its time is the
kernel's fault path and page zeroing, which scale with cores. So the range is
cut into pieces that threads populate side by side. On a 2-core VM, 512 MiB
took 0.16 s in one call and 0.08-0.10 s in 2-32 MiB pieces on two threads
(``torch.zeros``, whose zero fill runs on torch's threads, 0.11 s); pieces of
128 MiB or more on two threads gained little there, hence small pieces. The
smallest that gains, 2 MiB, also splits the few MiB that memory following
the load commits at a time: 8 MiB took 4.2 ms in 16 MiB pieces and 2.3 ms in
2 MiB ones, with no size slower (2026-12-04, medians of 9, in one process).
Older kernels get each piece's pages by writing zeros.

Shared memory (a memfd, see :mod:`extensible_kv.driver.host`) already has
its pages; what populating it makes present is the mapping's page tables,
and its contents must stay: there, an older kernel leaves the pages to
fault at first touch.
"""

from __future__ import annotations

import errno
import os
import threading

from extensible_kv.driver import _libc

#: Bytes one thread populates at a time.
PIECE_BYTES = 2 << 20


def populate(ptr: int, size: int, keep_contents: bool = False) -> None:
    """Make ``[ptr, ptr + size)`` present: every page faulted in (zeroed
    where fresh; ``keep_contents``: never written, the pages of shared
    memory whose contents matter).

    The range must be mapped readable and writable. The calling thread works
    on the pieces too, with a helper thread per further core; where no helper
    can start (a memory limit), it works alone. Raises the first
    :class:`OSError` (``ENOMEM`` where memory runs out) once every thread has
    stopped; pieces already populated stay so, and the caller unmaps the range.
    """
    end = ptr + size
    starts = iter(range(ptr, end, PIECE_BYTES))
    lock = threading.Lock()
    errors: list[OSError] = []

    def work() -> None:
        while not errors:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            try:
                _populate_piece(start, min(PIECE_BYTES, end - start), keep_contents)
            except OSError as exc:
                errors.append(exc)

    helpers: list[threading.Thread] = []
    for _ in range(min(-(-size // PIECE_BYTES), len(os.sched_getaffinity(0))) - 1):
        helper = threading.Thread(target=work, name="extensible-kv-populate", daemon=True)
        try:
            helper.start()
        except RuntimeError:
            break
        helpers.append(helper)
    work()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]


def _populate_piece(start: int, size: int, keep_contents: bool) -> None:
    try:
        _libc.madvise(start, size, _libc.MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if not keep_contents:
            _libc.memset_zero(start, size)
