"""Sizing after warm-up: what warm-up used, and the final block count."""

from __future__ import annotations

import pytest

from extensible_kv.kv import MemorySnapshot, size_kv_cache

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
    )
    assert sizing.warmup_bytes == 2 * GiB
    # Free after warm-up, plus the KV already held, minus the 150 MiB margin.
    assert sizing.available_bytes == 7 * GiB + 1 * GiB + 2 * MiB - 150 * MiB
    assert sizing.num_blocks == sizing.available_bytes // MiB
    assert "warm-up used 2048.0 MiB" in sizing.describe()


def test_capacity_caps_and_one_block_is_the_floor() -> None:
    snap = MemorySnapshot(free_bytes=GiB, total_bytes=GiB)
    assert (
        size_kv_cache(
            snap,
            snap,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=MiB,
            num_blocks_capacity=10,
        ).num_blocks
        == 10
    )
    tiny = MemorySnapshot(free_bytes=MiB, total_bytes=GiB)
    assert (
        size_kv_cache(
            tiny,
            tiny,
            kv_bytes_before=0,
            kv_bytes_after=0,
            bytes_per_block=MiB,
            num_blocks_capacity=10,
        ).num_blocks
        == 1
    )


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
    )
    assert not free.capped
    assert "capped" not in free.describe()
