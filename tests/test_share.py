"""Sharing a buffer with another process: fds over a Unix socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from extensible_kv import DriverError, ExtensibleTensor, FaultInjectingDriver, StatisticsDriver
from extensible_kv.driver import Driver, LiveUsage
from extensible_kv.share import receive_tensor, send_tensor
from extensible_kv.tensor import SharedLayout

TESTS = os.path.dirname(__file__)


def test_another_process_maps_the_same_bytes(
    stats: StatisticsDriver, vmm_backend: str, device: str
) -> None:
    """The receiver finds the exporter's device by its UUID (device=None);
    on a simulator, the child runs a simulator of the same GPUs."""
    granularity = stats.granularity(0, True)
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
            import socket, sys, torch
            from extensible_kv.share import receive_tensor
            sys.path.insert(0, {TESTS!r})
            driver = None
            if {vmm_backend!r}.endswith("-sim"):
                from gpusim import sim_driver
                driver = sim_driver({vmm_backend!r})[0]
            sock = socket.socket(fileno={theirs.fileno()})
            t = receive_tensor(sock, driver=driver)
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
    layout = SharedLayout(100, 2, 10, ((0, 2 << 20),), "cpu", 0, "host-x")
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
def test_a_failing_import_maps_nothing(device: str, driver: Driver, call: str, nth: int) -> None:
    granularity = driver.granularity(0, True)
    exporter = ExtensibleTensor(
        4 * granularity, device, shareable=True, driver=driver, chunk_bytes=granularity
    )
    exporter.resize_(3 * granularity)
    layout, fds = exporter.shared_layout()
    receiving = StatisticsDriver(driver)
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


def test_the_layout_names_the_device_by_ordinal_and_uuid(
    stats: StatisticsDriver, device: str
) -> None:
    et = ExtensibleTensor(1000, device, shareable=True, driver=stats)
    et.resize_(10)
    layout, fds = et.shared_layout()
    for fd in fds:
        os.close(fd)
    assert layout.device_index == et.buffer.device
    assert layout.device_uuid == stats.device_uuid(et.buffer.device)
    assert SharedLayout.from_json(layout.to_json()) == layout
    et.free()


def test_a_receiver_that_does_not_see_the_gpu_says_so() -> None:
    """Simulated GPUs: the receiving process sees other GPUs than the sender."""
    # The simulated CUDA backend runs the real one, whose bindings are the [cuda] extra.
    pytest.importorskip("cuda.bindings", reason="the [cuda] extra is not installed")
    from gpusim import SimMachine, sim_driver

    sender, _ = sim_driver("cuda-sim", SimMachine())
    elsewhere, _ = sim_driver("cuda-sim", SimMachine(order=[1]))
    et = ExtensibleTensor(4 << 20, "cpu", shareable=True, driver=sender)
    et.resize_(10)
    layout, fds = et.shared_layout()
    try:
        with pytest.raises(ValueError, match="not visible to this process"):
            ExtensibleTensor.from_shared(layout, fds, driver=elsewhere)
        with pytest.raises(ValueError, match="pass device=None"):
            ExtensibleTensor.from_shared(layout, fds, "cpu", driver=elsewhere)
    finally:
        for fd in fds:
            os.close(fd)
    et.free()
