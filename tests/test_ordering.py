"""Work in flight on other streams: every operation that copies, exports or
unmaps committed memory waits for all of it, not only for the caller's
stream. Only the LABELLED simulator (tests/gpusim) can hold work back: a
kernel "launched" there writes its bytes when a synchronize completes it,
the latest a real one could, and unmapping under it is an illegal address.
"""

from __future__ import annotations

import socket

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import SIMULATORS
from extensible_kv import ExtensibleTensor, StatisticsDriver
from extensible_kv.driver import Driver
from extensible_kv.kv import KVCacheBuffers
from extensible_kv.share import receive_tensor, send_tensor
from gpusim import SimMachine, sim_driver

SIDE_STREAM = 7


def cache_of(driver: Driver, per_block: int, chunk_bytes: int | None = None) -> KVCacheBuffers:
    buffers = [
        (
            ExtensibleTensor(
                64 * per_block * segments,
                "cpu",
                num_segments=segments,
                driver=driver,
                chunk_bytes=chunk_bytes,
            ),
            per_block,
        )
        for segments in (2, 1, 1)
    ]
    return KVCacheBuffers(buffers, 64)


def first_block(cache: KVCacheBuffers) -> torch.Tensor:
    buffer, per_block = cache.buffers[0]
    return buffer.full_view()[:per_block]


def write_in_flight(machine: SimMachine, view: torch.Tensor, value: int) -> None:
    """A kernel on a side stream, still running, that writes ``value`` over ``view``."""
    machine.launch(view.data_ptr(), view.numel(), value, stream=SIDE_STREAM)


