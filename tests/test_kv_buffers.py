"""KVCacheBuffers: lockstep commit, sleep and wake, defragment, all or nothing."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from extensible_kv import DriverError, ExtensibleTensor, FaultInjectingDriver, StatisticsDriver
from extensible_kv.driver import Driver, LiveUsage
from extensible_kv.kv import ExtensibleKVCacheBuffers, KVCacheBuffers, SleepState
from extensible_kv.tensor import in_one_chunk_per_segment
from faults import Fault, attempt, fault_strategy

MiB = 1 << 20
CAPACITY = 64
# (segments, bytes per block per segment): a K/V-split buffer whose segment
# boundary falls inside a granule, and two single-segment ones.
SHAPES = [(2, 48 * 1024), (1, 96 * 1024), (1, 40 * 1024 + 16)]


def make_cache(
    device: str, driver: Driver, chunk_bytes: int | None = None, *, shareable: bool = False
) -> KVCacheBuffers:
    buffers = [
        (
            ExtensibleTensor(
                CAPACITY * per_block * segments,
                device,
                num_segments=segments,
                shareable=shareable,
                driver=driver,
                chunk_bytes=chunk_bytes,
            ),
            per_block,
        )
        for segments, per_block in SHAPES
    ]
    return KVCacheBuffers(buffers, CAPACITY)


def block(buffer: ExtensibleTensor, per_block: int, segment: int, index: int) -> torch.Tensor:
    start = segment * buffer.segment_capacity_bytes + index * per_block
    return buffer.full_view()[start : start + per_block]


def test_commit_zeroes_new_blocks_and_ignores_smaller_counts(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    cache.commit(3)
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            block(buffer, per_block, segment, 2).fill_(9)
    cache.commit(2)
    assert cache.num_blocks_committed == 3
    cache.commit(CAPACITY)
    for buffer, per_block in cache.buffers:
        assert buffer.bytes_per_segment == CAPACITY * per_block
        for segment in range(buffer.num_segments):
            assert block(buffer, per_block, segment, 2).eq(9).all()
            assert int(block(buffer, per_block, segment, 3).count_nonzero()) == 0
            block(buffer, per_block, segment, CAPACITY - 1).fill_(1)
    assert cache.bytes_per_block == sum(s * b for s, b in SHAPES)
    cache.free()


def test_ensure_blocks_caps_at_capacity(stats: StatisticsDriver, device: str) -> None:
    cache = make_cache(device, stats)
    cache.ensure_blocks(5)
    assert cache.num_blocks_committed == 5
    cache.ensure_blocks(2)
    assert cache.num_blocks_committed == 5
    cache.ensure_blocks(10 * CAPACITY)
    assert cache.num_blocks_committed == CAPACITY
    cache.free()


def test_sleep_and_wake(stats: StatisticsDriver, device: str) -> None:
    cache = make_cache(device, stats)
    cache.commit(20)
    bases = [buffer.base_ptr for buffer, _ in cache.buffers]
    views = [buffer.full_view() for buffer, _ in cache.buffers]
    for view in views:
        view[:100].fill_(7)
    cache.release_physical()
    assert cache.asleep
    assert cache.physical_bytes == 0
    assert cache.num_blocks_committed == 0
    assert stats.live.handles == 0
    cache.release_physical()
    with pytest.raises(ValueError, match="released"):
        cache.trim(0)
    cache.recommit()
    assert not cache.asleep
    assert cache.num_blocks_committed == 20
    assert [buffer.base_ptr for buffer, _ in cache.buffers] == bases
    for view in views:
        assert int(view[:100].count_nonzero()) == 0
        view[:100].fill_(3)
    cache.recommit()
    assert cache.num_blocks_committed == 20
    cache.free()


def test_the_state_names_each_step_of_the_sleep_cycle(stats: StatisticsDriver, device: str) -> None:
    cache = make_cache(device, stats)
    cache.commit(20)
    assert cache.state is SleepState.AWAKE
    cache.release_physical(preserve=True)
    assert (cache.state, cache.asleep) == (SleepState.ASLEEP_PRESERVED, True)
    cache.release_physical()
    assert cache.state is SleepState.ASLEEP_DISCARDED, "a discarding sleep drops the copy"
    cache.commit(4)
    assert (cache.state, cache.asleep) == (SleepState.PARTLY_AWAKE, False)
    assert cache.num_blocks_committed == 4
    cache.release_physical(preserve=True)
    assert cache.state is SleepState.ASLEEP_PRESERVED
    cache.recommit()
    assert (cache.state, cache.num_blocks_committed) == (SleepState.AWAKE, 20)
    assert "awake" in repr(cache)
    cache.free()


@pytest.mark.parametrize("start", ["awake", "asleep", "asleep with a copy", "partly awake"])
def test_clear_forgets_every_block_from_any_state(
    stats: StatisticsDriver, device: str, start: str
) -> None:
    cache = make_cache(device, stats)
    cache.commit(20)
    for buffer, _ in cache.buffers:
        buffer.full_view()[:100].fill_(7)
    if start != "awake":
        cache.release_physical(preserve=start == "asleep with a copy")
    if start == "partly awake":
        cache.commit(4)
    cache.clear()
    assert cache.state is SleepState.AWAKE
    assert (cache.num_blocks_committed, cache.physical_bytes, cache.host_backup_bytes) == (0, 0, 0)
    assert stats.live.handles == 0
    cache.recommit()
    assert cache.num_blocks_committed == 0, "nothing to grow back to"
    cache.commit(20)
    for buffer, _ in cache.buffers:
        assert int(buffer.full_view()[:100].count_nonzero()) == 0
    cache.free()


def test_defragment_maps_each_segment_as_one_chunk(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    cache = make_cache(device, stats, chunk_bytes=granularity)
    for n in (1, 7, 30):
        cache.commit(n)
    assert max(len(buffer.buffer.chunks) for buffer, _ in cache.buffers) > 2
    for buffer, _ in cache.buffers:
        buffer.full_view()[:64].fill_(5)
    cache.commit(30, defragment=True)
    for buffer, per_block in cache.buffers:
        assert len(buffer.buffer.chunks) <= buffer.num_segments
        assert int(buffer.full_view()[:64].count_nonzero()) == 0, "defragment discards contents"
        assert buffer.bytes_per_segment == 30 * per_block
    cache.free()


def granules_of_prefix(buffer: ExtensibleTensor, granularity: int) -> int:
    """Bytes of the granules covering every segment's committed prefix."""
    covered = set()
    for segment in range(buffer.num_segments):
        start = segment * buffer.segment_capacity_bytes
        end = start + buffer.bytes_per_segment
        covered |= set(range(start // granularity, -(-end // granularity)))
    return len(covered) * granularity


def test_a_defragmenting_commit_holds_exactly_the_count_asked(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    """As vLLM's runner: the final commit of a connector's cache gives back
    the warm-up prefix past it, and a larger one maps every segment at once."""
    cache = make_cache(device, stats, chunk_bytes=granularity)
    cache.ensure_blocks(CAPACITY)  # warm-up touched every block
    for n in (CAPACITY // 3, CAPACITY // 2):
        cache.commit(n, defragment=True)
        assert cache.num_blocks_committed == n
        for buffer, per_block in cache.buffers:
            assert buffer.bytes_per_segment == n * per_block
            assert in_one_chunk_per_segment(buffer)
            assert buffer.physical_bytes == granules_of_prefix(buffer, granularity), (
                "nothing past the count stays mapped"
            )
    cache.free()
    assert stats.live == LiveUsage()


def test_a_defragmenting_commit_already_done_still_zeroes_without_remapping(
    stats: StatisticsDriver, device: str
) -> None:
    """A defragment discards, as the seed's did: a cache that already holds
    exactly that count in one chunk per segment takes the cheap path (no
    driver call) but its blocks still read zero after."""
    cache = make_cache(device, stats)
    cache.commit(20, defragment=True)
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            block(buffer, per_block, segment, 19).fill_(7)
            block(buffer, per_block, segment, 0).fill_(7)

    def mapping_calls() -> dict[str, int]:
        return {name: stats.calls[name].calls for name in ("create", "map", "unmap", "release")}

    before = mapping_calls()
    cache.commit(20, defragment=True)
    assert mapping_calls() == before  # no remap
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            assert int(block(buffer, per_block, segment, 19).count_nonzero()) == 0
            assert int(block(buffer, per_block, segment, 0).count_nonzero()) == 0
    cache.free()


@pytest.mark.parametrize("call", ["synchronize", "context"])
def test_a_failed_defragmenting_commit_changes_nothing(
    stats: StatisticsDriver, device: str, call: str
) -> None:
    """From 5 to 6 blocks inside the same granules, failing before anything
    moved: the count and the bytes are as before, and a retry zeroes."""
    faulty = FaultInjectingDriver(stats)
    cache = make_cache(device, faulty)
    cache.commit(5, defragment=True)
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            block(buffer, per_block, segment, 4).fill_(3)
    faulty.fail_at(call)
    with pytest.raises(DriverError):
        cache.commit(6, defragment=True)
    assert cache.num_blocks_committed == 5
    for buffer, per_block in cache.buffers:
        assert buffer.bytes_per_segment == 5 * per_block
        for segment in range(buffer.num_segments):
            assert block(buffer, per_block, segment, 4).eq(3).all()
    cache.commit(6, defragment=True)
    assert cache.num_blocks_committed == 6
    for buffer, per_block in cache.buffers:
        for segment in range(buffer.num_segments):
            assert int(block(buffer, per_block, segment, 4).count_nonzero()) == 0
            assert int(block(buffer, per_block, segment, 5).count_nonzero()) == 0
    cache.free()


def test_add_commits_a_new_buffer_to_the_current_count(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    cache.commit(10)
    extra = ExtensibleTensor(CAPACITY * 1000, device, driver=stats)
    cache.add(extra, 1000)
    assert extra.bytes_per_segment == 10_000
    cache.commit(12)
    assert extra.bytes_per_segment == 12_000
    cache.free()


def test_bad_input(stats: StatisticsDriver, device: str) -> None:
    tensor = ExtensibleTensor(1000, device, driver=stats)
    with pytest.raises(ValueError, match="must be positive"):
        KVCacheBuffers([(tensor, 10)], 0)
    with pytest.raises(ValueError, match="exceed the segment capacity"):
        KVCacheBuffers([(tensor, 11)], 100)
    with pytest.raises(ValueError, match="bytes_per_block_per_segment must be positive"):
        KVCacheBuffers([(tensor, 0)], 100)
    cache = KVCacheBuffers([(tensor, 10)], 100)
    with pytest.raises(ValueError, match="capacity is 100 blocks"):
        cache.commit(101)
    with pytest.raises(ValueError, match="capacity is 100 blocks"):
        cache.commit(-1)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        cache.commit(2.0)  # type: ignore[arg-type]
    assert cache.num_blocks_committed == 0
    assert ExtensibleKVCacheBuffers is KVCacheBuffers
    cache.free()


# -- fault injection across buffers --------------------------------------------


def snapshot(cache: KVCacheBuffers, stats: StatisticsDriver, data: bool = True) -> tuple[Any, ...]:
    per_buffer = []
    for buffer, _ in cache.buffers:
        content = b""
        if data and buffer.num_bytes:
            full = buffer.full_view()
            cap, n = buffer.segment_capacity_bytes, buffer.bytes_per_segment
            content = b"".join(
                bytes(full[i * cap : i * cap + n].cpu().tolist())
                for i in range(buffer.num_segments)
            )
        per_buffer.append((buffer.bytes_per_segment, buffer.physical_bytes, content))
    return (cache.num_blocks_committed, cache.asleep, per_buffer, stats.live)


def filled(
    device: str, driver: Driver, operation: str
) -> tuple[KVCacheBuffers, StatisticsDriver, FaultInjectingDriver]:
    stats = StatisticsDriver(driver)
    faulty = FaultInjectingDriver(stats)
    # One chunk per run makes a trim map the chunks straddling the end again.
    chunk_bytes = None if operation == "trim-remap" else driver.granularity(0, False)
    cache = make_cache(device, faulty, chunk_bytes=chunk_bytes)
    cache.commit(40 if operation.startswith("trim") else 9)
    for i, (buffer, _) in enumerate(cache.buffers):
        for segment in range(buffer.num_segments):
            start = segment * buffer.segment_capacity_bytes
            buffer.full_view()[start : start + buffer.bytes_per_segment].fill_(i + 1)
    return cache, stats, faulty


OPERATIONS: dict[str, Callable[[KVCacheBuffers], object]] = {
    "commit": lambda c: c.commit(40),
    "release": lambda c: c.release_physical(),
    "release-preserve": lambda c: c.release_physical(preserve=True),
    "recommit": lambda c: c.recommit(),
    "recommit-preserve": lambda c: c.recommit(),
    "defragment": lambda c: c.commit(40, defragment=True),
    "defragment-preserve": lambda c: c.defragment(preserve=True),
    "trim": lambda c: c.trim(3),
    "trim-remap": lambda c: c.trim(3),
}
IRREVERSIBLE = {"release", "free_reserved"}


def prepare(operation: str, cache: KVCacheBuffers) -> None:
    if operation == "recommit":
        cache.release_physical()
    elif operation == "recommit-preserve":
        cache.release_physical(preserve=True)


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_failure_at_any_call_of_any_buffer_leaves_every_buffer_as_it_was(
    device: str, driver: Driver, operation: str
) -> None:
    clean, clean_stats, _ = filled(device, driver, operation)
    prepare(operation, clean)
    before_calls = {n: s.calls for n, s in clean_stats.calls.items()}
    OPERATIONS[operation](clean)
    made = +Counter({n: s.calls - before_calls[n] for n, s in clean_stats.calls.items()})
    assert made, f"{operation} makes no driver call: the test would inject nothing"
    if operation.startswith("trim"):
        assert made["unmap"], f"{operation} unmaps nothing"
    expected = snapshot(clean, clean_stats, data=operation != "defragment")
    clean.free()
    # Defragmenting discards contents by contract: compare state, not bytes.
    with_data = operation != "defragment"
    for call, count in sorted(made.items()):
        for nth in range(1, count + 1):
            case = f"{operation}: {call} #{nth} of {count}"
            cache, stats, faulty = filled(device, driver, operation)
            prepare(operation, cache)
            before = snapshot(cache, stats, data=with_data)
            faulty.fail_at(call, nth)
            with pytest.raises(DriverError, match="injected"):
                OPERATIONS[operation](cache)
            after = snapshot(cache, stats, data=with_data)
            if operation == "defragment-preserve":
                # Runs already swapped in stay so; counts and bytes never change.
                assert (after[0], [b[::2] for b in after[2]]) == (
                    before[0],
                    [b[::2] for b in before[2]],
                ), case
            elif call not in IRREVERSIBLE:
                assert after == before, case
            OPERATIONS[operation](cache)
            assert snapshot(cache, stats, data=with_data) == expected, case
            cache.free()
            assert stats.live == LiveUsage(), case


# -- the stateful machine ---------------------------------------------------------


#: Driver calls a fault may hit inside the state machine's operations.
FAULT_CALLS = ("create", "map", "set_access", "unmap", "release", "synchronize", "context")
faults = fault_strategy(FAULT_CALLS)


class KVMachine(RuleBasedStateMachine):
    """KVCacheBuffers against a block-level model: per buffer, segment and
    block, the byte value it must read (None: unknown).

    Every operation may run with a driver fault armed (``fault``): it then
    either completes or leaves the cache exactly as it was (all or nothing),
    which the model checks by accepting the two outcomes and no other.
    """

    device = "cpu"
    driver: Driver

    def __init__(self) -> None:
        super().__init__()
        self.stats = StatisticsDriver(self.driver)
        self.faulty = FaultInjectingDriver(self.stats)
        self.cache = make_cache(self.device, self.faulty)
        self.committed = 0
        self.asleep_at: int | None = None
        # The count recommit() grows to after a commit while released.
        self.wake_to: int | None = None
        # model[(buffer, segment, block)] = value
        self.model: dict[tuple[int, int, int], int] = {}
        self.kept: dict[tuple[int, int, int], int] | None = None

    def _zero_blocks(self, start: int, end: int) -> None:
        for b, (buffer, _) in enumerate(self.cache.buffers):
            for s in range(buffer.num_segments):
                for i in range(start, end):
                    self.model[(b, s, i)] = 0

    def _grew_to(self, n: int) -> None:
        """The model after a commit of ``n`` blocks, or after a failed one
        (which must have committed all of them or none)."""
        now = self.cache.num_blocks_committed
        assert now in (self.committed, max(self.committed, n)), (now, self.committed, n)
        if now > self.committed:
            self._zero_blocks(self.committed, now)
            self.committed = now

    @rule(n=st.integers(0, CAPACITY), defragment=st.booleans(), fault=faults)
    def commit(self, n: int, defragment: bool, fault: Fault) -> None:
        if self.asleep_at is not None:
            self._commit_while_released(n, defragment, fault)
            return
        if not defragment:
            attempt(self.faulty, fault, lambda: self.cache.commit(n))
            self._grew_to(n)
            return
        # A defragmenting commit holds exactly n blocks after, zeroed (also
        # when it held exactly that already: no remap, but zeroed).
        done = attempt(self.faulty, fault, lambda: self.cache.commit(n, defragment=True))
        now = self.cache.num_blocks_committed
        if done:
            assert now == n
        else:
            assert now in (self.committed, n), (now, self.committed, n)
        self.model = {}
        if done:
            self._zero_blocks(0, n)
        self.committed = now
        if done:
            self.wake_to = None

    def _commit_while_released(self, n: int, defragment: bool, fault: Fault) -> None:
        done = attempt(self.faulty, fault, lambda: self.cache.commit(n, defragment=defragment))
        if self.cache.asleep:
            assert not done
            return
        asleep_at, self.asleep_at = self.asleep_at, None
        assert asleep_at is not None
        now = self.cache.num_blocks_committed
        if self.kept is not None:  # restored whole first, then committed
            self.model, self.kept = self.kept, None
            self.committed = asleep_at
            if defragment:
                assert now in (asleep_at, n)
                self.model, self.committed = {}, now
            else:
                self._grew_to(n)
            return
        self.model = {}
        self.committed = now
        if done:
            assert now == n
            self._zero_blocks(0, n)
        if not (done and defragment):
            self.wake_to = max(self.wake_to or 0, asleep_at)
        else:
            self.wake_to = None

    @precondition(lambda self: self.asleep_at is None)
    @rule(n=st.integers(0, 3 * CAPACITY), fault=faults)
    def ensure(self, n: int, fault: Fault) -> None:
        attempt(self.faulty, fault, lambda: self.cache.ensure_blocks(n))
        self._grew_to(min(n, CAPACITY))

    @precondition(lambda self: self.asleep_at is None and self.committed > 0)
    @rule(data=st.data(), value=st.integers(1, 255))
    def write(self, data: st.DataObject, value: int) -> None:
        b = data.draw(st.integers(0, len(self.cache.buffers) - 1))
        buffer, per_block = self.cache.buffers[b]
        s = data.draw(st.integers(0, buffer.num_segments - 1))
        i = data.draw(st.integers(0, self.committed - 1))
        block(buffer, per_block, s, i).fill_(value)
        self.model[(b, s, i)] = value

    @rule(preserve=st.booleans(), fault=faults)
    def release(self, preserve: bool, fault: Fault) -> None:
        was_asleep = self.asleep_at is not None
        attempt(self.faulty, fault, lambda: self.cache.release_physical(preserve=preserve))
        if not was_asleep and self.cache.asleep:
            self.asleep_at = self.committed
            self.committed = 0
            self.kept = dict(self.model) if preserve else None
            self.model = {}
        elif was_asleep and not preserve:
            self.kept = None  # a discarding sleep forgets the host copy

    @rule(keep_host_memory=st.booleans(), fault=faults)
    def recommit(self, keep_host_memory: bool, fault: Fault) -> None:
        done = attempt(
            self.faulty, fault, lambda: self.cache.recommit(keep_host_memory=keep_host_memory)
        )
        if self.asleep_at is not None and not self.cache.asleep:
            self.committed, self.asleep_at = self.asleep_at, None
            if self.kept is None:
                self._zero_blocks(0, self.committed)
            else:  # restored; blocks the model did not know stay unknown
                self.model = dict(self.kept)
        if self.asleep_at is None and self.wake_to is not None:
            self._grew_to(self.wake_to)
            if done:
                self.wake_to = None

    @precondition(lambda self: self.asleep_at is None)
    @rule(data=st.data(), fault=faults)
    def trim(self, data: st.DataObject, fault: Fault) -> None:
        n = data.draw(st.integers(0, self.committed))
        attempt(self.faulty, fault, lambda: self.cache.trim(n))
        now = self.cache.num_blocks_committed
        assert now in (self.committed, n), (now, self.committed, n)
        if now == n:
            self.wake_to = None
        self.committed = now
        self.model = {key: v for key, v in self.model.items() if key[2] < now}

    @precondition(lambda self: self.asleep_at is None)
    @rule(fault=faults)
    def defragment_preserving(self, fault: Fault) -> None:
        attempt(self.faulty, fault, lambda: self.cache.defragment(preserve=True))

    @precondition(lambda self: self.asleep_at is None)
    @rule(n=st.integers(0, CAPACITY), fault=faults)
    def commit_in_background(self, n: int, fault: Fault) -> None:
        attempt(self.faulty, fault, lambda: self.cache.commit_async(n).result().wait())
        self._grew_to(n)

    @invariant()
    def physical_memory_is_the_minimum(self) -> None:
        for buffer, per_block in self.cache.buffers:
            granule = buffer.buffer.granularity
            covering = set()
            for seg in range(buffer.num_segments if self.committed else 0):
                start = seg * buffer.segment_capacity_bytes
                end = start + self.committed * per_block
                covering |= set(range(start // granule, -(-end // granule)))
            assert buffer.physical_bytes == granule * len(covering)

    @invariant()
    def counts_match(self) -> None:
        assert self.cache.num_blocks_committed == self.committed
        assert self.cache.asleep == (self.asleep_at is not None)
        for buffer, per_block in self.cache.buffers:
            assert buffer.bytes_per_segment == self.committed * per_block
        if self.asleep_at is not None:
            assert self.cache.physical_bytes == 0
            # A handle whose release failed is kept (unmapped) for a retry.
            assert self.stats.live.mappings == 0

    @invariant()
    def blocks_hold_their_values(self) -> None:
        for (b, s, i), value in self.model.items():
            buffer, per_block = self.cache.buffers[b]
            content = block(buffer, per_block, s, i).cpu().numpy()
            assert np.all(content == value), (b, s, i, value)

    def teardown(self) -> None:
        self.cache.free()
        assert self.stats.live == LiveUsage()


def test_kv_state_machine(device: str, driver: Driver) -> None:
    machine = type("KVMachineOn", (KVMachine,), {"device": device, "driver": driver})
    run_state_machine_as_test(machine)


def test_add_all_joins_every_buffer_or_none(stats: StatisticsDriver, device: str) -> None:
    faulty = FaultInjectingDriver(stats)
    cache = make_cache(device, faulty)
    cache.commit(10)
    before = len(cache.buffers)
    extra = [(ExtensibleTensor(CAPACITY * 4096, device, driver=faulty), 4096) for _ in range(2)]
    faulty.fail_at("create", nth=2)  # the second buffer's commit
    with pytest.raises(Exception, match="injected"):
        cache.add_all(extra)
    assert len(cache.buffers) == before
    assert all(buffer.physical_bytes == 0 for buffer, _ in extra)
    with pytest.raises(ValueError, match="given twice"):
        cache.add_all([extra[0], extra[0]])
    cache.add_all(extra)
    assert [b.bytes_per_segment for b, _ in extra] == [10 * 4096, 10 * 4096]
    cache.free()
    assert stats.live.handles == 0


@pytest.mark.parametrize("keep_host_memory", [False, True])
def test_a_preserving_sleep_keeps_the_last_block_of_every_segment(
    stats: StatisticsDriver, device: str, keep_host_memory: bool
) -> None:
    """Every block filled with its own value, slept preserving and woken
    (twice, so a kept host copy is reused): every block, the last of each
    segment included, holds its value again."""
    cache = make_cache(device, stats)
    cache.commit(CAPACITY)

    def value(b: int, segment: int, index: int) -> int:
        return (b * 7 + segment * 3 + index) % 250 + 1

    for b, (buffer, per_block) in enumerate(cache.buffers):
        for segment in range(buffer.num_segments):
            for index in range(CAPACITY):
                block(buffer, per_block, segment, index).fill_(value(b, segment, index))
    for _ in range(2):
        cache.release_physical(preserve=True)
        assert cache.physical_bytes == 0
        cache.recommit(keep_host_memory=keep_host_memory)
        for b, (buffer, per_block) in enumerate(cache.buffers):
            for segment in range(buffer.num_segments):
                last = block(buffer, per_block, segment, CAPACITY - 1)
                assert last.eq(value(b, segment, CAPACITY - 1)).all(), (b, segment)
                for index in (0, CAPACITY // 2, CAPACITY - 2):
                    kept = block(buffer, per_block, segment, index)
                    assert kept.eq(value(b, segment, index)).all(), (b, segment, index)
    cache.free()


def test_a_discarding_sleep_after_a_preserving_one_forgets(
    stats: StatisticsDriver, device: str
) -> None:
    cache = make_cache(device, stats)
    cache.commit(8)
    for buffer, per_block in cache.buffers:
        block(buffer, per_block, 0, 7).fill_(5)
    cache.release_physical(preserve=True)
    assert cache.host_backup_bytes > 0
    cache.release_physical()  # discarding: the host copy goes too
    assert cache.host_backup_bytes == 0
    cache.recommit()
    assert cache.num_blocks_committed == 8
    for buffer, per_block in cache.buffers:
        assert int(block(buffer, per_block, 0, 7).count_nonzero()) == 0
    cache.free()


ASLEEP_CALLS = {
    "register_external": "cache.register_external('nixl')",
    "unregister_external": "cache.unregister_external('nixl')",
    "add": "cache.add(ExtensibleTensor(CAP * 4096, 'cpu'), 4096)",
    "add_all": "cache.add_all([(ExtensibleTensor(CAP * 4096, 'cpu'), 4096)])",
    "wait_for_streams": "cache.wait_for_streams(None)",
    "trim": "cache.trim(2)",
    "defragment": "cache.defragment(preserve=True)",
    "defragment_discarding": "cache.defragment(preserve=False)",
    "create_ahead": "cache.create_ahead(8).result()",
    "release_physical": "cache.release_physical(preserve=True)",
    "narrowed_views": "kv.narrowed_views()",
}


@pytest.mark.parametrize("call", sorted(ASLEEP_CALLS))
def test_no_call_kills_the_process_while_asleep(call: str) -> None:
    """Every public call of a KV cache asleep after a preserving sleep works
    or raises a ValueError; none touches unmapped memory (which would end the
    process with SIGSEGV, so each runs in a process of its own). The cache
    wakes with its contents after."""
    program = f"""
import torch
from extensible_kv import ExtensibleTensor
from extensible_kv.kv import (AttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheTensor,
                              KVSplitBackend, allocate_kv_cache)
CAP = 64
spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
config = KVCacheConfig(CAP, (KVCacheTensor(CAP * spec.page_size_bytes, ("a",)),),
                       (KVCacheGroup(("a",), spec),))
kv = allocate_kv_cache(config, KVSplitBackend, "cpu")
cache = kv.cache
cache.commit(8)
kv.views["a"][:, :8].fill_(3)
cache.release_physical(preserve=True)
try:
    {ASLEEP_CALLS[call]}
    print("worked")
except ValueError as exc:
    print("refused:", exc)
cache.recommit()
assert bool(kv.views["a"][:, :8].eq(3).all()), "the contents were lost"
print("woke")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines()[-1] == "woke"


def test_a_failed_release_in_one_batch_of_a_preserving_defragment_leaves_it_done(
    device: str, driver: Driver
) -> None:
    """Past the point of no return a failure does not stop the work: a
    handle whose release fails in the first tensor's remap is kept for a
    retry, and the later tensors are still defragmented."""
    per_block = 256 << 10

    def three(inner: Driver) -> KVCacheBuffers:
        tensors = [
            (
                ExtensibleTensor(CAPACITY * per_block * 2, device, num_segments=2, driver=inner),
                per_block,
            )
            for _ in range(3)
        ]
        cache = KVCacheBuffers(tensors, CAPACITY)
        cache.commit(8)
        cache.commit(21)
        return cache

    def chunks(cache: KVCacheBuffers) -> list[int]:
        return [len(tensor.buffer.chunks) for tensor, _ in cache.buffers]

    clean = three(driver)
    clean.defragment(preserve=True)
    expected = chunks(clean)
    clean.free()
    faulty = FaultInjectingDriver(driver)
    cache = three(faulty)
    for buffer, per_block_ in cache.buffers:
        block(buffer, per_block_, 1, 20).fill_(9)
    faulty.fail_at("release", 1)
    with pytest.raises(DriverError, match="injected"):
        cache.defragment(preserve=True)
    assert chunks(cache) == expected
    for buffer, per_block_ in cache.buffers:
        assert block(buffer, per_block_, 1, 20).eq(9).all()
    cache.free()
