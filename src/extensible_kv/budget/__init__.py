"""A memory budget per device, shared by every process of the user: the
state directory, each device's ledger (limit and claims), which processes
live, and what each publishes for ``extensible-kv top``.

Its adaptor, :class:`~extensible_kv.budget.adaptor.BudgetDriver`, claims
through it; the ``extensible-kv limit`` and ``top`` commands read and write
it. Only the adaptor calls a driver (the one below it).
"""

from extensible_kv.budget.holders import STALLED_S, Holder, LedgerView, Limit, StaleRevisionError
from extensible_kv.budget.ledger import Ledger
from extensible_kv.budget.sizes import format_bytes, parse_size
from extensible_kv.budget.snapshot import SCHEMA_VERSION, snapshot
from extensible_kv.budget.state_dir import STATE_DIR_ENV, StateDirError, state_dir

__all__ = [
    "SCHEMA_VERSION",
    "STALLED_S",
    "STATE_DIR_ENV",
    "Holder",
    "Ledger",
    "LedgerView",
    "Limit",
    "StaleRevisionError",
    "StateDirError",
    "format_bytes",
    "parse_size",
    "snapshot",
    "state_dir",
]
