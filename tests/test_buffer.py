"""VirtualBuffer: granule commits, chunks, release, views and lifetime."""

from __future__ import annotations

import gc

import pytest

from child import run_python
from extensible_kv import StatisticsDriver, VirtualBuffer
from extensible_kv.dlpack import as_tensor


def test_reservation_is_rounded_up_and_never_moves(
    stats: StatisticsDriver, granularity: int
) -> None:
    buffer = VirtualBuffer(3 * granularity + 1, stats)
    assert buffer.size == 4 * granularity
    base = buffer.base_ptr
    buffer.commit([(0, buffer.size)])
    buffer.release_physical()
    buffer.commit([(granularity, 1)])
    assert buffer.base_ptr == base
    buffer.free()


def test_zero_size_reserves_one_granule(stats: StatisticsDriver, granularity: int) -> None:
    buffer = VirtualBuffer(0, stats)
    assert buffer.size == granularity
    buffer.free()


def test_commit_widens_to_granules_and_skips_mapped_ones(
    stats: StatisticsDriver, granularity: int
) -> None:
    g = granularity
    buffer = VirtualBuffer(8 * g, stats)
    assert buffer.commit([(g + 5, 10)]) == [(g, g)]
    assert buffer.commit([(g, g)]) == []
    assert buffer.commit([(0, 3 * g)]) == [(0, g), (2 * g, g)]
    assert buffer.mapped_runs == [(0, 3 * g)]
    assert buffer.physical_bytes == 3 * g
    assert [(c.offset, c.size) for c in buffer.chunks] == [(0, g), (g, g), (2 * g, g)]
    assert buffer.mapped_in(g // 2, 4 * g) == [(g // 2, 3 * g - g // 2)]
    buffer.free()


def test_ranges_sharing_a_granule_map_it_once(stats: StatisticsDriver, granularity: int) -> None:
    g = granularity
    buffer = VirtualBuffer(4 * g, stats)
    new = buffer.commit([(0, g + 10), (g + 20, 10)])
    assert new == [(0, 2 * g)]
    assert stats.calls["create"].calls == 1
    assert stats.calls["set_access"].calls == 1
    buffer.free()


def test_chunk_bytes_splits_runs_but_grants_access_once(
    stats: StatisticsDriver, granularity: int
) -> None:
    g = granularity
    buffer = VirtualBuffer(8 * g, stats, chunk_bytes=2 * g)
    buffer.commit([(0, 5 * g)])
    assert [(c.offset, c.size) for c in buffer.chunks] == [(0, 2 * g), (2 * g, 2 * g), (4 * g, g)]
    assert stats.calls["map"].calls == 3
    assert stats.calls["set_access"].calls == 1
    buffer.free()


def test_release_outside_keeps_chunks_holding_kept_bytes(
    stats: StatisticsDriver, granularity: int
) -> None:
    g = granularity
    buffer = VirtualBuffer(8 * g, stats, chunk_bytes=2 * g)
    buffer.commit([(0, 8 * g)])
    released = buffer.release_outside([(0, 2 * g + 1)])
    assert released == 4 * g
    assert [(c.offset, c.size) for c in buffer.chunks] == [(0, 2 * g), (2 * g, 2 * g)]
    assert buffer.physical_bytes == 4 * g
    buffer.free()


def test_release_physical_keeps_the_range_and_returns_every_handle(
    stats: StatisticsDriver, granularity: int
) -> None:
    buffer = VirtualBuffer(4 * granularity, stats)
    buffer.commit([(0, 3 * granularity)])
    assert buffer.release_physical() == 3 * granularity
    assert buffer.physical_bytes == 0
    assert stats.live.handles == 0
    assert stats.live.reservations == 1
    assert stats.calls["synchronize"].calls == 1
    buffer.free()


def test_free_is_idempotent_and_final(stats: StatisticsDriver, granularity: int) -> None:
    buffer = VirtualBuffer(granularity, stats)
    buffer.commit([(0, 1)])
    buffer.free()
    buffer.free()
    assert buffer.freed
    assert not buffer.reserved
    assert buffer.release_physical() == 0
    with pytest.raises(ValueError, match="has been freed"):
        buffer.commit([(0, 1)])
    with pytest.raises(ValueError, match="has been freed"):
        buffer.add_view_ref()


def test_views_keep_the_range_reserved_after_free(
    stats: StatisticsDriver, granularity: int
) -> None:
    buffer = VirtualBuffer(2 * granularity, stats)
    buffer.commit([(0, granularity)])
    view = as_tensor(buffer, 0, granularity)
    view[:4] = 9
    assert buffer.live_views == 1
    buffer.free()
    assert stats.live.handles == 0
    assert stats.live.reservations == 1
    assert buffer.reserved
    del view
    gc.collect()
    assert buffer.live_views == 0
    assert not buffer.reserved
    assert stats.live.reservations == 0


def test_a_dropped_buffer_returns_everything(stats: StatisticsDriver, granularity: int) -> None:
    buffer = VirtualBuffer(2 * granularity, stats)
    buffer.commit([(0, 2 * granularity)])
    del buffer
    gc.collect()
    assert stats.live.handles == 0
    assert stats.live.reservations == 0


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(-1, 4)], "must not be negative"),
        ([(0, -4)], "must not be negative"),
        ([(0, 1 << 40)], "outside the"),
        ([(0.5, 1)], "offset must be an int"),
        ([(0, True)], "size must be an int"),
    ],
)
def test_bad_ranges_change_nothing(
    stats: StatisticsDriver, granularity: int, ranges: list[tuple[int, int]], message: str
) -> None:
    buffer = VirtualBuffer(2 * granularity, stats)
    buffer.commit([(0, 1)])
    with pytest.raises((ValueError, TypeError), match=message):
        buffer.commit([(granularity, 1), *ranges])
    assert buffer.mapped_runs == [(0, granularity)]
    buffer.free()


def test_bad_construction_is_refused(stats: StatisticsDriver, granularity: int) -> None:
    for size in (-1, 1 << 64, -(1 << 64)):
        with pytest.raises(ValueError, match="size must be between 0 and"):
            VirtualBuffer(size, stats)
    assert stats.live.reservations == 0
    with pytest.raises(ValueError, match="positive multiple of the granularity"):
        VirtualBuffer(granularity, stats, chunk_bytes=granularity + 1)
    with pytest.raises(TypeError, match="size must be an int"):
        VirtualBuffer(1.0, stats)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["release_physical", "free", "release_outside"])
def test_memory_goes_back_when_the_address_space_is_exhausted(how: str) -> None:
    """Under RLIMIT_AS, unmapping cannot park the pages it keeps for a
    rollback; a discarding release must still give the memory back."""
    child = run_python(
        f"""
        import resource
        from extensible_kv import VirtualBuffer
        from extensible_kv.driver import HostDriver
        G = 2 << 20
        buffer = VirtualBuffer(32 * G, HostDriver(), chunk_bytes=4 * G)
        buffer.commit([(0, 32 * G)])
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                  if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + G, resource.RLIM_INFINITY))
        if {how!r} == "release_outside":
            buffer.release_outside([(0, G)])
            assert buffer.physical_bytes == 4 * G, buffer
        else:
            getattr(buffer, {how!r})()
            assert buffer.physical_bytes == 0, buffer
        print("given back")
        """
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "given back"
