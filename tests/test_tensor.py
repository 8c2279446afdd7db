"""ExtensibleTensor: every public call, with vLLM's names and error wording."""

from __future__ import annotations

import gc

import pytest
import torch

import extensible_kv
from extensible_kv import ExtensibleTensor, StatisticsDriver


def make(
    stats: StatisticsDriver, device: str, max_num_bytes: int, **kwargs: object
) -> ExtensibleTensor:
    return ExtensibleTensor(max_num_bytes, device, driver=stats, **kwargs)  # type: ignore[arg-type]


def test_construction_reports_sizes(stats: StatisticsDriver, device: str, granularity: int) -> None:
    et = make(stats, device, 3 * granularity + 6, num_segments=3)
    assert et.max_num_bytes == 3 * granularity + 6
    assert et.num_segments == 3
    assert et.segment_capacity_bytes == granularity + 2
    assert et.capacity_bytes == 4 * granularity
    assert et.num_bytes == et.bytes_per_segment == et.physical_bytes == 0
    assert et.device.type == device
    assert et.base_ptr == et.buffer.base_ptr != 0
    assert "ExtensibleTensor(" in repr(et)
    et.free()


def test_resize_grows_in_place_and_keeps_bytes(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    et = make(stats, device, 4 * granularity)
    base = et.base_ptr
    view = et.resize_(100)
    assert view.shape == (100,)
    assert view.data_ptr() == base
    view.copy_(torch.arange(100, dtype=torch.uint8))
    grown = et.resize_(3 * granularity + 1)
    assert et.base_ptr == base
    assert grown[:100].cpu().tolist() == list(range(100))
    grown[-1] = 7
    assert et.num_bytes == 3 * granularity + 1
    assert et.physical_bytes == 4 * granularity
    et.free()


def test_append_grows_by_the_amount(stats: StatisticsDriver, device: str) -> None:
    et = make(stats, device, 1000)
    et.append(10)
    view = et.append(15)
    assert view.shape == (25,)
    assert et.num_bytes == 25
    et.free()


def test_tensor_and_full_view(stats: StatisticsDriver, device: str, granularity: int) -> None:
    et = make(stats, device, 2 * granularity)
    et.resize_(10)
    assert et.tensor.shape == (10,)
    full = et.full_view()
    assert full.shape == (2 * granularity,)
    assert full.data_ptr() == et.base_ptr
    assert torch.from_dlpack(et).data_ptr() == et.base_ptr
    assert et.__dlpack_device__()[1] == (et.device.index or 0)
    et.free()


def test_segments_grow_in_lockstep(stats: StatisticsDriver, device: str, granularity: int) -> None:
    cap = granularity + granularity // 2
    et = make(stats, device, 2 * cap, num_segments=2)
    et.resize_per_segment_(100)
    full = et.full_view()
    full[:100] = 1
    full[cap : cap + 100] = 2
    et.resize_per_segment_(cap)
    assert et.bytes_per_segment == cap
    assert et.num_bytes == 2 * cap
    assert full[:100].eq(1).all()
    assert full[cap : cap + 100].eq(2).all()
    full[cap - 1] = 3
    full[2 * cap - 1] = 4
    et.free()


def test_a_granule_shared_by_two_segments_is_mapped_once(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cap = granularity + granularity // 2
    et = make(stats, device, 2 * cap, num_segments=2)
    et.resize_per_segment_(cap)
    # Segment 0 ends and segment 1 starts inside granule 1: three granules in all.
    assert et.physical_bytes == 3 * granularity
    assert stats.live.mapped_bytes == 3 * granularity
    et.free()


def test_zero_new_zeroes_bytes_left_in_already_mapped_granules(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    et = make(stats, device, 2 * granularity)
    et.resize_(10)
    full = et.full_view()
    full[10:20] = 9  # past the committed prefix, inside a mapped granule
    et.resize_per_segment_(30, zero_new=True)
    assert full[10:30].cpu().tolist() == [0] * 20
    full[30:40] = 9
    et.resize_per_segment_(40)
    assert full[30:40].eq(9).all(), "without zero_new old bytes stay"
    et.free()


def test_new_granules_read_zero_with_zero_new(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    et = make(stats, device, 4 * granularity)
    et.resize_per_segment_(4 * granularity, zero_new=True)
    assert int(et.tensor.count_nonzero()) == 0
    et.free()


def test_shrink_returns_whole_chunks_past_the_end(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    et = make(stats, device, 6 * granularity, chunk_bytes=granularity)
    et.resize_(6 * granularity)
    et.tensor[:5] = 3
    released = et.shrink_per_segment_(granularity + 1)
    assert released == 4 * granularity
    assert et.num_bytes == granularity + 1
    assert et.physical_bytes == 2 * granularity
    assert et.tensor[:5].eq(3).all()
    et.free()


def test_shrink_maps_a_straddling_chunk_smaller_keeping_its_bytes(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    et = make(stats, device, 4 * granularity)
    base = et.base_ptr
    view = et.resize_(4 * granularity)
    pattern = torch.arange(granularity + 5, dtype=torch.int64).remainder(253).to(torch.uint8)
    view[: granularity + 5] = pattern.to(view.device)
    assert len(et.buffer.chunks) == 1
    assert et.shrink_per_segment_(granularity + 5) == 2 * granularity
    assert et.physical_bytes == 2 * granularity, "the minimum the granularity allows"
    assert [(c.offset, c.size) for c in et.buffer.chunks] == [(0, 2 * granularity)]
    assert et.base_ptr == base
    assert torch.equal(view[: granularity + 5].cpu(), pattern)
    assert et.shrink_per_segment_(0) == 2 * granularity
    assert et.physical_bytes == 0
    et.free()


def test_preserving_defragment_keeps_every_byte(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cap = 4 * granularity + granularity // 2
    et = make(stats, device, 2 * cap, num_segments=2, chunk_bytes=granularity)
    full = et.full_view()
    for size in (10, granularity + 10, 3 * granularity):
        et.resize_per_segment_(size)
    pattern = torch.arange(3 * granularity, dtype=torch.int64).remainder(251).to(torch.uint8)
    full[: 3 * granularity] = pattern.to(full.device)
    full[cap : cap + 3 * granularity] = pattern.flip(0).to(full.device)
    assert len(et.buffer.chunks) > 2
    et.defragment_(preserve=True)
    assert len(et.buffer.chunks) == 2
    assert torch.equal(full[: 3 * granularity].cpu(), pattern)
    assert torch.equal(full[cap : cap + 3 * granularity].cpu(), pattern.flip(0))
    et.free()


def test_release_and_regrow(stats: StatisticsDriver, device: str, granularity: int) -> None:
    et = make(stats, device, 2 * granularity, num_segments=2)
    base = et.base_ptr
    full = et.full_view()
    et.resize_per_segment_(granularity)
    et.release_physical()
    assert et.num_bytes == 0
    assert et.physical_bytes == 0
    assert stats.live.handles == 0
    et.resize_per_segment_(granularity, zero_new=True)
    assert et.base_ptr == base
    assert full.eq(0).all()
    et.free()


def test_free_returns_everything_and_is_idempotent(stats: StatisticsDriver, device: str) -> None:
    et = make(stats, device, 100)
    et.resize_(50)
    et.free()
    et.free()
    assert et.base_ptr == 0
    assert et.num_bytes == 0
    assert stats.live.reservations == 0


def test_views_outlive_free(stats: StatisticsDriver, device: str) -> None:
    et = make(stats, device, 100)
    view = et.resize_(50)
    et.free()
    assert stats.live.handles == 0
    assert stats.live.reservations == 1
    del view
    gc.collect()
    assert stats.live.reservations == 0


def test_device_forms(real_device: str) -> None:
    device = real_device
    forms: list[object] = [device, torch.device(device)]
    if device == "cuda":
        forms += [0, "cuda:0"]
    for form in forms:
        et = ExtensibleTensor(64, form)  # type: ignore[arg-type]
        assert et.device.type == device
        et.free()


def test_default_device_is_the_accelerator_or_the_host() -> None:
    et = ExtensibleTensor(64)
    assert et.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    et.free()


def test_vllm_names_are_importable() -> None:
    for name in ("ExtensibleTensor", "uint8_tensor_from_ptr", "vmm_unavailable_reason"):
        assert hasattr(extensible_kv, name)


def test_defragment_maps_each_segment_prefix_as_one_chunk(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cap = 4 * granularity + granularity // 2
    et = make(stats, device, 2 * cap, num_segments=2, chunk_bytes=granularity)
    for size in (10, granularity + 10, 3 * granularity):
        et.resize_per_segment_(size)
    et.full_view()[:10] = 4
    assert len(et.buffer.chunks) > 2
    base = et.base_ptr
    et.defragment_()
    assert len(et.buffer.chunks) == 2
    assert et.bytes_per_segment == 3 * granularity
    assert et.base_ptr == base
    assert int(et.full_view()[: 3 * granularity].count_nonzero()) == 0
    et.free()


def test_segment_views_and_the_checked_view(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cap = 2 * granularity
    et = make(stats, device, 2 * cap, num_segments=2)
    et.resize_per_segment_(100, zero_new=True)
    k, v = et.segment(0), et.segment(1)
    assert k.shape == v.shape == (100,)
    assert v.data_ptr() == et.base_ptr + cap
    v.fill_(7)
    assert et.checked_view(cap, 100).eq(7).all()
    assert et.checked_view(0, 100).eq(0).all()
    for offset, nbytes in ((0, 101), (cap - 1, 2), (100, 1), (-1, 1), (cap + 99, 2)):
        with pytest.raises(ValueError, match="are not all committed"):
            et.checked_view(offset, nbytes)
    with pytest.raises(ValueError, match="segment 2 does not exist"):
        et.segment(2)
    et.free()
