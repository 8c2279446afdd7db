"""Where the vLLM integration meets the library below it: the one module of
``integrations/vllm/`` that imports the rest of extensible-kv (``kv/``, the
budget, the default driver stack, the package root's helpers). Every other
module of the package takes what it uses of the library from here, so what
the integration leans on is this one list (``tests/test_structure.py``
checks it).

Most names are the library's own, passed on unchanged; the functions below
are what the integration needs that the library offers only by reaching
through its objects.
"""

from __future__ import annotations

import torch

from extensible_kv import granule_size, unavailable_reason, waiting_for_budget
from extensible_kv._checks import check_bool, check_int
from extensible_kv.budget import Ledger, snapshot, state_dir
from extensible_kv.budget.sizes import format_bytes
from extensible_kv.budget.stall import StallWatch
from extensible_kv.budget.state_dir import StateDirError
from extensible_kv.devices import get_driver, resolve_device, without_wants
from extensible_kv.driver import Driver, PoolingDriver
from extensible_kv.intervals import IntervalSet
from extensible_kv.kept import KeptCache, SpareKeeper, adopt, drop, kept_caches, name, start_keeper
from extensible_kv.kept.record import kept_dir
from extensible_kv.kv import (
    KVCache,
    KVCacheBuffers,
    OnDemandGrowth,
    allocate_kv_cache,
    at_capacity,
)
from extensible_kv.kv.growth import (
    ElasticBlocks,
    ElasticOrders,
    ElasticReport,
    UnitRanges,
    ranges_of,
    units_of,
)
from extensible_kv.kv.layouts import segmentation

__all__ = [
    "Driver",
    "ElasticBlocks",
    "ElasticOrders",
    "ElasticReport",
    "IntervalSet",
    "KVCache",
    "KVCacheBuffers",
    "Ledger",
    "StallWatch",
    "OnDemandGrowth",
    "PoolingDriver",
    "StateDirError",
    "UnitRanges",
    "accounting_of",
    "allocate_kv_cache",
    "at_capacity",
    "KeptCache",
    "SpareKeeper",
    "adopt",
    "check_bool",
    "drop",
    "kept_caches",
    "kept_dir",
    "name",
    "start_keeper",
    "check_int",
    "format_bytes",
    "get_driver",
    "granule_size",
    "ledger_of",
    "ranges_of",
    "segmentation",
    "snapshot",
    "units_of",
    "state_dir",
    "unavailable_reason",
    "waiting_for_budget",
    "without_wants",
]


def accounting_of(cache: KVCacheBuffers) -> tuple[str, str] | None:
    """Where the memory of ``cache`` is claimed: its device's name in every
    process and the budget's state directory (the driver protocol's
    ``accounting``, asked of the stack under the cache's first buffer);
    None before a claim opened the ledger, or with no budget in the stack."""
    tensor = cache.tensors[0][0]
    return tensor.buffer.driver.accounting(tensor.buffer.device)


def ledger_of(device: torch.device) -> Ledger:
    """The budget ledger of ``device`` in the budget's state directory,
    opened (the caller closes it)."""
    device, driver = resolve_device(device, None)
    return Ledger(state_dir(), driver.device_uuid(device.index or 0))
