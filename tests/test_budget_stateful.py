"""A Hypothesis state machine drives a KV cache under a device budget whose
limit changes between steps, against a block-level model, and checks the
budget's promises (docs/budget.md, "Three promises") after every step:

1. no step that adds memory leaves the device's claims past its limit; only
   a trim may claim past it while it runs, and it ends lower than it began;
2. a step the budget refuses (``BudgetExceededError``) leaves the cache as
   it was: the same blocks, contents, memory, claim, addresses and state
   (awake or asleep, with or without its host copy);
3. what this process claims through the cache's driver equals the memory
   the cache holds, after every step, refused or not.

Every step that succeeds moves the model: a grow adds zeroed blocks, a
defragmenting commit zeroes all, a trim keeps the prefix, a preserving sleep
and its wake keep every block, a discarding one zeroes them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from extensible_kv import BudgetDriver, BudgetExceededError, ExtensibleTensor, KVCacheBuffers
from extensible_kv.budget import Ledger
from extensible_kv.driver import backend

MiB = 1 << 20
GRANULE = 2 * MiB
BLOCK = 256 * 1024  # 8 blocks per granule
CAPACITY = 24  # blocks: 3 granules per segment
SEGMENTS = 4  # two buffers of two segments (K and V of two layers)
limits = st.sampled_from([None, 4, 8, 12, 16, 20, 24, 32, 40]).map(
    lambda mib: None if mib is None else mib * MiB
)
counts = st.integers(0, CAPACITY)


class BudgetMachine(RuleBasedStateMachine):
    """One cache on ``budget``, which every run shares: a ledger takes a
    slot per budget, for the life of the process."""

    def __init__(self, budget: BudgetDriver) -> None:
        super().__init__()
        self.budget = budget
        self.ledger: Ledger = self.budget.ledger(0)
        self.ledger.set_limit(None)
        assert self.ledger.held == 0  # the last run's cache gave everything back
        tensors = [
            ExtensibleTensor(CAPACITY * BLOCK * 2, "cpu", num_segments=2, driver=self.budget)
            for _ in range(2)
        ]
        self.cache = KVCacheBuffers([(t, BLOCK) for t in tensors], CAPACITY)
        self.views = [t.segment(s) for t in tensors for s in range(2)]
        self.addresses = self.cache.base_ptrs
        #: Each segment's committed blocks' fill byte; asleep: what the wake restores.
        self.blocks = np.zeros((SEGMENTS, 0), dtype=np.uint8)
        #: None awake; else whether the sleep kept a host copy.
        self.asleep: bool | None = None

    def teardown(self) -> None:
        self.cache.free()
        self.ledger.set_limit(None)

    # -- the model ---------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.cache.num_blocks_committed,
            self.cache.asleep,
            self.cache.physical_bytes,
            self.cache.host_backup_bytes,
            self.ledger.held,
            self.cache.base_ptrs,
            self.blocks.shape[1],
        )

    def step(self, action: Callable[[], None], *, trims: bool = False) -> bool:
        """Run ``action``; True if it ran, False if the budget refused it
        (and then nothing changed)."""
        before, claimed = self.snapshot(), self.ledger.read().claimed_bytes
        try:
            action()
        except BudgetExceededError:
            assert self.snapshot() == before
            self.check_contents()
            return False
        after, limit = self.ledger.read().claimed_bytes, self.ledger.limit().bytes
        if limit is not None and after > claimed and not trims:
            assert after <= limit, (after, limit)
        return True

    def grown(self, count: int) -> None:
        old = self.blocks.shape[1]
        if count > old:
            zeros = np.zeros((SEGMENTS, count - old), dtype=np.uint8)
            self.blocks = np.concatenate([self.blocks, zeros], axis=1)

    # -- rules -------------------------------------------------------------------

    @rule(limit=limits)
    def set_limit(self, limit: int | None) -> None:
        self.ledger.set_limit(limit)

    @precondition(lambda self: self.asleep is None and self.blocks.shape[1] > 0)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        segment = data.draw(st.integers(0, SEGMENTS - 1))
        block = data.draw(st.integers(0, self.blocks.shape[1] - 1))
        value = data.draw(st.integers(1, 255))
        self.views[segment][block * BLOCK : (block + 1) * BLOCK].fill_(value)
        self.blocks[segment, block] = value

    @precondition(lambda self: self.asleep is None)
    @rule(count=counts)
    def commit(self, count: int) -> None:
        if self.step(lambda: self.cache.commit(count)):
            self.grown(count)

    @precondition(lambda self: self.asleep is None)
    @rule(count=counts)
    def defragmenting_commit(self, count: int) -> None:
        if self.step(lambda: self.cache.commit(count, defragment=True)):
            self.blocks = np.zeros((SEGMENTS, count), dtype=np.uint8)

    @precondition(lambda self: self.asleep is None)
    @rule(fraction=st.floats(0, 1))
    def trim(self, fraction: float) -> None:
        count = round(self.blocks.shape[1] * fraction)
        assert self.step(lambda: self.cache.trim(count), trims=True)  # never refused
        self.blocks = self.blocks[:, :count]

    @precondition(lambda self: self.asleep is None)
    @rule(preserve=st.booleans())
    def sleep(self, preserve: bool) -> None:
        if self.step(lambda: self.cache.release_physical(preserve=preserve)):
            self.asleep = preserve

    @precondition(lambda self: self.asleep is not None)
    @rule()
    def wake(self) -> None:
        if self.step(self.cache.recommit):
            if not self.asleep:
                self.blocks[:] = 0
            self.asleep = None

    @precondition(lambda self: self.asleep is not None)
    @rule(count=counts)
    def wake_to(self, count: int) -> None:
        if not self.step(lambda: self.cache.recommit(num_blocks=count)):
            return
        if self.asleep:  # the copy comes back whole, then grows
            self.grown(count)
        else:
            self.blocks = np.zeros((SEGMENTS, count), dtype=np.uint8)
        self.asleep = None

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def claims_follow_memory(self) -> None:
        assert self.ledger.held == self.cache.physical_bytes

    @invariant()
    def addresses_never_move(self) -> None:
        assert self.cache.base_ptrs == self.addresses

    @invariant()
    def state_matches_the_model(self) -> None:
        assert self.cache.asleep == (self.asleep is not None)
        if self.asleep is None:
            assert self.cache.num_blocks_committed == self.blocks.shape[1]
            granules = -(-self.blocks.shape[1] * BLOCK // GRANULE)
            assert self.cache.physical_bytes == SEGMENTS * granules * GRANULE
        else:
            assert self.cache.physical_bytes == 0

    @invariant()
    def check_contents(self) -> None:
        if self.asleep is not None:
            return
        for segment, view in enumerate(self.views):
            for block, value in enumerate(self.blocks[segment]):
                got = view[block * BLOCK : (block + 1) * BLOCK]
                assert bool((got == int(value)).all()), (segment, block, int(value))


def test_the_budget_keeps_its_promises_under_changing_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    budget = BudgetDriver(backend("cpu"), state_dir=tmp_path)
    run_state_machine_as_test(lambda: BudgetMachine(budget))
