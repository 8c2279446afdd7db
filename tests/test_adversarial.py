"""What an adversarial pass over the public API found: sizes that wrap,
operations that left a cache half done, use after free, peers and callers
that lie. Each test states the rule the library now keeps."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import struct

import pytest
import torch

from child import run_python
from extensible_kv import (
    ExtensibleTensor,
    FaultInjectingDriver,
    OutOfMemoryError,
    StatisticsDriver,
    uint8_tensor_from_ptr,
)
from extensible_kv.dlpack import _LIVE, ByteView, as_tensor
from extensible_kv.driver import Driver, LiveUsage
from extensible_kv.kv import (
    AttentionSpec,
    KVCacheBuffers,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    KVSplitBackend,
    allocate_kv_cache,
)
from extensible_kv.share import MalformedMessageError, receive_tensor
from extensible_kv.tensor import SharedLayout

SPEC = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


def cache_of(device: str, driver: Driver, per_block: int, blocks: int = 64) -> KVCacheBuffers:
    buffers = [
        (
            ExtensibleTensor(blocks * per_block * 2, device, num_segments=2, driver=driver),
            per_block,
        ),
        (ExtensibleTensor(blocks * per_block, device, driver=driver), per_block),
    ]
    return KVCacheBuffers(buffers, blocks)


def consistent(cache: KVCacheBuffers) -> None:
    """Every buffer holds the committed count, and every committed byte is backed."""
    for buffer, per_block in cache.buffers:
        assert buffer.bytes_per_segment == cache.num_blocks_committed * per_block
        for segment in range(buffer.num_segments):
            start = segment * buffer.segment_capacity_bytes
            size = buffer.bytes_per_segment
            assert sum(n for _, n in buffer.buffer.mapped_in(start, size)) == size


# -- high: corruption or a stuck cache ----------------------------------------


def test_a_trim_that_runs_out_of_memory_changes_nothing(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    """The driver may not create a byte more than the cache holds: the trim
    cannot stage its smaller chunks, and every buffer stays at 7 blocks."""
    faulty = FaultInjectingDriver(stats)
    cache = cache_of(device, faulty, granularity // 2 + 4096)
    cache.commit(7)
    for region in cache._regions(7):
        region.fill_(3)
    faulty.byte_limit = stats.live.handle_bytes
    with pytest.raises(OutOfMemoryError):
        cache.trim(3)
    assert cache.num_blocks_committed == 7
    consistent(cache)
    assert all(region.eq(3).all() for region in cache._regions(7))
    faulty.clear()
    cache.trim(5)
    assert cache.num_blocks_committed == 5
    consistent(cache)
    cache.free()


@pytest.mark.parametrize("call", ["release", "unmap", "create"])
def test_a_defragmenting_commit_that_fails_leaves_a_consistent_cache(
    stats: StatisticsDriver, device: str, granularity: int, call: str
) -> None:
    faulty = FaultInjectingDriver(stats)
    cache = cache_of(device, faulty, granularity // 4)
    cache.commit(7)
    faulty.fail_at(call)
    with pytest.raises(Exception, match="injected"):
        cache.commit(12, defragment=True)
    consistent(cache)
    cache.commit(12, defragment=True)
    consistent(cache)
    cache.free()
    assert stats.live == LiveUsage()


def test_a_freed_cache_refuses_every_operation(stats: StatisticsDriver, device: str) -> None:
    cache = cache_of(device, stats, 4096)
    cache.commit(2)
    cache.free()
    for call in (
        lambda: cache.commit(3),
        lambda: cache.ensure_blocks(3),
        lambda: cache.commit_async(3),
        lambda: cache.trim(0),
        lambda: cache.defragment(),
        lambda: cache.release_physical(),
        lambda: cache.recommit(),
        lambda: cache.add(ExtensibleTensor(64 * 4096, device, driver=stats), 4096),
    ):
        with pytest.raises(ValueError, match="freed"):
            call()
    assert cache.num_blocks_committed == 0
    cache.free()
    gc.collect()


def test_a_buffer_joins_a_cache_once(stats: StatisticsDriver, device: str) -> None:
    buffer = ExtensibleTensor(64 * 4096, device, driver=stats)
    with pytest.raises(ValueError, match="already in this KV cache"):
        KVCacheBuffers([(buffer, 4096), (buffer, 4096)], 64)
    cache = KVCacheBuffers([(buffer, 4096)], 64)
    with pytest.raises(ValueError, match="already in this KV cache"):
        cache.add(buffer, 2048)
    cache.commit(5)
    cache.free()


# -- peers that lie ---------------------------------------------------------------


def _exported(device: str, driver: Driver) -> tuple[ExtensibleTensor, SharedLayout, list[int]]:
    g = driver.granularity(0, True)
    et = ExtensibleTensor(8 * g, device, num_segments=2, shareable=True, driver=driver)
    et.resize_per_segment_(g + 5)
    layout, fds = et.shared_layout()
    return et, layout, fds


@pytest.mark.parametrize("claimed", ["triple", -5, "past-capacity"])
def test_an_importer_checks_the_committed_size_against_the_chunks(
    device: str, driver: Driver, claimed: object
) -> None:
    et, layout, fds = _exported(device, driver)
    sizes = {
        "triple": 3 * layout.bytes_per_segment,
        "past-capacity": layout.max_num_bytes,
        -5: -5,
    }
    lying = SharedLayout(**{**layout.__dict__, "bytes_per_segment": sizes[claimed]})
    counted = StatisticsDriver(driver)
    try:
        with pytest.raises(ValueError, match=r"bytes_per_segment|back"):
            ExtensibleTensor.from_shared(lying, fds, driver=counted)
    finally:
        for fd in fds:
            os.close(fd)
    assert counted.live == LiveUsage()
    et.free()


def _send_raw(payload: bytes) -> socket.socket:
    ours, theirs = socket.socketpair()
    ours.sendall(struct.pack(">Q", len(payload)) + payload)
    ours.close()
    return theirs


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xfe",
        b"[1, 2]",
        b'{"max_num_bytes": 10}',
        json.dumps(
            {
                "max_num_bytes": 10,
                "num_segments": 1,
                "bytes_per_segment": 0,
                "chunks": [],
                "device": "cpu",
                "device_index": 0,
                "device_uuid": "x",
                "extra": 1,
            }
        ).encode(),
        json.dumps(
            {
                "max_num_bytes": "10",
                "num_segments": 1,
                "bytes_per_segment": 0,
                "chunks": [[0, "a"]],
                "device": "cpu",
                "device_index": 0,
                "device_uuid": "x",
            }
        ).encode(),
    ],
    ids=["not-utf8", "a-list", "missing-fields", "unknown-field", "wrong-types"],
)
def test_a_malformed_message_is_one_clear_error(payload: bytes) -> None:
    sock = _send_raw(payload)
    with pytest.raises(MalformedMessageError, match="malformed"):
        receive_tensor(sock)
    sock.close()


def test_a_huge_announced_length_is_refused_before_reading() -> None:
    ours, theirs = socket.socketpair()
    ours.sendall(struct.pack(">Q", 1 << 62))
    with pytest.raises(MalformedMessageError, match="more than the"):
        receive_tensor(theirs)
    ours.close()
    theirs.close()


def test_a_peer_cannot_make_the_importer_reserve_a_wrapped_size(
    device: str, driver: Driver
) -> None:
    et, layout, fds = _exported(device, driver)
    ours, theirs = socket.socketpair()
    lying = SharedLayout(**{**layout.__dict__, "max_num_bytes": 1 << 64})
    payload = lying.to_json().encode()
    ours.sendall(struct.pack(">Q", len(payload)) + payload)
    for start in range(0, len(fds), 250):
        batch = fds[start : start + 250]
        socket.send_fds(ours, [struct.pack(">I", len(batch))], batch)
    with pytest.raises(ValueError, match="between 0 and"):
        receive_tensor(theirs, driver=driver)
    for fd in fds:
        os.close(fd)
    ours.close()
    theirs.close()
    et.free()


# -- views ------------------------------------------------------------------------


def test_view_sizes_and_pointers_are_checked() -> None:
    raw = ctypes.create_string_buffer(64)
    for ptr, size, error in (
        (-1, 4, ValueError),
        (1 << 64, 4, ValueError),
        ((1 << 64) - 2, 4, ValueError),
        (ctypes.addressof(raw), True, TypeError),
        (ctypes.addressof(raw), -1, ValueError),
    ):
        with pytest.raises(error):
            uint8_tensor_from_ptr(ptr, size, 0, device_type="cpu")  # type: ignore[arg-type]
    assert uint8_tensor_from_ptr(ctypes.addressof(raw), 8, 0, device_type="cpu").numel() == 8


def test_owned_views_refuse_bool_sizes(stats: StatisticsDriver, device: str) -> None:
    et = ExtensibleTensor(64, device, driver=stats)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        as_tensor(et.buffer, 0, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offset must be an int"):
        ByteView(et.buffer, True, 4)  # type: ignore[arg-type]
    et.free()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
def test_a_gpu_view_on_a_cpu_only_torch_is_a_clear_error_and_leaks_nothing() -> None:
    raw = ctypes.create_string_buffer(64)
    live = len(_LIVE)
    with pytest.raises(ValueError, match="has no usable GPU"):
        uint8_tensor_from_ptr(ctypes.addressof(raw), 16, 0, device_type="cuda")
    assert len(_LIVE) == live


def test_a_freed_buffer_makes_no_new_views(stats: StatisticsDriver, device: str) -> None:
    et = ExtensibleTensor(64, device, driver=stats)
    kept = et.resize_(16)
    buffer = et.buffer
    et.free()
    assert buffer.reserved, "a live view keeps the range"
    with pytest.raises(ValueError, match="freed"):
        as_tensor(buffer, 0, 8)
    del kept
    gc.collect()


def test_printing_a_fresh_kv_cache_reads_no_memory() -> None:
    """Its views cover uncommitted blocks: reading them would fault."""
    child = run_python(
        """
        import torch
        from extensible_kv.kv import (
            AttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheTensor, KVSplitBackend,
            allocate_kv_cache,
        )
        spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
        config = KVCacheConfig(
            4096, (KVCacheTensor(4096 * spec.page_size_bytes, ("a",)),),
            (KVCacheGroup(("a",), spec),),
        )
        cache = allocate_kv_cache(config, KVSplitBackend, "cpu")
        print(repr(cache))
        print(str(cache))
        """
    )
    assert child.returncode == 0, child.stderr
    assert "KVCache(" in child.stdout
    assert "views={'a': (2, 4096, 16, 2, 64)}" in child.stdout


@pytest.mark.parametrize("num_blocks", [2.7, True, "4"])
def test_num_blocks_must_be_an_int(num_blocks: object) -> None:
    config = KVCacheConfig(
        num_blocks,  # type: ignore[arg-type]
        (KVCacheTensor(4 * SPEC.page_size_bytes, ("a",)),),
        (KVCacheGroup(("a",), SPEC),),
    )
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        allocate_kv_cache(config, KVSplitBackend, "cpu")
