"""The layout of an exported tensor, without its memory: what
:meth:`ExtensibleTensor.shared_layout
<extensible_kv.tensor.ExtensibleTensor.shared_layout>` makes,
:meth:`~extensible_kv.tensor.ExtensibleTensor.from_shared` reads, and
:mod:`extensible_kv.share` sends over a socket as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass

from extensible_kv._checks import check_int

__all__ = ["SharedLayout"]


@dataclass(frozen=True)
class SharedLayout:
    """An exported tensor, without its memory: sizes in bytes, the chunks as
    ``(offset, size)``, one file descriptor each, in order, and the device
    the memory lives on: its type, its ordinal in the exporting process and
    its UUID, which names it in every process whatever devices each sees."""

    max_num_bytes: int
    num_segments: int
    bytes_per_segment: int
    chunks: tuple[tuple[int, int], ...]
    device: str
    device_index: int
    device_uuid: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SharedLayout:
        """Read :meth:`to_json`'s text; anything else (it may come from another
        process) is a ValueError or TypeError saying what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a shared layout must be JSON: {exc}") from None
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ValueError(f"a shared layout is an object with the fields {sorted(fields)}")
        for name in ("max_num_bytes", "num_segments", "bytes_per_segment", "device_index"):
            check_int(name, data[name])
        for name in ("device", "device_uuid"):
            if not isinstance(data[name], str):
                raise ValueError(f"{name} must be a string, got {data[name]!r}")
        chunks = data["chunks"]
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(_is_int(v) for v in c) for c in chunks
        ):
            raise ValueError("chunks must be a list of [offset, size] pairs of ints")
        data["chunks"] = tuple((offset, size) for offset, size in chunks)
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
