"""Bad input: a clear error naming the rule broken, and nothing changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from extensible_kv import ExtensibleTensor, HostDriver, StatisticsDriver

Snapshot = tuple[Any, ...]


def snapshot(et: ExtensibleTensor, stats: StatisticsDriver) -> Snapshot:
    committed = b""
    if not et.buffer.freed:
        full = et.full_view()
        cap, n = et.segment_capacity_bytes, et.bytes_per_segment
        committed = b"".join(
            bytes(full[i * cap : i * cap + n].cpu().tolist()) for i in range(et.num_segments)
        )
    return (
        et.num_bytes,
        et.bytes_per_segment,
        et.physical_bytes,
        et.base_ptr,
        et.buffer.chunks,
        stats.live,
        committed,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_num_bytes": -1}, ValueError, "max_num_bytes must be between 0 and"),
        # Past 2**64 the size would wrap around size_t and reserve next to nothing.
        ({"max_num_bytes": 1 << 64}, ValueError, "max_num_bytes must be between 0 and"),
        ({"max_num_bytes": (1 << 48) + 2}, ValueError, r"\(2\*\*48\)"),
        ({"max_num_bytes": 10, "device": "cpu\n"}, ValueError, "cannot read device"),
        ({"max_num_bytes": 1.5}, TypeError, "max_num_bytes must be an int"),
        ({"max_num_bytes": 10, "num_segments": 0}, ValueError, "num_segments must be positive"),
        ({"max_num_bytes": 10, "num_segments": 3}, ValueError, "must be divisible by num_segments"),
        ({"max_num_bytes": 10, "num_segments": 2.0}, TypeError, "num_segments must be an int"),
        ({"max_num_bytes": 10, "device": "meta"}, ValueError, "'meta' is not supported"),
        ({"max_num_bytes": 10, "device": "cpu:1"}, ValueError, "one device"),
        ({"max_num_bytes": 10, "chunk_bytes": 12345}, ValueError, "chunk_bytes must be a positive"),
    ],
)
def test_bad_construction(
    stats: StatisticsDriver,
    device: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    kwargs = {"device": device, "driver": stats, **kwargs}
    with pytest.raises(error, match=message):
        ExtensibleTensor(**kwargs)
    assert stats.live.reservations == 0


def test_a_driver_for_another_device_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not a cuda device"):
        ExtensibleTensor(10, "cuda:0", driver=HostDriver())


def _multi(et: ExtensibleTensor) -> dict[str, Callable[[], object]]:
    cap = et.segment_capacity_bytes
    return {
        "negative resize": lambda: et.resize_per_segment_(-1),
        "shrinking resize": lambda: et.resize_per_segment_(et.bytes_per_segment - 1),
        "overflow": lambda: et.resize_per_segment_(cap + 1),
        "float bytes": lambda: et.resize_per_segment_(2.0),  # type: ignore[arg-type]
        "prefix resize": lambda: et.resize_(10),
        "prefix tensor": lambda: et.tensor,
        "prefix append": lambda: et.append(1),
        "growing shrink": lambda: et.shrink_per_segment_(et.bytes_per_segment + 1),
        "negative shrink": lambda: et.shrink_per_segment_(-1),
    }


MULTI_MESSAGES = {
    "negative resize": "must be non-negative",
    "shrinking resize": "grow-only",
    "overflow": "exceeds the segment capacity",
    "float bytes": "bytes_per_segment must be an int",
    "prefix resize": "use resize_per_segment_",
    "prefix tensor": "use full_view",
    "prefix append": "use resize_per_segment_",
    "growing shrink": "cannot grow",
    "negative shrink": "must be non-negative",
}


@pytest.mark.parametrize("case", sorted(MULTI_MESSAGES))
def test_bad_calls_on_a_two_segment_buffer(
    stats: StatisticsDriver, device: str, granularity: int, case: str
) -> None:
    et = ExtensibleTensor(3 * granularity, device, num_segments=2, driver=stats)
    et.resize_per_segment_(granularity)
    et.full_view()[:64] = torch.arange(64, dtype=torch.uint8)
    before = snapshot(et, stats)
    with pytest.raises((ValueError, TypeError), match=MULTI_MESSAGES[case]):
        _multi(et)[case]()
    assert snapshot(et, stats) == before
    et.free()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("append", "num_bytes to append must be non-negative"),
        ("resize", "exceeds the segment capacity"),
        ("shrink", "grow-only"),
    ],
)
def test_bad_calls_on_a_prefix_buffer(
    stats: StatisticsDriver, device: str, case: str, message: str
) -> None:
    et = ExtensibleTensor(100, device, driver=stats)
    et.resize_(50)
    before = snapshot(et, stats)
    call = {
        "append": lambda: et.append(-1),
        "resize": lambda: et.resize_(101),
        "shrink": lambda: et.resize_(10),
    }
    with pytest.raises(ValueError, match=message):
        call[case]()
    assert snapshot(et, stats) == before
    et.free()


@pytest.mark.parametrize(
    "call",
    [
        lambda et: et.resize_per_segment_(10),
        lambda et: et.resize_(10),
        lambda et: et.append(1),
        lambda et: et.shrink_per_segment_(0),
        lambda et: et.release_physical(),
        lambda et: et.full_view(),
        lambda et: et.tensor,
        lambda et: et.__dlpack__(),
    ],
    ids=[
        "resize_per_segment_",
        "resize_",
        "append",
        "shrink",
        "release",
        "full_view",
        "tensor",
        "dlpack",
    ],
)
def test_use_after_free(
    stats: StatisticsDriver, device: str, call: Callable[[ExtensibleTensor], object]
) -> None:
    et = ExtensibleTensor(100, device, driver=stats)
    et.resize_(50)
    et.free()
    before = snapshot(et, stats)
    with pytest.raises(ValueError, match="has been freed"):
        call(et)
    assert snapshot(et, stats) == before


def test_a_checked_view_past_the_end_is_refused(stats: StatisticsDriver) -> None:
    et = ExtensibleTensor(4 << 20, "cpu", num_segments=2, driver=stats)
    et.resize_per_segment_(1 << 20)
    before = snapshot(et, stats)
    for offset in (4 << 20, (4 << 20) + 1, 1 << 40, 1 << 63):
        with pytest.raises(ValueError, match="not all committed"):
            et.checked_view(offset, 0)
    assert et.checked_view(2 << 20, 0).numel() == 0  # the start of segment 1: committed
    assert snapshot(et, stats) == before
    et.free()


def test_buffers_joining_a_cache_must_be_extensible_tensors(stats: StatisticsDriver) -> None:
    from extensible_kv.kv import KVCacheBuffers

    et = ExtensibleTensor(1 << 20, "cpu", driver=stats)
    cache = KVCacheBuffers([(et, 1024)], 64)
    cache.commit(4)
    for items, message in (
        ([(torch.zeros(4), 1024)], "ExtensibleTensor"),
        ([("buffer", 1024)], "ExtensibleTensor"),
        ([et], "pairs"),
        ([(et,)], "pairs"),
    ):
        with pytest.raises(TypeError, match=message):
            cache.add_all(items)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=message):
            KVCacheBuffers(items, 64)  # type: ignore[arg-type]
    assert [b for b, _ in cache.buffers] == [et]
    assert cache.num_blocks_committed == 4
    cache.free()


@pytest.mark.parametrize("handle", [1.5, True, "7", -1, 2**64, None])
def test_stream_handles_are_checked_at_the_call(stats: StatisticsDriver, handle: Any) -> None:
    from extensible_kv.kv import KVCacheBuffers

    et = ExtensibleTensor(1 << 20, "cpu", driver=stats)
    cache = KVCacheBuffers([(et, 1024)], 64)
    cache.wait_for_streams([7])
    with pytest.raises((TypeError, ValueError), match="stream"):
        cache.wait_for_streams([handle])
    assert et.buffer.wait_streams == (7,)  # as before the refused call
    cache.wait_for_streams([0, 2**64 - 1])  # the legacy default stream, the largest handle
    cache.release_physical()
    cache.free()


def test_booleans_must_be_booleans(stats: StatisticsDriver) -> None:
    from extensible_kv.kv import ExtensibleKVCacheBuilder, KVCacheBuffers

    et = ExtensibleTensor(1 << 20, "cpu", driver=stats)
    cache = KVCacheBuffers([(et, 1024)], 64)
    cache.commit(4)
    et.full_view()[:1024].fill_(3)
    for call in (
        lambda: cache.extend(4, defragment="no"),  # type: ignore[arg-type]
        lambda: cache.commit(4, defragment=1),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="defragment must be a bool"):
            call()
    assert et.full_view()[:1024].eq(3).all()  # nothing was discarded
    with pytest.raises(TypeError, match="shareable must be a bool"):
        ExtensibleKVCacheBuilder(64, "cpu", shareable="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shareable must be a bool"):
        ExtensibleTensor(1 << 20, "cpu", shareable="no", driver=stats)  # type: ignore[arg-type]
    cache.free()
