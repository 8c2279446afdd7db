"""Ratios of paired measurements, and whether they settle a goal.

A benchmark on a shared machine compares ours with stock side by side: each
measurement of ours is paired with one of stock taken just before or after
it, so that a slow spell of the machine weighs on both sides of a ratio.
This module summarizes such pairs (:func:`spread`, :func:`paired_ratios`,
:func:`ratio_figures`) and says whether they decide a goal (:func:`decided`),
using a distribution-free interval for their median (:func:`median_interval`)
where there are enough of them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: The confidence of :func:`median_interval` in :func:`ratio_figures`.
CONFIDENCE = 0.95


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """min, median and max; None for a figure this kind does not have (a
    value None, or no values)."""
    if not values or any(value is None for value in values):
        return None
    numbers = [float(value) for value in values if value is not None]
    return {"min": min(numbers), "median": statistics.median(numbers), "max": max(numbers)}


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median of what ``values`` sample:
    order statistics ``k`` and ``n + 1 - k``, with the largest ``k`` for which
    they straddle the median with at least ``confidence`` (the sign test's
    binomial). With too few values for that, ``(min, max)``."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    k = 1
    while k < (n + 1) // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def _coverage(n: int, k: int) -> float:
    """The chance that order statistics ``k`` and ``n + 1 - k`` of ``n``
    values straddle their median: 1 - 2 P(Binomial(n, 1/2) < k)."""
    tail = sum(math.comb(n, i) for i in range(k))
    return 1.0 - 2.0 * tail / float(2**n)


def ratio_figures(ours: Sequence[float], stock: Sequence[float]) -> dict[str, float] | None:
    """Ours over stock, pair by pair: min, median, max, and the
    :func:`median_interval` as ``low`` and ``high``; None where a side
    lacks the figure or stock's is zero."""
    if any(o is None for o in ours) or any(not s for s in stock):
        return None
    ratios = [o / s for o, s in zip(ours, stock, strict=True)]
    summary = spread(ratios)
    assert summary is not None
    low, high = median_interval(ratios)
    return {**summary, "low": low, "high": high}


def paired_ratios(
    ours: list[dict[str, Any]], stock: list[dict[str, Any]], key: str
) -> dict[str, float] | None:
    """Figure ``key``'s :func:`ratio_figures`, ours over stock, run by run
    (run ``i`` of each side is a pair)."""
    return ratio_figures([o[key] for o in ours], [s[key] for s in stock])


def decided(ratio: dict[str, float], goal: float, *, at_most: bool = False) -> str:
    """Whether ``ratio`` (:func:`ratio_figures`) settles ``ratio >= goal``
    (``ratio <= goal`` with ``at_most``): ``"met"`` when the interval for
    its median lies wholly on the goal's side, ``"not met"`` when wholly on
    the other, ``"undecided"`` when it straddles the goal."""
    low, high = ratio["low"], ratio["high"]
    if at_most:
        low, high, goal = -high, -low, -goal
    if low >= goal:
        return "met"
    if high < goal:
        return "not met"
    return "undecided"
