"""Zero-backed reservations: uncommitted bytes read as zeros, never fault on
read, fault on write, and every mapping path keeps them so."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SIMULATORS
from extensible_kv import ExtensibleTensor, PoolingDriver, StatisticsDriver
from extensible_kv.buffer import VirtualBuffer
from extensible_kv.dlpack import as_tensor
from extensible_kv.driver import Driver, DriverError
from gpusim import SimMachine, sim_driver


def _bytes(buffer: VirtualBuffer) -> torch.Tensor:
    return as_tensor(buffer, 0, buffer.size).cpu().clone()


def test_uncommitted_bytes_read_as_zeros_through_every_change(
    stats: StatisticsDriver, device: str
) -> None:
    g = stats.granularity(0, False)
    tensor = ExtensibleTensor(4 * g, device, driver=stats, zero_backed=True)
    full = tensor.full_view()
    assert stats.live.reservations == 1
    assert int(full.count_nonzero()) == 0
    assert tensor.physical_bytes == 0

    tensor.resize_per_segment_(g + 1)
    full[: 2 * g].fill_(7)
    assert tensor.physical_bytes == 2 * g
    assert bool((full[: 2 * g] == 7).all())
    assert int(full[2 * g :].count_nonzero()) == 0

    tensor.shrink_per_segment_(1)
    assert tensor.physical_bytes == g
    assert int(full[0]) == 7
    assert int(full[1:].count_nonzero()) == 0  # the kept granule too, past the byte

    tensor.resize_per_segment_(3 * g)
    tensor.defragment_(preserve=True)
    assert int(full[0]) == 7
    assert int(full[3 * g :].count_nonzero()) == 0
    tensor.release_physical()
    assert int(full.count_nonzero()) == 0
    del full
    tensor.free()


def _past_prefixes(tensor: ExtensibleTensor) -> list[int]:
    """Non-zero bytes past each segment's prefix, per segment."""
    full, cap = tensor.full_view(), tensor.segment_capacity_bytes
    start = tensor.bytes_per_segment
    return [int(full[i * cap + start : (i + 1) * cap].count_nonzero()) for i in range(2)]


