"""IntervalSet against a plain set of integers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extensible_kv.intervals import IntervalSet

spans = st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1]))
ops = st.lists(st.tuples(st.booleans(), spans), max_size=30)


def runs_of(members: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for x in sorted(members):
        if runs and runs[-1][1] == x:
            runs[-1] = (runs[-1][0], x + 1)
        else:
            runs.append((x, x + 1))
    return runs


@given(ops, spans)
def test_matches_a_set_of_integers(
    operations: list[tuple[bool, tuple[int, int]]], query: tuple[int, int]
) -> None:
    intervals, model = IntervalSet(), set()
    for adding, (start, end) in operations:
        if adding:
            intervals.add(start, end)
            model |= set(range(start, end))
        else:
            intervals.remove(start, end)
            model -= set(range(start, end))
        assert list(intervals) == runs_of(model)
        assert intervals.total == len(model)
    lo, hi = query
    inside = model & set(range(lo, hi))
    assert intervals.overlaps(lo, hi) == runs_of(inside)
    assert intervals.gaps(lo, hi) == runs_of(set(range(lo, hi)) - inside)


def test_clear_empties_the_set() -> None:
    intervals = IntervalSet()
    intervals.add(0, 5)
    intervals.add(7, 9)
    intervals.clear()
    assert list(intervals) == []
    assert intervals.total == 0
    assert len(intervals) == 0
