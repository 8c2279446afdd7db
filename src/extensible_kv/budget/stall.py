"""A want that stands unmet, told once: which processes hold the memory it
waits for, and what each could give back.

A process whose claim a device's limit refuses posts a want and waits (a
claim within :func:`~extensible_kv.waiting_for_budget`), or asks again at
every step (an elastic vLLM engine). Nothing else in the waiting process
says why it waits: once a want has stood
:data:`~extensible_kv.budget.STALLED_S` seconds, the
waiting process logs one warning naming every other process that holds
memory on the device, with its pid, command line, claim, floor, cap and
cached bytes (the idle blocks of its prefix cache, where its engine counts
them). ``extensible-kv top`` marks the same want as stalled.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from extensible_kv.budget.ledger import Ledger
from extensible_kv.budget.liveness import command_line, one_line
from extensible_kv.budget.sizes import format_bytes
from extensible_kv.budget.snapshot import snapshot

__all__ = ["StallWatch", "stall_message"]


def stall_message(
    state_dir: Path, device: str, size: int, waited_s: float, mine: Collection[int]
) -> str:
    """One line: the processes ``mine`` have waited ``waited_s`` seconds for
    ``size`` more bytes on ``device`` (a UUID), and who holds the memory."""
    found = [d for d in snapshot(state_dir)["devices"] if d["device"] == device]
    limit = found[0]["limit_bytes"] if found else None
    others = [p for p in (found[0]["processes"] if found else []) if p["pid"] not in mine]
    held = "; ".join(_holder(p) for p in others if p["claimed_bytes"]) or "no other process"
    return (
        f"extensible-kv: pid {', '.join(map(str, sorted(mine)))} has waited {waited_s:.0f} s "
        f"for {format_bytes(size)} more on device {device} (limit "
        f"{format_bytes(limit) if limit is not None else 'none'}); the memory is held by: "
        f"{held}. An engine idle with cached blocks gives them back when it sees the want; "
        f"otherwise raise the limit (extensible-kv limit) or stop a holder"
    )


def _holder(process: dict[str, Any]) -> str:
    """A holder as ``pid P (command) holds X, floor F, cap C, cached K``."""
    floor, cap, cached = process["floor_bytes"], process["cap_bytes"], process["cached_bytes"]
    command = process["command"] or command_line(process["pid"])  # one that publishes nothing
    return (
        f"pid {process['pid']} ({one_line(command, 60)}) holds "
        f"{format_bytes(process['claimed_bytes'])}, "
        f"floor {format_bytes(floor) if floor else 'none'}, "
        f"cap {format_bytes(cap) if cap is not None else 'none'}, "
        f"cached {format_bytes(cached) if cached is not None else 'unknown'}"
    )


class StallWatch:
    """Tells once, per want, that a want of the processes ``mine`` stalled:
    :meth:`check` returns the message the first time it finds one of
    their wants on a ledger stalled, and again only after a want there
    was met or lapsed."""

    def __init__(self) -> None:
        self._told: set[str] = set()

    def check(self, ledger: Ledger, mine: Collection[int]) -> str | None:
        """The message for a stalled want of ``mine`` on ``ledger``, if it
        is not told yet (reads the ledger under its lock)."""
        holders = ledger.read().holders.items()
        wanting = [held for who, held in holders if who.pid in mine and held.wanted_bytes]
        if not wanting:
            self._told.discard(ledger.device)
            return None
        if not any(held.stalled for held in wanting) or ledger.device in self._told:
            return None
        self._told.add(ledger.device)
        size = sum(held.wanted_bytes for held in wanting)
        waited = max(held.wanting_s or 0.0 for held in wanting)
        return stall_message(ledger.state_dir, ledger.device, size, waited, mine)
