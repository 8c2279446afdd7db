"""Byte counts as people write them: ``64MiB``, ``8GiB``, ``1.5 GB``, ``50%``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*")
_PERCENT_RE = re.compile(r"\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*%\s*")


def parse_size(text: str, total_bytes: int | None = None) -> int:
    """``text`` in bytes: a number with an optional unit (B, KB, MB, GB, TB or
    KiB, MiB, GiB, TiB, any case), or a percentage of ``total_bytes``.

    Raises ValueError saying what is accepted; a size must be at least one byte
    and a percentage in (0, 100].
    """
    percent = _PERCENT_RE.fullmatch(text)
    if percent is not None:
        value = float(percent["number"])
        if not 0 < value <= 100:
            raise ValueError(f"a percentage must be above 0 and at most 100, got {text!r}")
        if total_bytes is None:
            raise ValueError(f"{text!r} is a percentage, but the device's size is unknown")
        return max(1, int(total_bytes * value / 100))
    match = _SIZE_RE.fullmatch(text)
    unit = None if match is None else _UNITS.get(match["unit"].lower())
    if match is None or unit is None:
        raise ValueError(f"cannot read the size {text!r}; use a size like 64MiB, 8GiB or 50%")
    size = int(float(match["number"]) * unit)
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size


def format_bytes(size: int) -> str:
    """``size`` bytes in binary units, three significant digits: ``1.50 GiB``."""
    if abs(size) < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            break
        value /= 1024
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"
