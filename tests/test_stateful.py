"""A Hypothesis state machine drives ExtensibleTensor against a byte-level model.

After every step it checks docs/design.md section 7:

1. ``base_ptr`` is constant from construction to ``free()``;
2. each segment's committed bytes are a prefix, and all of it is backed;
3. committed data survives every grow (and every shrink, for the kept prefix);
5. ``physical_bytes`` is granularity x mapped granules, and the mapped
   granules are exactly those covering committed bytes (a shrink maps a
   straddling chunk again smaller);
6. after ``free()`` and the last view, the driver holds nothing of ours; after
   a release, no handle;
7. a failed driver call changes nothing observable: every operation may run
   with a driver fault armed, and must then either complete or leave the
   tensor as it was (the model accepts those two outcomes and no other);
8. the address range outlives every view.

A tensor may sit on a handle pool (``PoolingDriver``) above the faults:
then freed memory may wait in the pool, and a release drains it.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from extensible_kv import (
    ExtensibleTensor,
    FaultInjectingDriver,
    PoolingDriver,
    StatisticsDriver,
)
from extensible_kv.driver import Driver, LiveUsage
from faults import Fault, attempt, fault_strategy


class SegmentModel:
    """What one segment's committed prefix must hold; unknown bytes unchecked."""

    def __init__(self) -> None:
        self.data = np.zeros(0, dtype=np.uint8)
        self.known = np.zeros(0, dtype=bool)

    def grow(self, size: int, zeroed: bool) -> None:
        extra = size - len(self.data)
        self.data = np.concatenate([self.data, np.zeros(extra, dtype=np.uint8)])
        self.known = np.concatenate([self.known, np.full(extra, zeroed)])

    def cut(self, size: int) -> None:
        self.data = self.data[:size]
        self.known = self.known[:size]


#: Driver calls a fault may hit inside the machine's operations.
FAULT_CALLS = ("create", "map", "set_access", "unmap", "release", "free_reserved", "context")
faults = fault_strategy(FAULT_CALLS)