def test_bytes_past_the_prefix_read_zero_in_the_granule_it_ends_in(
    stats: StatisticsDriver, device: str
) -> None:
    """The granule a prefix ends in is mapped past it: a zero-backed tensor
    zeroes what lies there, whatever memory it got (a pool's old bytes, a
    simulated GPU's garbage) and whatever changed the prefix."""
    g = stats.granularity(0, False)
    pool = PoolingDriver(stats, cap_bytes=16 * g)
    tensor = ExtensibleTensor(8 * g, device, 2, driver=pool, zero_backed=True)
    full = tensor.full_view()
    tensor.resize_per_segment_(2 * g)
    full.view(2, 4 * g)[:, : 2 * g].fill_(7)
    tensor.shrink_per_segment_(0)
    assert pool.idle_handles == 2  # holding the 7s

    tensor.resize_per_segment_(g + 5)  # the 7s come back from the pool
    assert pool.hits == 2
    assert _past_prefixes(tensor) == [0, 0]

    full.view(2, 4 * g)[:, : g + 5].fill_(9)
    tensor.shrink_per_segment_(3)  # the kept granule held 9s past 3
    assert tensor.physical_bytes == 2 * g
    assert _past_prefixes(tensor) == [0, 0]

    full.view(2, 4 * g)[:, :3].fill_(9)
    tensor.resize_per_segment_(3 * g + 1, zero_new=True)
    tensor.defragment_(preserve=True)
    assert _past_prefixes(tensor) == [0, 0]
    full.view(2, 4 * g)[:, : 3 * g + 1].fill_(5)
    tensor.shrink_per_segment_(g // 2)
    full.view(2, 4 * g)[:, : g // 2].fill_(5)
    tensor.defragment_()  # discarding: new chunks, from the pool's old bytes
    assert _past_prefixes(tensor) == [0, 0]
    assert int(full.count_nonzero()) == 0
    del full
    tensor.free()
    pool.drain()


@settings(max_examples=25)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["commit", "release_outside", "defragment", "release"]),
            st.sets(st.integers(0, 3), max_size=3),
        ),
        max_size=6,
    )
)
def test_buffer_shows_its_chunks_and_zeros_elsewhere(
    steps: list[tuple[str, set[int]]],
) -> None:
    """Against a model (the chunks, as granule runs, and the byte written in
    each committed granule), over the host backend and both simulated GPUs:
    committed granules keep their bytes, all others read zeros."""
    for kind in ("cpu", *SIMULATORS):
        driver = _driver(kind)
        g = driver.granularity(0, False)
        buffer = VirtualBuffer(4 * g, driver, chunk_bytes=g, zero_backed=True)
        chunks: set[tuple[int, int]] = set()
        written: dict[int, int] = {}
        try:
            for n, (op, granules) in enumerate(steps, start=1):
                ranges = [(i * g, g) for i in sorted(granules)]
                if op == "commit":
                    buffer.commit(ranges)
                    new = granules - written.keys()
                    chunks |= {(i, i + 1) for i in new}
                elif op == "release_outside":
                    buffer.release_outside(ranges)
                    chunks = {c for c in chunks if granules & set(range(*c))}
                    new = set()
                elif op == "defragment":
                    buffer.defragment(ranges)
                    chunks, new = _runs(granules), granules
                else:
                    buffer.release_physical()
                    chunks, new = set(), set()
                held = {i for c in chunks for i in range(*c)}
                written = {i: written.get(i, 0) for i in held}
                view = as_tensor(buffer, 0, buffer.size)
                for i in new:
                    view[i * g : (i + 1) * g].fill_(n)
                    written[i] = n
                del view
                seen = _bytes(buffer).view(4, g)
                for i in range(4):
                    assert bool((seen[i] == written.get(i, 0)).all()), (kind, op, i)
                assert buffer.physical_bytes == len(held) * g
        finally:
            buffer.free()


def _runs(granules: set[int]) -> set[tuple[int, int]]:
    """Runs of adjacent granules as ``(first, end)``."""
    runs: list[list[int]] = []
    for i in sorted(granules):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return {(a, b) for a, b in runs}


def _driver(kind: str) -> Driver:
    if kind == "cpu":
        from extensible_kv import get_driver

        return get_driver("cpu")
    return sim_driver(kind, SimMachine())[0]


def test_one_zero_granule_serves_every_reservation_of_a_device(
    simulated: tuple[Driver, SimMachine],
) -> None:
    driver, machine = simulated
    g = driver.granularity(0, False)
    with driver.context(0):
        first = driver.reserve_zeroed(8 * g, g, 0)
        second = driver.reserve_zeroed(16 * g, g, 0)
        assert machine.used(0) == g
        driver.free_reserved(first, 8 * g)
        assert machine.used(0) == g
        driver.free_reserved(second, 16 * g)
    assert machine.used(0) == 0
    assert machine.empty()


def test_writing_uncommitted_memory_faults_on_a_simulated_gpu(
    simulated: tuple[Driver, SimMachine],
) -> None:
    driver, machine = simulated
    g = driver.granularity(0, False)
    buffer = VirtualBuffer(2 * g, driver, zero_backed=True)
    buffer.commit([(0, g)])
    machine.launch(buffer.base_ptr, g, 3)
    with pytest.raises(Exception, match="read-only"):
        machine.launch(buffer.base_ptr + g, g, 3)
    machine.sticky = None


