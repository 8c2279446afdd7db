"""The give-way case's arithmetic (``extensible_kv/bench/give_way.py``),
with no engine: a run's figures from its turns, the spread over rounds,
and the goal, met only when every way gave way within a second and no want
went unmet. The case itself runs in ``tests/test_vllm_give_way.py``."""

from __future__ import annotations

from typing import Any

from extensible_kv.bench import give_way


def turn(rooms: list[float | None], idle: float = 44.0, least: float = 8.0) -> dict[str, Any]:
    return {
        "b_idle_mib": idle,
        "b_least_mib": least,
        "rooms_s": rooms,
        "completed": 16,
        "errors": [],
    }


def test_a_runs_figures_count_every_want_and_the_slowest_that_came() -> None:
    run = give_way.figures([turn([0.2, None]), turn([0.6], idle=40.0, least=12.0)])
    assert run["wants"] == 3
    assert run["unmet"] == 1
    assert run["room_s"] == 0.6
    assert run["room_median_s"] == 0.4
    assert run["b_idle_mib"] == 42.0
    assert run["b_least_mib"] == 10.0
    assert run["completed"] == 32


def test_a_run_with_no_want_has_no_room_time() -> None:
    run = give_way.figures([turn([]), turn([])])
    assert run["wants"] == 0
    assert run["room_s"] is None


def summary(rooms: dict[str, list[float | None]]) -> dict[str, Any]:
    runs = {way: [give_way.figures([turn(rooms[way])])] for way in give_way.WAYS}
    return give_way.summary(runs)


def test_the_goal_is_met_only_if_every_way_gives_way_within_a_second() -> None:
    fast = {way: [0.3] for way in give_way.WAYS}
    assert summary(fast)["goal"]["met"]
    slow = fast | {"program-tp2": [1.4]}
    result = summary(slow)
    assert not result["goal"]["met"]
    assert "program-tp2 1.40 s" in result["goal"]["measured"]


def test_a_want_never_met_fails_the_goal_and_is_named() -> None:
    unmet = {way: [0.3] for way in give_way.WAYS} | {"program": [0.3, None]}
    result = summary(unmet)
    assert not result["goal"]["met"]
    assert "program 0.30 s (1 unmet)" in result["goal"]["measured"]


def test_the_table_has_a_row_per_figure_and_the_goal() -> None:
    table = give_way.rows(summary({way: [0.25] for way in give_way.WAYS}))
    assert table[0] == ["figure", *(f"B as {way}" for way in give_way.WAYS)]
    assert len(table) == 1 + len(give_way.FIGURES) + 1
    assert all(len(row) == len(table[0]) for row in table)
    assert table[-1][2] == "met"
    assert "| figure |" in give_way.markdown(summary({way: [0.25] for way in give_way.WAYS}))