def make_machine(device: str, driver: Driver) -> type[RuleBasedStateMachine]:
    granularity = driver.granularity(0, False)

    class TensorMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.stats = StatisticsDriver(driver)
            self.faulty = FaultInjectingDriver(self.stats)
            self.et: ExtensibleTensor | None = None
            self.pool: PoolingDriver | None = None
            self.views: list[torch.Tensor] = []

        def settle(self, old: int, new: int) -> int:
            """After a failed size change: the size is the old or the new one."""
            now = self.tensor.bytes_per_segment
            assert now in (old, new), (now, old, new)
            return now

        @precondition(lambda self: self.et is None or (self.freed and not self.views))
        @rule(
            num_segments=st.integers(1, 3),
            granules=st.integers(1, 3),
            extra=st.sampled_from([0, 1, 4096, granularity // 2 + 3]),
            chunked=st.booleans(),
            zero_backed=st.booleans(),
            pooled=st.booleans(),
        )
        def create(
            self,
            num_segments: int,
            granules: int,
            extra: int,
            chunked: bool,
            zero_backed: bool,
            pooled: bool,
        ) -> None:
            cap = granules * granularity + extra
            if self.pool is not None:
                self.pool.drain()
            self.pool = PoolingDriver(self.faulty, cap_bytes=4 * granularity) if pooled else None
            self.et = ExtensibleTensor(
                cap * num_segments,
                device,
                num_segments=num_segments,
                driver=self.pool or self.faulty,
                chunk_bytes=granularity if chunked else None,
                zero_backed=zero_backed,
            )
            self.base = self.et.base_ptr
            self.models = [SegmentModel() for _ in range(num_segments)]
            self.freed = False

        def alive(self) -> bool:
            return self.et is not None and not self.freed

        @property
        def tensor(self) -> ExtensibleTensor:
            assert self.et is not None
            return self.et

        def fraction_of(self, lo: int, hi: int, fraction: float) -> int:
            return lo + round((hi - lo) * fraction)

        @precondition(alive)
        @rule(fraction=st.floats(0, 1), zero_new=st.booleans(), fault=faults)
        def resize_per_segment(self, fraction: float, zero_new: bool, fault: Fault) -> None:
            et = self.tensor
            old = et.bytes_per_segment
            size = self.fraction_of(old, et.segment_capacity_bytes, fraction)
            attempt(self.faulty, fault, lambda: et.resize_per_segment_(size, zero_new=zero_new))
            now = self.settle(old, size)
            for model in self.models:
                model.grow(now, zero_new)

        @precondition(lambda self: self.alive() and self.tensor.num_segments == 1)
        @rule(fraction=st.floats(0, 1))
        def resize(self, fraction: float) -> None:
            et = self.tensor
            size = self.fraction_of(et.num_bytes, et.segment_capacity_bytes, fraction)
            assert et.resize_(size).shape == (size,)
            self.models[0].grow(size, False)

        @precondition(lambda self: self.alive() and self.tensor.num_segments == 1)
        @rule(fraction=st.floats(0, 1))
        def append(self, fraction: float) -> None:
            et = self.tensor
            extra = self.fraction_of(0, et.segment_capacity_bytes - et.num_bytes, fraction)
            assert et.append(extra).shape == (et.num_bytes,)
            self.models[0].grow(et.num_bytes, False)

        @precondition(alive)
        @rule(fraction=st.floats(0, 1), fault=faults)
        def shrink(self, fraction: float, fault: Fault) -> None:
            et = self.tensor
            old = et.bytes_per_segment
            size = self.fraction_of(0, old, fraction)
            physical = et.physical_bytes
            attempt(self.faulty, fault, lambda: et.shrink_per_segment_(size))
            assert (physical - et.physical_bytes) % granularity == 0
            now = self.settle(old, size)
            for model in self.models:
                model.cut(now)

        @precondition(lambda self: self.alive() and self.tensor.bytes_per_segment > 0)
        @rule(data=st.data(), value=st.integers(0, 255))
        def write(self, data: st.DataObject, value: int) -> None:
            et = self.tensor
            segment = data.draw(st.integers(0, et.num_segments - 1))
            start = data.draw(st.integers(0, et.bytes_per_segment - 1))
            end = data.draw(st.integers(start + 1, et.bytes_per_segment))
            offset = segment * et.segment_capacity_bytes
            et.full_view()[offset + start : offset + end] = value
            self.models[segment].data[start:end] = value
            self.models[segment].known[start:end] = True

        @precondition(alive)
        @rule(preserve=st.booleans(), fault=faults)
        def defragment(self, preserve: bool, fault: Fault) -> None:
            et = self.tensor
            if not attempt(self.faulty, fault, lambda: et.defragment_(preserve=preserve)):
                assert et.bytes_per_segment == len(self.models[0].data)
                if not preserve:  # zeroed if the defragment ran before the fault
                    for model in self.models:
                        model.known[:] = False
                return
            for i in range(et.num_segments if et.bytes_per_segment else 0):
                start = i * et.segment_capacity_bytes
                end = start + et.bytes_per_segment
                holding = [c for c in et.buffer.chunks if c.offset < end and start < c.end]
                assert len(holding) == 1, "one chunk per segment prefix"
            if not preserve:
                for model in self.models:
                    model.data[:] = 0
                    model.known[:] = True

        @precondition(alive)
        @rule(fault=faults)
        def release(self, fault: Fault) -> None:
            old = self.tensor.bytes_per_segment
            if attempt(self.faulty, fault, self.tensor.release_physical):
                assert self.stats.live.handles == 0
            now = self.settle(old, 0)
            for model in self.models:
                model.cut(now)

        @precondition(alive)
        @rule(prefix=st.booleans())
        def make_view(self, prefix: bool) -> None:
            et = self.tensor
            view = et.tensor if prefix and et.num_segments == 1 else et.full_view()
            assert view.numel() == 0 or view.data_ptr() == self.base
            self.views.append(view)

        @precondition(lambda self: bool(self.views))
        @rule(data=st.data())
        def drop_view(self, data: st.DataObject) -> None:
            self.views.pop(data.draw(st.integers(0, len(self.views) - 1)))

        @precondition(alive)
        @rule(fault=faults)
        def free(self, fault: Fault) -> None:
            if not attempt(self.faulty, fault, self.tensor.free):
                # A failure past the release leaves it done; a retry finishes.
                self.tensor.free()
            self.freed = True
            assert self.tensor.base_ptr == 0

        # -- invariants --------------------------------------------------------

        @invariant()
        def base_pointer_is_constant(self) -> None:
            if self.alive():
                assert self.tensor.base_ptr == self.base

        @invariant()
        def committed_prefixes_are_backed(self) -> None:
            if not self.alive():
                return
            et, buffer = self.tensor, self.tensor.buffer
            for i in range(et.num_segments):
                offset = i * et.segment_capacity_bytes
                backed = sum(size for _, size in buffer.mapped_in(offset, et.bytes_per_segment))
                assert backed == et.bytes_per_segment

        @invariant()
        def committed_data_survives(self) -> None:
            if not self.alive() or self.tensor.num_bytes == 0:
                return
            et = self.tensor
            full = et.full_view()
            for i, model in enumerate(self.models):
                offset = i * et.segment_capacity_bytes
                actual = full[offset : offset + et.bytes_per_segment].cpu().numpy()
                assert len(model.data) == et.bytes_per_segment
                assert np.array_equal(actual[model.known], model.data[model.known])

        @invariant()
        def uncommitted_bytes_read_zero_when_zero_backed(self) -> None:
            if not self.alive() or not self.tensor.buffer.zero_backed:
                return
            buffer = self.tensor.buffer
            full = self.tensor.full_view()
            cursor = 0
            for offset, size in [*buffer.mapped_runs, (buffer.size, 0)]:
                gap = full[cursor : min(offset, full.numel())]
                assert int(gap.count_nonzero()) == 0, (cursor, offset)
                cursor = offset + size

        @invariant()
        def physical_bytes_match_the_mapped_granules(self) -> None:
            if not self.alive():
                return
            et, buffer = self.tensor, self.tensor.buffer
            chunks = buffer.chunks
            mapped = {
                g for c in chunks for g in range(c.offset // granularity, c.end // granularity)
            }
            assert et.physical_bytes == granularity * len(mapped)
            assert et.physical_bytes == self.stats.live.mapped_bytes
            covering = set()
            for i in range(et.num_segments if et.bytes_per_segment else 0):
                start = i * et.segment_capacity_bytes
                end = start + et.bytes_per_segment
                covering |= set(range(start // granularity, -(-end // granularity)))
            # A shrink maps straddling chunks again smaller, so nothing more
            # than the granules covering committed bytes stays mapped.
            assert mapped == covering

        @invariant()
        def nothing_leaks(self) -> None:
            if self.et is None:
                return
            live = self.stats.live
            if self.freed:
                idle = self.pool.idle_handles if self.pool is not None else 0
                assert live.handles == idle, "freed memory is gone, or idle in the pool"
                assert live.mappings == 0
                expected = 1 if self.views else 0
                assert live.reservations == expected, "the range must outlive every view"
            else:
                # Plus scratch reservations a failed remap could not return
                # yet: the buffer's next call returns them.
                assert live.reservations == 1 + len(self.tensor.buffer._leftovers)

        def teardown(self) -> None:
            if self.et is not None:
                self.et.free()
            if self.pool is not None:
                self.pool.drain()
            self.views.clear()
            assert self.stats.live == LiveUsage()

    return TensorMachine


def test_extensible_tensor_state_machine(device: str, driver: Driver) -> None:
    run_state_machine_as_test(make_machine(device, driver))