def test_writing_uncommitted_memory_faults_on_the_host() -> None:
    script = textwrap.dedent(
        """
        import ctypes
        from extensible_kv import get_driver
        from extensible_kv.buffer import VirtualBuffer
        buffer = VirtualBuffer(2 << 20, get_driver("cpu"), zero_backed=True)
        assert ctypes.c_char.from_address(buffer.base_ptr + 100).value == b"\\0"
        print("read ok", flush=True)
        ctypes.memset(buffer.base_ptr, 1, 1)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "read ok" in done.stdout
    assert done.returncode == -11  # SIGSEGV: the zeros are read-only


def test_unmap_in_a_zeroed_reservation_covers_one_mapping(driver: Driver) -> None:
    g = driver.granularity(0, False)
    with driver.context(0):
        ptr = driver.reserve_zeroed(2 * g, g, 0)
        handles = [driver.create(g, 0, False) for _ in range(2)]
        for i, handle in enumerate(handles):
            driver.map(ptr + i * g, g, handle)
        with pytest.raises(DriverError, match="exactly one mapping"):
            driver.unmap(ptr, 2 * g)
        for i, handle in enumerate(handles):
            driver.unmap(ptr + i * g, g)
            driver.release(handle)
        driver.free_reserved(ptr, 2 * g)


def test_reserve_zeroed_refuses_a_size_off_the_granularity(driver: Driver) -> None:
    g = driver.granularity(0, False)
    with driver.context(0), pytest.raises(DriverError, match="granularity"):
        driver.reserve_zeroed(g + g // 2, g, 0)


_NAMES = {
    "cuda-sim": {"map": "cuMemMap", "unmap": "cuMemUnmap", "memset": "cuMemsetD8"},
    "hip-sim": {"map": "hipMemMap", "unmap": "hipMemUnmap", "memset": "hipMemset"},
}


@pytest.mark.parametrize("kind", SIMULATORS)
@pytest.mark.parametrize(
    ("operation", "failing"),
    [("map", "map"), ("map", "unmap"), ("unmap", "map"), ("unmap", "unmap")],
)
def test_a_failing_driver_call_leaves_the_reservation_as_it_was(
    kind: str, operation: str, failing: str
) -> None:
    """map: showing the zeros' unmap, or the map itself, fails; unmap: the
    unmap, or showing the zeros again, fails. Either way nothing changes."""
    machine = SimMachine()
    driver, bindings = sim_driver(kind, machine)
    g = driver.granularity(0, False)
    buffer = VirtualBuffer(2 * g, driver, zero_backed=True)
    if operation == "unmap":
        buffer.commit([(0, g)])
        as_tensor(buffer, 0, g).fill_(9)
    before = _bytes(buffer).clone()
    bindings.failures[_NAMES[kind][failing]] = 1
    change = (lambda: buffer.commit([(0, g)])) if operation == "map" else buffer.release_physical
    with pytest.raises(DriverError):
        change()
    assert torch.equal(_bytes(buffer), before)
    assert buffer.physical_bytes == (g if operation == "unmap" else 0)
    buffer.commit([(0, 2 * g)])
    buffer.release_physical()
    assert int(_bytes(buffer).count_nonzero()) == 0
    buffer.free()
    assert machine.empty()


@pytest.mark.parametrize("kind", SIMULATORS)
def test_a_failing_zero_fill_leaves_nothing_behind(kind: str) -> None:
    machine = SimMachine()
    driver, bindings = sim_driver(kind, machine)
    bindings.failures[_NAMES[kind]["memset"]] = 2
    with pytest.raises(DriverError):
        VirtualBuffer(4 << 20, driver, zero_backed=True)
    assert machine.empty()
    buffer = VirtualBuffer(4 << 20, driver, zero_backed=True)
    assert int(_bytes(buffer).count_nonzero()) == 0
    buffer.free()
    assert machine.empty()


@pytest.mark.parametrize("kind", SIMULATORS)
def test_a_device_refusing_read_only_access_gets_writable_zeros_and_a_warning(
    kind: str,
) -> None:
    machine = SimMachine(read_only_access=False)
    driver, _ = sim_driver(kind, machine)
    g = driver.granularity(0, False)
    with pytest.warns(RuntimeWarning, match="refused read-only access"):
        buffer = VirtualBuffer(2 * g, driver, zero_backed=True)
    buffer.commit([(0, g)])
    as_tensor(buffer, 0, g).fill_(4)
    seen = _bytes(buffer)
    assert bool((seen[:g] == 4).all())
    assert int(seen[g:].count_nonzero()) == 0
    buffer.free()
    assert machine.empty()
