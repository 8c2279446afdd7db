"""Sizing after warm-up: what warm-up used, and the final block count."""

from __future__ import annotations

import pytest

from extensible_kv.kv import KVCacheTooSmallError, KVSizing, MemorySnapshot, size_kv_cache

MiB = 1 << 20
GiB = 1 << 30


def test_warmup_use_excludes_the_kv_it_committed() -> None:
    before = MemorySnapshot(free_bytes=10 * GiB, total_bytes=16 * GiB)
    after = MemorySnapshot(free_bytes=7 * GiB, total_bytes=16 * GiB)
    sizing = size_kv_cache(
        before,
        after,
        kv_bytes_before=2 * MiB,
        kv_bytes_after=1 * GiB + 2 * MiB,
        bytes_per_block=MiB,
        num_blocks_capacity=100_000,
        memory_utilization=None,
    )
    assert sizing.warmup_bytes == 2 * GiB
    # Free after warm-up, plus the KV already held, minus the 150 MiB margin.
    assert sizing.available_bytes == 7 * GiB + 1 * GiB + 2 * MiB - 150 * MiB
    assert sizing.num_blocks == sizing.available_bytes // MiB
    assert "warm-up used 2048.0 MiB" in sizing.describe()


def test_capacity_caps_the_count() -> None:
    snap = MemorySnapshot(free_bytes=GiB, total_bytes=GiB)
    sizing = size_kv_cache(
        snap,
        snap,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB,
        num_blocks_capacity=10,
    )
    assert sizing.num_blocks == 10


@pytest.mark.parametrize(
    ("mode", "named"),
    [
        ({"memory_utilization": None}, "1.0 MiB was free after warm-up"),
        ({}, "memory_utilization 0.9 allows 921.6 MiB of 1024.0 MiB; 1023.0 MiB is held"),
        ({"kv_budget_bytes": MiB // 2}, "the KV budget of 0.5 MiB"),
    ],
    ids=["free", "share", "budget"],
)
def test_no_room_for_one_block_is_an_error_naming_the_numbers(
    mode: dict[str, object], named: str
) -> None:
    """Sizing never invents a cache: vLLM refuses to start rather than serve
    from a cache it has no memory for."""
    before = MemorySnapshot(free_bytes=3 * MiB, total_bytes=GiB)
    tiny = MemorySnapshot(free_bytes=MiB, total_bytes=GiB)
    with pytest.raises(KVCacheTooSmallError) as caught:
        size_kv_cache(
            before,
            tiny,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=MiB,
            num_blocks_capacity=10,
            **mode,  # type: ignore[arg-type]
        )
    message = str(caught.value)
    assert "no room for one KV block of 1048576 bytes" in message
    assert named in message
    assert "warm-up used 2.0 MiB" in message
    assert "the margin is 150.0 MiB" in message or "budget" in message


def test_the_default_is_vllms_share_of_the_total() -> None:
    """0.9 of the total, less what others hold: free memory is not the limit."""
    after = MemorySnapshot(free_bytes=60 * GiB, total_bytes=80 * GiB)
    sizing = size_kv_cache(
        after,
        after,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB,
        num_blocks_capacity=10**7,
        margin_bytes=0,
    )
    assert sizing.available_bytes == int(80 * GiB * 0.9) - 20 * GiB
    free = size_kv_cache(
        after,
        after,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB,
        num_blocks_capacity=10**7,
        margin_bytes=0,
        memory_utilization=None,
    )
    assert free.available_bytes == 60 * GiB


def test_a_cudagraph_estimate_is_the_least_warm_up_counts() -> None:
    before = MemorySnapshot(free_bytes=10 * GiB, total_bytes=16 * GiB)
    after = MemorySnapshot(free_bytes=9 * GiB, total_bytes=16 * GiB)

    def size(estimate: int = 0) -> KVSizing:
        return size_kv_cache(
            before,
            after,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=MiB,
            num_blocks_capacity=10**6,
            memory_utilization=None,
            margin_bytes=0,
            cudagraph_memory_bytes=estimate,
        )

    measured, smaller, larger = size(), size(GiB // 2), size(3 * GiB)
    assert measured.warmup_bytes == smaller.warmup_bytes == GiB
    assert measured.available_bytes == smaller.available_bytes == 9 * GiB
    assert larger.warmup_bytes == 3 * GiB
    # The 2 GiB of graphs warm-up did not show are still to come.
    assert larger.available_bytes == 7 * GiB


def test_an_explicit_budget_is_honoured_as_asked() -> None:
    snap = MemorySnapshot(free_bytes=MiB, total_bytes=GiB)
    sizing = size_kv_cache(
        snap,
        snap,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB,
        num_blocks_capacity=10_000,
        kv_budget_bytes=300 * MiB,
    )
    assert sizing.num_blocks == 300


def test_memory_utilization_limits_to_a_share_of_the_device() -> None:
    after = MemorySnapshot(free_bytes=60 * GiB, total_bytes=80 * GiB)
    sizing = size_kv_cache(
        after,
        after,
        kv_bytes_before=0,
        kv_bytes_after=4 * GiB,
        bytes_per_block=MiB,
        num_blocks_capacity=10**7,
        memory_utilization=0.5,
        margin_bytes=0,
    )
    # 40 GiB allowed; 16 GiB is used by others (20 in use, 4 of it KV).
    assert sizing.available_bytes == 24 * GiB
    with pytest.raises(ValueError, match="memory_utilization"):
        size_kv_cache(
            after,
            after,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=MiB,
            num_blocks_capacity=1,
            memory_utilization=1.5,
        )
    with pytest.raises(ValueError, match="bytes_per_block"):
        size_kv_cache(
            after,
            after,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=0,
            num_blocks_capacity=1,
        )


def test_snapshots_read_the_device(real_device: str) -> None:
    device = real_device
    snap = MemorySnapshot.take(device)
    assert 0 < snap.free_bytes <= snap.total_bytes


def test_the_description_gives_the_blocks_bytes_and_the_cap() -> None:
    snap = MemorySnapshot(free_bytes=GiB, total_bytes=GiB)
    capped = size_kv_cache(
        snap,
        snap,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB // 2,
        num_blocks_capacity=256,
        memory_utilization=None,
    )
    assert capped.capped
    text = capped.describe()
    assert "256 blocks of 524288 bytes (128.0 MiB)" in text
    assert "capped by the capacity of 256 blocks" in text
    free = size_kv_cache(
        snap,
        snap,
        kv_bytes_before=0,
        kv_bytes_after=0,
        bytes_per_block=MiB,
        num_blocks_capacity=100_000,
        memory_utilization=None,
    )
    assert not free.capped
    assert "capped" not in free.describe()
