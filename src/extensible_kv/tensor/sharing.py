"""A tensor's memory shared with another process: the layout an exporter
makes of it, the device an importer finds it on, and the committed size an
importer takes only once its chunks back it. The wire format is
:mod:`extensible_kv.share`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from extensible_kv._checks import check_int
from extensible_kv.devices import get_driver, resolve_device
from extensible_kv.driver import Driver, device_with_uuid
from extensible_kv.tensor.shared_layout import SharedLayout

if TYPE_CHECKING:
    from extensible_kv.tensor.core import ExtensibleTensor

__all__ = ["committed_in", "exported_layout", "importing_device"]


def importing_device(
    layout: SharedLayout, device: torch.device | str | int | None, driver: Driver | None
) -> tuple[torch.device, Driver]:
    """The device of this process holding the memory ``layout`` describes,
    and its driver: found by UUID, or ``device`` after checking it is that one."""
    if device is None:
        ordinal = device_with_uuid(driver or get_driver(layout.device), layout.device_uuid)
        device = f"cuda:{ordinal}" if layout.device == "cuda" else layout.device
    here, driver = resolve_device(device, driver)
    found = driver.device_uuid(here.index or 0)
    if found != layout.device_uuid:
        raise ValueError(
            f"the shared memory lives on device {layout.device_uuid} "
            f"({layout.device}:{layout.device_index} in the exporting process), but {here} "
            f"here is {found}; pass device=None to find it"
        )
    return here, driver


def committed_in(tensor: ExtensibleTensor, bytes_per_segment: object) -> int:
    """An imported layout's committed size (bytes per segment), after
    checking that the chunks mapped into ``tensor`` back every byte of it (a
    peer's word is not enough)."""
    size = check_int("bytes_per_segment", bytes_per_segment)
    if not 0 <= size <= tensor.segment_capacity_bytes:
        raise ValueError(
            f"the shared layout's bytes_per_segment {size} is not between 0 "
            f"and the segment capacity {tensor.segment_capacity_bytes}"
        )
    for offset, length in tensor._segment_ranges(0, size):
        backed = sum(n for _, n in tensor.buffer.mapped_in(offset, length))
        if backed != length:
            raise ValueError(
                f"the shared layout says {size} bytes per segment are committed, "
                f"but its chunks back {backed} of the {length} at offset {offset}"
            )
    return size


def exported_layout(tensor: ExtensibleTensor) -> tuple[SharedLayout, list[int]]:
    """``tensor``'s layout and one new fd per chunk (the caller closes them),
    after every stream's work on the device; the caller holds its lock."""
    buffer = tensor.buffer
    buffer.synchronize()
    exported = buffer.export_chunks()
    layout = SharedLayout(
        max_num_bytes=tensor.max_num_bytes,
        num_segments=tensor.num_segments,
        bytes_per_segment=tensor.bytes_per_segment,
        chunks=tuple((chunk.offset, chunk.size) for chunk, _ in exported),
        device=tensor.device.type,
        device_index=buffer.device,
        device_uuid=buffer.driver.device_uuid(buffer.device),
    )
    return layout, [fd for _, fd in exported]
