"""Batches in flight (integrations/vllm/scheduler/in_flight.py, no vLLM needed): a
unit a request gave back while batches ran stays pinned until every batch
scheduled by then has finished, against a model that keeps, per unit, the
batches that were running when its blocks came back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extensible_kv.integrations.vllm.scheduler.in_flight import BatchesInFlight

#: A step of the engine: schedule a batch, finish the oldest, or give back
#: blocks of some units.
steps = st.lists(
    st.one_of(
        st.just("schedule"),
        st.just("finish"),
        st.frozensets(st.integers(0, 5), min_size=1, max_size=3),
    ),
    max_size=40,
)


@given(steps)
def test_a_unit_stays_pinned_exactly_while_a_batch_running_at_its_give_back_runs(
    steps: list[str | frozenset[int]],
) -> None:
    batches = BatchesInFlight()
    running: list[int] = []  # batch numbers in flight, oldest first
    waits: dict[int, set[int]] = {}  # unit -> batches it waits for
    for step in steps:
        if step == "schedule":
            batches.batch_scheduled()
            running.append(batches.scheduled)
        elif step == "finish":
            if not running:
                continue
            done = running.pop(0)
            batches.batch_finished()
            for waiting in waits.values():
                waiting.discard(done)
        else:
            assert isinstance(step, frozenset)
            batches.given_back(step)
            for unit in step:
                waits[unit] = waits.get(unit, set()) | set(running)
        for unit in range(6):
            assert batches.pinned(unit) == bool(waits.get(unit)), (unit, waits, running)
        assert batches.any_pinned == any(waits.values())


def test_nothing_is_pinned_with_no_batch_running() -> None:
    batches = BatchesInFlight()
    batches.given_back([1, 2])
    assert not batches.any_pinned
    batches.batch_scheduled()
    batches.given_back([1])
    batches.batch_scheduled()
    batches.given_back([2])
    batches.batch_finished()
    assert not batches.pinned(1)
    assert batches.pinned(2)
    batches.batch_finished()
    assert not batches.any_pinned
