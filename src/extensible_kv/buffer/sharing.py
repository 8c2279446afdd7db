"""A buffer's memory shared between processes: its chunks exported as file
descriptors, and chunks another process exported mapped into unmapped
granules here. The buffer package's own: these read a buffer's chunk
bookkeeping directly, as its methods do."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extensible_kv._checks import check_int
from extensible_kv.buffer.chunks import Chunk, runs_of_chunks

if TYPE_CHECKING:
    from extensible_kv.buffer.virtual import VirtualBuffer

__all__ = ["export_chunks", "map_imported"]


def export_chunks(buffer: VirtualBuffer) -> list[tuple[Chunk, int]]:
    """See :meth:`VirtualBuffer.export_chunks`."""
    with buffer._lock:
        buffer._check_usable()
        if not buffer.shareable:
            raise ValueError("only a buffer created with shareable=True can be exported")
        exported: list[tuple[Chunk, int]] = []
        try:
            with buffer._context():
                for chunk in buffer._chunks:
                    exported.append((chunk, buffer.driver.export_handle(chunk.handle)))
        except BaseException:
            for _, fd in exported:
                os.close(fd)
            raise
        return exported


def map_imported(
    buffer: VirtualBuffer, chunks: Sequence[tuple[int, int, int]], *, adopt: bool
) -> None:
    """See :meth:`VirtualBuffer.map_imported`."""
    with buffer._lock:
        buffer._check_usable()
        for offset, size, _ in chunks:
            _check_fits(buffer, offset, size)
        made: list[Chunk] = []
        driver = buffer.driver
        try:
            # HIP imports onto the current device: make it this buffer's.
            with buffer._context():
                for offset, size, fd in chunks:
                    handle = driver.import_handle(fd)
                    if adopt:
                        try:
                            driver.adopt_import(handle, buffer.device, size)
                        except BaseException:
                            driver.release(handle)
                            raise
                    made.append(buffer._map_new(offset, size, handle))
                for run in runs_of_chunks(sorted(made, key=lambda c: c.offset)):
                    start, end = run[0].offset, run[-1].end
                    driver.set_access(buffer.base_ptr + start, end - start, buffer.device)
        except BaseException:
            buffer._unmap_and_release(made)
            raise
        buffer._add(made)


def _check_fits(buffer: VirtualBuffer, offset: int, size: int) -> None:
    """Refuse an imported chunk that is not whole granules of unmapped room."""
    check_int("imported chunk offset", offset)
    check_int("imported chunk size", size)
    granularity = buffer.granularity
    if offset < 0 or offset % granularity or size % granularity or size <= 0:
        raise ValueError(
            f"imported chunk (offset={offset}, size={size}) is not made of whole "
            f"{granularity}-byte granules"
        )
    if offset + size > buffer.size or buffer.mapped_in(offset, size):
        raise ValueError(
            f"imported chunk [{offset}, {offset + size}) does not fit an unmapped "
            f"part of the {buffer.size}-byte reservation"
        )
