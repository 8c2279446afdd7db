"""The composition root: the driver stack every tensor and cache gets by
default, a device's backend under the budget shared by every process
(:class:`~extensible_kv.budget.adaptor.BudgetDriver`). The one module that
puts the driver and the budget together; below it ``driver/`` knows no budget.
"""

from __future__ import annotations

import threading

from extensible_kv.budget.adaptor import BudgetDriver, waiting_for_budget
from extensible_kv.driver.protocol import Driver
from extensible_kv.driver.select import backend

__all__ = ["BudgetDriver", "get_driver", "waiting_for_budget"]

_budgets_lock = threading.Lock()
#: The budget adaptor over each backend, by the backend's id (backends live
#: as long as the process).
_budgets: dict[int, BudgetDriver] = {}


def get_driver(device: object) -> Driver:
    """The shared driver for ``device``'s type: its backend under a
    :class:`~extensible_kv.budget.adaptor.BudgetDriver`, so that every
    process's commits count against the device's shared limit
    (``extensible-kv limit``) and show in ``extensible-kv top``. Raises
    :class:`~extensible_kv.driver.BackendUnavailableError` saying why when
    there is none."""
    return _with_budget(backend(device))


def _with_budget(below: Driver) -> BudgetDriver:
    with _budgets_lock:
        found = _budgets.get(id(below))
        if found is None or found.inner is not below:
            found = _budgets[id(below)] = BudgetDriver(below)
        return found
