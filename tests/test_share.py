"""Sharing a buffer with another process: fds over a Unix socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from extensible_kv import DriverError, ExtensibleTensor, FaultInjectingDriver, StatisticsDriver
from extensible_kv.driver import LiveUsage, get_driver
from extensible_kv.share import receive_tensor, send_tensor
from extensible_kv.tensor import SharedLayout


def test_another_process_maps_the_same_bytes(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cap = 3 * granularity + 100
    et = ExtensibleTensor(
        2 * cap, device, num_segments=2, shareable=True, driver=stats, chunk_bytes=granularity
    )
    et.resize_per_segment_(2 * granularity + 7)
    full = et.full_view()
    full[: 2 * granularity + 7].fill_(7)
    full[cap : cap + 2 * granularity + 7].fill_(8)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import socket, torch
            from extensible_kv.share import receive_tensor
            sock = socket.socket(fileno={theirs.fileno()})
            t = receive_tensor(sock, {device!r})
            full = t.full_view()
            n, cap = t.bytes_per_segment, t.segment_capacity_bytes
            assert n == {2 * granularity + 7}, n
            assert bool(full[:n].eq(7).all()) and bool(full[cap:cap + n].eq(8).all())
            full[:5].fill_(42)
            full[cap:cap + 5].fill_(43)
            if full.device.type == "cuda":
                torch.cuda.synchronize()
            sock.sendall(b"ok")
            sock.recv(1)
            t.free()
        """),
        ],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    try:
        send_tensor(ours, et)
        reply = ours.recv(2)
        assert reply == b"ok", child.stderr.read() if child.stderr else ""
        assert full[:5].eq(42).all()
        assert full[cap : cap + 5].eq(43).all()
        assert full[5 : 2 * granularity + 7].eq(7).all()
        ours.sendall(b"x")
    finally:
        ours.close()
        child.wait(timeout=120)
    assert child.returncode == 0
    et.free()


def test_within_one_process_with_a_socketpair(stats: StatisticsDriver, device: str) -> None:
    et = ExtensibleTensor(1000, device, shareable=True, driver=stats)
    et.resize_(600).fill_(3)
    a, b = socket.socketpair()
    send_tensor(a, et)
    other = receive_tensor(b, device, driver=stats)
    assert other.base_ptr != et.base_ptr
    assert other.num_bytes == 600
    assert other.tensor.eq(3).all()
    other.tensor[:10] = 9
    assert et.tensor[:10].eq(9).all()
    other.free()
    et.free()
    a.close()
    b.close()


def test_only_shareable_buffers_can_be_sent(stats: StatisticsDriver, device: str) -> None:
    et = ExtensibleTensor(1000, device, driver=stats)
    et.resize_(10)
    a, b = socket.socketpair()
    with pytest.raises(ValueError, match="shareable=True"):
        send_tensor(a, et)
    et.free()
    a.close()
    b.close()


def test_layouts_round_trip_and_fds_must_match() -> None:
    layout = SharedLayout(100, 2, 10, ((0, 2 << 20),), "cpu")
    assert SharedLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="1 chunks need 1 fds, got 0"):
        ExtensibleTensor.from_shared(layout, [])


def test_a_closed_socket_is_a_clear_error() -> None:
    a, b = socket.socketpair()
    a.sendall(bytes(2))
    a.close()
    with pytest.raises(ConnectionError, match="closed the socket"):
        receive_tensor(b)
    b.close()


@pytest.mark.parametrize(("call", "nth"), [("import_handle", 2), ("map", 2), ("set_access", 1)])
def test_a_failing_import_maps_nothing(device: str, granularity: int, call: str, nth: int) -> None:
    exporter = ExtensibleTensor(4 * granularity, device, shareable=True, chunk_bytes=granularity)
    exporter.resize_(3 * granularity)
    layout, fds = exporter.shared_layout()
    receiving = StatisticsDriver(get_driver(device))
    faulty = FaultInjectingDriver(receiving)
    faulty.fail_at(call, nth)
    try:
        with pytest.raises(DriverError, match="injected"):
            ExtensibleTensor.from_shared(layout, fds, device, driver=faulty)
    finally:
        for fd in fds:
            os.close(fd)
    assert receiving.live == LiveUsage()
    exporter.free()
