"""Driver faults inside the Hypothesis state machines: a fault is armed for
one operation, which must then complete or leave everything as it was."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from extensible_kv import DriverError, FaultInjectingDriver

#: A driver call and which of its calls fails, or None for no fault.
Fault = tuple[str, int] | None


def fault_strategy(calls: tuple[str, ...]) -> st.SearchStrategy[Fault]:
    """No fault, or one of ``calls`` failing at its 1st to 5th call."""
    return st.none() | st.tuples(st.sampled_from(calls), st.integers(1, 5))


def attempt(faulty: FaultInjectingDriver, fault: Fault, operation: Callable[[], object]) -> bool:
    """Run ``operation`` with ``fault`` armed; True if it raised nothing.

    Only the injected failure is swallowed; any other error propagates.
    """
    if fault is not None:
        faulty.fail_at(*fault)
    try:
        operation()
    except DriverError as exc:
        if "injected" not in str(exc):
            raise
        return False
    finally:
        faulty.clear()
    return True