@pytest.mark.parametrize(
    "operation",
    [
        lambda cache: cache.trim(9),
        lambda cache: cache.defragment(preserve=True),
        lambda cache: (cache.release_physical(preserve=True), cache.recommit()),
    ],
    ids=["trim", "defragment-preserve", "sleep-preserve"],
)
def test_copies_of_blocks_wait_for_writers_on_every_stream(
    simulated: tuple[Driver, SimMachine], operation: object
) -> None:
    driver, machine = simulated
    g = driver.granularity(0, False)
    cache = cache_of(driver, g // 4 + 512, chunk_bytes=g)
    cache.commit(40)
    first_block(cache).fill_(1)
    write_in_flight(machine, first_block(cache), 9)
    operation(cache)  # type: ignore[operator]
    assert machine.sticky is None
    assert first_block(cache).eq(9).all(), "the copy ran before the side stream's write"
    cache.free()
    assert machine.empty()


def test_a_sent_tensor_is_seen_after_the_work_in_flight(
    simulated: tuple[Driver, SimMachine],
) -> None:
    driver, machine = simulated
    g = driver.granularity(0, True)
    et = ExtensibleTensor(4 * g, "cpu", shareable=True, driver=driver)
    et.resize_(2 * g).fill_(1)
    write_in_flight(machine, et.tensor[:64], 5)
    ours, theirs = socket.socketpair()
    send_tensor(ours, et)
    received = receive_tensor(theirs, driver=driver)
    assert received.tensor[:64].eq(5).all(), "exported before the work was done"
    received.free()
    et.free()
    ours.close()
    theirs.close()
    assert machine.empty()


def test_a_trim_of_many_buffers_synchronizes_once_per_batch(
    simulated: tuple[Driver, SimMachine],
) -> None:
    """Stage every buffer's smaller chunks, synchronize once, swap: not one
    synchronize and one scratch reservation per chunk mapped again."""
    driver, _ = simulated
    g = driver.granularity(0, False)
    stats = StatisticsDriver(driver)
    cache = cache_of(stats, g // 4 + 512, chunk_bytes=2 * g)
    cache.commit(64)
    remapped = sum(
        1
        for b, per_block in cache.buffers
        for remap in b.buffer.plan_remaps(b._segment_ranges(0, 9 * per_block), merge=False)
        if remap.runs
    )
    assert remapped > len(cache.buffers), "several chunks straddle an end"
    stats.reset_calls()
    cache.trim(9)
    calls = stats.calls
    assert calls["synchronize"].calls == 2, "before copying, and before swapping"
    assert calls["reserve"].calls == len(cache.buffers), "one scratch reservation per buffer"
    cache.free()


OTHER_STREAM = 9


@pytest.mark.parametrize(
    "operation",
    [
        lambda cache: cache.trim(9),
        lambda cache: cache.defragment(preserve=True),
        lambda cache: (cache.release_physical(preserve=True), cache.recommit()),
        lambda cache: cache.release_physical(),
    ],
    ids=["trim", "defragment-preserve", "sleep-preserve", "sleep"],
)
def test_stream_ordered_waits_take_the_named_streams_and_leave_the_others(
    simulated: tuple[Driver, SimMachine], operation: object
) -> None:
    """A cache told its streams waits for their work only: the writer on a
    named stream is done before any copy or unmap, while another stream's
    work elsewhere on the device is still running after the operation."""
    driver, machine = simulated
    g = driver.granularity(0, False)
    stats = StatisticsDriver(driver)
    cache = cache_of(stats, g // 4 + 512, chunk_bytes=g)
    cache.wait_for_streams([SIDE_STREAM])
    cache.commit(40)
    first_block(cache).fill_(1)
    elsewhere = ExtensibleTensor(g, "cpu", driver=driver)
    elsewhere.resize_(g)
    machine.launch(elsewhere.tensor.data_ptr(), 64, 4, stream=OTHER_STREAM)
    write_in_flight(machine, first_block(cache), 9)
    stats.reset_calls()
    operation(cache)  # type: ignore[operator]
    assert machine.sticky is None
    assert [k.stream for k in machine.pending] == [OTHER_STREAM], "the other work still runs"
    assert any(k.stream == SIDE_STREAM for k in machine.completed)
    assert stats.calls["synchronize"].calls == 0, "no device-wide synchronize"
    assert stats.calls["synchronize_streams"].calls >= 1
    if cache.num_blocks_committed:
        assert first_block(cache).eq(9).all(), "the copy ran before the named stream's write"
    machine.synchronize(0)
    cache.free()
    elsewhere.free()
    assert machine.empty()


def test_the_device_wide_wait_comes_back_with_none(simulated: tuple[Driver, SimMachine]) -> None:
    driver, machine = simulated
    g = driver.granularity(0, False)
    stats = StatisticsDriver(driver)
    cache = cache_of(stats, g // 4 + 512)
    cache.wait_for_streams([SIDE_STREAM])
    cache.wait_for_streams(None)
    cache.commit(8)
    machine.launch(first_block(cache).data_ptr(), 64, 2, stream=OTHER_STREAM)
    stats.reset_calls()
    cache.release_physical()
    assert stats.calls["synchronize"].calls >= 1
    assert not machine.pending
    cache.free()


def test_stream_handles_accept_ints_and_objects_with_a_cuda_stream() -> None:
    class FakeStream:  # LABELLED stand-in: torch.cuda.Stream needs a GPU here
        cuda_stream = 0x5EED

    et = ExtensibleTensor(1 << 21, "cpu")
    et.wait_for_streams([3, FakeStream()])
    assert et.buffer.wait_streams == (3, 0x5EED)
    et.wait_for_streams(None)
    assert et.buffer.wait_streams is None
    et.free()


class StreamOrderedMachine(RuleBasedStateMachine):
    """Random commits, trims, defragments and sleeps of a cache told its
    stream, with kernels in flight on it and, over other memory, on another
    stream: no unmap ever lands under a kernel of the named stream (the
    simulator's sticky illegal address), and the other stream's work is
    never waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.machine = SimMachine()
        driver, _ = sim_driver(SIMULATORS[0], self.machine)
        self.g = driver.granularity(0, False)
        self.cache = cache_of(driver, self.g // 4 + 512, chunk_bytes=self.g)
        self.cache.wait_for_streams([SIDE_STREAM])
        self.elsewhere = ExtensibleTensor(self.g, "cpu", driver=driver)
        self.elsewhere.resize_(self.g)

    @rule(blocks=st.integers(0, 64))
    def commit(self, blocks: int) -> None:
        if not self.cache.asleep:
            self.cache.commit(blocks)

    @rule(blocks=st.integers(0, 64))
    def trim(self, blocks: int) -> None:
        if not self.cache.asleep:
            self.cache.trim(min(blocks, self.cache.num_blocks_committed))

    @rule(preserve=st.booleans())
    def defragment(self, preserve: bool) -> None:
        if not self.cache.asleep:
            self.cache.defragment(preserve=preserve)

    @rule(preserve=st.booleans())
    def sleep(self, preserve: bool) -> None:
        self.cache.release_physical(preserve=preserve)

    @rule()
    def wake(self) -> None:
        self.cache.recommit()

    @rule(value=st.integers(1, 255))
    def launch_named(self, value: int) -> None:
        if not self.cache.asleep and self.cache.num_blocks_committed:
            write_in_flight(self.machine, first_block(self.cache), value)

    @rule()
    def launch_other(self) -> None:
        self.machine.launch(self.elsewhere.tensor.data_ptr(), 64, 1, stream=OTHER_STREAM)

    @invariant()
    def no_unmap_under_a_named_kernel(self) -> None:
        assert self.machine.sticky is None

    @invariant()
    def other_work_is_never_waited_for(self) -> None:
        assert not any(k.stream == OTHER_STREAM for k in self.machine.completed)

    def teardown(self) -> None:
        self.machine.synchronize(0)
        self.cache.free()
        self.elsewhere.free()
        assert self.machine.empty()


TestStreamOrderedMachine = pytest.mark.skipif(not SIMULATORS, reason="no simulator bindings")(
    StreamOrderedMachine.TestCase
)
TestStreamOrderedMachine.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)
