"""A worker's floor and cap in its device's budget (the ``floor_bytes`` and
``cap_bytes`` options): what the budget keeps for this rank while it holds
less, and the most it may hold. Set once, before the KV cache claims
anything; they go when the process does."""

from __future__ import annotations

import logging

import torch

from extensible_kv.integrations.vllm.options import Options
from extensible_kv.integrations.vllm.seam import ledger_of

logger = logging.getLogger(__name__)


def set_floor_and_cap(device: torch.device, options: Options) -> None:
    """Give this process ``options``' floor and cap on ``device``'s budget,
    if it names either. A floor the limit cannot hold beside the others'
    raises ValueError, and the engine does not start."""
    floor, cap = options.floor_bytes, options.cap_bytes
    if not floor and cap is None:
        return
    ledger = ledger_of(device)
    try:
        written = ledger.set_floor_and_cap(floor, cap)
    finally:
        ledger.close()
    logger.info(
        "extensible-kv: this rank's floor %d bytes and cap %s on %s (budget revision %d)",
        floor,
        "none" if cap is None else f"{cap} bytes",
        ledger.device,
        written.revision,
    )
