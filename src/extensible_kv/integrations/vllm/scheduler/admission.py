"""Requests an elastic engine could never finish under its device's limit,
refused at admission instead of queueing forever.

A request holds every block of its prompt and output until it finishes,
and no engine gives way below its floor, so a request whose prompt and
``max_tokens`` (within the model's length) need more than the limit less
the other processes' floors would wait for ever. It is finished the way
vLLM finishes a prompt longer than the model's length
(``FINISHED_IGNORED``: finish reason ``"length"``, no tokens), with the
message naming the limit as its ``stop_reason`` (in the OpenAI server's
response and in ``LLM.generate``'s output), and the engine logs it. Only
the engine core sees the budget, and vLLM 0.32 gives it no per-request
error message: a request it finishes with an error reaches an OpenAI
client as a bare 500, so that path is not used.

Each request is checked once, at the first schedule after it arrives and
after the workers named their budget ledgers (their first report).
"""

from __future__ import annotations

from typing import Any

from extensible_kv.integrations.vllm.scheduler.demand import blocks_at_end
from extensible_kv.integrations.vllm.scheduler.pressure import Pressure, Room
from extensible_kv.integrations.vllm.seam import format_bytes

__all__ = ["Admission"]


class Admission:
    """The requests not checked yet against the room the budget leaves.

    Args:
        pressure: the engine's view of its devices' ledgers.
        block_size: tokens per block.
        blocks_per_unit: blocks per unit (the engine holds whole units).
        max_model_len: the most tokens a request holds.
    """

    def __init__(
        self, pressure: Pressure, block_size: int, blocks_per_unit: int, max_model_len: int
    ) -> None:
        self._pressure = pressure
        self._block_size = block_size
        self._per_unit = blocks_per_unit
        self._max_model_len = max_model_len
        self._unchecked: list[Any] = []

    def add(self, request: Any) -> None:
        """A request vLLM admitted, to check at the next look."""
        self._unchecked.append(request)

    def never_fit(self) -> list[tuple[Any, str]]:
        """The requests added since the last look that can never finish under
        the budget, each with the message that says why. Until a worker named
        a ledger none is checked (they wait for the next look); with no limit
        and no cap, none is refused."""
        if not self._unchecked or not self._pressure.known:
            return []
        checking, self._unchecked = self._unchecked, []
        room = self._pressure.room()
        if room is None:
            return []
        refused = []
        for request in checking:
            if request.is_finished():
                continue
            blocks = blocks_at_end(request, self._block_size, self._max_model_len)
            # The null block (block 0) lies in unit 0, held whatever else is.
            units = -(-(blocks + 1) // self._per_unit)
            if units * self._per_unit > room.blocks:
                refused.append((request, self._message(request, units * self._per_unit, room)))
        return refused

    def _message(self, request: Any, blocks: int, room: Room) -> str:
        need = format_bytes(blocks * room.bytes_per_block)
        if room.limit_bytes is None:
            bound = "its caps"
        else:
            bound = (
                f"the device's limit of {format_bytes(room.limit_bytes)} less the other "
                f"processes' floors ({format_bytes(room.floors_bytes)})"
            )
        return (
            f"extensible-kv: request {request.request_id} can never finish on this engine: "
            f"its {request.num_prompt_tokens} prompt tokens and max_tokens "
            f"{request.max_tokens} need {need} of KV memory ({blocks} blocks), more than "
            f"{bound} lets it hold: {format_bytes(room.most_bytes)} on device {room.device}. "
            "Ask for fewer tokens, raise the limit (extensible-kv limit DEVICE SIZE), or "
            "lower the others' floors (extensible-kv limit DEVICE --pid PID --floor SIZE)"
        )
